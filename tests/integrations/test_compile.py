"""Patched Hugging Face models under torch.compile(fullgraph=True): no graph break of attnorm's making.

transformers itself may break a graph (e.g. a logging call), so each patched model is
held to the break count of the same model with ``attn_implementation="sdpa"``, and to
the eager values and gradients of the patched model.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()

from attnorm.integrations.transformers import patch  # noqa: E402
from tests.integrations.test_transformers import tiny_gpt2, tiny_llama  # noqa: E402

NORMALIZERS = ["softmax:temperature=0.7", "ssmax", "sa_softmax", "sparsemax", "entmax", "topk:k=3"]
MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def graph_breaks(model, ids, mask) -> int:
    torch._dynamo.reset()

    def step(ids, mask):
        return model(input_ids=ids, attention_mask=mask).logits

    return torch._dynamo.explain(step)(ids, mask).graph_break_count


# By default GPT-2 with an SDPA-routed (ssmax), a fused entmax-family (sparsemax) and the top-k normalizer,
# Llama (rotary embeddings, GQA) with Self-Adjusted: one of each route and kernel family.  The other pairs
# (6-9 s each on 2 cores) run with -m slow.
DEFAULT_PAIRS = {("gpt2", "ssmax"), ("gpt2", "sparsemax"), ("gpt2", "topk:k=3"), ("llama", "sa_softmax")}
PAIRS = [pytest.param(model_name, normalizer, id=f"{model_name}-{normalizer}",
                      marks=() if (model_name, normalizer) in DEFAULT_PAIRS else pytest.mark.slow)
         for model_name in MODELS for normalizer in NORMALIZERS]


@pytest.mark.parametrize(("model_name", "normalizer"), PAIRS)
def test_patched_model_compiles_like_sdpa_and_matches_eager(model_name, normalizer):
    model = MODELS[model_name]()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: a key-padding mask reaches the normalizer
    model.set_attn_implementation("sdpa")
    sdpa_breaks = graph_breaks(model, ids, mask)
    with patch(model, normalizer):
        assert graph_breaks(model, ids, mask) <= sdpa_breaks
        expected = model(input_ids=ids, attention_mask=mask).logits
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), [model.get_input_embeddings().weight])
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        logits = compiled(input_ids=ids, attention_mask=mask).logits
        (grad,) = torch.autograd.grad(logits.square().sum(), [model.get_input_embeddings().weight])
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("normalizer", [pytest.param(name, marks=() if name == "sparsemax" else pytest.mark.slow)
                                        for name in NORMALIZERS])
def test_static_cache_generation_compiles_whole_and_matches_eager_generation(normalizer):
    """Transformers' static KV cache with the model's forward compiled ``fullgraph=True``: the recipe that
    lets a GPU replay decoding steps from CUDA graphs (``mode="reduce-overhead"``), which takes the host
    time of attnorm's eager layers out of every step.  Greedy generation of a left-padded batch gives the
    eager model's tokens and logits with its default (dynamic) cache."""
    from tests.integrations.test_transformers import padded_batch

    model = tiny_llama()
    ids, mask, _ = padded_batch("left", (7, 4))
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                    return_dict_in_generate=True, output_logits=True)
    with torch.no_grad(), patch(model, normalizer):
        expected = model.generate(ids, **settings)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        try:
            got = model.generate(ids, cache_implementation="static", **settings)
        finally:
            del model.forward  # the class's forward again
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
