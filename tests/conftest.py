"""Test-wide settings: one torch thread, deterministic seeds, and the devices to test on."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from jacflow.autojac._graph import SPARSE_OPERANDS_READABLE

torch.set_num_threads(1)

# The default profile is derandomized: every run (CI included) draws the same examples, so a
# green suite stays green. JACFLOW_HYPOTHESIS=explore draws new examples each run, to hunt bugs.
_COMMON = {
    "max_examples": 40,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("jacflow", derandomize=True, **_COMMON)
settings.register_profile("explore", derandomize=False, **_COMMON)
settings.load_profile("explore" if os.environ.get("JACFLOW_HYPOTHESIS") == "explore" else "jacflow")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def on_device(device: str) -> Iterator[str]:
    """``device``, also the default device of the tensors and modules the test creates."""
    with torch.device(device):
        yield device


@pytest.fixture(params=DTYPES, ids=["float32", "float64"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param  # type: ignore[no-any-return]


# jacflow's routing of sparse products (a graph neural network's adjacency @ x), and these
# tests of it, need torch 2.10 (docs/getting-started.md says so): see SPARSE_OPERANDS_READABLE.
_NEEDS_SPARSE_OPERANDS = (
    "tests/autogram/test_mtl.py::test_a_graph_neural_network_trunk[compute_gramian-generic-coo]",
    "tests/autogram/test_mtl.py::test_a_graph_neural_network_trunk[backward-generic-coo]",
    "tests/autogram/test_mtl.py::test_a_graph_neural_network_trunk[mtl_backward-generic-coo]",
    "tests/autojac/test_backward.py::test_a_sparse_input_is_differentiated_row_by_row[None]",
    "tests/autojac/test_backward.py::test_a_sparse_input_is_differentiated_row_by_row[2]",
    "tests/func/test_jacrev.py::test_a_product_with_a_sparse_adjacency_matrix",
    "tests/docs/test_examples.py::test_page_examples[getting-started.md]",
    "src/jacflow/autogram/_outside.py::jacflow.autogram._outside.sparse_inside",
    "src/jacflow/autojac/_graph.py::jacflow.autojac._graph.sparse_operation",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if SPARSE_OPERANDS_READABLE:
        return
    skip = pytest.mark.skip(reason="needs torch >= 2.10 (SavedTensor.data) for sparse products")
    for item in items:
        if item.nodeid.startswith(_NEEDS_SPARSE_OPERANDS):
            item.add_marker(skip)
