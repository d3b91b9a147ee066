"""Top-k softmax: softmax restricted to the k largest scores."""

from __future__ import annotations

from attnorm import validation as V
from attnorm.normalizers.base import Checked, Normalizer
from attnorm.normalizers.registry import register_normalizer


class TopKSoftmax(Normalizer):
    """Softmax over the ``k`` largest allowed scores, exactly 0 elsewhere.

    The paper's advice to keep the active set small, as a parameter: max weight is
    at least ``1 / k`` whatever the row length.

    Args:
        k: int >= 1, or float in (0, 1) meaning ``max(1, ceil(k * n))`` of the n allowed positions.
        temperature: T > 0 applied to the kept scores.
        dim: axis to normalise over.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
    """

    kernel = "topk_softmax"
    sparse = True
    k = Checked(V.check_k)
    temperature = Checked(V.check_temperature)

    def __init__(self, k: float, temperature: float = 1.0, dim: int = -1, backend: str | None = None) -> None:
        super().__init__(dim, backend)
        self.k = k
        self.temperature = temperature

    def kernel_params(self) -> dict:
        return {"k": self.k, "temperature": self.temperature}

    def _repr_fields(self) -> dict:
        return {"k": self.k, "temperature": self.temperature}


register_normalizer("topk", TopKSoftmax, ("topk_softmax", "top-k"))
