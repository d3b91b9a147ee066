"""Swap the attention normalizer of a Hugging Face ``transformers`` model.

``patch(model, normalizer)`` routes every self-attention layer of a loaded model
through :func:`attnorm.attention` with the given normalizer::

    from attnorm.integrations.transformers import patch

    with patch(model, "ssmax"):          # or an instance, or a factory layer_idx -> Normalizer
        logits = model(**batch).logits   # the original implementation is back after the block

How it plugs in: transformers (>= 4.54) looks the attention function up by
``config._attn_implementation`` in its ``AttentionInterface`` registry, and builds
the attention masks with the function registered under the same name in
``masking_utils.AttentionMaskInterface``.  A name without a mask function gets no
mask at all, so attnorm registers both: the attention function below and
transformers' own ``sdpa_mask``, which gives a bool mask (True = may attend) or None
when the plain causal / bidirectional pattern can be passed as ``is_causal`` instead.
Causal, padding and KV-cache masks therefore reach the normalizer, so
Scalable-Softmax's ``n`` counts the cached keys a query may attend.

Layers found: modules whose ``forward`` calls the ``ALL_ATTENTION_FUNCTIONS``
registry, minus cross-attention (``is_cross_attention`` or a class named
``*CrossAttention*``), which keeps exact softmax attention.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnorm.attention import attention
from attnorm.normalizers import Normalizer
from attnorm.normalizers.registry import make

__all__ = ["ATTN_IMPLEMENTATION", "AttnormPatch", "Recorder", "attnorm_attention_forward", "patch"]

ATTN_IMPLEMENTATION = "attnorm"
MIN_TRANSFORMERS = "4.54"
NORMALIZER_ATTR = "attnorm_normalizer"
_STATE_ATTR = "_attnorm_layer"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")

Recorder = Callable[[int, Tensor, Tensor, Tensor, Tensor], None]
NormalizerSpec = Normalizer | str | Callable[[int], Normalizer]


@dataclass
class _LayerState:
    layer_idx: int
    recorder: Recorder | None


def attnorm_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The ``AttentionInterface`` function registered as ``"attnorm"``.

    Args:
        module: the attention layer; its ``attnorm_normalizer`` submodule is used
            (softmax when it has none, e.g. cross-attention).
        query: ``(B, H, Lq, D)``.
        key: ``(B, Hkv, Lk, D)``; ``Hkv`` may divide ``H`` (grouped-query attention).
        value: ``(B, Hkv, Lk, Dv)``.
        attention_mask: bool ``(B, 1, Lq, Lk)`` (True = may attend), an additive float
            mask, or None for the layer's plain causal / bidirectional pattern.
        dropout: dropout on the weights (transformers passes 0 in eval mode).
        scaling: score scale (None = ``1 / sqrt(D)``).
        is_causal: overrides ``module.is_causal`` when the mask is None.

    Returns:
        ``(out, weights)``: ``out`` is ``(B, Lq, H, Dv)``; ``weights`` is ``(B, H, Lq, Lk)``
        when a recorder asked for them, else None.

    Raises:
        NotImplementedError: for logit soft-capping, attention sinks or position biases.
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attnorm attention does not support {name!r} (layer {type(module).__name__})")
    normalizer = getattr(module, NORMALIZER_ATTR, None)
    state: _LayerState | None = getattr(module, _STATE_ATTR, None)
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # A single query (decoding) attends every cached key, as in transformers' sdpa path.
        mask_args = {"is_causal": bool(causal) and query.shape[2] > 1}
    else:
        mask_args = {"attn_mask": attention_mask}
    weights = None
    if state is None or state.recorder is None:
        out = attention(query, key, value, normalizer, scale=scaling, dropout_p=dropout, **mask_args)
    else:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out, weights = attention(
            query, key, value, normalizer, scale=scaling, dropout_p=dropout, return_weights=True, **mask_args
        )
        state.recorder(state.layer_idx, query, key, value, weights)
    return out.transpose(1, 2).contiguous(), weights


@functools.cache
def _register() -> None:
    """Register the attention and mask functions under ``"attnorm"`` (once)."""
    try:
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        PreTrainedModel.set_attn_implementation  # noqa: B018  (public since the same releases)
    except (ImportError, AttributeError) as error:
        import importlib.metadata

        try:
            found = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            found = "not installed"
        raise ImportError(
            f"attnorm.integrations.transformers needs transformers >= {MIN_TRANSFORMERS} (AttentionInterface, "
            f"masking_utils.AttentionMaskInterface, PreTrainedModel.set_attn_implementation); found {found}"
        ) from error
    AttentionInterface.register(ATTN_IMPLEMENTATION, attnorm_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@functools.cache
def _uses_attention_registry(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _is_cross_attention(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or "CrossAttention" in type(module).__name__


def attention_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """The self-attention layers of ``model`` with their layer index, in module order."""
    found = [
        module
        for module in model.modules()
        if _uses_attention_registry(type(module)) and not _is_cross_attention(module)
    ]
    layers = []
    for position, module in enumerate(found):
        layer_idx = getattr(module, "layer_idx", None)
        layers.append((layer_idx if isinstance(layer_idx, int) else position, module))
    return layers


class AttnormPatch:
    """Handle returned by :func:`patch`; ``remove()`` (or leaving the ``with`` block) restores the model.

    Attributes:
        model: the patched model.
        layers: ``(layer_idx, attention module)`` pairs that were patched.
    """

    def __init__(self, model: nn.Module, layers: list[tuple[int, nn.Module]], original: str | None) -> None:
        self.model = model
        self.layers = layers
        self._original = original
        self._removed = False

    @property
    def normalizers(self) -> dict[int, Normalizer]:
        """The normalizer of each patched layer, by layer index."""
        return {layer_idx: getattr(module, NORMALIZER_ATTR) for layer_idx, module in self.layers}

    def remove(self) -> None:
        """Restore the original attention implementation and drop the normalizer submodules."""
        if self._removed:
            return
        self._removed = True
        for _, module in self.layers:
            delattr(module, NORMALIZER_ATTR)
            delattr(module, _STATE_ATTR)
        self.model.set_attn_implementation(self._original)

    def __enter__(self) -> AttnormPatch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


def patch(model: nn.Module, normalizer: NormalizerSpec, *, recorder: Recorder | None = None) -> AttnormPatch:
    """Route every self-attention layer of a ``transformers`` model through :func:`attnorm.attention`.

    Args:
        model: a loaded ``transformers`` ``PreTrainedModel`` whose attention uses the
            ``AttentionInterface`` registry (GPT-2, BERT-family, Llama-family, most decoders).
        normalizer: a :class:`~attnorm.Normalizer` instance (shared by all layers), a
            spec string for :func:`attnorm.make` (one new normalizer per layer), or a
            factory ``layer_idx -> Normalizer`` (e.g. per-layer learnable parameters).
            Each layer's normalizer becomes its submodule ``attnorm_normalizer``, so
            ``model.parameters()``, optimizers and ``state_dict`` see it.
        recorder: called once per call of a patched layer as
            ``recorder(layer_idx, query, key, value, weights)`` with query ``(B, H, Lq, D)``,
            key and value ``(B, H, Lk, D)`` after any KV-head repetition and weights
            ``(B, H, Lq, Lk)`` (materialised for the call; tensors keep their autograd graph).

    Returns:
        An :class:`AttnormPatch`; ``remove()`` it (or use it as a context manager) to restore the model.

    Raises:
        ImportError: transformers older than 4.54.
        ValueError: no attention layer routed through the registry, or the model refused the switch.
        RuntimeError: the model is already patched.
        TypeError: a factory returned something other than a Normalizer.
    """
    _register()
    layers = attention_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention layer that calls transformers' ALL_ATTENTION_FUNCTIONS registry"
        )
    if any(hasattr(module, NORMALIZER_ATTR) for _, module in layers):
        raise RuntimeError("the model is already patched with attnorm; remove() the previous patch first")
    normalizers = [_layer_normalizer(normalizer, layer_idx) for layer_idx, _ in layers]
    original = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} does not allow switching its attention implementation")
    for (layer_idx, module), layer_normalizer in zip(layers, normalizers, strict=True):
        device = next(module.parameters(), torch.empty(0)).device
        module.add_module(NORMALIZER_ATTR, layer_normalizer.to(device))
        setattr(module, _STATE_ATTR, _LayerState(layer_idx, recorder))
    return AttnormPatch(model, layers, original)


def _layer_normalizer(normalizer: NormalizerSpec, layer_idx: int) -> Normalizer:
    if isinstance(normalizer, (Normalizer, str)):
        return make(normalizer)
    if isinstance(normalizer, type):
        raise TypeError(f"pass an instance ({normalizer.__name__}()), a spec string or a factory, not the class")
    if callable(normalizer):
        built = normalizer(layer_idx)
        if not isinstance(built, Normalizer):
            raise TypeError(f"the normalizer factory must return a Normalizer, got {type(built).__name__}")
        return built
    raise TypeError(f"normalizer must be a Normalizer, a spec string or a factory, got {type(normalizer).__name__}")
