"""Shared behaviour of every scalarizer: input checks, dtypes, gradients, non-finite values,
``reset``, ``repr``/``str``, and the hyper-parameter checks of every constructor."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow import Stateful
from jacflow.scalarization import (
    COSMOS,
    DWA,
    FAMO,
    IMTLL,
    LBTW,
    PBI,
    STCH,
    UW,
    AdaLoss,
    AugmentedTchebycheff,
    Constant,
    GeometricMean,
    LogSTCH,
    Mean,
    ReLoBRaLo,
    RevisedUW,
    Scalarizer,
    SoftAdapt,
    Tchebycheff,
)
from tests.aggregation.test_hyperparameters import BAD_TENSORS
from tests.scalarization._table import (
    DIFFERENTIABLE,
    FACTORIES,
    STATEFUL,
    M,
    assert_same_state,
    frozen,
)

NAMES = list(FACTORIES)
LOSSES = [[1.0, 2.0, 0.5], [0.8, 1.5, 0.6], [0.7, 1.6, 0.4], [0.6, 1.2, 0.45]]


def _protocol(scalarizer: Scalarizer, losses: Tensor) -> float:
    """One training step of the method's protocol (FAMO's update, DWA's and LogSTCH's epochs)."""
    value = float(scalarizer(losses).detach())
    if isinstance(scalarizer, FAMO):
        scalarizer.update(losses * 0.9)
    if isinstance(scalarizer, (DWA, LogSTCH)):
        scalarizer.step()
    return value


def _run(scalarizer: Scalarizer, rows: list[list[float]], dtype: torch.dtype) -> list[float]:
    """Call on each row of losses as one training step (stepping epochs / FAMO after each)."""
    return [_protocol(scalarizer, torch.tensor(row, dtype=dtype)) for row in rows]


@pytest.mark.parametrize("name", NAMES)
def test_returns_a_scalar_of_the_losses_dtype(name: str, dtype: torch.dtype, device: str) -> None:
    losses = torch.tensor(LOSSES[0], dtype=dtype, device=device, requires_grad=True)
    scalarizer = FACTORIES[name]()
    out = scalarizer(losses)
    assert out.shape == ()
    assert out.dtype == dtype
    assert out.device == losses.device
    assert torch.isfinite(out)
    out.backward()
    assert losses.grad is not None and torch.isfinite(losses.grad).all()
    for tensor in [*scalarizer.parameters(), *scalarizer.buffers()]:
        assert tensor.device == losses.device
        assert tensor.dtype == dtype


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradient_matches_finite_differences(name: str) -> None:
    scalarizer = FACTORIES[name]()
    _run(scalarizer, LOSSES[:3], torch.float64)  # move the stateful ones past their warm-up
    losses = torch.tensor(LOSSES[3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(frozen(scalarizer), (losses,))


@pytest.mark.parametrize("name", ["IMTLL", "UW", "RevisedUW"])
def test_gradient_wrt_parameters_matches_finite_differences(name: str) -> None:
    scalarizer = FACTORIES[name]()
    losses = torch.tensor(LOSSES[0], dtype=torch.float64)
    scalarizer(losses)  # the parameter follows the losses to float64
    (param,) = scalarizer.parameters()
    with torch.no_grad():
        param.copy_(torch.tensor([0.3, -0.2, 1.1]))

    def of_param(p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            param.copy_(p)
        return scalarizer(losses)

    # d/dp of the scalarization, by autograd at p, against central differences
    p0 = param.detach().clone()
    grad = torch.autograd.grad(scalarizer(losses), param)[0]
    numeric = torch.empty_like(p0)
    for i in range(M):
        step = torch.zeros_like(p0)
        step[i] = 1e-6
        numeric[i] = (of_param(p0 + step) - of_param(p0 - step)) / 2e-6
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_losses_propagate(name: str, bad: float) -> None:
    """Every method answers a NaN or infinite loss (``-inf`` included) with a non-finite value,
    as their docstrings say; LBTW, AdaLoss and LogSTCH raised on ``-inf``. (A maximum ignores
    a ``-inf`` term, as it should: STCH and Tchebycheff stay finite there.)"""
    if bad == -float("inf") and name in ("STCH", "Tchebycheff"):
        return
    scalarizer = FACTORIES[name]()
    _run(scalarizer, LOSSES[:3], torch.float32)
    losses = torch.tensor(LOSSES[3])
    losses[1] = bad
    out = scalarizer(losses)
    assert not torch.isfinite(out)


@pytest.mark.parametrize("name", STATEFUL)
def test_reset_restores_initial_behaviour(name: str) -> None:
    fresh = FACTORIES[name]()
    used = FACTORIES[name]()
    torch.manual_seed(3)
    expected = _run(fresh, LOSSES, torch.float64)
    _run(used, LOSSES[::-1], torch.float64)
    if list(used.parameters()):  # learnable: move the parameters away from their start
        (used(torch.tensor(LOSSES[0], dtype=torch.float64)) * 10).backward()
        torch.optim.SGD(used.parameters(), lr=1.0).step()
    assert isinstance(used, Stateful)
    used.reset()
    torch.manual_seed(3)
    assert _run(used, LOSSES, torch.float64) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_rejects_bad_losses(name: str) -> None:
    scalarizer = FACTORIES[name]()
    with pytest.raises(TypeError, match=r"`losses` to be a torch\.Tensor"):
        scalarizer([1.0, 2.0, 3.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="floating dtype"):
        scalarizer(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="at least one loss"):
        scalarizer(torch.zeros(0))


@pytest.mark.parametrize(
    "name",
    ["Constant", "STCH", "Tchebycheff", "PBI", "COSMOS", "FAMO", "IMTLL", "UW", "RevisedUW"],
)
def test_rejects_losses_of_the_wrong_shape(name: str) -> None:
    with pytest.raises(ValueError, match=r"shape.*\(3,\).*\(4,\)|\(4,\).*\(3,\)"):
        FACTORIES[name]()(torch.ones(4))


@pytest.mark.parametrize("name", ["FAMO", "IMTLL", "UW", "RevisedUW"])
def test_a_method_built_for_a_shape_says_to_build_a_new_one(name: str) -> None:
    """UW, IMTLL and RevisedUW told the user to call ``reset()``, which keeps the shape: the
    same error came back. The message now names what works, and the new instance does work."""
    scalarizer = FACTORIES[name]()
    scalarizer(torch.ones(3))
    message = rf"{name} was built for losses of shape \(3,\).*Build a new `{name}\(2\)`"
    with pytest.raises(ValueError, match=message):
        scalarizer(torch.ones(2))
    assert isinstance(scalarizer, Stateful)
    scalarizer.reset()  # (keeps the shape, as the message says)
    with pytest.raises(ValueError, match=message):
        scalarizer(torch.ones(2))
    rebuilt = type(scalarizer)(2)
    assert torch.isfinite(rebuilt(torch.ones(2)))


@pytest.mark.parametrize("name", ["DWA", "LBTW", "AdaLoss", "SoftAdapt", "ReLoBRaLo", "LogSTCH"])
def test_rejects_a_shape_change_without_reset(name: str) -> None:
    scalarizer = FACTORIES[name]()
    scalarizer(torch.ones(3))
    scalarizer(torch.ones(3))
    with pytest.raises(ValueError, match=r"reset\(\)"):
        scalarizer(torch.ones(4))
    if isinstance(scalarizer, Stateful):
        scalarizer.reset()
    assert torch.isfinite(scalarizer(torch.ones(4)))


BAD_HYPERPARAMETERS: list[tuple[Callable[[], object], type[Exception], str]] = [
    (lambda: STCH(0.0), ValueError, "mu"),
    (lambda: STCH(-1.0), ValueError, "mu"),
    (lambda: STCH(float("nan")), ValueError, "mu"),
    (lambda: STCH("1"), TypeError, "mu"),  # type: ignore[arg-type]
    (lambda: STCH(1.0, weights=[1.0, 2.0]), TypeError, "weights"),  # type: ignore[arg-type]
    (lambda: STCH(1.0, reference=3.0), TypeError, "reference"),  # type: ignore[arg-type]
    (lambda: AugmentedTchebycheff(-0.1), ValueError, "rho"),
    (lambda: Tchebycheff(weights=(1, 2)), TypeError, "weights"),  # type: ignore[arg-type]
    (lambda: PBI(-1.0, torch.ones(2)), ValueError, "theta"),
    (lambda: PBI(1.0, None), TypeError, "weights"),  # type: ignore[arg-type]
    (lambda: COSMOS(-1.0, torch.ones(2)), ValueError, "lambda_"),
    (lambda: Constant([1.0]), TypeError, "weights"),  # type: ignore[arg-type]
    (lambda: DWA(0.0), ValueError, "temperature"),
    (lambda: DWA(True), TypeError, "temperature"),
    (lambda: FAMO(2, lr=-1.0), ValueError, "lr"),
    (lambda: FAMO(2, weight_decay=-1.0), ValueError, "weight_decay"),
    (lambda: FAMO(2, min_losses=torch.zeros(3)), ValueError, "min_losses"),
    (lambda: FAMO(0), ValueError, "shape"),
    (lambda: FAMO(2.5), TypeError, "shape"),  # type: ignore[arg-type]
    (lambda: UW((2, -1)), TypeError, "shape"),
    (lambda: IMTLL("3"), TypeError, "shape"),  # type: ignore[arg-type]
    (lambda: RevisedUW((2, 0)), ValueError, "shape"),
    (lambda: LogSTCH(0.0), ValueError, "mu"),
    (lambda: LogSTCH(1.0, warmup_epochs=-1), ValueError, "warmup_epochs"),
    (lambda: LogSTCH(1.0, warmup_epochs=1.5), TypeError, "warmup_epochs"),  # type: ignore[arg-type]
    (lambda: LBTW(-0.5), ValueError, "alpha"),
    (lambda: AdaLoss(momentum=1.0), ValueError, "momentum"),
    (lambda: AdaLoss(eps=-1.0), ValueError, "eps"),
    (lambda: SoftAdapt(beta=float("inf")), ValueError, "beta"),
    (lambda: SoftAdapt(normalized=1), TypeError, "normalized"),  # type: ignore[arg-type]
    (lambda: ReLoBRaLo(alpha=1.5), ValueError, "alpha"),
    (lambda: ReLoBRaLo(rho=-0.1), ValueError, "rho"),
    (lambda: ReLoBRaLo(temperature=0.0), ValueError, "temperature"),
]


@pytest.mark.parametrize(("make", "error", "name"), BAD_HYPERPARAMETERS)
def test_rejects_bad_hyperparameters(
    make: Callable[[], object], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=f"`{name}`"):
        make()


def test_repr_and_str() -> None:
    assert repr(Mean()) == "Mean()"
    assert str(STCH(0.5)) == "STCH"
    assert repr(STCH(0.5)) == "STCH(mu=0.5, weights=None, reference=None)"
    assert repr(DWA()) == "DWA(temperature=2.0)"
    assert repr(FAMO((2, 3))) == "FAMO(shape=(2, 3), lr=0.025, weight_decay=0.001)"
    assert repr(UW(2)) == "UW(shape=(2,))"
    assert repr(ReLoBRaLo()) == "ReLoBRaLo(alpha=0.999, rho=0.999, temperature=0.1)"
    for name, make in FACTORIES.items():
        label = str(make())
        assert label == name or (name == "Constant" and label.startswith("Constant(["))
        assert repr(make()).startswith(f"{name}(")


SHAPE_FREE = [
    name
    for name in NAMES
    if name not in ("Constant", "STCH", "Tchebycheff", "AugmentedTchebycheff", "PBI", "COSMOS")
]


@pytest.mark.parametrize("name", SHAPE_FREE)
def test_losses_of_any_shape(name: str) -> None:
    """Losses [3] and the same losses as [1, 3] give the same values (methods with weights of a
    given shape are covered in their own tests); methods built for a shape accept 0-dim losses."""
    if name in ("FAMO", "IMTLL", "UW", "RevisedUW"):
        make = {"FAMO": FAMO, "IMTLL": IMTLL, "UW": UW, "RevisedUW": RevisedUW}[name]
        assert make(())(torch.tensor(2.0)).shape == ()
        flat, grid = make(3), make((1, 3))
    else:
        flat, grid = FACTORIES[name](), FACTORIES[name]()
    torch.manual_seed(0)
    a = _run(flat, LOSSES, torch.float64)
    torch.manual_seed(0)
    b = _run(grid, [[row] for row in LOSSES], torch.float64)  # type: ignore[list-item]
    assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdaLoss(momentum=0.0),
        lambda: LBTW(alpha=0.5),
        lambda: LogSTCH(mu=1.0, warmup_epochs=0),
        lambda: GeometricMean(),
        lambda: DWA(),
        lambda: ReLoBRaLo(alpha=0.5, rho=0.5),
        lambda: SoftAdapt(loss_weighted=True),
    ],
    ids=["AdaLoss", "LBTW", "LogSTCH", "GeometricMean", "DWA", "ReLoBRaLo", "SoftAdapt-lw"],
)
def test_methods_for_non_negative_losses_refuse_a_negative_one(
    make: Callable[[], Scalarizer],
) -> None:
    """AdaLoss gave the loss a negative weight (a step ascended it), LBTW and LogSTCH NaN;
    SoftAdapt(loss_weighted=True) a negative weight, DWA and ReLoBRaLo more weight to the loss
    that improved (their ratios read backwards). Refused before any state changes, as
    GeometricMean and FAMO refuse it."""
    scalarizer = make()
    scalarizer(torch.tensor([1.0, 2.0]))  # (a first call that sets their state)
    state = copy.deepcopy(scalarizer.state_dict())
    with pytest.raises(ValueError, match=r"non-negative losses only, received \[-2.0, 1.0\]"):
        scalarizer(torch.tensor([-2.0, 1.0]))
    assert_same_state(scalarizer.state_dict(), state)


ASSIGNMENTS = [
    (lambda: AdaLoss(), "momentum", 1.0, 0.5),
    (lambda: AdaLoss(), "eps", -1.0, 0.1),
    (lambda: COSMOS(1.0, torch.ones(2)), "lambda_", -1.0, 2.0),
    (lambda: COSMOS(1.0, torch.ones(2)), "weights", [0.5, 0.5], torch.tensor([0.2, 0.8])),
    (lambda: DWA(), "temperature", -1.0, 1.0),
    (lambda: FAMO(2), "lr", -0.1, 0.1),
    (lambda: FAMO(2), "weight_decay", float("nan"), 0.0),
    (lambda: LBTW(), "alpha", -0.5, 1.0),
    (lambda: LogSTCH(1.0), "mu", 0.0, 0.5),
    (lambda: LogSTCH(1.0), "warmup_epochs", -1, 2),
    (lambda: PBI(1.0, torch.ones(2)), "theta", -1.0, 2.0),
    (lambda: ReLoBRaLo(), "alpha", 5.0, 0.9),
    (lambda: ReLoBRaLo(), "rho", -0.1, 0.5),
    (lambda: ReLoBRaLo(), "temperature", 0.0, 1.0),
    (lambda: SoftAdapt(), "beta", float("inf"), 0.5),
    (lambda: SoftAdapt(), "normalized", "yes", True),
    (lambda: SoftAdapt(), "loss_weighted", 1, True),
    (lambda: STCH(1.0), "mu", 0.0, 0.5),
    (lambda: STCH(1.0), "weights", "uniform", torch.ones(2)),
    (lambda: Tchebycheff(), "reference", 3, torch.zeros(2)),
    (lambda: AugmentedTchebycheff(0.1), "rho", -1.0, 0.2),
]


@pytest.mark.parametrize(
    ("make", "name", "bad", "good"),
    ASSIGNMENTS,
    ids=[f"{i}-{a[1]}" for i, a in enumerate(ASSIGNMENTS)],
)
def test_hyperparameters_are_checked_on_assignment(
    make: Callable[[], Scalarizer], name: str, bad: object, good: object
) -> None:
    """As in the constructor (``s.mu = 0`` made STCH return NaN; ``ReLoBRaLo().alpha = 5``
    gave a negative objective); a refused value leaves the attribute as it was."""
    scalarizer = make()
    before = getattr(scalarizer, name)
    with pytest.raises((ValueError, TypeError), match=f"`{name}`"):
        setattr(scalarizer, name, bad)
    assert getattr(scalarizer, name) is before
    setattr(scalarizer, name, good)
    assert getattr(scalarizer, name) is good or getattr(scalarizer, name) == good


@pytest.mark.parametrize("name", STATEFUL)
def test_evaluation_calls_leave_the_state_and_the_training_run_unchanged(name: str) -> None:
    """A validation pass under ``.eval()`` advanced the training state (LBTW took the
    validation losses as its reference, SoftAdapt as its previous losses, ...): the training
    values after it changed. In evaluation mode a call reads the state and changes nothing,
    not even torch's random generator (ReLoBRaLo's draw)."""
    rows = [torch.tensor(row, dtype=torch.float64) for row in LOSSES]
    validation = torch.tensor([2.0, 0.1, 5.0], dtype=torch.float64)
    plain, evaluated = FACTORIES[name](), FACTORIES[name]()
    torch.manual_seed(0)
    expected = [_protocol(plain, row) for row in rows]
    torch.manual_seed(0)
    values = []
    for row in rows:
        values.append(_protocol(evaluated, row))
        state, generator = copy.deepcopy(evaluated.state_dict()), torch.random.get_rng_state()
        evaluated.eval()
        for losses in (validation, validation.float()):
            assert torch.isfinite(evaluated(losses))
            with torch.no_grad():
                evaluated(losses)
        evaluated.train()
        assert_same_state(evaluated.state_dict(), state)
        assert torch.equal(torch.random.get_rng_state(), generator)
    assert values == expected
    assert_same_state(evaluated.state_dict(), plain.state_dict())


@pytest.mark.parametrize("name", ["FAMO", "IMTLL", "UW", "RevisedUW"])
def test_a_float32_call_in_a_float64_run_keeps_the_state_and_computes_in_float64(
    name: str,
) -> None:
    """Parameters and buffers followed the dtype of every call: one float32 (validation) call
    in a float64 run rounded the learned values for good."""
    scalarizer = FACTORIES[name]()
    for row in LOSSES[:2]:
        _protocol(scalarizer, torch.tensor(row, dtype=torch.float64))
    tensors = [*scalarizer.parameters(), *scalarizer.buffers()]
    if isinstance(scalarizer, FAMO):
        scalarizer.logits.copy_(torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64) / 3)
    else:
        with torch.no_grad():
            tensors[0].copy_(torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64) / 3)
    before = [t.detach().clone() for t in tensors]
    exact = frozen(scalarizer)(torch.tensor(LOSSES[2], dtype=torch.float64))
    value = scalarizer(torch.tensor(LOSSES[2], dtype=torch.float32))
    assert value.dtype == torch.float64  # (the wider of the two)
    torch.testing.assert_close(value, exact, rtol=1e-7, atol=0.0)  # (losses rounded, not state)
    for tensor, kept in zip(tensors, before, strict=True):
        assert tensor.dtype == torch.float64 and torch.equal(tensor, kept)


@pytest.mark.parametrize("name", ["IMTLL", "UW", "RevisedUW"])
def test_a_float64_call_after_float32_adam_steps_keeps_the_parameters(name: str) -> None:
    """A float64 call turned the float32 parameter into float64 in place: Adam's next step
    failed on its float32 state ("expected dtype float for `end` but got dtype double")."""
    scalarizer = FACTORIES[name]()
    optimizer = torch.optim.Adam(scalarizer.parameters(), lr=0.1)
    (param,) = scalarizer.parameters()
    for dtype in (torch.float32, torch.float32, torch.float64, torch.float64):
        optimizer.zero_grad()
        scalarizer(torch.tensor(LOSSES[0], dtype=dtype)).backward()
        optimizer.step()
        assert param.dtype == torch.float32 and param.grad is not None
        assert param.grad.dtype == torch.float32
    assert next(iter(scalarizer.parameters())) is param and torch.isfinite(param).all()


@pytest.mark.parametrize("name", ["FAMO", "IMTLL", "UW", "RevisedUW"])
def test_a_loaded_state_dict_settles_the_dtype(name: str) -> None:
    """The optimizer loaded after the scalarizer holds state of the saved dtype: a first call
    on losses of another dtype must not change the parameters' (nor FAMO's buffers')."""
    source = FACTORIES[name]()
    _protocol(source, torch.tensor(LOSSES[0], dtype=torch.float64))
    target = FACTORIES[name]()
    target.load_state_dict(source.state_dict())
    target(torch.tensor(LOSSES[1], dtype=torch.float32))
    for tensor in [*target.parameters(), *target.buffers()]:
        assert tensor.dtype == torch.float64


@pytest.mark.parametrize("name", ["IMTLL", "UW", "RevisedUW"])
def test_settled_parameters_refuse_losses_on_another_device(name: str) -> None:
    """Moved in place, a parameter no longer matched its optimizer's state; the message says to
    move the scalarizer, which then works."""
    scalarizer = FACTORIES[name]()
    scalarizer(torch.tensor(LOSSES[0]))
    losses = torch.ones(3, device="meta")
    with pytest.raises(
        ValueError, match=r"parameters are on cpu but `losses` are on meta.*\.to\('meta'\)"
    ):
        scalarizer(losses)
    assert all(p.device.type == "cpu" for p in scalarizer.parameters())
    assert scalarizer.to("meta")(losses).device.type == "meta"


def _devices(value: object) -> set[str]:
    if isinstance(value, Tensor):
        return {value.device.type}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(*(_devices(item) for item in value))
    return set()


@pytest.mark.parametrize("name", STATEFUL)
def test_to_moves_the_whole_state(name: str) -> None:
    """The state kept as plain tensors (DWA's averages, LBTW's reference, FAMO's last losses,
    ...) stayed on the CPU under ``.to(device)``: a CPU checkpoint resumed on a GPU failed on
    mixed devices. (``meta`` stands in for a GPU.)"""
    scalarizer = FACTORIES[name]()
    for row in LOSSES[:3]:
        _protocol(scalarizer, torch.tensor(row))
    scalarizer(torch.tensor(LOSSES[3]))  # (FAMO: losses kept for the next update)
    assert _devices(scalarizer.state_dict()) == {"cpu"}
    scalarizer.to("meta")
    assert _devices(scalarizer.state_dict()) == {"meta"}


# (factory from a tensor of 3 entries, the argument's name): every tensor hyper-parameter.
TENSOR_HYPERPARAMETERS: list[tuple[Callable[[Tensor], Scalarizer], str]] = [
    (Constant, "weights"),
    (lambda v: Tchebycheff(weights=v), "weights"),
    (lambda v: Tchebycheff(reference=v), "reference"),
    (lambda v: AugmentedTchebycheff(0.1, weights=v), "weights"),
    (lambda v: AugmentedTchebycheff(0.1, reference=v), "reference"),
    (lambda v: STCH(1.0, weights=v), "weights"),
    (lambda v: STCH(1.0, reference=v), "reference"),
    (lambda v: PBI(5.0, weights=v), "weights"),
    (lambda v: PBI(5.0, weights=torch.ones(3), reference=v), "reference"),
    (lambda v: COSMOS(1.0, weights=v), "weights"),
    (lambda v: FAMO(3, min_losses=v), "min_losses"),
]


@pytest.mark.parametrize(("make", "name"), TENSOR_HYPERPARAMETERS)
@BAD_TENSORS
def test_tensor_hyperparameters_refuse_nonfinite_complex_nonfloat_and_meta_values(
    make: Callable[[Tensor], Scalarizer], name: str, bad: Tensor, error: type, words: str
) -> None:
    """A NaN weight or reference was accepted and every value was NaN; a complex one lost its
    imaginary part. All are refused at construction, naming the class and the argument."""
    with pytest.raises(error, match=rf"\w+: `{name}`.*{words}"):
        make(bad)
    value = make(torch.tensor([0.5, 0.25, 0.25]))(torch.tensor(LOSSES[0]))
    assert bool(torch.isfinite(value))


@pytest.mark.parametrize(
    "make",
    [
        DWA,
        ReLoBRaLo,
        AdaLoss,
        LBTW,
        SoftAdapt,
        GeometricMean,
        lambda: FAMO(3),
        FACTORIES["LogSTCH"],
    ],
)
def test_methods_that_read_the_losses_refuse_meta_losses(make: Callable[[], Scalarizer]) -> None:
    """Meta losses raised torch's ``Tensor.item() cannot be called on meta tensors``."""
    scalarizer = make()
    with pytest.raises(ValueError, match=r"reads the values of `losses`.*meta device"):
        scalarizer(torch.ones(3, device="meta"))
    assert bool(torch.isfinite(scalarizer(torch.tensor(LOSSES[0]))))
