"""Sparse normalizers from the entmax family: sparsemax and alpha-entmax."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnorm import validation as V
from attnorm.normalizers.base import Normalizer
from attnorm.normalizers.registry import register_normalizer
from attnorm.normalizers.scalable_softmax import head_shape


class Sparsemax(Normalizer):
    """Sparsemax (Martins & Astudillo, 2016): Euclidean projection onto the simplex.

    Max weight is at least ``1 / support size``, independent of the row length.

    Args:
        dim: axis to normalise over.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
    """

    kernel = "sparsemax"
    sparse = True


class Entmax(Normalizer):
    """alpha-entmax (Peters et al., 2019); learnable alpha per head (Correia et al., 2019).

    alpha = 1 is softmax, alpha = 2 sparsemax, alpha = 1.5 is exact.  With
    ``learnable=True``, alpha is parametrised as ``1 + sigmoid(alpha_logit)`` and so
    stays in the open interval (1, 2); the initial ``alpha`` must lie there.

    Args:
        alpha: >= 1 (in (1, 2) when learnable).
        learnable: train alpha (``alpha_logit`` is the ``nn.Parameter``).
        num_heads: one alpha per head, broadcast over scores ``(..., H, Lq, Lk)``.
        dim: axis to normalise over.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
    """

    kernel = "entmax"
    sparse = True

    def __init__(
        self,
        alpha: float = 1.5,
        learnable: bool = False,
        num_heads: int | None = None,
        dim: int = -1,
        backend: str | None = None,
    ) -> None:
        super().__init__(dim, backend)
        V.check_alpha(alpha)
        self.learnable = learnable
        self.num_heads = num_heads
        shape = head_shape(num_heads)
        if learnable:
            if not 1 < float(alpha) < 2:
                raise ValueError(f"a learnable alpha is kept in (1, 2); the initial alpha must lie there, got {alpha}")
            logit = math.log((alpha - 1) / (2 - alpha))
            self.alpha_logit = nn.Parameter(torch.full(shape, logit))
        elif shape:
            self.register_buffer("fixed_alpha", torch.full(shape, float(alpha)))
        else:
            self.fixed_alpha = float(alpha)

    @property
    def alpha(self) -> float | Tensor:
        """The current alpha (a tensor when learnable or per head)."""
        if self.learnable:
            return 1 + torch.sigmoid(self.alpha_logit)
        return self.fixed_alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if self.learnable:
            raise ValueError("alpha is learnable (1 + sigmoid(alpha_logit)): assign alpha_logit instead")
        V.check_alpha(value)
        if isinstance(self.fixed_alpha, Tensor):
            self.fixed_alpha.fill_(float(value))
        else:
            self.fixed_alpha = float(value)

    def kernel_params(self) -> dict:
        return {"alpha": self.alpha}

    def check_state(self, state: dict[str, Tensor]) -> None:
        if "alpha_logit" in state:
            V.check_finite("alpha_logit", state["alpha_logit"])
        if "fixed_alpha" in state:
            V.check_alpha(state["fixed_alpha"])

    def _repr_fields(self) -> dict:
        fields: dict = {"alpha": self.alpha, "learnable": self.learnable}
        if self.num_heads is not None:
            fields["num_heads"] = self.num_heads
        return fields


register_normalizer("sparsemax", Sparsemax)
register_normalizer("entmax", Entmax, ("alpha_entmax", "entmax15"))
