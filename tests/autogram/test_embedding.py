"""``nn.Embedding``'s closed form: what it reads of the module at the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jacflow.autogram import Engine, _embedding
from tests.autogram.test_engine import assert_exact_step
from tests.autogram.test_linear import assert_change_refused, assert_exact_backward, row_losses

# an attribute of an Embedding(7, 3) set between its forward and the step, and whether a
# forward after the change is one the test differentiates (not a sparse gradient)
CHANGES: list[tuple[str, object, bool]] = [
    ("padding_idx", 1, True),
    ("scale_grad_by_freq", True, True),
    ("sparse", True, False),
]


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(("name", "value", "exact"), CHANGES, ids=[c[0] for c in CHANGES])
def test_attributes_changed_after_the_forward_are_refused(
    name: str, value: object, exact: bool, batch_dim: int | None
) -> None:
    """The closed form reads which token gets no gradient, whether the gradient is divided by
    the tokens' counts, and its layout at the step: one changed since the forward is refused,
    naming it, before anything is written (the step was silently wrong: 41-265% off for the
    first two); a forward after the change is differentiated exactly."""
    embedding = nn.Embedding(7, 3).double()
    ids = torch.tensor([[1, 2, 1, 5], [1, 1, 0, 3], [6, 1, 2, 2]])

    def losses_of(m: nn.Module) -> torch.Tensor:
        return row_losses(m(ids).sin(), batch_dim)

    assert_change_refused(
        embedding, losses_of, lambda: setattr(embedding, name, value), batch_dim, name
    )
    if exact:
        assert_exact_backward(embedding, losses_of, batch_dim)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_negative_padding_index_counts_from_the_end(batch_dim: int | None) -> None:
    """``padding_idx = -1`` set as an attribute (the constructor makes it positive) is the
    table's last row for ``F.embedding``: the closed form compared the ids with -1, and the
    Gramian counted that row's gradient, which is 0."""
    embedding = nn.Embedding(7, 3).double()
    embedding.padding_idx = -1
    ids = torch.tensor([[6, 1, 6], [2, 6, 3]])
    assert_exact_backward(embedding, lambda m: row_losses(m(ids).sin(), batch_dim), batch_dim)


class _Tabular(nn.Module):
    """A numeric feature and a categorical one given no width (``nn.Embedding(5, 0)``, as
    size rules such as ``min(50, cardinality // 2)`` give a single-valued column)."""

    def __init__(self) -> None:
        super().__init__()
        self.categorical, self.numeric = nn.Embedding(5, 0).double(), nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.numeric(x) + self.categorical(ids).sum((1, 2)).unsqueeze(1)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_an_embedding_of_zero_width_is_exact(batch_dim: int | None) -> None:
    """Its closed form reshaped the rows' gradients with ``-1`` for the positions, which
    torch refuses for a tensor of no element: the step crashed with torch's reshape error."""
    torch.manual_seed(0)
    x, ids = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 5, (4, 6))
    assert_exact_backward(_Tabular(), lambda m: row_losses(m(x, ids).sin(), batch_dim), batch_dim)


def test_tokens_of_one_row_only_add_to_its_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token that one row reads alone adds to that row's diagonal entry only: the dense form
    runs over the tokens that several rows share (it ran over every token of the batch, R x
    n_v x p mostly zeros: 22x the SGD step for V = 50000, B = 32, T = 128), exactly."""
    widths: list[int] = []
    gramian_of = _embedding.row_gramian
    monkeypatch.setattr(
        _embedding, "row_gramian", lambda m: widths.append(m.shape[1]) or gramian_of(m)
    )
    embedding = nn.Embedding(1000, 4).double()
    ids = torch.arange(24).view(3, 8) * 37
    ids[:, 0] = ids[1, 1] = 5  # the one token of several rows (twice in row 1)
    assert_exact_backward(embedding, lambda m: row_losses(m(ids).sin(), 0), 0)
    assert widths == [4, 4]  # (the Gramian's and the step's: one shared token of width 4)


@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_sequence_first_ids_per_sample(scale_grad_by_freq: bool) -> None:
    """Ids ``[T, B]`` (sequence first, as for ``nn.Transformer``'s default layers) into an
    Embedding and a Linear: per sample, each reads the batch on dimension 1 (refused before:
    "must have its batch size on dimension 0")."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(7, 4, scale_grad_by_freq=scale_grad_by_freq), nn.Tanh(), nn.Linear(4, 2)
    ).double()
    ids = torch.randint(0, 7, (5, 3))

    def forward() -> torch.Tensor:
        return model(ids).pow(2).sum(dim=(0, 2))

    with Engine(model, batch_dim=0) as engine:
        assert_exact_step(engine, forward, list(model.parameters()))
