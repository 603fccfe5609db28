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

# NOTE: numba's OpenMP threading layer is the fastest here (the sparse
# attention kernel ran 1.7x slower under TBB or workqueue), but by default its
# workers busy-wait after a parallel region while torch's own OpenMP runtime (a
# separate copy) tries to run: on two cores a 0.4 ms torch op measured 56 ms
# right after a numba kernel. An OpenMP runtime reads OMP_WAIT_POLICY once,
# when it loads; torch's loaded with torch, numba's loads when its workers are
# first launched. So numba's workers are launched here with OMP_WAIT_POLICY=
# PASSIVE (they sleep when idle), and the environment is restored afterwards.
# A user's own NUMBA_THREADING_LAYER(_PRIORITY) or OMP_WAIT_POLICY wins.
def _launch_sleeping_workers() -> None:
    if any(name in os.environ for name in
           ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY", "OMP_WAIT_POLICY")):
        return
    try:
        from numba.np.ufunc.parallel import _launch_threads  # not public API: skip if it moves
    except ImportError:
        return
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        _launch_threads()
    finally:
        del os.environ["OMP_WAIT_POLICY"]


_launch_sleeping_workers()

PARALLEL_JIT = {"parallel": True, "cache": True, "fastmath": False, "nogil": True, "error_model": "numpy"}
"""Options of a ``prange`` kernel whose sums keep their written order (no reordering, no fused multiply-adds)."""

PARALLEL_MIN_WORK = 1 << 22
"""Below this many multiply-adds or elements, :func:`threads_for` runs a kernel on one thread."""


_ALL_THREADS = 1 << 30  # "every thread": numba_threads clamps it to the threads there are


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
    """All of numba's threads for ``work`` (multiply-adds or elements) of at least ``PARALLEL_MIN_WORK``, else one.

    (``numba_threads`` clamps the count to the threads there are; each ``numba.get_num_threads()`` costs
    ~3 us, so it is asked once per call.)"""
    return numba_threads(_ALL_THREADS if work >= PARALLEL_MIN_WORK else 1)
