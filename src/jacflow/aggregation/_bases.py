"""The two abstractions of aggregation and the two ways of composing them.

* :class:`Aggregator` maps a Jacobian ``J`` of shape ``[m, n]`` to an update of shape ``[n]``.
* :class:`Weighting` maps a statistic of ``J`` (``J`` itself or its Gramian) to weights ``[m]``.

Most methods only depend on ``J`` through its Gramian ``G = J J^T``; they are written once as a
:class:`GramianWeighting` and wrapped by :class:`GramianWeightedAggregator`. That split is what
lets the Gramian engine (:mod:`jacflow.autogram`) run them without ever forming ``J``.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeGuard

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from jacflow._labels import received, with_vector
from jacflow.aggregation._hyperparameters import (
    Configurable,
    Forwarded,
    Hyperparameter,
    check_callable,
)
from jacflow.aggregation._properties import Property
from jacflow.linalg import compute_gramian
from jacflow.linalg._gramian import has_nonfinite


def _check_matrix(value: object, name: str, owner: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{owner} expects `{name}` to be a torch.Tensor, received {type(value)}.")
    if value.ndim != 2:
        raise ValueError(
            f"{owner} expects `{name}` to be a 2-D matrix of shape [m, n], received a tensor of "
            f"shape {tuple(value.shape)}. Flatten a Jacobian with `J.flatten(1)` first."
        )
    if not value.is_floating_point():
        raise TypeError(
            f"{owner} expects `{name}` to be a real floating-point tensor (e.g. float32 or "
            f"float64), received dtype {value.dtype}. Convert it with `.float()` first."
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{owner} expects `{name}` to hold values, but it is on the meta device, which holds "
            "none; pass a tensor on a real device (e.g. cpu)."
        )
    return value


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which an input of ``dtype`` is aggregated: float32 for float16 and bfloat16
    (the solvers' linear algebra has no half-precision kernels, and their precision cut-offs
    would remove most updates), ``dtype`` itself otherwise.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bases import compute_dtype
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def peak_magnitude(t: Tensor) -> Tensor:
    """The largest absolute entry of the non-empty real tensor ``t`` (NaN where one is NaN), as
    ``t.abs().amax()`` without forming ``t.abs()`` (one reduction over ``t``).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bases import peak_magnitude
        >>> peak_magnitude(torch.tensor([[2.0, -5.0], [1.0, 0.5]]))
        tensor(5.)
    """
    if t.numel() <= 4096:  # (a small one, as a Gramian of a few objectives: fewer calls)
        return t.abs().amax()
    low, high = t.aminmax()
    return torch.maximum(high, -low)


def unit_peak_factor(matrices: Sequence[Tensor], dtype: torch.dtype | None = None) -> Tensor:
    """The power of two (a 0-d tensor of ``dtype``, default the first matrix's) that brings the
    largest absolute entry of ``matrices`` into [1/2, 1); 1 when it is zero or not finite, or
    when every matrix is empty. No host synchronisation.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bases import unit_peak_factor
        >>> unit_peak_factor([torch.tensor([3.0]), torch.tensor([[-5.0, 1.0]])])
        tensor(0.1250)
    """
    dtype = matrices[0].dtype if dtype is None else dtype
    # (each matrix's smallest and largest entries, whose largest magnitude is the peak: one
    # reduction per matrix, without forming |m|; NaN stays NaN)
    extremes = [e for m in matrices if m.numel() for e in m.detach().aminmax()]
    if not extremes:  # (no entry: nothing to scale)
        return torch.ones((), dtype=dtype, device=matrices[0].device)
    peak = torch.stack(extremes).to(dtype).abs().amax()
    _, exponent = torch.frexp(peak)  # peak = mantissa * 2**exponent, mantissa in [1/2, 1)
    largest = math.frexp(torch.finfo(dtype).max)[1] - 1  # 2**largest is finite
    exponent = torch.where(torch.isfinite(peak), exponent, 0).clamp(min=-largest)
    # (exp2 of an integer is exact; it is computed in the matrices' dtype, unlike ldexp's 2**e)
    return torch.exp2(-exponent.to(dtype))


def out_of_range(gramian: Tensor, matrices: Sequence[Tensor]) -> bool:
    """Whether ``gramian``, formed from the finite ``matrices`` in a dtype narrower than
    float64, overflowed (entries about 1e19 in float32) or underflowed (its largest entry
    below ``tiny / eps``, about 1e-31 in float32: its smaller entries lose digits as subnormal
    numbers, or vanish): a weighting that reads the Gramian's scale then gets it formed in
    float64. One host synchronisation, only below float64.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bases import out_of_range
        >>> J = torch.tensor([[3e19, 1e19]])
        >>> out_of_range(J @ J.T, [J]), out_of_range(J.double() @ J.double().T, [J.double()])
        (True, False)
        >>> tiny, zero = torch.tensor([[1e-25, 2e-25]]), torch.zeros(1, 2)
        >>> out_of_range(tiny @ tiny.T, [tiny]), out_of_range(zero @ zero.T, [zero])
        (True, False)
    """
    if not peak_out_of_range(gramian):
        return False
    if has_nonfinite(gramian):  # overflowed, unless a matrix holds a non-finite entry itself
        return not any(has_nonfinite(m) for m in matrices)
    return any(bool(m.any()) for m in matrices)  # underflowed, unless every entry is zero


def peak_out_of_range(gramian: Tensor) -> bool:
    """Whether the largest absolute entry of ``gramian``, in a dtype narrower than float64,
    is not finite (inf or NaN) or below ``tiny / eps`` (zero included): the test of
    :func:`out_of_range` on the Gramian alone. One host read, only below float64.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bases import peak_out_of_range
        >>> peak_out_of_range(torch.tensor([[1e-35]])), peak_out_of_range(torch.eye(2))
        (True, False)
    """
    if gramian.dtype == torch.float64 or gramian.numel() == 0:
        return False
    info = torch.finfo(gramian.dtype)
    # (NaN fails both comparisons)
    return not info.tiny / info.eps <= float(peak_magnitude(gramian.detach())) < math.inf


def scale_to_unit_peak(matrix: Tensor) -> Tensor:
    """``matrix`` times the power of two that brings its largest absolute entry into [1/2, 1).

    A power of two only shifts the exponents, so the scaling is exact (except for entries that
    end up below the smallest normal number, far below the largest one), and so is the
    Gramian's: ``(c J)(c J)^T = c^2 J J^T`` bit for bit. It keeps the Gramian of a finite
    matrix from overflowing (float32 entries of about 1e19) or underflowing (about 1e-20).
    An empty, zero or non-finite matrix is returned unscaled. No host synchronisation.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bases import scale_to_unit_peak
        >>> scale_to_unit_peak(torch.tensor([[3e20, -1e20], [0.0, 1e19]]))
        tensor([[ 0.5082, -0.1694],
                [ 0.0000,  0.0169]])
    """
    if matrix.numel() == 0:
        return matrix
    return matrix * unit_peak_factor([matrix])


def runs_forward_hooks(*modules: nn.Module) -> bool:
    """Whether calling one of ``modules`` runs a forward hook or pre-hook (its own or a
    global one): a shortcut that skips the call would skip them (TorchJD's monitoring hooks
    on ``A.weighting``, a hook that changes the weights).

    Example:
        >>> from jacflow.aggregation import Mean
        >>> from jacflow.aggregation._bases import runs_forward_hooks
        >>> A = Mean()
        >>> runs_forward_hooks(A.weighting)
        False
        >>> _ = A.weighting.register_forward_hook(lambda module, args, out: out)
        >>> runs_forward_hooks(A.weighting)
        True
    """
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(module._forward_hooks or module._forward_pre_hooks for module in modules)


class Aggregator(Configurable, ABC):
    """Maps a Jacobian matrix ``[m, n]`` (one row per objective) to one update vector ``[n]``.

    Subclasses implement :meth:`forward`; calling the aggregator validates the input first.
    ``m = 0`` is allowed and gives the zero vector for every method that is weighted (except
    ``ParetoMTL`` with preference vectors of one entry or more per objective: they fix ``m``).
    A float16 or bfloat16 matrix is aggregated in float32 (``forward`` and its hooks see the
    float32 copy) and the update is returned in the input's dtype.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Mean
        >>> Mean()(torch.tensor([[1., 2.], [3., 4.]]))
        tensor([2., 3.])
    """

    properties: ClassVar[frozenset[Property]] = frozenset()
    """The :class:`Property` claims of this method in its default configuration, each asserted
    by the test suite; :meth:`claimed_properties` gives those of an instance."""

    uniform_preference_properties: ClassVar[frozenset[Property]] = frozenset()
    """The claims of :attr:`properties` that hold only with a uniform ``pref_vector`` (``None``
    or equal entries): a preference that weights the objectives unequally breaks them."""

    def claimed_properties(self) -> frozenset[Property]:
        """The :class:`Property` claims of this configuration: :attr:`properties`, less
        :attr:`uniform_preference_properties` when its ``pref_vector`` has unequal entries.

        Example:
            >>> import torch
            >>> from jacflow.aggregation import Property, UPGrad
            >>> Property.PERMUTATION_INVARIANT in UPGrad().claimed_properties()
            True
            >>> UPGrad(pref_vector=torch.tensor([1., 2.])).claimed_properties() < UPGrad.properties
            True
        """
        pref = getattr(self, "pref_vector", None)
        if isinstance(pref, Tensor) and not bool((pref == pref[:1]).all()):
            return self.properties - self.uniform_preference_properties
        return self.properties

    without_autograd: ClassVar[bool] = False
    """Whether the method computes its update from ``J`` without autograd (see
    :attr:`differentiable`)."""

    @property
    def differentiable(self) -> bool:
        """Whether the update's graph to ``J`` gives its true derivative (a method of your own:
        True, autograd records it). A method whose weights are computed without autograd (most
        of them; as in TorchJD) returns an update without a graph, so that no derivative of it
        can silently hold those weights constant; :func:`jacflow.backward` refuses it with
        ``create_graph=True``.

        Example:
            >>> from jacflow.aggregation import IMTLG, UPGrad
            >>> UPGrad().differentiable, IMTLG().differentiable
            (True, False)
        """
        return not self.without_autograd

    def __call__(self, matrix: Tensor) -> Tensor:
        _check_matrix(matrix, "matrix", type(self).__name__)
        with contextlib.nullcontext() if self.differentiable else torch.no_grad():
            work = compute_dtype(matrix.dtype)
            if work != matrix.dtype:
                return super().__call__(matrix.to(work)).to(matrix.dtype)
            return super().__call__(matrix)

    def check_rows(self, m: int) -> None:
        """Raise ``ValueError`` if this aggregator cannot take a matrix of ``m`` rows.

        :func:`jacflow.backward` calls it before it differentiates, so that a number of rows
        that the aggregator would refuse fails with the graph intact. Accepts any ``m`` unless
        the configuration fixes or bounds it (e.g. :class:`Constant`, :class:`Krum`); a method
        that overrides it refuses the same ``m`` when called.

        Example:
            >>> from jacflow.aggregation import Krum
            >>> Krum(n_byzantine=1).check_rows(3)
            Traceback (most recent call last):
            ...
            ValueError: Krum with n_byzantine=1 needs at least n_byzantine + 3 = 4 rows, ...
        """

    @abstractmethod
    def forward(self, matrix: Tensor) -> Tensor:
        """Return the aggregation of the rows of ``matrix``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __str__(self) -> str:
        """The class name, with the preference vector of a method that has one (TorchJD's
        label: ``UPGrad([0.2, 0.8])``)."""
        pref = getattr(self, "pref_vector", None)
        return with_vector(type(self).__name__, pref if isinstance(pref, Tensor) else None)


class Weighting(Configurable, ABC):
    """Maps a matrix statistic (``J`` or ``J J^T``) of shape ``[m, k]`` to ``m`` weights.

    A float16 or bfloat16 statistic is weighted in float32 and the weights are returned in its
    dtype, as for :class:`Aggregator`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MeanWeighting
        >>> MeanWeighting()(torch.eye(4))
        tensor([0.2500, 0.2500, 0.2500, 0.2500])
    """

    without_autograd: ClassVar[bool] = False
    """Whether the method computes its weights from its input without autograd (see
    :attr:`differentiable`)."""

    @property
    def differentiable(self) -> bool:
        """Whether ``weights @ J``'s graph gives the true derivative of the weighted update:
        the weights are computed with autograd or do not depend on the input (locally), as
        those of :class:`MeanWeighting`, :class:`ConstantWeighting`, :class:`KrumWeighting`,
        :class:`MGDAWeighting` or :class:`UPGradWeighting` with a ``TorchProjector``; a
        weighting of your own: True.
        Its aggregators are :attr:`Aggregator.differentiable` when it is.

        Example:
            >>> from jacflow.aggregation import IMTLGWeighting, MeanWeighting
            >>> MeanWeighting().differentiable, IMTLGWeighting().differentiable
            (True, False)
        """
        return not self.without_autograd

    def __call__(self, stat: Tensor) -> Tensor:
        self._check_input(stat)
        work = compute_dtype(stat.dtype)
        if work != stat.dtype:
            return super().__call__(stat.to(work)).to(stat.dtype)
        return super().__call__(stat)

    def _check_input(self, stat: Tensor) -> None:
        _check_matrix(stat, "stat", type(self).__name__)

    def check_rows(self, m: int) -> None:
        """Raise ``ValueError`` if this weighting cannot weight ``m`` rows (objectives).

        Accepts any ``m`` unless the configuration fixes or bounds it; a weighting that
        overrides it refuses the same ``m`` when called.
        """

    @abstractmethod
    def forward(self, stat: Tensor) -> Tensor:
        """Return the ``[m]`` weights."""

    def __lshift__(self, fn: Callable[[Tensor], Tensor]) -> Weighting:
        """The composition ``self << fn``: a :class:`Weighting` whose weights of ``x`` are
        ``self(fn(x))`` (e.g. a Gramian weighting composed with the Gramian computation is a
        weighting of the Jacobian). Hooks on ``self`` still run; the composition accepts any
        tensor that ``fn`` accepts.

        Example:
            >>> import torch
            >>> from jacflow.aggregation import UPGradWeighting
            >>> from jacflow.linalg import compute_gramian
            >>> W = UPGradWeighting() << compute_gramian
            >>> W(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
            tensor([1.1111, 0.7895])
        """
        return _Composition(self, fn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __str__(self) -> str:
        return type(self).__name__


def check_weighting(value: object, name: str) -> Weighting:
    """``value`` if it is a :class:`Weighting`, else a ``TypeError``."""
    if not isinstance(value, Weighting):
        raise TypeError(
            f"`{name}` must be a jacflow.aggregation.Weighting, received {received(value)}."
        )
    return value


class _Composition(Weighting):
    """``weighting << fn``: the weights of ``x`` are ``weighting(fn(x))``."""

    weighting = Hyperparameter(check_weighting)
    fn = Hyperparameter(check_callable)

    def __init__(self, weighting: Weighting, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.weighting = weighting
        self.fn = fn

    def _check_input(self, stat: Tensor) -> None:
        if not isinstance(stat, Tensor):  # (the rest is for ``fn`` and ``weighting`` to check)
            raise TypeError(f"{self!r} expects a torch.Tensor, received {type(stat)}.")

    def check_rows(self, m: int) -> None:
        self.weighting.check_rows(m)  # (``fn`` keeps the rows: one weight per row of ``x``)

    @property
    def differentiable(self) -> bool:
        """The inner weighting's (``fn`` is recorded by autograd)."""
        return self.weighting.differentiable

    def forward(self, stat: Tensor) -> Tensor:
        return self.weighting(self.fn(stat))

    def __repr__(self) -> str:
        return f"{self.weighting!r} << {getattr(self.fn, '__name__', repr(self.fn))}"


class GramianWeighting(Weighting):
    """A :class:`Weighting` whose input is a Gramian ``G = J J^T`` of shape ``[m, m]``.

    These are the weightings usable with :mod:`jacflow.autogram`, which computes ``G`` without
    the Jacobian.

    :attr:`scale_invariant` says whether the weights ignore a global scale of the Gramian,
    ``weights(c^2 G) == weights(G)`` for every ``c > 0`` (a test asserts it for every weighting
    that says so). :class:`GramianWeightedAggregator` then forms the Gramian of ``J`` scaled to
    a largest entry of about 1, so that Jacobians of extreme but finite scale (about 1e19 or
    1e-25 in float32) neither overflow nor underflow it.

    Gradients through the weights: :class:`UPGradWeighting`'s and :class:`DualProjWeighting`'s
    weights (with a ``TorchProjector``, the default, or a projector that declares itself
    :attr:`~jacflow.linalg.DualConeProjector.differentiable`) are differentiable with respect
    to ``G`` and the preference (implicit differentiation of the projections, also twice), and
    so are
    :class:`Periodic`'s on the calls where it recomputes them with such a weighting;
    :class:`MGDAWeighting`'s (normalisations ``"none"`` and ``"l2"``) and
    :class:`AlignedMTLWeighting`'s (first derivatives only) are too; every
    other weighting computes its weights without autograd, so they carry no graph to ``G``
    (:class:`ConstantWeighting` returns the weights it was given, as they are), and where they
    depend on ``G`` (see :attr:`~Weighting.differentiable`), their aggregators' updates carry
    none to ``J`` either.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGradWeighting
        >>> UPGradWeighting()(torch.tensor([[1., 0.], [0., 1.]]))
        tensor([0.5000, 0.5000])
    """

    # Set to True by a class whose ``forward`` reads only the Gramian's number of rows; a
    # subclass with a ``forward`` of its own does not inherit the claim (see ``_size_only``).
    _forward_reads_size_only: ClassVar[bool] = False

    def _size_only(self) -> bool:
        """Whether the ``forward`` that runs is one declared to read only the number of rows."""
        for cls in type(self).__mro__:
            if "forward" in cls.__dict__:
                return bool(cls.__dict__.get("_forward_reads_size_only", False))
        return False

    @property
    def scale_invariant(self) -> bool:
        """Whether ``weights(c^2 G) == weights(G)`` for every ``c > 0`` (default: False; True
        for the weightings that do not read the Gramian, see :attr:`reads_gramian`)."""
        return self._size_only()

    @property
    def reads_gramian(self) -> bool:
        """Whether the weights read the Gramian's values, not only its number of rows (default:
        True). :class:`MeanWeighting`, :class:`SumWeighting`, :class:`ConstantWeighting` and
        :class:`RandomWeighting` do not, unless a subclass gives them a ``forward`` of its own:
        the :class:`~jacflow.autogram.Engine` then skips its range test of their Gramian (a
        host read), which only matters to weights computed from it.

        Example:
            >>> import torch
            >>> from jacflow.aggregation import MeanWeighting, UPGradWeighting
            >>> MeanWeighting().reads_gramian, UPGradWeighting().reads_gramian
            (False, True)
            >>> class Diagonal(MeanWeighting):
            ...     def forward(self, stat: torch.Tensor) -> torch.Tensor:
            ...         return stat.diagonal() / stat.trace()
            >>> Diagonal().reads_gramian, Diagonal().scale_invariant
            (True, False)
        """
        return not self._size_only()

    def _check_input(self, stat: Tensor) -> None:
        gramian = _check_matrix(stat, "gramian", type(self).__name__)
        if gramian.shape[0] != gramian.shape[1]:
            raise ValueError(
                f"{type(self).__name__} expects a square Gramian [m, m], received shape "
                f"{tuple(gramian.shape)}. Pass `J @ J.T`, or use the aggregator form on `J`."
            )


def check_gramian_weighting(value: object, name: str = "weighting") -> GramianWeighting:
    """``value`` if it is a :class:`GramianWeighting` (what wrappers accept), else a ``TypeError``.

    Example:
        >>> from jacflow.aggregation import MeanWeighting
        >>> from jacflow.aggregation._bases import check_gramian_weighting
        >>> check_gramian_weighting(MeanWeighting())
        MeanWeighting()
    """
    if not isinstance(value, GramianWeighting):
        raise TypeError(
            f"`{name}` must be a jacflow.aggregation.GramianWeighting (e.g. UPGradWeighting()), "
            f"received {received(value)}.{_gramian_weighting_hint(value)}"
        )
    return value


def _gramian_weighting_hint(value: object) -> str:
    """Where ``value`` holds the Gramian weighting to pass (UPGrad's, or that of UPGrad's
    weighting of ``J``), the way to it; for another aggregator, why it has none."""
    inner = getattr(value, "gramian_weighting", None)
    library = type(value).__module__.startswith("jacflow.")  # (not a subclass of one's own)
    if isinstance(value, Aggregator):
        if weights_from_gramian(value) and library:
            return (
                " It is an aggregator: pass its Gramian weighting, its `.gramian_weighting` (a "
                f"{type(inner).__name__})."
            )
        return (
            " It is an aggregator whose weights do not come from the Gramian alone (or whose "
            "forward is one's own), so it has no Gramian weighting to pass here."
        )
    if type(value) is GramianOfJacobianWeighting and isinstance(inner, GramianWeighting):
        return (
            " It weights the Jacobian through the Gramian: pass its `.gramian_weighting` (a "
            f"{type(inner).__name__})."
        )
    return ""


class GramianOfJacobianWeighting(Weighting):
    """``gramian_weighting << gramian``: the weighting of the Jacobian ``J`` that applies
    ``gramian_weighting`` to ``J J^T`` (the :attr:`~GramianWeightedAggregator.weighting` of a
    :class:`GramianWeightedAggregator`).

    When ``gramian_weighting`` is :attr:`~GramianWeighting.scale_invariant`, the Gramian is
    formed from ``J`` scaled by a power of two to a largest entry in [1/2, 1) (exact, and the
    same weights, without overflow or underflow of ``J J^T``); a float16 or bfloat16 ``J`` is
    weighted in float32 and the weights are returned in its dtype.

    Args:
        gramian_weighting: maps the ``[m, m]`` Gramian to ``[m]`` weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGradWeighting
        >>> from jacflow.aggregation._bases import GramianOfJacobianWeighting
        >>> W = GramianOfJacobianWeighting(UPGradWeighting())
        >>> W(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([1.1111, 0.7895])
    """

    gramian_weighting = Hyperparameter(check_gramian_weighting)

    def __init__(self, gramian_weighting: GramianWeighting) -> None:
        super().__init__()
        self.gramian_weighting = gramian_weighting

    def _check_input(self, stat: Tensor) -> None:
        _check_matrix(stat, "matrix", type(self).__name__)

    def check_rows(self, m: int) -> None:
        self.gramian_weighting.check_rows(m)

    @property
    def differentiable(self) -> bool:
        """The Gramian weighting's (the Gramian ``J J^T`` is recorded by autograd)."""
        return self.gramian_weighting.differentiable

    def forward(self, stat: Tensor) -> Tensor:
        if self.gramian_weighting.scale_invariant:
            stat = scale_to_unit_peak(stat)  # same weights; no overflow or underflow of G
            return self.gramian_weighting(compute_gramian(stat))
        gramian = compute_gramian(stat)
        if out_of_range(gramian, [stat]):
            return self.gramian_weighting(compute_gramian(stat.double())).to(stat.dtype)
        return self.gramian_weighting(gramian)

    def __repr__(self) -> str:
        return f"{self.gramian_weighting!r} << gramian"


class WeightedAggregator(Aggregator):
    """Aggregates by ``weighting(J) @ J`` for a weighting that reads the Jacobian itself.

    Args:
        weighting: maps the ``[m, n]`` Jacobian to ``[m]`` weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MeanWeighting, WeightedAggregator
        >>> WeightedAggregator(MeanWeighting())(torch.tensor([[0., 2.], [2., 0.]]))
        tensor([1., 1.])
    """

    properties: ClassVar[frozenset[Property]] = frozenset({Property.WEIGHTED})

    weighting = Hyperparameter(check_weighting)
    """The weighting of the Jacobian: ``weighting(J)`` are the weights of the rows of ``J``."""

    def __init__(self, weighting: Weighting) -> None:
        super().__init__()
        self.weighting = weighting

    def weights(self, matrix: Tensor) -> Tensor:
        """Weights that this aggregator gives to the rows of ``matrix``."""
        return self.weighting(matrix)

    def __setattr__(self, name: str, value: object) -> None:
        # (an attribute would hide the method, and the next call fail on it: `Constant(w)`'s
        # weights are its weighting's hyper-parameter)
        if name == "weights":
            raise AttributeError(
                f"`weights` is the method weights(matrix) of {type(self).__name__}: assigning "
                f"it would hide that method. {_weights_hint(self)}"
            )
        super().__setattr__(name, value)

    def check_rows(self, m: int) -> None:
        self.weighting.check_rows(m)

    @property
    def differentiable(self) -> bool:
        """The weighting's, unless the method computes its update without autograd
        (:attr:`without_autograd`)."""
        return not self.without_autograd and self.weighting.differentiable

    def forward(self, matrix: Tensor) -> Tensor:
        return self.weights(matrix).to(matrix.dtype) @ matrix

    def extra_repr(self) -> str:
        return repr(self.weighting) if type(self) in (WeightedAggregator,) else ""


def _weights_hint(aggregator: WeightedAggregator) -> str:
    """Where the weights of ``aggregator`` are set: a ``Constant``'s on its weighting."""
    from jacflow.aggregation._constant import ConstantWeighting  # (it builds on this module)

    weighting = getattr(aggregator, "gramian_weighting", aggregator.weighting)
    if isinstance(weighting, ConstantWeighting):
        return (
            "Constant weights are a hyper-parameter of the weighting: "
            "`aggregator.gramian_weighting.weights = tensor` (checked there)."
        )
    return "Its weights come from its weighting; change the weighting's hyper-parameters."


class GramianWeightedAggregator(WeightedAggregator):
    """Aggregates by ``gramian_weighting(J J^T) @ J``.

    Named Gramian-based methods (:class:`UPGrad`, ...) are presets of this class; any
    :class:`GramianWeighting` of your own composes with it the same way. When the weighting is
    :attr:`~GramianWeighting.scale_invariant`, the Gramian is formed from ``J`` scaled by a
    power of two to a largest entry in [1/2, 1) (exact; the weights are the same).

    As in TorchJD, :attr:`weighting` is a weighting of ``J`` (``gramian_weighting << gramian``,
    the one the aggregator calls) and :attr:`gramian_weighting` the weighting of the Gramian.
    To change the method, assign ``gramian_weighting`` (on this class; a named method builds
    its own and exposes its hyper-parameters instead).

    Args:
        gramian_weighting: maps the ``[m, m]`` Gramian to ``[m]`` weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GramianWeightedAggregator, UPGradWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> A = GramianWeightedAggregator(UPGradWeighting())
        >>> A(J)
        tensor([0.2924, 1.9006, 1.9006])
        >>> A.weighting(J), A.gramian_weighting(J @ J.T)
        (tensor([1.1111, 0.7895]), tensor([1.1111, 0.7895]))
    """

    weighting = Hyperparameter(
        check_weighting, frozen="it is derived, `gramian_weighting << gramian`"
    )
    """The weighting of the Jacobian, ``gramian_weighting << gramian``: ``weighting(J)`` are
    the weights of the rows of ``J`` (those of :meth:`weights`)."""

    gramian_weighting = Forwarded(GramianOfJacobianWeighting.gramian_weighting, via="weighting")
    """The weighting of the Gramian: ``gramian_weighting(J @ J.T)`` are the weights."""

    def __init__(self, gramian_weighting: GramianWeighting) -> None:
        super().__init__(GramianOfJacobianWeighting(gramian_weighting))

    def extra_repr(self) -> str:
        return repr(self.gramian_weighting) if type(self) is GramianWeightedAggregator else ""


def weights_from_gramian(aggregator: Aggregator) -> TypeGuard[GramianWeightedAggregator]:
    """Whether ``aggregator``'s weights are those of its :attr:`~GramianWeightedAggregator.
    gramian_weighting` on the plain Gramian ``J J^T``, so that a caller holding only that
    Gramian (or ``J`` in blocks) may form it and skip ``J``. False for a weighting of ``J``
    that reads more than ``J J^T`` (:class:`Krum`'s scores the centred rows in float64).

    Example:
        >>> from jacflow.aggregation import Krum, UPGrad
        >>> from jacflow.aggregation._bases import weights_from_gramian
        >>> weights_from_gramian(UPGrad()), weights_from_gramian(Krum(1))
        (True, False)
    """
    return (
        isinstance(aggregator, GramianWeightedAggregator)
        and type(aggregator.weighting) is GramianOfJacobianWeighting
    )


def weights_without_gramian(
    aggregator: GramianWeightedAggregator,
    matrix: Tensor,
    shortcut: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """The weights of ``matrix`` rows for an ``aggregator`` whose Gramian weighting reads only
    the number of rows: ``shortcut(matrix)`` (default: the Gramian weighting of the ``[m, 0]``
    matrix ``matrix[:, :0]``), without the Gramian; the aggregator's :attr:`~WeightedAggregator.
    weighting` when that would skip a forward hook (:func:`runs_forward_hooks`).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Random
        >>> from jacflow.aggregation._bases import weights_without_gramian
        >>> _ = torch.manual_seed(0)
        >>> weights_without_gramian(Random(), torch.ones(3, 1000))  # (no 3 x 3 Gramian formed)
        tensor([0.8446, 0.1349, 0.0205])
    """
    if runs_forward_hooks(aggregator.weighting, aggregator.gramian_weighting):  # (they must run)
        return aggregator.weighting(matrix)
    if shortcut is None:
        return aggregator.gramian_weighting(matrix[:, :0])
    return shortcut(matrix)
