"""Integrations of attnorm with model libraries.

* :mod:`attnorm.integrations.transformers`: the attention implementation ``"attnorm"``
  of Hugging Face ``transformers`` (``from_pretrained(..., attn_implementation="attnorm")``
  with the normalizer in ``config.attnorm``) and ``patch(model, normalizer)``.

transformers has no plug-in discovery, so ``import attnorm`` calls
:func:`register_when_imported`: the ``"attnorm"`` name is registered the moment
``transformers.modeling_utils`` is imported (at once if it already is), and
transformers is never imported by attnorm itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType

__all__ = ["register_when_imported"]

_TRIGGER = "transformers.modeling_utils"


def _register_transformers() -> None:
    from attnorm.integrations import transformers

    try:
        transformers._register()
    except ImportError:
        pass  # too old a transformers: patch() and the name raise the clear error when used


class _CallbackLoader(importlib.abc.Loader):
    """Runs the real loader, then the registration."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register_transformers()


class _AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot finder that wraps the loader of ``transformers.modeling_utils``."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != _TRIGGER:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader)
        return spec


def register_when_imported() -> None:
    """Register the ``"attnorm"`` attention implementation once transformers is imported.

    Does nothing when transformers is not installed; never imports it.
    """
    if _TRIGGER in sys.modules:
        _register_transformers()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
