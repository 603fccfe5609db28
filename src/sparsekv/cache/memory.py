"""Page storage allocation: zeroed tensors, backed by 2 MiB pages on Linux CPUs where the kernel allows it.

Attention over a paged cache reads a few thousand rows scattered through
pages that span gigabytes, so nearly every row is a TLB miss with 4 KiB
pages. :func:`allocate_pages` asks the kernel for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) on the allocation's aligned interior *before*
the first touch, then zeroes it (which faults the memory in as huge pages).
It is a hint: where THP is off (``/sys/kernel/mm/transparent_hugepage/enabled``
set to ``never``), on other systems and on GPUs this is ``torch.zeros``.
Measured: QSA sparse attention decode over a 268 MB cache (B=4, 32k tokens,
budget 2048, bf16) 5-10% faster (three timings of the same process pair).

Example::

    blocks = allocate_pages((1024, 2, 4, 128, 8, 128), torch.bfloat16, "cpu")  # 2 GiB of zeros
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.lru_cache(maxsize=1)
def _libc_madvise():
    """libc's ``madvise`` (Linux only), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # the process's own symbols: libc is loaded
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """``madvise(MADV_HUGEPAGE)`` over the whole 2 MiB pages inside a CPU ``tensor``'s memory; whether the
    kernel took the hint (memory touched before keeps its 4 KiB pages until the kernel merges them).
    ``ValueError`` for a tensor that is not a contiguous CPU tensor (its memory is not one span)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor: expected a contiguous CPU tensor, got one on {tensor.device} "
                         f"with strides {tensor.stride()}")
    madvise = _libc_madvise()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if madvise is None or last <= first:
        return False
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


def allocate_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed ``shape`` tensor of ``dtype`` on ``device`` for page storage.

    On a Linux CPU, an allocation of at least two huge pages is advised to
    use 2 MiB pages (:func:`advise_huge_pages`) before its first touch;
    everything else is ``torch.zeros``. The values are the same either way.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)  # a large allocation is a fresh, untouched mapping
    if tensor.numel() * tensor.element_size() >= 2 * HUGE_PAGE_BYTES:
        advise_huge_pages(tensor)
    return tensor.zero_()


__all__ = ["HUGE_PAGE_BYTES", "advise_huge_pages", "allocate_pages"]
