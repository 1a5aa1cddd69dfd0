"""Per-sample Jacobian descent on Hugging Face language models built from small configurations
(random weights, no download), against autograd row by row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting
from jacflow.autogram import Engine
from jacflow.autogram._fallback import FallbackRule
from tests.autogram.test_engine import reference_jacobian

transformers = pytest.importorskip("transformers", reason='pip install "jacflow[integrations]"')

B, T, VOCAB = 3, 6, 20


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_embd=16,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=T,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


def _sequence_losses(model: nn.Module, ids: Tensor) -> Tensor:
    """Each sequence's mean next-token loss, ``[B]``; the positions expanded to the batch (the
    models' default ``[1, T]`` positions are one row shared by the samples)."""
    positions = torch.arange(T).expand(B, T)
    logits = model(input_ids=ids, position_ids=positions).logits[:, :-1]
    tokens = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    return tokens.view(B, -1).mean(1)


def test_gpt2_per_sample_is_exact_in_closed_forms() -> None:
    """GPT-2 (its ``Conv1D`` layers, tied ``lm_head``, attention and LayerNorm): the Gramian and
    ``.grad`` equal autograd's, with no layer left to the generic rule's re-runs."""
    model = _gpt2()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    reference = reference_jacobian(_sequence_losses(model, ids), params)
    weights = torch.rand(B, dtype=torch.float64)
    with Engine(model, batch_dim=0) as engine:
        torch.testing.assert_close(
            engine.compute_gramian(_sequence_losses(model, ids)),
            reference @ reference.T,
            rtol=1e-9,
            atol=1e-12,
        )
        engine.backward(_sequence_losses(model, ids), ConstantWeighting(weights))
        generic = [u.name for u in engine._units if isinstance(u.rule, FallbackRule)]
    assert generic == []
    grads = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(grads, weights @ reference, rtol=1e-9, atol=1e-12)


def test_opt_per_sample_is_exact_with_its_flattened_tokens() -> None:
    """OPT calls its MLP and last LayerNorm of each layer on the tokens flattened batch first
    (``[B T, d]``): read as ``[B, T, d]``, its Gramian and ``.grad`` equal autograd's."""
    config = transformers.OPTConfig(
        hidden_size=16,
        num_hidden_layers=2,
        ffn_dim=32,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=T + 2,
        word_embed_proj_dim=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).double()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))

    def losses() -> Tensor:
        logits = model(input_ids=ids).logits[:, :-1]
        tokens = F.cross_entropy(
            logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
        )
        return tokens.view(B, -1).mean(1)

    params = [p for p in model.parameters() if p.requires_grad]
    reference = reference_jacobian(losses(), params)
    weights = torch.rand(B, dtype=torch.float64)
    with Engine(model, batch_dim=0) as engine:
        gramian = engine.compute_gramian(losses())
        torch.testing.assert_close(gramian, reference @ reference.T, rtol=1e-9, atol=1e-12)
        engine.backward(losses(), ConstantWeighting(weights))
    grads = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(grads, weights @ reference, rtol=1e-9, atol=1e-12)
