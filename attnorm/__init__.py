"""attnorm: drop-in attention normalizers for PyTorch.

Every normalizer maps attention scores to weights with one interface
(``dim``, ``mask``, dtype rules), as an ``nn.Module`` and as a function.
"""

from attnorm import functional
from attnorm.attention import attention
from attnorm.kernels.backends import get_backend, set_backend, use_backend
from attnorm.masks import StructuredMask, causal_mask, key_padding_mask
from attnorm.normalizers import (
    Entmax,
    Normalizer,
    ScalableSoftmax,
    SelfAdjustedSoftmax,
    Softmax,
    Sparsemax,
    TopKSoftmax,
)
from attnorm.normalizers.registry import available, make

__version__ = "0.1.0"

__all__ = [
    "Entmax",
    "Normalizer",
    "ScalableSoftmax",
    "SelfAdjustedSoftmax",
    "Softmax",
    "Sparsemax",
    "StructuredMask",
    "TopKSoftmax",
    "__version__",
    "attention",
    "available",
    "causal_mask",
    "functional",
    "get_backend",
    "key_padding_mask",
    "make",
    "set_backend",
    "use_backend",
]
