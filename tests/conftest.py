"""Test-wide settings.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU
tensors; the variable must be set before any ``triton.jit`` decoration runs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("sparsekv", deadline=None, max_examples=30, derandomize=False)
settings.load_profile("sparsekv")
