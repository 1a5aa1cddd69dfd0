"""Every constructor argument of every aggregator and weighting, read back and assigned.

As in TorchJD, the hyper-parameters are attributes of the weighting and of the aggregator. An
assignment is checked as the constructor checks the argument and then acts as if the object had
been built with the new value; a refused one changes nothing. Sizes that the state or the
trainable parameters have, and the weighting that a named method builds itself, cannot be
assigned (an ``AttributeError`` says to build a new instance).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import jacflow.aggregation as agg
from jacflow.aggregation import LossAware
from jacflow.linalg import QuadprogProjector

torch.set_num_threads(1)

M = 4  # rows of the inputs, and the size of every per-objective argument below
PREF = torch.tensor([1.0, 2.0, 3.0, 4.0])
PREFERENCES = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])


@dataclass
class Case:
    """A class, constructor arguments, and assignments to try on an instance.

    ``changes``: valid new values (each compared with a fresh instance built with it);
    ``invalid``: values the constructor refuses; ``frozen``: values refused because the
    argument cannot change after construction; ``inert``: the changes that do not change the
    outputs on the inputs of this file.
    """

    cls: type[nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)
    changes: dict[str, Any] = field(default_factory=dict)
    invalid: dict[str, Any] = field(default_factory=dict)
    frozen: dict[str, Any] = field(default_factory=dict)
    inert: set[str] = field(default_factory=set)

    def __str__(self) -> str:
        return self.cls.__name__


def _both(name: str, **fields: Any) -> list[Case]:
    """The same case for the aggregator ``name`` and its weighting ``name + "Weighting"``."""
    return [Case(getattr(agg, name), **fields), Case(getattr(agg, name + "Weighting"), **fields)]


CASES: list[Case] = [
    *_both(
        "AlignedMTL",
        changes={"pref_vector": PREF, "scale_mode": "median"},
        invalid={"pref_vector": torch.ones(2, 2), "scale_mode": "max"},
    ),
    *_both(
        "AuxiNash",
        kwargs={"preferences": torch.ones(M), "max_norm": 1e-3},
        changes={"preferences": PREF, "max_norm": None, "max_iter": 1},
        invalid={"preferences": -torch.ones(M), "max_norm": 0.0, "max_iter": 0},
    ),
    *_both(
        "CAGrad",
        kwargs={"c": 0.5},
        changes={"c": 2.0, "norm_eps": 10.0, "rescale": 1},
        invalid={"c": -1.0, "norm_eps": -1.0, "rescale": 3},
    ),
    Case(
        agg.CRMOGMWeighting,
        kwargs={"weighting": agg.UPGradWeighting(), "alpha": 0.5, "initial_weights": torch.ones(M)},
        changes={
            "weighting": agg.MGDAWeighting(),
            "alpha": 0.1,
            "initial_weights": torch.tensor([1.0, 0.0, 0.0, 0.0]),
        },
        invalid={"weighting": object(), "alpha": 2.0, "initial_weights": torch.ones(2, 2)},
    ),
    Case(agg.ConFIG, changes={"pref_vector": PREF}, invalid={"pref_vector": torch.ones(2, 2)}),
    # (Constant's `weights` is its method `weights(J)`; the argument is its weighting's)
    Case(agg.Constant, kwargs={"weights": torch.ones(M)}),
    Case(
        agg.ConstantWeighting,
        kwargs={"weights": torch.ones(M)},
        changes={"weights": PREF},
        invalid={"weights": torch.ones(2, 2)},
    ),
    Case(
        agg.DBMTL,
        changes={"beta": 0.5, "beta_sigma": 1.0},
        invalid={"beta": 1.0, "beta_sigma": -1.0},
    ),
    *_both(
        "DualProj",
        changes={"pref_vector": PREF, "projector": QuadprogProjector()},
        invalid={"pref_vector": torch.ones(2, 2), "projector": "quadprog"},
    ),
    *_both(
        "EPO",
        kwargs={"preference": torch.ones(M), "eps": 10.0},  # (descent mode, where relax acts)
        changes={"preference": PREF, "eps": 1e-4, "relax": True},
        invalid={"preference": torch.zeros(M), "eps": -1.0, "relax": 1},
    ),
    *_both(
        "ExcessMTL",
        changes={"robust_step_size": 0.1, "n_warmup_steps": 0},
        invalid={"robust_step_size": 0.0, "n_warmup_steps": -1},
    ),
    *_both(
        "FairGrad",
        kwargs={"alpha": 1.0},
        changes={"alpha": 2.0, "max_iters": 1},
        invalid={"alpha": -1.0, "max_iters": 0},
    ),
    Case(
        agg.GradDrop,
        changes={"f": torch.zeros_like, "leak": torch.tensor([1.0, 0.0, 1.0, 0.0])},
        invalid={"f": 3, "leak": 2 * torch.ones(M)},
    ),
    *_both(
        "GradNorm",
        changes={"alpha": 0.0, "lr": 1.0},
        invalid={"alpha": -1.0, "lr": 0.0},
    ),
    *_both(
        "GradVac",
        changes={"beta": 0.9, "eps": 1.0},
        invalid={"beta": 2.0, "eps": -1.0},
    ),
    Case(
        agg.GramianWeightedAggregator,
        kwargs={"gramian_weighting": agg.UPGradWeighting()},
        changes={"gramian_weighting": agg.MGDAWeighting()},
        invalid={"gramian_weighting": agg.ExcessMTLWeighting()},
    ),
    Case(agg.IMTL, kwargs={"n_tasks": M}, frozen={"n_tasks": M + 1}),
    *_both(
        "Krum",
        kwargs={"n_byzantine": 1, "n_selected": 2},
        changes={"n_byzantine": 0, "n_selected": 3},
        invalid={"n_byzantine": -1, "n_selected": 0},
    ),
    Case(
        agg.LogLoss,
        kwargs={"weighting": agg.UPGradWeighting()},
        changes={"weighting": agg.MGDAWeighting()},
        invalid={"weighting": agg.ExcessMTLWeighting()},
    ),
    *_both(
        "MGDA",
        changes={"epsilon": 0.9, "max_iters": 1, "normalization": "l2"},
        invalid={"epsilon": 0.0, "max_iters": 0, "normalization": "L2"},
        # (they only tune the Frank-Wolfe start of an exact active-set solve)
        inert={"epsilon", "max_iters"},
    ),
    Case(
        agg.MoCo,
        changes={"beta": 1.0, "beta_sigma": 1.0, "gamma": 1.0, "gamma_sigma": 1.0, "rho": 1.0},
        invalid={"beta": 0.0, "beta_sigma": -1.0, "gamma": 0.0, "gamma_sigma": -1.0, "rho": -1.0},
    ),
    *_both(
        "MoDo",
        kwargs={"gamma": 1e-3},
        changes={"gamma": 1e-2, "rho": 10.0},
        invalid={"gamma": 0.0, "rho": -1.0},
    ),
    *_both(
        "NashMTL",
        kwargs={"n_tasks": M},
        changes={"max_norm": 0.0, "update_weights_every": 2, "optim_niter": 1},
        invalid={"max_norm": -1.0, "update_weights_every": 0, "optim_niter": 0},
        frozen={"n_tasks": M + 1},
    ),
    *_both(
        "ParetoMTL",
        kwargs={"preferences": PREFERENCES, "index": 0},
        changes={"preferences": PREFERENCES.flip(1), "index": 2, "n_warmup_steps": 0},
        # (index 3 is out of the 3 rows of `preferences`; 2 rows leave out index 2)
        invalid={"preferences": -PREFERENCES, "index": 3, "n_warmup_steps": -1},
    ),
    *_both(
        "PCD",
        changes={"tau": 0.5, "beta": 0.5, "eps": 1.0},
        invalid={"tau": 2.0, "beta": 1.0, "eps": -1.0},
    ),
    Case(
        agg.Periodic,
        kwargs={"weighting": agg.UPGradWeighting(), "every": 2},
        changes={"weighting": agg.MGDAWeighting(), "every": 1},
        invalid={"weighting": agg.ExcessMTLWeighting(), "every": 0},
    ),
    *_both(
        "SDMGrad",
        kwargs={"lr": 1.0},  # (the default 10 reaches a vertex whatever the momentum)
        changes={"lr": 0.1, "momentum": 0.0, "n_iter": 1, "lambda_": 0.0, "pref_vector": PREF},
        invalid={
            "lr": 0.0,
            "momentum": 1.0,
            "n_iter": 0,
            "lambda_": -1.0,
            "pref_vector": torch.ones(2, 2),
        },
    ),
    Case(
        agg.TrimmedMean,
        kwargs={"trim_number": 1},
        changes={"trim_number": 0},
        invalid={"trim_number": -1},
    ),
    *_both(
        "UPGrad",
        changes={"pref_vector": PREF, "projector": QuadprogProjector()},
        invalid={"pref_vector": torch.ones(2, 2), "projector": "quadprog"},
    ),
    Case(
        agg.WeightedAggregator,
        kwargs={"weighting": agg.MeanWeighting()},
        changes={"weighting": agg.SumWeighting()},
        invalid={"weighting": object()},
    ),
]
ASSIGNABLE = [case for case in CASES if case.changes or case.invalid or case.frozen]

_J = torch.tensor(
    [[-4.0, 1.0, 1.0, 2.0, 0.5], [6.0, 1.0, 1.0, -1.0, 0.0], [1.0, -3.0, 0.5, 0.0, 2.0]],
    dtype=torch.float64,
)
J = torch.cat([_J, 0.5 * _J[:1] - _J[1:2]])  # 4 rows, two of them conflicting
# Three steps, on changing Jacobians and losses: a stateful method's hyper-parameters may only
# act on its later steps (a moving average, a period, the first losses as reference).
STEPS = [
    (J, torch.ones(M, dtype=torch.float64)),
    (
        J.roll(1, dims=0) * torch.tensor([[1.0], [2.0], [1.0], [0.5]]),
        torch.tensor([0.5, 1, 1.5, 2]),
    ),
    (J, torch.tensor([0.2, 1.0, 0.7, 3.0], dtype=torch.float64)),
]


def _outputs(module: nn.Module) -> Tensor:
    """The outputs of the steps, each from the same random draws: the update of an aggregator,
    the weights of a weighting (of ``J``, or of its Gramian for a Gramian weighting)."""
    target = module
    if isinstance(module, agg.GramianWeightedAggregator) and not isinstance(module, LossAware):
        target = module.gramian_weighting
    outputs = []
    for matrix, losses in STEPS:
        torch.manual_seed(0)
        if isinstance(target, LossAware):
            target.set_losses(losses.to(matrix))
        gramian_input = isinstance(module, agg.GramianWeighting)
        outputs.append(module(matrix @ matrix.T if gramian_input else matrix))
    return torch.stack(outputs)


def _same(a: object, b: object) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a is b or a == b


def _unchanged_on_refusal(case: Case, obj: nn.Module, name: str, value: Any) -> None:
    before = getattr(obj, name)
    error = AttributeError if name in case.frozen else (ValueError, TypeError)
    match = "build a new" if name in case.frozen else f"`{name}`"
    with pytest.raises(error, match=match):
        setattr(obj, name, value)
    assert getattr(obj, name) is before


def test_every_constructor_argument_is_read_back() -> None:
    """Under its constructor name, on the weighting and on the aggregator, for every public
    class; a class without a row here fails (add one)."""
    covered = {case.cls for case in CASES}
    for public in agg.__all__:
        cls = getattr(agg, public)
        if not (isinstance(cls, type) and issubclass(cls, (agg.Aggregator, agg.Weighting))):
            continue
        names = [p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs")]
        if not names:
            continue
        assert cls in covered, f"add a Case for {public} to CASES"
    for case in CASES:
        obj = case.cls(**case.kwargs)
        for name, parameter in inspect.signature(case.cls).parameters.items():
            if case.cls is agg.Constant:  # (`weights` is the method; see its weighting)
                assert _same(obj.gramian_weighting.weights, case.kwargs["weights"])
                continue
            expected = case.kwargs.get(name, parameter.default)
            value = getattr(obj, name)
            if name == "projector" and expected is None:
                assert value is not None  # the default projector
            elif isinstance(expected, Tensor):
                assert torch.equal(value, expected), (case, name)
            else:
                assert value is expected or value == expected, (case, name, value)


@pytest.mark.parametrize("case", ASSIGNABLE, ids=str)
def test_assignment_acts_as_construction_and_refusals_change_nothing(case: Case) -> None:
    original = _outputs(case.cls(**case.kwargs))
    inert = set()
    for name, value in case.changes.items():
        obj = case.cls(**case.kwargs)
        setattr(obj, name, value)
        assert _same(getattr(obj, name), value)
        outputs = _outputs(obj)
        fresh = case.cls(**{**case.kwargs, name: value})
        torch.testing.assert_close(outputs, _outputs(fresh), equal_nan=True)
        if torch.allclose(outputs, original, equal_nan=True):
            inert.add(name)
    # (so that the comparison with a fresh instance sees an assignment that is ignored)
    assert inert == case.inert, f"these changes do not change the outputs: {inert}"
    for name, value in {**case.invalid, **case.frozen}.items():
        obj = case.cls(**case.kwargs)
        _unchanged_on_refusal(case, obj, name, value)
        torch.testing.assert_close(_outputs(obj), original, equal_nan=True)


def test_aggregator_and_weighting_share_their_hyperparameters() -> None:
    A = agg.CAGrad(c=0.5)
    A.c = 2.0
    assert A.gramian_weighting.c == 2.0
    A.gramian_weighting.norm_eps = 0.5
    assert A.norm_eps == 0.5
    with pytest.raises(ValueError, match=r"`c` must be a float in \[0.0, inf\), received -1"):
        A.c = -1
    assert A.c == 2.0
    excess = agg.ExcessMTL()
    excess.robust_step_size = 0.5
    assert excess.weighting.robust_step_size == 0.5  # (a weighting of J, as in TorchJD)


def test_a_named_method_builds_its_own_weighting() -> None:
    """Its weighting is not a constructor argument: swapping it would leave the method's name
    (and its hyper-parameters) on another method."""
    for aggregator in (agg.CAGrad(c=0.5), agg.UPGrad(), agg.Mean()):
        with pytest.raises(AttributeError, match="build a new"):
            aggregator.gramian_weighting = agg.MGDAWeighting()
        with pytest.raises(AttributeError, match="build a new"):
            aggregator.weighting = agg.MeanWeighting()
    excess = agg.ExcessMTL()
    with pytest.raises(AttributeError, match="build a new"):
        excess.weighting = agg.ExcessMTLWeighting()


def test_module_and_parameter_values_are_checked_and_registered() -> None:
    """A weighting given or assigned is a submodule, a ``nn.Parameter`` preference a parameter
    (so ``.to()``, ``parameters()`` and the optimizer see them); ``nn.Module`` registers such
    values itself, and they are checked all the same."""
    inner = agg.MGDAWeighting()
    W = agg.CRMOGMWeighting(agg.UPGradWeighting())
    W.weighting = inner
    assert W.weighting is inner and dict(W.named_children()) == {"weighting": inner}
    with pytest.raises(TypeError, match=r"`weighting` must be a jacflow\.aggregation\.Weighting"):
        W.weighting = nn.Linear(2, 2)
    assert W.weighting is inner and dict(W.named_children()) == {"weighting": inner}
    preference = nn.Parameter(torch.ones(M))
    U = agg.UPGradWeighting()
    U.pref_vector = preference
    assert U.pref_vector is preference and list(U.parameters()) == [preference]
    with pytest.raises(ValueError, match="`pref_vector` must be a vector"):
        U.pref_vector = nn.Parameter(torch.ones(2, 2))
    assert U.pref_vector is preference and list(U.parameters()) == [preference]


def test_pareto_mtl_index_and_preferences_stay_consistent() -> None:
    A = agg.ParetoMTL(PREFERENCES, index=2)
    with pytest.raises(ValueError, match=r"`preferences` must have a row `index` = 2"):
        A.preferences = PREFERENCES[:2]
    with pytest.raises(ValueError, match=r"`index` must be in \[0, 2\]"):
        A.index = 3
    A.index = 1
    A.preferences = PREFERENCES[:2]
    assert A.index == 1 and torch.equal(A.preferences, PREFERENCES[:2])


class _SmallerC(agg.CAGradWeighting):
    """A user's subclass that sets a declared hyper-parameter in its own constructor."""

    def __init__(self) -> None:
        super().__init__(c=0.5)
        self.c = 0.7


class _Swapped(agg.GramianWeightedAggregator):
    def __init__(self) -> None:
        super().__init__(agg.UPGradWeighting())
        self.gramian_weighting = agg.MGDAWeighting()


class _Passing(agg.CAGrad):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


def test_a_subclass_constructor_sets_declared_hyperparameters() -> None:
    """Its assignments are part of construction (they were refused as assignments after it);
    after construction the usual rule holds, and ``**kwargs`` passed on count as taking it."""
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    G = J @ J.T
    assert _SmallerC().c == 0.7
    torch.testing.assert_close(_SmallerC()(G), agg.CAGradWeighting(c=0.7)(G))
    torch.testing.assert_close(_Swapped()(J), agg.MGDA()(J))
    with pytest.raises(AttributeError, match="_SmallerC's constructor takes no `c`"):
        _SmallerC().c = 0.9
    passing = _Passing(c=0.5)
    passing.c = 0.9
    torch.testing.assert_close(passing(J), agg.CAGrad(c=0.9)(J))
    assert "_jacflow_constructing" not in vars(passing)


_NAN = float("nan")
_INF = float("inf")

# (factory from a vector of 3 entries, the argument's name): every tensor hyper-parameter.
TENSOR_HYPERPARAMETERS: list[tuple[Any, str]] = [
    *[
        (lambda v, cls=cls: cls(pref_vector=v), "pref_vector")
        for cls in (
            agg.UPGrad,
            agg.UPGradWeighting,
            agg.DualProj,
            agg.DualProjWeighting,
            agg.ConFIG,
            agg.AlignedMTL,
            agg.AlignedMTLWeighting,
            agg.SDMGrad,
            agg.SDMGradWeighting,
        )
    ],
    (agg.Constant, "weights"),
    (agg.ConstantWeighting, "weights"),
    (lambda v: agg.CRMOGMWeighting(agg.MeanWeighting(), initial_weights=v), "initial_weights"),
    (agg.EPO, "preference"),
    (agg.AuxiNash, "preferences"),
    (lambda v: agg.ParetoMTL(torch.stack([v, v]), 0), "preferences"),
    (lambda v: agg.GradDrop(leak=v), "leak"),
    (lambda v: agg.PCD(tau=v[:2]), "tau"),  # (one entry per row after the first)
]


# (value, exception, words of its message), with their ids: the values every tensor
# hyper-parameter refuses (also used by the scalarization tests).
BAD_TENSORS = pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        (torch.tensor([1.0, _NAN, 1.0]), ValueError, r"must be finite, received \[1\.0, nan"),
        (torch.tensor([1.0, _INF, 1.0]), ValueError, r"must be finite, received \[1\.0, inf"),
        (torch.ones(3, dtype=torch.complex64), TypeError, r"real floating-point.*complex64"),
        (torch.tensor([True, False, True]), TypeError, r"real floating-point.*torch\.bool"),
        (torch.ones(3, dtype=torch.int64), TypeError, r"real floating-point.*int64"),
        (torch.ones(3, device="meta"), ValueError, r"meta device"),
    ],
    ids=["nan", "inf", "complex", "bool", "int", "meta"],
)


@pytest.mark.parametrize(("make", "name"), TENSOR_HYPERPARAMETERS)
@BAD_TENSORS
def test_tensor_hyperparameters_refuse_nonfinite_complex_nonfloat_and_meta_values(
    make: Any, name: str, bad: Tensor, error: type[Exception], words: str
) -> None:
    """A NaN or inf tensor hyper-parameter was accepted (every later output NaN), a complex one
    lost its imaginary part or raised NotImplementedError, a bool ``leak`` failed at call time
    and a meta one failed inside torch: all are refused at construction, naming the argument."""
    with pytest.raises(error, match=rf"`{name}`.*{words}"):
        make(bad)
    valid = make(torch.tensor([0.5, 0.25, 1.0]))
    matrix = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    if isinstance(valid, agg.LossAware):
        valid.set_losses(torch.ones(3))
    assert bool(
        torch.isfinite(
            valid(matrix @ matrix.T if isinstance(valid, agg.Weighting) else matrix)
        ).all()
    )


def test_tensor_hyperparameter_assignment_is_checked_too() -> None:
    aggregator = agg.UPGrad(pref_vector=torch.ones(2))
    with pytest.raises(ValueError, match=r"`pref_vector` must be finite"):
        aggregator.pref_vector = torch.tensor([_NAN, 1.0])
    assert aggregator.pref_vector.tolist() == [1.0, 1.0]


def test_a_meta_matrix_is_refused_at_the_boundary() -> None:
    """A meta matrix raised torch's ``Tensor.item() cannot be called on meta tensors``."""
    with pytest.raises(ValueError, match=r"UPGrad expects `matrix`.*meta device"):
        agg.UPGrad()(torch.ones(3, 4, device="meta"))
    with pytest.raises(ValueError, match=r"UPGradWeighting expects `gramian`.*meta device"):
        agg.UPGradWeighting()(torch.ones(3, 3, device="meta"))
