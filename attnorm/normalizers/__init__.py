"""Normalizer modules: one file per family, all subclasses of :class:`Normalizer`.

Importing a family's module registers its names with :func:`attnorm.make`.
"""

# Registration order is the order of attnorm.available().
from attnorm.normalizers.base import Normalizer  # noqa: I001
from attnorm.normalizers.softmax import Softmax
from attnorm.normalizers.scalable_softmax import ScalableSoftmax
from attnorm.normalizers.self_adjusted import SelfAdjustedSoftmax
from attnorm.normalizers.entmax import Entmax, Sparsemax
from attnorm.normalizers.topk import TopKSoftmax
from attnorm.normalizers.normalized import Normalized, ReLUNormalized, SigmoidAttention, Softmax1, SoftplusNormalized
from attnorm.normalizers.taylor import TaylorSoftmax
from attnorm.normalizers.output import L2NormAttention, OutputNormalizer

__all__ = [
    "Entmax",
    "L2NormAttention",
    "Normalized",
    "Normalizer",
    "OutputNormalizer",
    "ReLUNormalized",
    "ScalableSoftmax",
    "SelfAdjustedSoftmax",
    "SigmoidAttention",
    "Softmax",
    "Softmax1",
    "SoftplusNormalized",
    "Sparsemax",
    "TaylorSoftmax",
    "TopKSoftmax",
]
