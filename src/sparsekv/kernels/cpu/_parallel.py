"""How the numba CPU kernels use threads: the ``prange`` kernels' jit options and per-call thread counts.

A parallel region costs a thread wake-up and a barrier: microseconds on idle
cores, milliseconds when they are oversubscribed, and numba's spinning
workers then fight torch's own threads for the cores. Small calls therefore
run their ``prange`` loops on the calling thread. Results never depend on the
thread count: every output element is computed by one task, in a fixed order.

Example: ``with threads_for(rows * cols * dim): kernel(...)`` runs ``kernel``
on one thread for a decode-sized call and on all of numba's threads for a
large one; ``with numba_threads(num_pools // 1024): kernel(...)`` gives it one
thread per 1024 pools.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numba

# NOTE: numba's default threading-layer order (tbb, omp, workqueue) falls back
# to its OpenMP layer when TBB is missing. Its workers then busy-wait after a
# parallel region while torch's own OpenMP pool (a separate runtime) tries to
# run: on two cores a 0.4 ms torch op measured 56 ms right after a numba
# kernel. TBB (a dependency on x86-64) and numba's workqueue layer both let
# their workers sleep, so they go first. The workqueue layer does not allow
# parallel kernels to be launched from several Python threads at once; with
# TBB installed that never applies. An explicit NUMBA_THREADING_LAYER or
# NUMBA_THREADING_LAYER_PRIORITY is left alone.
if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["tbb", "workqueue", "omp"]

PARALLEL_JIT = {"parallel": True, "cache": True, "fastmath": False, "nogil": True}
"""Options of a ``prange`` kernel whose sums keep their written order (no reordering, no fused multiply-adds)."""

PARALLEL_MIN_WORK = 1 << 22
"""Below this many multiply-adds or elements, :func:`threads_for` runs a kernel on one thread."""


@contextlib.contextmanager
def numba_threads(count: int) -> Iterator[None]:
    """Run numba's parallel loops inside the block on ``count`` threads, clamped to 1 .. numba's current count."""
    available = numba.get_num_threads()
    count = max(1, min(available, count))
    if count == available:
        yield
        return
    numba.set_num_threads(count)
    try:
        yield
    finally:
        numba.set_num_threads(available)


def threads_for(work: int) -> contextlib.AbstractContextManager[None]:
    """All of numba's threads for ``work`` (multiply-adds or elements) of at least ``PARALLEL_MIN_WORK``, else one."""
    return numba_threads(numba.get_num_threads() if work >= PARALLEL_MIN_WORK else 1)
