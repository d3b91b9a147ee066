"""``with attnorm.override_sdpa(normalizer):`` any model calling SDPA uses ``normalizer``.

A ``torch.overrides.TorchFunctionMode`` intercepts every call of
``torch.nn.functional.scaled_dot_product_attention`` made inside the block (custom
models, nanoGPT-style code, timm and torchvision layers that call it) and runs
:func:`attnorm.attention` with the same arguments instead.  The mode is inactive inside
its own handler, and every other one passes attnorm's own SDPA calls through
(:func:`attnorm.routes.sdpa.real_sdpa`), so attnorm's SDPA route for softmax and Scalable-Softmax
reaches the real SDPA in nested blocks and in explicit :func:`attnorm.attention` calls too.
``torch.compile`` traces through an active function mode.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from attnorm.attention import attention
from attnorm.normalizers import Normalizer
from attnorm.normalizers.registry import make
from attnorm.routes.sdpa import internal_call

__all__ = ["override_sdpa"]

_SDPA = F.scaled_dot_product_attention


def _attnorm_sdpa(
    normalizer: Normalizer,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """SDPA's signature and conventions, weights from ``normalizer``."""
    if not enable_gqa and query.ndim >= 3 and key.ndim >= 3 and query.shape[-3] != key.shape[-3]:
        # One head broadcasts over the other side's, as in SDPA: q's is expanded, k's and v's taken by
        # attention() as one group.  Any other difference needs enable_gqa.
        if query.shape[-3] == 1:
            query = query.expand(*query.shape[:-3], key.shape[-3], *query.shape[-2:])
        elif key.shape[-3] != 1:
            raise RuntimeError(
                f"query has {query.shape[-3]} heads and key {key.shape[-3]}: pass enable_gqa=True for grouped-query "
                "attention (as scaled_dot_product_attention requires)"
            )
    return attention(
        query, key, value, normalizer, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p
    )


class override_sdpa(TorchFunctionMode):  # noqa: N801  (used like a function: ``with override_sdpa(...)``)
    """Run every ``F.scaled_dot_product_attention`` call inside the block through ``normalizer``.

    Masks keep SDPA's conventions (bool True = may attend, or a float mask added to the
    scores); ``is_causal``, ``scale``, ``dropout_p`` and ``enable_gqa`` are honoured.  A query
    row with no allowed key gives zeros (SDPA gives NaN).

    Args:
        normalizer: a :class:`~attnorm.Normalizer`, or a spec string for :func:`attnorm.make`.
            Its parameters (learnable ones included) are used as they are; they belong to
            whoever holds the instance, not to the model.

    Example::

        with attnorm.override_sdpa("entmax:alpha=1.5"):
            logits = model(tokens)
    """

    def __init__(self, normalizer: Normalizer | str) -> None:
        super().__init__()
        self.normalizer = make(normalizer)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and not internal_call():
            return _attnorm_sdpa(self.normalizer, *args, **kwargs)
        return func(*args, **kwargs)
