"""The properties an aggregation method may claim, as checked by the test suite.

Each aggregator class states its claims in its ``properties`` class attribute (those of its
default configuration; ``claimed_properties()`` gives an instance's); the test suite
asserts every claim on hypothesis-generated Jacobians and the documentation table is generated
from the same attribute, so a claim in the docs is always a test.
"""

from __future__ import annotations

from enum import Enum


class Property(str, Enum):
    """A property of an aggregator ``A`` on Jacobians ``J`` of shape ``[m, n]``.

    Example:
        >>> from jacflow.aggregation import Mean, Property, UPGrad
        >>> Property.NON_CONFLICTING in UPGrad.properties
        True
        >>> Property.NON_CONFLICTING in Mean.properties
        False
        >>> Property("weighted") is Property.WEIGHTED
        True
    """

    NON_CONFLICTING = "non-conflicting"
    """``J @ A(J) >= 0``: no objective increases to first order."""

    LINEAR_UNDER_SCALING = "linear under scaling"
    """``A(diag(c) J)`` is linear in ``c`` for ``c > 0``."""

    PERMUTATION_INVARIANT = "permutation invariant"
    """Permuting the rows of ``J`` does not change ``A(J)`` (with a uniform ``pref_vector``)."""

    WEIGHTED = "weighted"
    """``A(J) = J^T w`` for weights ``w`` that the aggregator exposes."""
