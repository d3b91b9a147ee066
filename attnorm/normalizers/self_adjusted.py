"""Self-Adjusted Softmax (SA-Softmax)."""

from __future__ import annotations

from attnorm import validation as V
from attnorm.normalizers.base import Checked, Normalizer
from attnorm.normalizers.registry import register_normalizer


class SelfAdjustedSoftmax(Normalizer):
    """SA-Softmax (Zheng et al., 2025, arXiv 2502.18277): ``x * softmax(x)`` or its min-max normalised form.

    With ``normalized=True``: ``(x - min(x_min, 0)) / (max(x_max, 0) - min(x_min, 0)) * softmax(x)``.
    The weights do **not** sum to 1; the plain variant can be negative.

    Args:
        normalized: use the min-max normalised factor.
        dim: axis to normalise over.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
    """

    kernel = "self_adjusted_softmax"
    sums_to_one = False
    normalized = Checked(V.check_bool("normalized"))

    def __init__(self, normalized: bool = True, dim: int = -1, backend: str | None = None) -> None:
        super().__init__(dim, backend)
        self.normalized = normalized

    @property
    def nonnegative(self) -> bool:
        """The plain variant ``x * softmax(x)`` is negative where ``x`` is."""
        return self.normalized

    def kernel_params(self) -> dict:
        return {"normalized": self.normalized}

    def _repr_fields(self) -> dict:
        return {"normalized": self.normalized}


register_normalizer("sa_softmax", SelfAdjustedSoftmax, ("self_adjusted_softmax", "self-adjusted-softmax"))
