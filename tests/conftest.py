"""Test-wide set-up.

Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter,
which must be switched on before ``triton`` is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
