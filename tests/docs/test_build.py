"""The documentation site builds offline with ``mkdocs build --strict`` (warnings fail), and its
generated method pages say what the code says."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from jacflow import aggregation
from jacflow.aggregation import Aggregator, Property

ROOT = Path(__file__).resolve().parents[2]


def _gen_pages() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_pages", ROOT / "docs" / "gen_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip('mkdocs and mkdocs-material are not installed (pip install "jacflow[docs]")')
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    log = completed.stdout + completed.stderr
    assert completed.returncode == 0, log
    assert "WARNING" not in log, log
    upgrad = (site / "methods" / "upgrad" / "index.html").read_text()
    assert "Jacobian Descent for Multi-Objective Optimization" in upgrad
    assert "non-conflicting" in upgrad
    migration = (site / "migration" / "index.html").read_text()
    assert "torchjd.aggregation.UPGrad" in migration and "torchjd-names" not in migration
    for page in ("getting-started", "examples", "cli", "monitoring", "performance"):
        assert (site / page / "index.html").is_file()


def test_one_page_per_method_with_the_claimed_properties() -> None:
    gen = _gen_pages()
    pages = gen.generated_pages()
    for name in aggregation.__all__:
        cls = getattr(aggregation, name)
        if not (isinstance(cls, type) and issubclass(cls, Aggregator)) or name.endswith(
            "Aggregator"
        ):
            continue
        page = pages[f"methods/{name.lower()}.md"]
        for member in Property:
            row = next(line for line in page.splitlines() if line.startswith(f"| {member.value} |"))
            assert row.endswith("✓ |") == (member in cls.properties), (name, row)
        dropped = "With a `pref_vector` of unequal entries, permutation invariant is not claimed"
        assert (dropped in page) == bool(cls.uniform_preference_properties), name
    index = pages["methods/index.md"]
    upgrad_row = next(line for line in index.splitlines() if line.startswith("| [UPGrad]"))
    assert upgrad_row.count("✓") == len(aggregation.UPGrad.properties)


def test_docstring_conversion() -> None:
    gen = _gen_pages()
    doc = """Summary with ``code`` and :class:`~jacflow.aggregation.UPGrad`.

    Author, *A Title*, 2024 (arXiv 1). More text.

    .. math:: x = y

    Args:
        alpha: first line
            continued.

    Example:
        >>> 1 + 1
        2
    """
    markdown = gen.docstring_to_markdown(doc)
    assert "Summary with `code` and `UPGrad`." in markdown
    assert "```text\nx = y\n```" in markdown
    assert "- `alpha`: first line continued." in markdown
    assert "```pycon\n>>> 1 + 1\n2\n```" in markdown

    class WithPaper:
        __doc__ = doc

    assert gen._paper(WithPaper) == "Author, *A Title*, 2024 (arXiv 1)."
