"""capture() on the offline MiniLM and a small random GPT-2, against the models' own eager attention."""

from __future__ import annotations

import entmax
import pytest
import torch

from attnorm.diagnostics.capture import capture
from attnorm.diagnostics.models import load_model, token_windows

pytest.importorskip("attnorm.integrations.transformers")


@pytest.fixture(scope="module")
def minilm():
    model, tokenizer = load_model()
    ids = token_windows(tokenizer, "The lamp turned all night and the keeper wrote the weather down. " * 8, 24, 1)
    return model, ids


def split_heads(states: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width = states.shape
    return states.view(batch, length, heads, width // heads).transpose(1, 2)


def test_minilm_softmax_matches_eager_attention_and_projections(minilm):
    model, ids = minilm
    records = capture(model, ids)
    with torch.no_grad():
        reference = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    assert [record.layer for record in records] == list(range(6))
    heads = model.config.num_attention_heads
    for record, weights, hidden in zip(records, reference.attentions, reference.hidden_states, strict=False):
        assert record.weights.shape == (1, heads, 24, 24)
        assert torch.allclose(record.weights, weights, atol=1e-6)
        attention = model.encoder.layer[record.layer].attention.self
        with torch.no_grad():
            assert torch.allclose(record.query, split_heads(attention.query(hidden), heads), atol=1e-5)
            assert torch.allclose(record.key, split_heads(attention.key(hidden), heads), atol=1e-5)
            assert torch.allclose(record.value, split_heads(attention.value(hidden), heads), atol=1e-5)
    assert model.config._attn_implementation == "eager"


def test_minilm_sparsemax_weights_are_sparsemax_of_recorded_scores(minilm):
    model, ids = minilm
    for record in capture(model, ids, "sparsemax"):
        scores = record.query.double() @ record.key.double().transpose(-1, -2) / record.query.shape[-1] ** 0.5
        assert torch.allclose(record.weights.double(), entmax.sparsemax(scores, dim=-1), atol=1e-5)
        assert (record.weights == 0).any()


def test_gpt2_capture_is_causal_and_matches_eager():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=64, attn_implementation="eager")
    model = GPT2Model(config).eval()
    ids = torch.randint(0, 64, (2, 10))
    records = capture(model, ids)
    with torch.no_grad():
        reference = model(input_ids=ids, output_attentions=True).attentions
    for record, weights in zip(records, reference, strict=True):
        assert torch.allclose(record.weights, weights, atol=1e-6)
        assert (record.weights.triu(1) == 0).all()
