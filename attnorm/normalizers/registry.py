"""Build normalizers by name: ``attnorm.make("entmax:alpha=1.3")``."""

from __future__ import annotations

import ast
from collections.abc import Callable

import torch
from torch import nn

from attnorm.normalizers.base import Normalizer

__all__ = ["available", "make", "register_kind", "register_normalizer"]

_FACTORIES: dict[str, Callable[..., Normalizer]] = {}
_ALIASES: dict[str, str] = {}
# The kinds of module make() builds and passes through: normalizers of scores, and the
# kinds registered by register_kind (output normalizers, attnorm.normalizers.output).
_KINDS: list[type[nn.Module]] = [Normalizer]


def register_normalizer(name: str, factory: Callable[..., Normalizer], aliases: tuple[str, ...] = ()) -> None:
    """Make ``factory`` buildable by ``make(name)`` and by each alias.

    Each normalizer module registers its classes where they are defined.
    """
    _FACTORIES[name] = factory
    for alias in aliases:
        _ALIASES[alias] = name


def register_kind(kind: type[nn.Module]) -> None:
    """Let :func:`make` return instances of ``kind`` as well as :class:`Normalizer` ones.

    A kind is a base class of modules that ``attnorm.attention`` accepts, such as
    :class:`attnorm.normalizers.output.OutputNormalizer` (it normalises attention outputs,
    not scores).
    """
    if kind not in _KINDS:
        _KINDS.append(kind)


def available() -> list[str]:
    """Names accepted by :func:`make`: the short names first, then the aliases."""
    return list(_FACTORIES) + list(_ALIASES)


@torch.compiler.assume_constant_result  # a pure function of a constant string: no need to trace ast
def _parse_value(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_spec(spec: str) -> tuple[str, dict]:
    """Split ``"name:key=value,key=value"`` into the name and keyword arguments."""
    name, _, arguments = spec.partition(":")
    kwargs = {}
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad normalizer spec {spec!r}: expected 'name:key=value,...', got item {item!r}")
        kwargs[key.strip()] = _parse_value(value)
    return name.strip(), kwargs


def make(spec: str | nn.Module, **overrides) -> nn.Module:
    """Build a normalizer from a name or spec string.

    Args:
        spec: a name from :func:`available`, optionally with arguments:
            ``"entmax:alpha=1.3"``, ``"topk:k=0.06"``, ``"ssmax:s=0.5,learnable=true"``.
            A :class:`Normalizer` instance (or one of a kind from :func:`register_kind`) is
            returned as it is (when no overrides are given).
        **overrides: keyword arguments that take precedence over the spec's.

    Returns:
        A new normalizer module.

    Raises:
        ValueError: unknown name, or an argument the normalizer does not take.
    """
    if isinstance(spec, tuple(_KINDS)):
        if overrides:
            raise ValueError(f"overrides can only be given with a spec string, not a {type(spec).__name__} instance")
        return spec
    if not isinstance(spec, str):
        kinds = " or ".join(kind.__name__ for kind in _KINDS)
        raise TypeError(f"spec must be a string or a {kinds}, got {type(spec).__name__}")
    name, kwargs = parse_spec(spec)
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _FACTORIES:
        raise ValueError(f"unknown normalizer {name!r}; available: {', '.join(available())}")
    kwargs.update(overrides)
    factory = _FACTORIES[key]
    try:
        return factory(**kwargs)
    except TypeError as error:
        import inspect

        valid = [p for p in inspect.signature(factory).parameters if p != "self"]
        raise ValueError(f"bad arguments {sorted(kwargs)} for {key!r} ({error}); valid: {', '.join(valid)}") from error
