"""Normalizer modules: one file per family, all subclasses of :class:`Normalizer`.

Importing a family's module registers its names with :func:`attnorm.make`.
"""

from attnorm.normalizers.base import Normalizer
from attnorm.normalizers.softmax import Softmax  # isort: skip  (registration order = attnorm.available() order)
from attnorm.normalizers.scalable_softmax import ScalableSoftmax  # isort: skip
from attnorm.normalizers.self_adjusted import SelfAdjustedSoftmax  # isort: skip
from attnorm.normalizers.entmax import Entmax, Sparsemax  # isort: skip
from attnorm.normalizers.topk import TopKSoftmax  # isort: skip

__all__ = ["Entmax", "Normalizer", "ScalableSoftmax", "SelfAdjustedSoftmax", "Softmax", "Sparsemax", "TopKSoftmax"]
