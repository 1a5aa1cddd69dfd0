"""Dual-cone projectors and their use by UPGrad."""

from __future__ import annotations

import copy
import io
import pickle
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import DualProjWeighting, UPGrad, UPGradWeighting
from jacflow.linalg import (
    DualConeProjector,
    QuadprogProjector,
    TorchProjector,
    project_weights,
)
from jacflow.linalg._dual_cone import project_weights_reference
from jacflow.linalg._projectors import solves_on_host
from tests.conftest import DEVICES
from tests.linalg.test_dual_cone import full_route, make_gramian


class ReferenceProjector(DualConeProjector):
    """A user-defined projector: the slow exact oracle."""

    def __call__(self, u: Tensor, gramian: Tensor) -> Tensor:
        return project_weights_reference(u, gramian)


def test_torch_projector_is_project_weights() -> None:
    torch.manual_seed(3)
    j = torch.randn(7, 5, dtype=torch.float64)
    u = torch.randn(3, 7, dtype=torch.float64)
    projector = TorchProjector(norm_eps=1e-4, reg_eps=1e-3, method="fista")
    expected = project_weights(u, j @ j.T, norm_eps=1e-4, reg_eps=1e-3, method="fista")
    torch.testing.assert_close(projector(u, j @ j.T), expected)
    assert repr(projector) == (
        "TorchProjector(norm_eps=0.0001, reg_eps=0.001, method='fista', max_iter=None, tol=None)"
    )


def test_quadprog_projector_matches_torch_on_the_regularised_problem() -> None:
    torch.manual_seed(4)
    j = torch.randn(6, 3, dtype=torch.float64)  # rank 3 < 6: regularisation makes it definite
    u = torch.eye(6, dtype=torch.float64)
    got = QuadprogProjector()(u, j @ j.T)
    expected = project_weights(u, j @ j.T, norm_eps=1e-4, reg_eps=1e-4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-8)
    assert repr(QuadprogProjector()) == "QuadprogProjector(norm_eps=0.0001, reg_eps=0.0001)"


def test_quadprog_projector_keeps_dtype_and_shape() -> None:
    g, u = torch.tensor([[2.0, -1.0], [-1.0, 2.0]]), torch.eye(2).reshape(1, 2, 2)
    with torch.device("meta"):  # (the default device plays no part)
        out = QuadprogProjector()(u, g)
    assert out.shape == (1, 2, 2) and out.dtype == torch.float32


def test_quadprog_projector_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    zero = torch.zeros(2, 2, dtype=torch.float64)  # singular: quadprog needs reg_eps > 0
    with pytest.raises(ValueError, match="reg_eps > 0"):
        QuadprogProjector(reg_eps=0.0)(torch.eye(2, dtype=torch.float64), zero)
    with pytest.raises(ValueError, match=r"\[m, m\]"):
        QuadprogProjector()(torch.eye(2), torch.eye(2).expand(3, 2, 2))
    with pytest.raises(ValueError, match="norm_eps"):
        QuadprogProjector(norm_eps=-1.0)
    monkeypatch.setitem(sys.modules, "quadprog", None)
    with pytest.raises(ImportError, match="pip install quadprog"):
        QuadprogProjector()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("projector", [QuadprogProjector(), TorchProjector()], ids=repr)
def test_projectors_and_their_aggregators_copy_and_pickle(how: str, projector: Any) -> None:
    """A ``QuadprogProjector`` held the imported ``quadprog`` module: ``copy.deepcopy``, pickle
    and ``torch.save`` of it, or of an ``UPGrad`` or model holding it (a checkpoint), raised
    "cannot pickle 'module' object". The copy gives the original's weights."""
    aggregator = UPGrad(projector=projector)
    if how == "deepcopy":
        copied = copy.deepcopy(aggregator)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(aggregator))
    else:
        buffer = io.BytesIO()
        torch.save(torch.nn.ModuleDict({"aggregator": aggregator}), buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)["aggregator"]
    jacobian = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0], [1.0, -3.0, 0.5]])
    assert type(copied.projector) is type(projector)
    torch.testing.assert_close(copied(jacobian), aggregator(jacobian), rtol=0, atol=0)


def test_torch_projector_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="`method`"):
        TorchProjector(method="qp")
    with pytest.raises(ValueError, match="`max_iter`"):
        TorchProjector(max_iter=-2)
    with pytest.raises(ValueError, match="`tol`"):
        TorchProjector(tol=0.0)


def test_upgrad_with_projectors() -> None:
    torch.manual_seed(5)
    j = torch.randn(5, 9, dtype=torch.float64)
    default = UPGrad()(j)
    torch.testing.assert_close(UPGrad(projector=ReferenceProjector())(j), default)
    # TorchJD's regularisation moves the result away from the exact one, by a small amount.
    torchjd_like = UPGrad(projector=QuadprogProjector())(j)
    assert 0 < float((torchjd_like - default).norm()) < 1e-2 * float(default.norm())
    assert "projector=TorchProjector(" in repr(UPGradWeighting())


@settings(max_examples=40)
@given(
    m=st.integers(1, 40),
    kind=st.sampled_from(["psd", "conflicting", "rank_deficient", "duplicated", "zero_rows"]),
    seed=st.integers(0, 2**31 - 1),
    signs=st.sampled_from(["positive", "with_zeros", "mixed"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    device=st.sampled_from(DEVICES),
)
def test_project_diagonal_is_the_projection_of_the_diagonal_rows(
    m: int, kind: str, seed: int, signs: str, dtype: torch.dtype, device: str
) -> None:
    """UPGrad's problems without forming diag(pref): the reference's answer on every Gramian
    kind, with zero and negative preferences, on both sides of the Python-float route and on
    every device."""
    gen = torch.Generator().manual_seed(seed)
    gramian = make_gramian(m, kind, 1.0, seed)
    pref = torch.rand(m, generator=gen, dtype=torch.float64) + 0.1
    if signs != "positive":
        pref[torch.rand(m, generator=gen) < 0.3] = 0.0
    if signs == "mixed":
        pref = torch.where(torch.rand(m, generator=gen) < 0.3, -pref, pref)
    v = TorchProjector().project_diagonal(pref.to(device, dtype), gramian.to(device, dtype))
    assert v.dtype == dtype and v.shape == (m, m) and v.device.type == device
    v = v.cpu()
    exact_g = gramian.to(dtype).double()
    expected = project_weights_reference(torch.diag(pref), exact_g)
    # v is not unique for a singular G, J^T v is: compare G v (scaled to G's trace), to the
    # solvers' tolerance relative to max(1, |v|) (float32: 1e-6, with the rounding of v)
    g = exact_g / exact_g.trace().clamp_min(1e-300)
    scale = float(pref.abs().max()) * max(1.0, float(expected.abs().max()))
    atol = (1e-9 if dtype == torch.float64 else 1e-5) * scale
    torch.testing.assert_close(v.double() @ g, expected @ g, rtol=0, atol=atol)


@pytest.mark.parametrize("m", [4, 12, 24])  # the Python floats, the lean PDAS (both ends)
def test_project_diagonal_settings_and_odd_inputs(m: int) -> None:
    """Settings reach the solver; NaN / inf give NaN rows as project_weights does; bad `pref`
    gets a clear error; autograd goes through the differentiable route."""
    j = torch.randn(m, m + 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g, pref = j @ j.T, torch.full((m,), 1 / m, dtype=torch.float64)
    for projector in (TorchProjector(norm_eps=1e-4, reg_eps=1e-3), TorchProjector(method="admm")):
        torch.testing.assert_close(
            projector.project_diagonal(pref, g), projector(torch.diag(pref), g), atol=1e-7, rtol=0
        )
    bad = [(float("nan"), 1.0), (float("inf"), 1.0), (1.0, float("nan")), (1.0, float("inf"))]
    for bad_g, bad_pref in [*bad, (1.0, -float("inf"))]:
        g2, pref2 = g.clone(), pref.clone()
        g2[0, 3] *= bad_g
        pref2[2] *= bad_pref
        expected = project_weights(torch.diag(pref2), g2)
        assert torch.equal(TorchProjector().project_diagonal(pref2, g2).isnan(), expected.isnan())
    for bad_shape in (torch.ones(2, m), torch.ones(m + 1)):
        with pytest.raises(ValueError, match="`pref` must have shape \\[m\\]"):
            TorchProjector().project_diagonal(bad_shape.double(), g)
    with pytest.raises(ValueError, match="one Gramian"):
        TorchProjector().project_diagonal(pref, g[None])
    with pytest.raises(TypeError, match=r"`pref` must be a torch\.Tensor"):
        TorchProjector().project_diagonal([1.0] * m, g)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`pref` must have a floating dtype"):
        TorchProjector().project_diagonal(torch.ones(m, dtype=torch.long), g)
    leaf = g.clone().requires_grad_()
    TorchProjector().project_diagonal(pref, leaf).sum().backward()
    reference = g.clone().requires_grad_()
    project_weights(torch.diag(pref), reference).sum().backward()
    assert leaf.grad is not None and reference.grad is not None
    torch.testing.assert_close(leaf.grad, reference.grad)


def test_project_diagonal_of_no_objective_off_the_host_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """m = 0 where the Python-float route does not apply (as on an accelerator): an empty
    result, as project_weights gives, not a reduction over an empty dimension."""
    full_route(monkeypatch)
    empty = TorchProjector().project_diagonal(torch.ones(0), torch.ones(0, 0))
    assert empty.shape == (0, 0)


def test_a_projector_written_to_torchjds_contract_is_accepted() -> None:
    """One abstract ``__call__``, as TorchJD's ``DualConeProjector``: constructible (a second
    abstract method refused it with a TypeError), with a bare repr, and usable by UPGrad."""
    projector = ReferenceProjector()
    assert repr(projector) == "ReferenceProjector()"
    # (it may solve outside autograd: UPGrad's update with it keeps no graph, create_graph
    # refuses it)
    assert not UPGrad(projector=projector).differentiable
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(UPGrad(projector=projector)(J), UPGrad()(J))


class DifferentiableProjector(DualConeProjector):
    """A projector of one's own in differentiable torch code, which says so."""

    differentiable = True

    def __call__(self, u: Tensor, gramian: Tensor) -> Tensor:
        return project_weights(u, gramian, method="pdas")


def test_a_projector_that_declares_itself_differentiable_gives_a_graph() -> None:
    """UPGrad and DualProj follow the projector's flag: with one that declares itself
    differentiable, their updates have the true derivative (finite differences); with one that
    does not (the default, and QuadprogProjector), no graph."""
    from jacflow.aggregation import DualProj
    from jacflow.linalg import QuadprogProjector

    assert TorchProjector.differentiable and not QuadprogProjector.differentiable
    assert not DualConeProjector.differentiable
    j = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 2.0], [1.0, -3.0, 0.5]], dtype=torch.float64)
    direction = torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for make in (UPGrad, DualProj):
        aggregator = make(projector=DifferentiableProjector())
        assert aggregator.differentiable
        leaf = j.clone().requires_grad_()
        (grad,) = torch.autograd.grad(aggregator(leaf).sum(), leaf)
        h = 1e-6
        expected = (aggregator(j + h * direction) - aggregator(j - h * direction)).sum() / (2 * h)
        torch.testing.assert_close((grad * direction).sum(), expected, rtol=1e-6, atol=1e-8)
        for silent in (ReferenceProjector(), QuadprogProjector()):
            assert not make(projector=silent).differentiable
            assert not make(projector=silent)(j.clone().requires_grad_()).requires_grad
            weights = make(projector=silent).weighting(j.clone().requires_grad_())
            assert not weights.requires_grad  # (the weighting alone holds no graph either)


def test_quadprog_gives_nan_weights_for_non_finite_rows_and_takes_no_objective() -> None:
    """A NaN or infinite row of ``u`` gave finite (or infinite) weights through quadprog, where
    the batched solver and the docs give NaN weights; ``m = 0`` crashed."""
    pytest.importorskip("quadprog")
    g = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 4.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    u = torch.tensor([[float("nan"), 0, 0], [float("inf"), 0, 0], [1, 0, 0]], dtype=torch.float64)
    v = QuadprogProjector()(u, g)
    assert bool(v[:2].isnan().all())
    torch.testing.assert_close(v[2], TorchProjector()(u[2:], g)[0], rtol=0, atol=1e-4)
    empty = torch.zeros(3, 0, dtype=torch.float64)
    torch.testing.assert_close(QuadprogProjector()(empty, torch.zeros(0, 0)), empty)


@pytest.mark.parametrize("m", [3, 20, 40])
def test_a_subnormal_trace_gives_the_weights_of_the_scaled_gramian(m: int) -> None:
    """A finite float64 Gramian whose trace is subnormal (gradients of about 1e-155): the
    reciprocal of its trace overflowed and every weight was NaN, silently."""
    gen = torch.Generator().manual_seed(m)
    j = torch.randn(m, m + 3, generator=gen, dtype=torch.float64)
    u = torch.randn(4, m, generator=gen, dtype=torch.float64)
    expected = project_weights(u, j @ j.T)
    torch.testing.assert_close(project_weights(u, j @ j.T * 1e-313), expected, rtol=1e-6, atol=1e-9)


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"norm_eps": _NAN}, ValueError, r"`norm_eps` must be a float in \[0.0, inf\)"),
        ({"norm_eps": _INF}, ValueError, r"`norm_eps` must be a float in \[0.0, inf\)"),
        ({"reg_eps": _INF}, ValueError, r"`reg_eps` must be a float in \[0.0, inf\)"),
        ({"reg_eps": -_INF}, ValueError, r"`reg_eps` must be a float in \[0.0, inf\)"),
        ({"tol": _INF}, ValueError, r"`tol` must be a float in \(0.0, inf\)"),
        ({"tol": _NAN}, ValueError, r"`tol` must be a float in \(0.0, inf\)"),
        ({"norm_eps": "x"}, TypeError, r"`norm_eps` must be a float.*received <class 'str'>"),
        ({"reg_eps": True}, TypeError, r"`reg_eps` must be a float.*received <class 'bool'>"),
        ({"tol": "x"}, TypeError, r"`tol` must be a float.*received <class 'str'>"),
        ({"max_iter": "x"}, TypeError, r"`max_iter` must be an int >= 1.*<class 'str'>"),
        ({"max_iter": 2.0}, TypeError, r"`max_iter` must be an int >= 1.*<class 'float'>"),
        ({"max_iter": True}, TypeError, r"`max_iter` must be an int >= 1.*<class 'bool'>"),
    ],
)
def test_solver_settings_must_be_finite_numbers(
    options: dict[str, Any], error: type[Exception], words: str
) -> None:
    g = torch.tensor([[1.0, -1.0], [-1.0, 4.0]])
    with pytest.raises(error, match=words):
        TorchProjector(**options)
    with pytest.raises(error, match=words):
        project_weights(torch.ones(2), g, **options)
    if "norm_eps" in options or "reg_eps" in options:
        with pytest.raises(error, match=words):
            QuadprogProjector(**options)


def test_valid_solver_settings_are_kept() -> None:
    g, u = torch.tensor([[1.0, -1.0], [-1.0, 4.0]]), torch.tensor([1.0, 0.0])
    expected = torch.tensor([1.0, 0.25])
    for options in ({}, {"norm_eps": 0, "reg_eps": 0.0, "max_iter": 50, "tol": 1e-7}):
        torch.testing.assert_close(TorchProjector(**options)(u, g), expected)
    torch.testing.assert_close(QuadprogProjector(0, 0)(u, g), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("u", "gramian", "error", "words"),
    [
        ([1.0, 0.0], torch.eye(2), TypeError, r"`u` must be a torch\.Tensor"),
        (torch.ones(2), [[1.0, 0.0], [0.0, 1.0]], TypeError, r"`gramian` must be a torch\.T"),
        (torch.ones(2, dtype=torch.int64), torch.eye(2), TypeError, "`u`.*floating dtype"),
        (torch.ones(2), torch.eye(2, dtype=torch.complex64), TypeError, "`gramian`.*complex64"),
        (torch.ones(2), torch.tensor(1.0), ValueError, r"\[m, m\].*\(2,\) and \(\)"),
        (torch.ones(2), torch.ones(2, 3), ValueError, r"\[m, m\].*\(2, 3\)"),
    ],
)
def test_quadprog_projector_refuses_bad_inputs(
    u: object, gramian: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        QuadprogProjector()(u, gramian)  # type: ignore[arg-type]


def test_weightings_solve_on_the_host_where_the_projector_would() -> None:
    """``solves_on_host``: a default-method ``TorchProjector``'s problem on one accelerator
    Gramian of at most 128 objectives, outside autograd (checked on the ``meta`` device, which
    stands for any accelerator: the decision reads only the device type, shape and flags)."""
    meta = torch.empty(128, 128, device="meta")
    assert solves_on_host(TorchProjector(), meta)
    assert solves_on_host(TorchProjector(), meta, None, torch.empty(128, device="meta"))
    assert not solves_on_host(TorchProjector(), torch.empty(129, 129, device="meta"))
    assert not solves_on_host(TorchProjector(), torch.empty(2, 8, 8, device="meta"))  # a batch
    assert not solves_on_host(TorchProjector(), torch.eye(8))  # (already there)
    assert not solves_on_host(TorchProjector(method="pdas"), meta)
    assert not solves_on_host(QuadprogProjector(), meta)
    tracked = torch.empty(8, 8, device="meta", requires_grad=True)
    pref = torch.empty(8, device="meta", requires_grad=True)
    assert not solves_on_host(TorchProjector(), tracked)  # (its graph: on the device)
    assert not solves_on_host(TorchProjector(), tracked.detach(), pref)
    with torch.no_grad():
        assert solves_on_host(TorchProjector(), tracked, pref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weighting", ["upgrad", "dualproj"])
@pytest.mark.parametrize("m", [2, 9, 128, 129])
def test_weightings_of_a_gpu_gramian_equal_the_hosts(weighting: str, m: int) -> None:
    """On a GPU, the weights (computed on the host up to 128 objectives, on the GPU above) are
    the CPU's, on the GPU, with a preference vector on the GPU too; under autograd (the GPU
    route) their gradient is the CPU's."""
    gen = torch.Generator().manual_seed(m)
    j = torch.randn(m, 2 * m, generator=gen, dtype=torch.float64)
    j[: m // 2] *= -1  # (conflicting rows)
    gramian = j @ j.T
    pref = torch.rand(m, generator=gen, dtype=torch.float64) + 0.1
    make = {"upgrad": UPGradWeighting, "dualproj": DualProjWeighting}[weighting]
    for preference in (None, pref):
        on_gpu = make(None if preference is None else preference.cuda())(gramian.cuda())
        assert on_gpu.device.type == "cuda"
        expected = make(preference)(gramian)
        torch.testing.assert_close(on_gpu.cpu(), expected, rtol=1e-6, atol=1e-9)
    tracked = gramian.cuda().requires_grad_()
    make()(tracked).sum().backward()
    host = gramian.clone().requires_grad_()
    make()(host).sum().backward()
    assert tracked.grad is not None and host.grad is not None
    torch.testing.assert_close(tracked.grad.cpu(), host.grad, rtol=1e-5, atol=1e-8)
