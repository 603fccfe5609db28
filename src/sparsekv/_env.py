"""Environment switches read by the op registry and the kernels (a leaf: imports nothing of sparsekv).

* ``SPARSEKV_BACKEND``: ``auto`` (default; an empty value means the same),
  ``reference``, ``cpu`` or ``triton``; see ``sparsekv.ops._registry``.
* ``SPARSEKV_DEBUG``: any value but ``""``, ``0``, ``false``, ``False`` makes
  GPU ops run the host-side validation (page bounds, offsets) that they
  otherwise skip to stay free of host syncs.

Both are read at every call, so a test or a caller may change them at run time.
"""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "SPARSEKV_BACKEND"
DEBUG_ENV = "SPARSEKV_DEBUG"
#: Backends that ``SPARSEKV_BACKEND`` may force, in the order of the ``kernels`` packages.
BACKENDS = ("reference", "cpu", "triton")
_BACKEND_CHOICES = BACKENDS + ("auto",)
_CPU = torch.device("cpu")


def requested_backend() -> str:
    """``SPARSEKV_BACKEND``'s value, ``"auto"`` when unset or empty.

    Raises ``ValueError`` naming the variable and its value for anything but
    ``auto``, ``reference``, ``cpu`` or ``triton``.
    """
    value = os.environ.get(BACKEND_ENV, "") or "auto"
    if value not in _BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}: expected one of auto, {', '.join(BACKENDS)}; got {value!r}")
    return value


def debug_checks() -> bool:
    """True when ``SPARSEKV_DEBUG`` asks device ops for host-side validation."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0", "false", "False")


def is_cpu(device: torch.device) -> bool:
    """Whether ``device`` is the CPU (``==`` first: ``device.type`` alone costs ~0.2 us a call)."""
    return device == _CPU or device.type == "cpu"


def host_checks(device) -> bool:
    """Whether an op on ``device`` (a ``torch.device``) first validates device values on the host.

    Always for CPU tensors (SPEC 1.1: a missing page raises there); on a GPU
    only with ``SPARSEKV_DEBUG=1``, since it synchronises with the host.
    Without it the kernels mask invalid entries (pages, counted entries,
    slots) instead.
    """
    return is_cpu(device) or debug_checks()
