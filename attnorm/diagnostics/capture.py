"""Capture attention weights and q, k, v from a Hugging Face model under any attnorm normalizer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnorm.normalizers import Normalizer, Softmax

__all__ = ["AttentionRecord", "capture"]


@dataclass(frozen=True)
class AttentionRecord:
    """What one attention layer saw and produced in one forward pass (detached, float32, CPU).

    Attributes:
        layer: the layer index.
        query: ``(B, H, Lq, D)``.
        key: ``(B, H, Lk, D)``.
        value: ``(B, H, Lk, D)``: the vectors the weights mix.
        weights: ``(B, H, Lq, Lk)``: the normalizer's output, masked positions 0.
    """

    layer: int
    query: Tensor
    key: Tensor
    value: Tensor
    weights: Tensor


def capture(
    model: nn.Module,
    inputs: Tensor | Mapping[str, Tensor],
    normalizer: Normalizer | str | Callable[[int], Normalizer] | None = None,
) -> list[AttentionRecord]:
    """Run ``model`` once and return every attention layer's weights and q, k, v.

    Built on :func:`attnorm.integrations.transformers.patch`, so it works for every model
    that integration supports (GPT-2 and BERT family at least).  The model is patched
    only for the duration of the call.

    Args:
        model: a Hugging Face model.
        inputs: ``input_ids`` ``(B, L)``, or the keyword arguments of ``model(...)``
            (e.g. a tokenizer's output).
        normalizer: the attention normalizer: a Normalizer (shared by all layers), a spec
            string such as ``"entmax:alpha=1.5"`` or a factory ``layer_idx -> Normalizer``;
            None uses :class:`~attnorm.Softmax`, the models' own map.

    Returns:
        One :class:`AttentionRecord` per attention call, in layer order.
    """
    from attnorm.integrations.transformers import patch

    normalizer = Softmax() if normalizer is None else normalizer
    if isinstance(inputs, Tensor):
        inputs = {"input_ids": inputs}
    device = next(model.parameters()).device
    inputs = {name: value.to(device) if isinstance(value, Tensor) else value for name, value in inputs.items()}
    records: list[AttentionRecord] = []

    def recorder(layer: int, query: Tensor, key: Tensor, value: Tensor, weights: Tensor) -> None:
        detached = (tensor.detach().to("cpu", torch.float32) for tensor in (query, key, value, weights))
        records.append(AttentionRecord(layer, *detached))

    with torch.no_grad(), patch(model, normalizer, recorder=recorder):
        model(**inputs)
    return sorted(records, key=lambda record: record.layer)
