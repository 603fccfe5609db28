"""How the numba CPU kernels use threads: the ``prange`` kernels' jit options and per-call thread counts.

A parallel region costs a thread wake-up and a barrier: microseconds on idle
cores, milliseconds when they are oversubscribed, and numba's spinning
workers then fight torch's own threads for the cores. Small calls therefore
run their ``prange`` loops on the calling thread. Results never depend on the
thread count: every output element is computed by one task, in a fixed order.

On a shared machine a parallel region is only as fast as its slowest worker:
when another process holds a core, the region waits for a descheduled worker
for up to a scheduler slice. :data:`CONTENTION` watches every parallel
region (wall time against the CPU time the process spent in it) and, when the
threads did not run in parallel, runs every kernel on one thread for a while,
then tries the threads again (:class:`ContentionPolicy`). Measured on 2 cores
(QSA compress, fp32, 4 x 8192 keys, 40 calls each, the machine already busy
with other work, load average 5-8):

============================  =====================  =====================
condition                     2 threads, median ms   1 thread, median ms
============================  =====================  =====================
busy machine                  9.2-36.0               1.7-5.8
same plus one busy process    49.9-53.1              2.0-2.2
============================  =====================  =====================

The 2-thread regions' process CPU time over wall time was 0.40-0.66 under
load (a worker sat descheduled while the others waited at the barrier),
where two threads that both run give close to 2 whatever the kernel, so the
ratio tells contention apart from slow work without knowing how long the
kernel should take. Smaller dynamic chunks do not help:
a descheduled worker holds the chunk it is in, and the barrier waits for it
whatever the chunk size. The check costs a process-clock read (about
0.5 us) per parallel call, and a second one for a region long enough to be
judged.

torch's own intra-op threads (an OpenMP pool too) wait the same way: with
one busy process, an elementwise op on a 512 x 24 x 256 float32 tensor took
16-24 ms on torch's 2 threads against 1.6-1.7 ms on one, and the demo's
serving time was 74 s with numba alone falling back against 16 s with every
pool on one thread (11.6 s with this policy; one busy process, load average
4-8). So the policy sets torch's
threads to one as well while it sees contention, and gives them back when a
parallel region runs well.

Example: ``with threads_for(rows * cols * dim): kernel(...)`` runs ``kernel``
on one thread for a decode-sized call and on all of numba's threads for a
large one; ``with numba_threads(num_pools // 1024): kernel(...)`` gives it one
thread per 1024 pools.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numba
import torch
from numba import types
from numba.extending import intrinsic

# NOTE: numba's OpenMP threading layer is the fastest here (the sparse
# attention kernel ran 1.7x slower under TBB or workqueue). With torch's PyPI
# wheels it binds to torch's own libgomp (loaded into the global symbol scope
# first): one pool of threads for both, under torch's wait policy. Where it
# gets a runtime of its own, two pools of spinning workers fight for the cores
# (a short numba region took 6.2 ms right after a torch op instead of 0.03 ms).
# An OpenMP runtime reads OMP_WAIT_POLICY once, when it loads, so numba's
# workers are launched here with OMP_WAIT_POLICY=PASSIVE (the environment is
# restored afterwards): a runtime of numba's own sleeps when idle, and one
# shared with torch is left as torch set it. A user's own
# NUMBA_THREADING_LAYER(_PRIORITY) or OMP_WAIT_POLICY wins. Figures, and what
# OMP_WAIT_POLICY=PASSIVE set before torch loads costs: docs/benchmarks.md,
# "Idle workers".
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


def _thread_count_functions() -> tuple[Callable[[], int], Callable[[int], None]]:
    """numba's getter and setter of this thread's count: the threading layer's own, where numba's module has
    them once its workers run (0.08 and 0.16 us a call here, against 0.57 and 0.85 us for the public
    functions, which launch the workers and check the count first: a block on one thread set the count
    and gave it back for 3.4 us), else the public ones. The counts given are always valid (1 .. the
    count read)."""
    public = numba.get_num_threads, numba.set_num_threads
    count = numba.get_num_threads()  # launches the workers
    try:
        from numba.np.ufunc import parallel  # not public API: the public functions if it moves
        get, set_ = parallel._get_num_threads, parallel._set_num_threads
    except (ImportError, AttributeError):
        return public
    if not (callable(get) and callable(set_)) or get() != count:
        return public
    return get, set_


_get_thread_count, _set_thread_count = _thread_count_functions()

PARALLEL_JIT = {"parallel": True, "cache": True, "fastmath": False, "nogil": True, "error_model": "numpy"}
"""Options of a ``prange`` kernel whose sums keep their written order (no reordering, no fused multiply-adds)."""

PARALLEL_MIN_WORK = 1 << 22
"""Below this many multiply-adds or elements, :func:`threads_for` runs a kernel on one thread."""


_ALL_THREADS = 1 << 30  # "every thread": numba_threads clamps it to the threads there are


class ContentionPolicy:
    """Whether a parallel region may use more than one thread, from how the last ones went.

    After each judged region on ``threads > 1`` threads, :meth:`record` gets
    its wall time and the process CPU time spent in it (seconds). Their
    ratio, the threads that actually ran, below ``1 + (threads - 1) *
    min_share`` means the cores were taken by someone else: the following
    regions then run on one thread until both ``first_backoff * 2**level``
    seconds and ``first_calls * 2**level`` declined calls have passed, and
    the next region tries the threads again. A contended try raises
    ``level`` (up to ``max_level``), one that ran in parallel lowers it, so
    a machine that stays busy is probed rarely (a failed try costs up to a
    scheduler slice) and a quiet one gets its threads back within
    ``first_backoff * 2**max_level`` seconds. Counting calls as well as
    seconds keeps rare calls (seconds apart) from being a try each. Regions
    shorter than ``min_wall`` are not judged (kernel dispatch is serial and
    weighs on them), but they follow the decision.

    A region can also run below the threshold on an idle machine, when its
    work splits unevenly over the threads (fewer tasks than threads, one
    long task), or, when it is short, when waking the workers takes a good
    part of it, or when it is shorter than a scheduler tick: the process clock
    then often lacks the workers' time when the region ends (Linux adds a
    thread's time when it sleeps or at a tick; measured here, two threads
    that both ran read 1.00-1.03 over 0.2-0.3 ms, 1.86 over 1.9 ms, 2.02
    over 94 ms). ``cores_taken(threads)``, when given, confirms a low ratio:
    ``False`` (the runnable tasks of other processes leave ``threads`` cores
    free) keeps the threads, and is trusted for ``confirm_ttl`` seconds
    without asking again; ``True`` or ``None`` (unknown) falls back.
    :func:`cores_taken_now` reads the machine's runnable-task count.
    Without a confirmation the ratio alone decides, and regions shorter than
    2 ms (the default ``min_wall``) are not judged: on an idle 2-core machine,
    judging from 0.2 ms on found 8-10 of the default demo's regions
    "contended" and made it 25-45% slower than with no policy. With it,
    :data:`CONTENTION` judges from 0.2 ms on, so that a process whose kernels
    are all short (a decode step's block score) also falls back.

    With ``torch_threads``, torch's intra-op threads follow the same
    decision: set to one when a region is judged contended, given back (when
    nobody changed them meanwhile) when one runs in parallel again. torch's
    OpenMP pool waits for a descheduled worker just as numba's does.

    Example: ``policy.record(2, wall=0.050, cpu=0.022, now=t)`` (a 2-thread
    region that ran 0.44 threads' worth) makes ``policy.allow_parallel(now)``
    false for the next ``first_calls`` calls and until ``t + first_backoff``.
    """

    def __init__(self, *, min_share: float = 0.3, min_wall: float = 2e-3, first_backoff: float = 0.1,
                 first_calls: int = 2, max_level: int = 5, torch_threads: bool = False,
                 cores_taken: Callable[[int], bool | None] | None = None, confirm_ttl: float = 0.05) -> None:
        self.min_share = min_share
        self.cores_taken = cores_taken
        self.confirm_ttl = confirm_ttl
        self.cores_free_until = float("-inf")
        self.min_wall = min_wall
        self.first_backoff = first_backoff
        self.first_calls = first_calls
        self.max_level = max_level
        self.torch_threads = torch_threads
        self.saved_torch_threads: int | None = None
        self.level = 0
        self.serial_until = float("-inf")
        self.serial_calls = 0
        self.contended_regions = 0

    def allow_parallel(self, now: float, threads: int = 2) -> bool:
        """Whether a region starting at ``now`` (``time.perf_counter()`` seconds) may use ``threads``
        threads; a call declined counts towards the next try.

        When a backoff has passed, ``cores_taken`` (if given) is asked first:
        while other processes still take the cores, the policy stays on one
        thread for another backoff, one level longer, instead of trying, since
        a failed try costs up to a scheduler slice (and the question itself
        about 7 ms when the cores are taken: it is asked rarely on a machine
        that stays busy).
        """
        if now >= self.serial_until and self.serial_calls <= 0:
            if self.level == 0 or self.cores_taken is None or not self.cores_taken(threads):
                return True
            self.level = min(self.level + 1, self.max_level)
            self._back_off(now)
        self.serial_calls -= 1
        return False

    def _back_off(self, now: float) -> None:
        """Stay on one thread for ``first_backoff * 2**level`` seconds and ``first_calls * 2**level`` calls."""
        self.serial_until = now + self.first_backoff * 2**self.level
        self.serial_calls = self.first_calls * 2**self.level

    def judges(self, threads: int, wall: float) -> bool:
        """Whether a region that ran on ``threads`` threads for ``wall`` seconds is judged (several threads, at
        least ``min_wall``): :meth:`record` ignores any other, so its caller need not read the process clock."""
        return threads >= 2 and wall >= self.min_wall

    def record(self, threads: int, wall: float, cpu: float, now: float) -> None:
        """Judge a region that ran on ``threads`` threads for ``wall`` seconds using ``cpu`` seconds of the
        process's CPU time and ended at ``now`` (a region it does not :meth:`judge <judges>` changes nothing)."""
        if not self.judges(threads, wall):
            return
        if cpu < wall * (1.0 + (threads - 1) * self.min_share) and self._confirmed(threads, now):
            self.contended_regions += 1
            self._back_off(now)
            self.level = min(self.level + 1, self.max_level)
            if self.torch_threads and self.saved_torch_threads is None and torch.get_num_threads() > 1:
                self.saved_torch_threads = torch.get_num_threads()
                torch.set_num_threads(1)
        else:
            self.level = max(self.level - 1, 0)
            self._give_back_torch_threads()

    def _confirmed(self, threads: int, now: float) -> bool:
        """Whether a region that ran below the threshold was contended (see ``cores_taken``)."""
        if self.cores_taken is None:
            return True
        if now < self.cores_free_until:
            return False
        if self.cores_taken(threads) is False:
            self.cores_free_until = now + self.confirm_ttl
            return False
        return True

    def reset(self) -> None:
        """Forget what was seen: the next region may use every thread (and torch its threads)."""
        self.level = self.serial_calls = 0
        self.serial_until = self.cores_free_until = float("-inf")
        self._give_back_torch_threads()

    def _give_back_torch_threads(self) -> None:
        if self.saved_torch_threads is not None:
            if torch.get_num_threads() == 1:  # else someone set them meanwhile: theirs stands
                torch.set_num_threads(self.saved_torch_threads)
            self.saved_torch_threads = None


def _runnable_elsewhere() -> int:
    """Runnable tasks of other processes right now (Linux: ``/proc/loadavg``'s count, less this
    process's own runnable threads: torch's OpenMP workers may still be spinning).

    Our threads are read first: a worker that goes to sleep between the two
    reads is then left out of both counts rather than counted as another
    process's task.
    """
    own = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as file:
                own += file.read().rpartition(b")")[2].split(None, 1)[0] == b"R"
        except OSError:  # the thread ended meanwhile
            continue
    with open("/proc/loadavg", "rb") as file:
        running = int(file.read().split()[3].split(b"/")[0])
    return max(running - own, 0)


def cores_taken_now(threads: int, samples: int = 3, interval: float = 3e-3) -> bool | None:
    """Whether the runnable tasks of other processes leave fewer than ``threads`` of this process's
    CPUs free, in each of ``samples`` readings ``interval`` seconds apart (a task that runs for a few
    milliseconds is not a competitor); ``None`` where that cannot be read (not Linux).

    A reading costs about 0.1 ms, and the readings stop at the first that
    finds the cores free, so the policy asks only to confirm a region that
    looked contended; cores that stay taken cost the whole ``(samples - 1) *
    interval``. On the idle 2-core machine, right after two-thread kernels,
    readings 0.5 ms apart confirmed 0.08-0.11% of the time (about one region
    per benchmark run then ran on one thread for 0.1 s or more), 1.5 ms apart
    0.04-0.06%, 3 ms apart none of 96k; with one busy process all three
    confirmed every time (6.7 ms a question instead of 1.5).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
        for sample in range(samples):
            if sample:
                time.sleep(interval)
            if _runnable_elsewhere() + threads <= cpus:
                return False
        return True
    except (OSError, ValueError, IndexError, AttributeError):
        return None


CONTENTION = ContentionPolicy(torch_threads=True, cores_taken=cores_taken_now, min_wall=2e-4)
"""The process-wide policy every :func:`numba_threads` block follows, torch's threads included:
contention is a property of the machine, so what one kernel sees applies to all."""


THREAD_COUNT_TTL = 0.05
"""Seconds for which :class:`numba_threads` trusts the numba thread count it last read on a thread: the read
itself measured 3-7% of a 0.3 ms decode score call (its code is cold after a kernel), while numba's count
changes only through ``numba.set_num_threads``, which the blocks' own changes also update. A count that a
user changed meanwhile only changes how many workers a kernel splits its tasks over, never its results."""


class _KnownThreadCount(threading.local):
    """numba's thread count on this thread (``count``) and until when it is trusted (``until``)."""

    count = 0
    until = float("-inf")


_KNOWN_THREADS = _KnownThreadCount()


class numba_threads:  # noqa: N801 - used like a function: ``with numba_threads(n):``
    """Run numba's parallel loops inside the block on ``count`` threads, clamped to 1 .. numba's current count.

    Asking for more than one thread is a request: while :data:`CONTENTION` sees the cores taken by other
    work, the block runs on one thread, and a block that does run on several is timed and judged.
    ``with numba_threads(n) as threads:`` gives the count the block runs on. numba's count is read afresh
    wherever the block changes it (it restores what it read), else at most every :data:`THREAD_COUNT_TTL`
    seconds."""

    __slots__ = ("requested", "threads", "available", "cpu_start", "wall_start")

    def __init__(self, count: int) -> None:
        self.requested = count

    def __enter__(self) -> int:
        now = time.perf_counter()
        known = _KNOWN_THREADS
        if now >= known.until:
            known.count, known.until = _get_thread_count(), now + THREAD_COUNT_TTL
        available = known.count
        count = max(1, min(available, self.requested))
        if count > 1 and not CONTENTION.allow_parallel(now, count):
            count = 1
        if count != available:
            available = known.count = _get_thread_count()
            known.until = now + THREAD_COUNT_TTL
            count = min(count, available)
            if count != available:
                _set_thread_count(count)
                known.count = count
        self.threads, self.available = count, available
        if count > 1:
            self.cpu_start = time.process_time()
            self.wall_start = time.perf_counter()
        return count

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.threads > 1 and exc_type is None:
            now = time.perf_counter()
            wall = now - self.wall_start
            if CONTENTION.judges(self.threads, wall):  # else the process clock's read (~0.5 us) is spared
                CONTENTION.record(self.threads, wall, time.process_time() - self.cpu_start, now)
        if self.threads != self.available:
            _set_thread_count(self.available)
            _KNOWN_THREADS.count = self.available


def threads_for(work: int) -> numba_threads:
    """All of numba's threads for ``work`` (multiply-adds or elements) of at least ``PARALLEL_MIN_WORK``, else one."""
    return numba_threads(_ALL_THREADS if work >= PARALLEL_MIN_WORK else 1)


@numba.njit(cache=True, nogil=True, inline="always")
def balanced_order(task, tasks):
    """The ``task``-th of ``tasks`` in the order first, last, second, second to last, ...: each contiguous run
    of the iterations (numba's equal split of a ``prange``, or a run a worker claims: :func:`claim_tasks`)
    then holds as many early tasks as late ones, where work grows or shrinks along the tasks (a causal
    prefill's late rows select more keys than its early ones; its late key chunks are seen by fewer rows)."""
    return task // 2 if task % 2 == 0 else tasks - 1 - task // 2


@numba.njit(cache=True, nogil=True, inline="always")
def worker_tasks(worker, workers, tasks):
    """``(first, end)``: the contiguous run of ``tasks`` that iteration ``worker`` of ``prange(workers)``
    runs, the same equal split numba gives a ``prange(tasks)`` on ``workers`` threads (``workers`` from
    ``with threads_for(work) as workers:``; numba's own thread count read inside a kernel would keep it
    out of the disk cache). A kernel that loops ``for worker in prange(workers)`` over its runs
    allocates its scratch once per worker instead of once per task (the score kernels' three scratch
    arrays per 128-key task were 8-9% of a decode call)."""
    return worker * tasks // workers, (worker + 1) * tasks // workers


def _is_counter(counter) -> bool:
    return isinstance(counter, types.Array) and counter.ndim == 1 and counter.dtype == types.int64


@intrinsic
def _fetch_add(typingctx, counter, amount):
    """``counter[0] += amount`` as one atomic step (any thread may run it at once), returning the value before
    (numba only). ``counter`` a 1-d int64 array; relaxed ordering: nothing is published through it, and the
    region's end is the barrier for the tasks' outputs."""
    if not (_is_counter(counter) and isinstance(amount, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        value = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.atomic_rmw("add", data, value, "monotonic")

    return types.int64(counter, amount), codegen


@intrinsic
def _load_relaxed(typingctx, counter):
    """``counter[0]`` read as one atomic load (numba only; ``counter`` as for :func:`_fetch_add`)."""
    if not _is_counter(counter):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load_atomic(data, "monotonic", 8)

    return types.int64(counter), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def claim_tasks(counter, tasks, workers):
    """``(first, end)``: the next run of ``tasks`` a worker of ``prange(workers)`` takes from ``counter`` (int64
    ``[1]``, zero when the region starts, shared by the workers), a guided share: what is left over ``2 *
    workers``, at least one task. ``first >= tasks``: none left.

    The workers take the tasks as they go instead of a fixed equal share each: on a shared machine one core
    often runs slower than the other for a while (another tenant's work beside it), and an equal split
    then waits for its slower worker (the decode pool score's two workers, bf16, ended 18-84 us apart at
    the median, 3 with this; the score kernels up to 1.14x faster, docs/performance-notes.md). Long runs first
    keep each worker's keys in long streams; every task is one worker's, so results do not depend on who
    runs it.

    A kernel takes its tasks one by one through :func:`next_task`.
    """
    grain = max(1, (tasks - _load_relaxed(counter)) // (2 * workers))
    first = _fetch_add(counter, grain)
    return first, min(first + grain, tasks)


@numba.njit(cache=True, nogil=True, inline="always")
def next_task(counter, own_run, tasks, workers):
    """The next of ``tasks`` this worker runs, ``-1`` when none is left: the next of its current run ``own_run``
    (int64 ``[2]``, ``[next, end]``, zeros before the first call; the worker's own), else the first of a new
    run :func:`claim_tasks` takes from ``counter``.

    Example, each worker with its own scratch::

        claimed = np.zeros(1, np.int64)
        for worker in prange(workers):
            own_run = np.zeros(2, np.int64)
            while True:
                task = next_task(claimed, own_run, tasks, workers)
                if task < 0:
                    break
                ...
    """
    if own_run[0] >= own_run[1]:
        own_run[0], own_run[1] = claim_tasks(counter, tasks, workers)
        if own_run[0] >= tasks:
            return -1
    task = own_run[0]
    own_run[0] += 1
    return task
