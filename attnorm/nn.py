"""``attnorm.nn.MultiheadAttention``: ``torch.nn.MultiheadAttention`` with any normalizer.

A subclass of ``torch.nn.MultiheadAttention``: the same constructor (``batch_first``,
``kdim``/``vdim``, ``bias``, ``add_bias_kv``, ``add_zero_attn``, ``dropout``), the same
parameters, initialisation and ``state_dict`` keys, the same forward signature and
defaults, and torch's mask conventions (the opposite of SDPA's: in ``key_padding_mask``
and a bool ``attn_mask``, True = *ignore* that key; float masks are added to the
scores).  Only the normalizer of the scores changes, through :func:`attnorm.attention`.
``replace_multihead_attention(model, normalizer)`` swaps every ``nn.MultiheadAttention``
of a model (``nn.TransformerEncoder``, torchvision's ViT, ...) keeping its weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnorm.attention import attention
from attnorm.normalizers import Normalizer
from attnorm.normalizers.registry import make

__all__ = ["MultiheadAttention", "replace_multihead_attention"]


def _keep_off_fused_paths(module: nn.Module, args) -> None:
    """A forward pre-hook that does nothing: its presence turns off ``nn.TransformerEncoderLayer``'s
    fused inference path, which reads the projection weights and never calls this module."""


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose attention weights come from ``normalizer``.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
            batch_first, device, dtype: as ``torch.nn.MultiheadAttention``.
        normalizer: a :class:`~attnorm.Normalizer` (a submodule, so learnable parameters
            train with the model), a spec string for :func:`attnorm.make`, or None (softmax).

    With softmax the module equals ``torch.nn.MultiheadAttention`` (outputs, weights and
    gradients), except that a query row whose keys are all masked gives zeros (torch: NaN).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        normalizer: Normalizer | str | None = None,
    ) -> None:
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.normalizer = make("softmax" if normalizer is None else normalizer)
        self.register_forward_pre_hook(_keep_off_fused_paths)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Same arguments and returns as ``torch.nn.MultiheadAttention.forward``.

        Args:
            query: ``(L, E)`` unbatched, ``(L, N, E)``, or ``(N, L, E)`` with ``batch_first``.
            key, value: ``(S, kdim)`` / ``(S, vdim)``, batched like ``query``.
            key_padding_mask: ``(N, S)`` or ``(S,)``; bool True = ignore the key, or float added.
            need_weights: also return the attention weights.
            attn_mask: ``(L, S)`` or ``(N * num_heads, L, S)``; bool True = ignore, or float added.
            average_attn_weights: average the returned weights over heads.
            is_causal: a hint that ``attn_mask`` is the causal mask (which must be given); as
                in torch, without ``key_padding_mask`` and ``need_weights`` the causal mask is
                applied structurally instead of ``attn_mask``.

        Returns:
            ``(output, weights)``: output shaped like ``query`` with ``E`` features; weights
            ``(N, L, S)`` averaged, ``(N, num_heads, L, S)`` per head (no ``N`` when
            unbatched), or None when ``need_weights`` is False.
        """
        if query.dim() not in (2, 3):
            raise ValueError(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query "
                             "tensor")
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
                raise TypeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as torch.nn.MultiheadAttention)")
        structural_causal = is_causal and key_padding_mask is None and not need_weights
        q, k, v = self._project(query, key, value)  # (N, H, L, hd), (N, H, S, hd)
        attn_mask = None if structural_causal else self._merged_mask(attn_mask, key_padding_mask, q.shape, k)
        if self.bias_k is not None:
            k, v, attn_mask = self._append_key(k, v, self.bias_k, self.bias_v, attn_mask)
        if self.add_zero_attn:
            zeros = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[-1])
            k, v, attn_mask = self._append_key(k, v, zeros, zeros, attn_mask, heads_first=True)
        dropout_p = self.dropout if self.training else 0.0
        mask_args = {"is_causal": True} if structural_causal else {"attn_mask": attn_mask}
        weights = None
        if need_weights:
            out, weights = attention(q, k, v, self.normalizer, return_weights=True, **mask_args)
            if dropout_p > 0:  # torch returns the weights after dropout, and uses them
                weights = F.dropout(weights, dropout_p)
                out = weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = attention(q, k, v, self.normalizer, dropout_p=dropout_p, **mask_args)
        out = out.permute(2, 0, 1, 3).flatten(2)  # (L, N, E)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not batched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """In-projections, split into heads: ``(N, H, L, head_dim)`` each."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        heads = self.num_heads
        return tuple(
            F.linear(x, w, b).unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)  # (L, N, E) -> (N, H, L, hd)
            for x, w, b in ((query, w_q, b_q), (key, w_k, b_k), (value, w_v, b_v))
        )

    def _merged_mask(self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, q_shape, k: Tensor):
        """One mask in SDPA's convention (bool True = may attend, or float added), ``(N, H|1, L|1, S)``."""
        batch, heads, lq = q_shape[0], q_shape[1], q_shape[2]
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.view(batch, heads, lq, -1)
            masks.append(attn_mask)
        if key_padding_mask is not None:
            masks.append(key_padding_mask.view(batch, 1, 1, -1))
        if not masks:
            return None
        if all(mask.dtype == torch.bool for mask in masks):
            ignored = masks[0] if len(masks) == 1 else masks[0] | masks[1]
            return ~ignored
        additive = [
            torch.zeros_like(mask, dtype=k.dtype).masked_fill_(mask, -torch.inf) if mask.dtype == torch.bool
            else mask.to(k.dtype)
            for mask in masks
        ]
        return additive[0] if len(additive) == 1 else additive[0] + additive[1]

    def _append_key(self, k, v, extra_k, extra_v, mask, heads_first: bool = False):
        """Append one key/value (``bias_k``/``bias_v``, or zeros) and an allowed mask column."""
        if not heads_first:  # bias_k is (1, 1, E): one key per head
            extra_k = extra_k.view(1, self.num_heads, 1, -1).expand(k.shape[0], -1, -1, -1)
            extra_v = extra_v.view(1, self.num_heads, 1, -1).expand(v.shape[0], -1, -1, -1)
        k, v = torch.cat([k, extra_k], dim=2), torch.cat([v, extra_v], dim=2)
        if mask is not None:
            fill = True if mask.dtype == torch.bool else 0.0
            mask = F.pad(mask, (0, 1), value=fill)
        return k, v, mask


def replace_multihead_attention(model: nn.Module, normalizer: Normalizer | str) -> nn.Module:
    """Replace every ``torch.nn.MultiheadAttention`` in ``model`` by :class:`MultiheadAttention`.

    The replacements keep the weights (same ``state_dict``), device, dtype, settings and
    training mode.  ``normalizer``: an instance is shared by all replaced modules; a spec
    string builds one normalizer per module.

    Returns:
        ``model`` (changed in place); a bare ``nn.MultiheadAttention`` returns its replacement.

    Raises:
        ValueError: ``model`` holds no ``nn.MultiheadAttention``.
    """
    if type(model) is nn.MultiheadAttention:
        return _converted(model, normalizer)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                setattr(parent, name, _converted(child, normalizer))
                replaced += 1
    if not replaced:
        raise ValueError(f"{type(model).__name__} holds no torch.nn.MultiheadAttention to replace")
    return model


def _converted(module: nn.MultiheadAttention, normalizer: Normalizer | str) -> MultiheadAttention:
    reference = module.out_proj.weight
    new = MultiheadAttention(
        module.embed_dim, module.num_heads, module.dropout, bias=module.in_proj_bias is not None,
        add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn, kdim=module.kdim,
        vdim=module.vdim, batch_first=module.batch_first, device="meta", dtype=reference.dtype,
        normalizer=make(normalizer) if isinstance(normalizer, str) else normalizer,
    )
    missing, unexpected = new.load_state_dict(module.state_dict(), strict=False, assign=True)
    if unexpected or any(not name.startswith("normalizer.") for name in missing):
        raise RuntimeError(f"weights did not carry over: missing {missing}, unexpected {unexpected}")
    new.normalizer.to(reference.device)
    return new.train(module.training)
