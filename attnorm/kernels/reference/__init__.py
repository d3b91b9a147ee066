"""Pure-torch reference implementations: the autograd oracle and the no-compiler backend.

* Forward functions (differentiable, any floating dtype, vmap / compile friendly):
  :func:`softmax`, :func:`scalable_softmax`, :func:`self_adjusted_softmax`, :func:`entmax`,
  :func:`sparsemax`, :func:`topk_softmax`.
* Closed-form vector-Jacobian (and Jacobian-vector) products (:mod:`.jacobians`), differentiable again.
* The seven backend functions of the kernel contract (:mod:`.backend`, ``kernels/README.md``).
"""

from attnorm.kernels.reference.backend import (
    entmax_backward,
    entmax_forward,
    self_adjusted_backward,
    self_adjusted_forward,
    softmax_backward,
    softmax_forward,
    topk_forward,
)
from attnorm.kernels.reference.jacobians import (
    entmax_alpha_grad,
    entmax_vjp,
    multiplier_grad,
    self_adjusted_vjp,
    softmax_vjp,
    temperature_grad,
)
from attnorm.kernels.reference.softmax import scalable_softmax, self_adjusted_softmax, softmax, topk_softmax
from attnorm.kernels.reference.sparse import entmax, sparsemax

__all__ = [
    "entmax",
    "entmax_alpha_grad",
    "entmax_backward",
    "entmax_forward",
    "entmax_vjp",
    "multiplier_grad",
    "scalable_softmax",
    "self_adjusted_backward",
    "self_adjusted_forward",
    "self_adjusted_softmax",
    "self_adjusted_vjp",
    "softmax",
    "softmax_backward",
    "softmax_forward",
    "softmax_vjp",
    "sparsemax",
    "temperature_grad",
    "topk_forward",
    "topk_softmax",
]
