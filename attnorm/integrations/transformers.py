"""The ``"attnorm"`` attention implementation of Hugging Face ``transformers``.

Load a model with a normalizer named in its config::

    config = AutoConfig.from_pretrained(path)
    config.attnorm = {"normalizer": "entmax:alpha=1.5"}      # or one spec per attention layer
    model = AutoModel.from_pretrained(path, config=config, attn_implementation="attnorm")

or switch a loaded one (``model.config.attnorm = ...; model.set_attn_implementation("attnorm")``),
or patch it for a while with any normalizer instance or factory::

    with patch(model, "ssmax"):          # or an instance, or a factory layer_idx -> Normalizer
        logits = model(**batch).logits   # the original implementation is back after the block

How it plugs in: transformers (>= 4.54) looks the attention function up by
``config._attn_implementation`` in its ``AttentionInterface`` registry, and builds
the attention masks with the function registered under the same name in
``masking_utils.AttentionMaskInterface``.  attnorm registers both (``import attnorm``
does it when transformers is imported, see :mod:`attnorm.integrations`): the attention
function below and :func:`~attnorm.integrations.transformers_masks.attnorm_mask`, which is
transformers' own ``sdpa_mask`` (a bool mask, True = may attend, or None when the plain
causal / bidirectional pattern can be passed as ``is_causal`` instead) except for packed
sequences.  Causal, padding, packed-sequence and KV-cache masks therefore reach the
normalizer, so Scalable-Softmax's ``n`` counts the keys a query may attend.

Packed sequences (several documents in one row, ``position_ids`` restarting at 0, as
``DataCollatorWithFlattening`` produces; batch of one, no ``attention_mask``,
``use_cache=False``): transformers detects them from ``position_ids``, and the mask
function returns ``document_mask(cu_seqlens) & causal_mask()`` instead of a dense
``(1, 1, L, L)`` mask, so the kernels skip cross-document blocks and ``n`` is counted per
document (see :mod:`attnorm.integrations.transformers_masks`).

Each self-attention layer holds its normalizer as the submodule ``attnorm_normalizer``,
so learnable parameters are ordinary parameters of the model (``named_parameters()``,
optimizers, ``state_dict``, DDP).  Models are built before their weights are loaded, so
the normalizers are built with the model (transformers' ``post_init``), from the spec in
``config.attnorm`` (the structure); the weights file brings their values back, like any
other parameter.  A checkpoint without them (a base model given a new spec) starts
them from the spec, and their keys are not reported missing.  ``patch()`` writes the
spec of its normalizers to ``config.attnorm``, so ``save_pretrained`` of a patched
model loads back with ``attn_implementation="attnorm"``.

Layers found: modules whose ``forward`` calls the ``ALL_ATTENTION_FUNCTIONS``
registry, minus cross-attention (``is_cross_attention``, a class named ``*CrossAttention*``,
or a submodule named ``encoder_attn``, ``EncDecAttention`` or ``*cross*``, as encoder-decoder
models name theirs), which keeps exact softmax attention.
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnorm.attention import attention
from attnorm.integrations.transformers_config import CONFIG_ATTR, config_entry, layer_specs, shared, spec_of
from attnorm.integrations.transformers_masks import attnorm_mask
from attnorm.normalizers import Normalizer
from attnorm.normalizers.registry import make

__all__ = ["ATTN_IMPLEMENTATION", "AttnormPatch", "Recorder", "attention_layers", "attnorm_attention_forward", "patch"]

ATTN_IMPLEMENTATION = "attnorm"
MIN_TRANSFORMERS = "4.54"
NORMALIZER_ATTR = "attnorm_normalizer"
_STATE_ATTR = "_attnorm_layer"
_SPEC_ATTR = "_attnorm_spec"  # on a normalizer built from config.attnorm: the spec that initialises it
_MISSING_OK = rf"\.{NORMALIZER_ATTR}\."  # keys a checkpoint without attnorm parameters lacks
_UNSUPPORTED_KWARGS = ("position_bias",)

Recorder = Callable[[int, Tensor, Tensor, Tensor, Tensor], None]
NormalizerSpec = Normalizer | str | Callable[[int], Normalizer]


@dataclass
class _LayerState:
    layer_idx: int
    recorder: Recorder | None = None
    from_config: bool = False
    spec: str | None = None
    shared: bool = False


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
            (softmax for a cross-attention layer, which has none).
        query: ``(B, H, Lq, D)``.
        key: ``(B, Hkv, Lk, D)``; ``Hkv`` may divide ``H`` (grouped-query attention).
        value: ``(B, Hkv, Lk, Dv)``.
        attention_mask: bool ``(B, 1, Lq, Lk)`` (True = may attend), an additive float
            mask, a :class:`~attnorm.StructuredMask` (packed sequences: a document mask),
            or None for the layer's plain causal / bidirectional pattern.
        dropout: dropout on the weights (transformers passes 0 in eval mode).
        scaling: score scale (None = ``1 / sqrt(D)``).
        is_causal: overrides ``module.is_causal`` when the mask is None.
        **kwargs: ``softcap`` (Gemma 2's logit soft-capping) and ``s_aux`` / ``sinks`` (gpt-oss's
            per-head attention sinks) are passed to :func:`attnorm.attention`.

    Returns:
        ``(out, weights)``: ``out`` is ``(B, Lq, H, Dv)``; ``weights`` is ``(B, H, Lq, Lk)``
        when a recorder asked for them, else None.

    Raises:
        RuntimeError: the layer has no attnorm normalizer (no ``config.attnorm``, no ``patch()``).
        NotImplementedError: for position biases (T5-style).
    """
    state: _LayerState | None = getattr(module, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation='attnorm' but has no attnorm normalizer: set "
            "model.config.attnorm = {'normalizer': 'entmax:alpha=1.5'} and call "
            "model.set_attn_implementation('attnorm'), or use attnorm.integrations.transformers.patch(model, ...)"
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attnorm attention does not support {name!r} (layer {type(module).__name__})")
    normalizer = getattr(module, NORMALIZER_ATTR, None)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: one sink logit per query head
    extra = {"softcap": kwargs.get("softcap"), "sinks": None if sinks is None else sinks.reshape(-1)}
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # A single query (decoding) attends every cached key, as in transformers' sdpa path.
        mask_args = {"is_causal": bool(causal) and query.shape[2] > 1}
    else:
        mask_args = {"attn_mask": attention_mask}
    weights = None
    if state.recorder is None:
        out = attention(query, key, value, normalizer, scale=scaling, dropout_p=dropout, **mask_args, **extra)
    else:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out, weights = attention(
            query, key, value, normalizer, scale=scaling, dropout_p=dropout, return_weights=True, **mask_args, **extra
        )
        state.recorder(state.layer_idx, query, key, value, weights)
    return out.transpose(1, 2).contiguous(), weights


@functools.cache
def _register() -> None:
    """Register the attention and mask functions under ``"attnorm"`` and hook model construction (once)."""
    try:
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401  (attnorm_mask calls it)

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
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attnorm_mask)
    _hook(PreTrainedModel)


def _hook(model_class: type) -> None:
    """Wrap three ``PreTrainedModel`` methods so the normalizers follow ``config.attnorm``.

    * ``post_init`` (the end of every model's ``__init__``): build the normalizers, so
      ``from_pretrained`` finds their parameters and loads their values.
    * ``set_attn_implementation``: build (or rebuild, when the spec changed) them on a loaded model.
    * ``_initialize_weights``: transformers' initialisation of parameters a checkpoint
      lacks; a normalizer built from a spec is initialised from that spec.
    """
    post_init, set_impl = model_class.post_init, model_class.set_attn_implementation
    initialize = getattr(model_class, "_initialize_weights", None)

    @functools.wraps(post_init)
    def attnorm_post_init(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        sync_from_config(self)

    @functools.wraps(set_impl)
    def attnorm_set_attn_implementation(self, *args, **kwargs):
        before = getattr(getattr(self, "config", None), "_attn_implementation", None)
        set_impl(self, *args, **kwargs)
        try:
            sync_from_config(self)
        except Exception:
            # A refused switch (no or a malformed config.attnorm) leaves the model as it was: it stayed on
            # "attnorm", with no normalizer, and every later forward raised.
            if isinstance(before, str) and self.config._attn_implementation != before:
                set_impl(self, before)
            raise

    model_class.post_init = attnorm_post_init
    model_class.set_attn_implementation = attnorm_set_attn_implementation
    if initialize is not None:

        @functools.wraps(initialize)
        def attnorm_initialize_weights(self, module, *args, **kwargs):
            spec = getattr(module, _SPEC_ATTR, None)
            if spec is None:
                return initialize(self, module, *args, **kwargs)
            initial = make(spec).state_dict()
            with torch.no_grad():
                for name, tensor in module.state_dict(keep_vars=True).items():
                    if not getattr(tensor, "_is_hf_initialized", False):  # loaded tensors carry the flag
                        tensor.copy_(initial[name])
                        tensor._is_hf_initialized = True

        model_class._initialize_weights = attnorm_initialize_weights


def sync_from_config(model: nn.Module) -> None:
    """Give every self-attention layer the normalizer that ``model.config.attnorm`` names.

    Runs when the model is built and when its attention implementation is set.  Under
    another implementation the normalizers built from the config are kept while
    ``config.attnorm`` still names them (switching back finds their values), and
    detached once it does not (a model switched back to eager for good holds no attnorm
    parameters and can be patched).  Layers patched by :func:`patch` are left to the
    patch; layers built from an older spec are rebuilt.

    Raises:
        ValueError: the implementation is ``"attnorm"`` and ``config.attnorm`` is missing or malformed.
    """
    config = getattr(model, "config", None)
    entry = getattr(config, CONFIG_ATTR, None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
        if entry is None:
            _detach_config_normalizers(model)
        elif implementation is not None:
            warnings.warn(
                f"{type(model).__name__}: config.attnorm is set but attn_implementation is {implementation!r}, "
                "so attention runs without the attnorm normalizer; pass attn_implementation='attnorm'",
                stacklevel=3,
            )
        return
    layers = attention_layers(model)
    states = [getattr(module, _STATE_ATTR, None) for _, module in layers]
    if layers and all(state is not None and not state.from_config for state in states):
        return  # patch() owns them
    specs = layer_specs(entry, len(layers), type(config).__name__)
    one = shared(entry, type(config).__name__)
    built: Normalizer | None = None
    attached: set[int] = set()
    for (layer_idx, module), state, spec in zip(layers, states, specs, strict=True):
        if state is not None and (not state.from_config or (state.spec, state.shared) == (spec, one)):
            continue  # a layer built from another spec, or shared otherwise, is rebuilt
        if built is None or not one:
            built = make(spec)
            setattr(built, _SPEC_ATTR, spec)
        _attach(module, built, attached)
        setattr(module, _STATE_ATTR, _LayerState(layer_idx, from_config=True, spec=spec, shared=one))
    for module in _cross_attention_layers(model):
        if not hasattr(module, _STATE_ATTR):
            setattr(module, _STATE_ATTR, _LayerState(-1, from_config=True))  # exact softmax, on purpose
    ignored = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignored or ()), _MISSING_OK}


def _detach_config_normalizers(model: nn.Module) -> None:
    """Remove from every attention layer the normalizer (and state) built from ``config.attnorm``; a
    :func:`patch`'s stay."""
    layers = [module for _, module in attention_layers(model)] + _cross_attention_layers(model)
    for module in layers:
        state = getattr(module, _STATE_ATTR, None)
        if state is None or not state.from_config:
            continue
        if NORMALIZER_ATTR in module._modules:
            del module._modules[NORMALIZER_ATTR]
        else:
            module.__dict__.pop(NORMALIZER_ATTR, None)  # a shared instance held as a plain attribute
        delattr(module, _STATE_ATTR)


def _attach(module: nn.Module, normalizer: Normalizer, attached: set[int]) -> None:
    """Give the attention layer ``module`` its normalizer, on the layer's device; ``attached``: ids given so far.

    A normalizer an earlier layer holds already (one instance shared by every layer) is
    held here as a plain attribute, not a submodule: the model's ``state_dict`` keeps its
    parameters once, under the first layer (tensors shared under several names stop
    ``save_pretrained``), and a copy loaded with ``{"shared": True}`` shares them again.
    """
    reference = next(module.parameters(), None)
    if reference is not None:
        normalizer = normalizer.to(device=reference.device)
    if id(normalizer) in attached:
        object.__setattr__(module, NORMALIZER_ATTR, normalizer)
    else:
        attached.add(id(normalizer))
        module.add_module(NORMALIZER_ATTR, normalizer)


@functools.cache
def _uses_attention_registry(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


_CROSS_ATTENTION_NAMES = ("encoder_attn", "encdecattention")
"""Submodule names of cross-attention layers whose class serves self-attention too (BART, Whisper, Marian, T5's
``EncDecAttention``): the class tells cross-attention apart by its call's ``key_value_states`` alone."""


def _is_cross_attention(name: str, module: nn.Module) -> bool:
    """Whether the attention layer ``module``, at ``name`` in its model, attends another sequence (an encoder's)."""
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
        return True
    last = name.rsplit(".", 1)[-1].lower()
    return last in _CROSS_ATTENTION_NAMES or "cross" in last


def _registry_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if _uses_attention_registry(type(m))]


def _cross_attention_layers(model: nn.Module) -> list[nn.Module]:
    return [module for name, module in _registry_layers(model) if _is_cross_attention(name, module)]


def attention_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """The self-attention layers of ``model`` with their layer index, in module order.

    The index is the layer's own ``layer_idx`` when every layer has a distinct one; else (an
    encoder-decoder, whose decoder counts from 0 again; layers without one) the position in
    module order, so that each layer has an index of its own.
    """
    found = [module for name, module in _registry_layers(model) if not _is_cross_attention(name, module)]
    indices = [getattr(module, "layer_idx", None) for module in found]
    if not all(isinstance(index, int) for index in indices) or len(set(indices)) != len(indices):
        indices = list(range(len(found)))
    return list(zip(indices, found, strict=True))


class AttnormPatch:
    """Handle returned by :func:`patch`; ``remove()`` (or leaving the ``with`` block) restores the model.

    Attributes:
        model: the patched model.
        layers: ``(layer_idx, attention module)`` pairs that were patched.
    """

    def __init__(
        self, model: nn.Module, layers: list[tuple[int, nn.Module]], original: str | None, original_entry
    ) -> None:
        self.model = model
        self.layers = layers
        self._original = original
        self._original_entry = original_entry
        self._removed = False

    @property
    def normalizers(self) -> dict[int, Normalizer]:
        """The normalizer of each patched layer, by layer index."""
        return {layer_idx: getattr(module, NORMALIZER_ATTR) for layer_idx, module in self.layers}

    def remove(self) -> None:
        """Restore the original attention implementation, ``config.attnorm`` and drop the normalizer submodules."""
        if self._removed:
            return
        self._removed = True
        for module in [module for _, module in self.layers] + _cross_attention_layers(self.model):
            if hasattr(module, NORMALIZER_ATTR):
                delattr(module, NORMALIZER_ATTR)
            if hasattr(module, _STATE_ATTR):
                delattr(module, _STATE_ATTR)
        config = self.model.config
        if self._original_entry is None:
            if hasattr(config, CONFIG_ATTR):
                delattr(config, CONFIG_ATTR)
        else:
            setattr(config, CONFIG_ATTR, self._original_entry)
        if self._original != ATTN_IMPLEMENTATION:
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
        normalizer: a :class:`~attnorm.Normalizer` instance (shared by all layers: its
            parameters are the first layer's submodule, the other layers refer to it), a
            spec string for :func:`attnorm.make` (one new normalizer per layer), or a
            factory ``layer_idx -> Normalizer`` (e.g. per-layer learnable parameters).
            Each layer's normalizer becomes its submodule ``attnorm_normalizer``, so
            ``model.parameters()``, optimizers and ``state_dict`` see it.  Their specs
            go to ``model.config.attnorm`` (when every one is a registered class), so a
            ``save_pretrained`` copy loads back with ``attn_implementation="attnorm"``.
        recorder: called once per call of a patched layer as
            ``recorder(layer_idx, query, key, value, weights)`` with query ``(B, H, Lq, D)``,
            key and value ``(B, H, Lk, D)`` after any KV-head repetition and weights
            ``(B, H, Lq, Lk)`` (materialised for the call; tensors keep their autograd graph).

    Returns:
        An :class:`AttnormPatch`; ``remove()`` it (or use it as a context manager) to restore the model.

    Raises:
        ImportError: transformers older than 4.54.
        ValueError: no attention layer routed through the registry, or the model refused the switch.
        RuntimeError: the model already has attnorm normalizers (patched, or built from ``config.attnorm``).
        TypeError: a factory returned something other than a Normalizer.
        NotImplementedError: the layers add a relative position bias to their scores (T5, mT5, UMT5).
    """
    _register()
    layers = attention_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention layer that calls transformers' ALL_ATTENTION_FUNCTIONS registry"
        )
    biased = [module for _, module in layers if hasattr(module, "has_relative_attention_bias")]
    if biased:  # T5 and its kin: every layer adds a learned relative position bias to its scores
        raise NotImplementedError(
            f"{type(biased[0]).__name__} adds a relative position bias (position_bias) to its scores, which "
            f"attnorm attention does not take: {type(model).__name__} cannot be patched"
        )
    if any(hasattr(module, NORMALIZER_ATTR) for _, module in layers):
        raise RuntimeError(
            "the model is already patched with attnorm (a previous patch(), or normalizers from config.attnorm): "
            "remove() the patch, "
            "or change model.config.attnorm and call model.set_attn_implementation('attnorm')"
        )
    normalizers = [_layer_normalizer(normalizer, layer_idx) for layer_idx, _ in layers]
    _own_config(model)
    original, original_entry = model.config._attn_implementation, getattr(model.config, CONFIG_ATTR, None)
    attached: set[int] = set()
    for (layer_idx, module), layer_normalizer in zip(layers, normalizers, strict=True):
        _attach(module, layer_normalizer, attached)
        setattr(module, _STATE_ATTR, _LayerState(layer_idx, recorder))
    for module in _cross_attention_layers(model):
        setattr(module, _STATE_ATTR, _LayerState(-1, recorder=None))
    specs = [spec_of(layer_normalizer) for layer_normalizer in normalizers]
    if all(spec is not None for spec in specs):
        one = len(normalizers) > 1 and len(attached) == 1  # one instance for every layer
        setattr(model.config, CONFIG_ATTR, config_entry(specs, shared=one))
    handle = AttnormPatch(model, layers, original, original_entry)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        handle.remove()
        raise ValueError(f"{type(model).__name__} does not allow switching its attention implementation")
    return handle


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a config object of its own before :func:`patch` writes to it.

    Models built from one config object share it (``Model(config)`` keeps the object, and so
    does each submodule that reads it), and the attention implementation and
    ``config.attnorm`` live on it: patching one model switched every other model built from
    that config to attnorm attention, whose layers had no normalizer (their forward raised),
    and a model built from it afterwards counted as patched.  Every module's reference to
    the config, or to one of its sub-configs (``text_config``, ...), moves to one deep copy.
    """
    from transformers import PretrainedConfig

    memo: dict[int, object] = {}
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        found = {name: value for name, value in vars(module).items() if isinstance(value, PretrainedConfig)}
        for name, value in found.items():
            if id(value) in memo:
                setattr(module, name, memo[id(value)])


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
