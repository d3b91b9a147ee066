"""Normalizer modules: one file per family, all subclasses of :class:`Normalizer`."""

from attnorm.normalizers.base import Normalizer
from attnorm.normalizers.entmax import Entmax, Sparsemax
from attnorm.normalizers.scalable_softmax import ScalableSoftmax
from attnorm.normalizers.self_adjusted import SelfAdjustedSoftmax
from attnorm.normalizers.softmax import Softmax
from attnorm.normalizers.topk import TopKSoftmax

__all__ = ["Entmax", "Normalizer", "ScalableSoftmax", "SelfAdjustedSoftmax", "Softmax", "Sparsemax", "TopKSoftmax"]
