"""Softmax with temperature."""

from __future__ import annotations

from attnorm import validation as V
from attnorm.normalizers.base import Checked, Normalizer
from attnorm.normalizers.registry import register_normalizer


class Softmax(Normalizer):
    """``softmax(x / T)`` over the allowed positions of each row.

    Lemma 1 of Mudarisov et al. (arXiv 2508.17821): with logits in [a, b] every
    weight lies in ``[e^{-(b-a)/T} / L, e^{(b-a)/T} / L]``; Lemma 2: the Jacobian's
    spectral norm is at most ``1 / (2T)``.

    Args:
        temperature: T > 0.
        dim: axis to normalise over.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None (global default).
    """

    kernel = "softmax"
    temperature = Checked(V.check_temperature)

    def __init__(self, temperature: float = 1.0, dim: int = -1, backend: str | None = None) -> None:
        super().__init__(dim, backend)
        self.temperature = temperature

    def kernel_params(self) -> dict:
        return {"temperature": self.temperature}

    def _repr_fields(self) -> dict:
        return {"temperature": self.temperature}


register_normalizer("softmax", Softmax)
