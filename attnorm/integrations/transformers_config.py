"""``config.attnorm``: the normalizer of a Hugging Face model, as its config stores it.

The config holds the *structure* (one spec string for all attention layers, or one per
layer); the weights file holds the *values* of learnable or per-head parameters, like
any other parameter of the model::

    config.attnorm = {"normalizer": "entmax:alpha=1.5"}
    config.attnorm = {"normalizer": ["softmax", "ssmax:learnable=true,num_heads=12", ...]}

A bare spec string (``config.attnorm = "sparsemax"``) is accepted as a shorthand.
``"shared": True`` (what :func:`attnorm.integrations.transformers.patch` writes for one
instance given to every layer) builds one normalizer that every layer uses, its parameters
saved once, under the first layer::

    config.attnorm = {"normalizer": "ssmax:learnable=true,num_heads=12", "shared": True}
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor

from attnorm.normalizers import Normalizer
from attnorm.normalizers.registry import _FACTORIES, make

__all__ = ["CONFIG_ATTR", "config_entry", "layer_specs", "shared", "spec_of"]

CONFIG_ATTR = "attnorm"
_EXAMPLE = "{'normalizer': 'entmax:alpha=1.5'}"


def layer_specs(entry: Any, num_layers: int, owner: str) -> list[str]:
    """One spec string per attention layer from a ``config.attnorm`` entry.

    Raises:
        ValueError: no entry, a malformed one, an unknown normalizer, or a per-layer
            list whose length is not the number of attention layers.
    """
    if entry is None:
        raise ValueError(
            f"attn_implementation='attnorm' needs the normalizer in the config: set {owner}.attnorm = {_EXAMPLE} "
            "(or one spec per attention layer) before loading or before set_attn_implementation('attnorm')"
        )
    spec = entry.get("normalizer") if isinstance(entry, dict) else entry
    if isinstance(spec, str):
        specs = [spec] * num_layers
    elif isinstance(spec, (list, tuple)) and all(isinstance(item, str) for item in spec):
        specs = list(spec)
        if len(specs) != num_layers:
            raise ValueError(
                f"{owner}.attnorm['normalizer'] lists {len(specs)} specs; the model has {num_layers} attention layers"
            )
    else:
        raise ValueError(f"{owner}.attnorm must be like {_EXAMPLE} or a list of spec strings per layer, got {entry!r}")
    for item in set(specs):
        make(item)  # unknown names and bad arguments fail here, naming the spec
    return specs


def shared(entry: Any, owner: str) -> bool:
    """Whether a ``config.attnorm`` entry asks for one normalizer shared by every layer.

    Raises:
        ValueError: ``"shared"`` that is not a bool, or shared with one spec per layer.
    """
    if not isinstance(entry, dict) or "shared" not in entry:
        return False
    value = entry["shared"]
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.attnorm['shared'] must be True or False, got {value!r}")
    if value and not isinstance(entry.get("normalizer"), str):
        raise ValueError(f"{owner}.attnorm['shared'] = True needs one spec string for every layer, "
                         f"got {entry.get('normalizer')!r}")
    return value


def spec_of(normalizer: Normalizer) -> str | None:
    """The spec string that rebuilds ``normalizer``'s structure, or None for an unregistered class.

    Tensor parameters (learnable or per head) are written as their first value, to six
    significant digits: the weights file restores their exact values.
    """
    name = next((key for key, factory in _FACTORIES.items() if factory is type(normalizer)), None)
    if name is None:
        return None
    arguments = []
    for parameter in inspect.signature(type(normalizer)).parameters.values():
        if parameter.name in ("dim", "self") or not hasattr(normalizer, parameter.name):
            continue
        value = getattr(normalizer, parameter.name)
        if isinstance(value, Tensor):
            value = float(f"{float(value.detach().flatten()[0]):.6g}")  # float32 noise off
        if value != parameter.default:
            arguments.append(f"{parameter.name}={value!r}" if isinstance(value, str) else f"{parameter.name}={value}")
    return name if not arguments else f"{name}:{','.join(arguments)}"


def config_entry(specs: list[str], shared: bool = False) -> dict[str, Any]:
    """The ``config.attnorm`` entry for per-layer specs (one string when all layers agree), or one shared normalizer."""
    if shared:
        return {"normalizer": specs[0], "shared": True}
    return {"normalizer": specs[0] if len(set(specs)) == 1 else list(specs)}
