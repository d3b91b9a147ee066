"""attnorm: drop-in attention normalizers for PyTorch.

Every normalizer maps attention scores to weights with one interface
(``dim``, ``mask``, dtype rules), as an ``nn.Module`` and as a function.
"""

from attnorm import functional, nn
from attnorm.attention import attention
from attnorm.integrations import register_when_imported
from attnorm.kernels.backends import get_backend, set_backend, use_backend
from attnorm.masks import StructuredMask, causal_mask, document_mask, key_padding_mask, sliding_window_mask
from attnorm.normalizers import (
    Entmax,
    L2NormAttention,
    Normalized,
    Normalizer,
    OutputNormalizer,
    ReLUNormalized,
    ScalableSoftmax,
    SelfAdjustedSoftmax,
    SigmoidAttention,
    Softmax,
    Softmax1,
    SoftplusNormalized,
    Sparsemax,
    TaylorSoftmax,
    TopKSoftmax,
)
from attnorm.normalizers.registry import available, make
from attnorm.sdpa_override import override_sdpa

__version__ = "0.1.0"

register_when_imported()  # the "attnorm" attention implementation of transformers, once it is imported

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
    "StructuredMask",
    "TaylorSoftmax",
    "TopKSoftmax",
    "__version__",
    "attention",
    "available",
    "causal_mask",
    "document_mask",
    "functional",
    "get_backend",
    "key_padding_mask",
    "make",
    "nn",
    "override_sdpa",
    "set_backend",
    "sliding_window_mask",
    "use_backend",
]
