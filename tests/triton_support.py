"""What every Triton test module shares: the skip when Triton is missing, the
device the kernels run on, and the GPU validation rules.

Without CUDA the kernels run in Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.ops._registry import debug_checks, triton_status

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def require_triton() -> None:
    """Skip the calling test module when Triton kernels cannot run here."""
    ok, why = triton_status()
    if not ok:
        pytest.skip(f"Triton kernels cannot run here: {why}", allow_module_level=True)


def gpu_validation_rules(monkeypatch) -> None:
    """Validate on the host only with SPARSEKV_DEBUG=1, as for CUDA tensors (CPU tensors always validate)."""
    from sparsekv.kernels.triton import _common

    monkeypatch.setattr(_common, "host_checks", lambda device: debug_checks())
