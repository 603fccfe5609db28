"""Timing, peers and the result table shared by every benchmark.

A row reports our time, the bytes the op must move at least, the achieved
GB/s, and the time of each peer measured in the same run; ``ratio`` columns
are ``peer_time / our_time`` (above 1 means we are faster). The ``1thread``
peer is our own op on one thread (:func:`one_thread`): its column above 1
means the threads help.

A run can be made under load: :func:`busy_processes` starts ``N`` processes
that spin on a core for the run and stops them (by their own ids) when it
ends, and its :class:`LoadReport` (``N`` and the 1-minute load average before
and after) goes under the table and into the JSON rows.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from ..cache.layout import SENTINEL
from ..cache.memory import allocate_pages
from ..kernels.cpu._parallel import numba_threads

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
PAGE_SIZE = 128  # tokens per page of the benchmarks' caches

BUSY_LOOP = "import os\nwhile os.getppid() == {parent}: pass"
"""The program each competing process runs (``{parent}``: the benchmark's process id): one core's worth
of pure computation, until that parent exits (a benchmark killed by a signal, whose cleanup never
runs, leaves no busy process behind)."""


@dataclass
class BenchRow:
    """One measured op at one shape. Times are medians in milliseconds."""

    op: str
    shape: str
    dtype: str
    backend: str
    time_ms: float
    bytes_moved: int
    peers_ms: dict[str, float] = field(default_factory=dict)
    note: str = ""
    paired: dict[str, float] = field(default_factory=dict)
    """Ratios that are the median of per-round ratios (:func:`time_against_peers`), not the medians' ratio."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / (self.time_ms * 1e-3) / 1e9 if self.time_ms > 0 else float("nan")

    def ratio(self, peer: str) -> float:
        """``peer_time / our_time``: how many times faster than the peer we are."""
        return self.peers_ms[peer] / self.time_ms

    def ratios(self) -> dict[str, float]:
        """:meth:`ratio` of every peer, and ``roof`` where both ``read`` and ``peak`` were timed: the longer
        of their two times (the op's bytes read once at the machine's read bandwidth, its multiply-adds at
        the register tile's peak: the roofline's time for the op on this machine) over ours, the fraction of
        it the op reaches."""
        ratios = {p: self.paired.get(p, self.ratio(p)) for p in self.peers_ms}
        if "read" in self.peers_ms and "peak" in self.peers_ms:
            ratios["roof"] = self.paired.get(
                "roof", max(self.peers_ms["read"], self.peers_ms["peak"]) / self.time_ms)
        return ratios

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gb_per_s"] = self.gb_per_s
        d["ratios"] = self.ratios()
        return d


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], *, device: torch.device | str | None = None,
              warmup: int = 2, repeat: int = 10, min_seconds: float = 0.0) -> float:
    """Median wall time of ``fn()`` in milliseconds (CUDA events on a GPU).

    Runs ``warmup`` untimed calls first, then at least ``repeat`` timed calls
    and keeps going until ``min_seconds`` of timed calls have passed.
    """
    device = torch.device(device) if device is not None else None
    for _ in range(warmup):
        fn()
    _sync(device)
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < repeat or time.perf_counter() - started < min_seconds:
        if device is not None and device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= 10 * max(repeat, 1):
            break
    return statistics.median(samples)


class SelfTimedPeer:
    """A peer that times its own calls (in another process, say), for :func:`time_interleaved`.

    :meth:`time_calls` runs ``warmup`` untimed calls, then ``calls`` timed calls back to back, and returns
    the wall time of the timed ones in seconds, measured where they ran. Calling the peer runs one call.
    """

    def time_calls(self, calls: int, warmup: int = 0) -> float:
        raise NotImplementedError

    def __call__(self) -> None:
        self.time_calls(1)


def _round_ms(fn: Callable[[], object], repeats: int, device: torch.device | None) -> float:
    """Milliseconds per call of ``repeats`` calls of ``fn`` back to back, after one untimed call."""
    if isinstance(fn, SelfTimedPeer):
        return fn.time_calls(repeats, warmup=1) * 1e3 / repeats
    fn()
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - started) * 1e3 / repeats


def time_interleaved(calls: dict[str, Callable[[], object]], *, rounds: int = 9,
                     device: torch.device | str | None = None, round_ms: float = 2.0) -> dict[str, float]:
    """Median per-call time (ms) of every call, measured in interleaved rounds (:func:`time_rounds`)."""
    return {name: statistics.median(times) for name, times in
            time_rounds(calls, rounds=rounds, device=device, round_ms=round_ms).items()}


def time_rounds(calls: dict[str, Callable[[], object]], *, rounds: int = 9,
                device: torch.device | str | None = None, round_ms: float = 2.0) -> dict[str, list[float]]:
    """Per-call times (ms) of every call in each of ``rounds`` interleaved rounds.

    Each round runs every call in turn, in an order shuffled each round (with
    a fixed seed): once untimed (so that every call is timed with its own
    data in cache, however long it is), then timed, a call under
    ``round_ms`` several times back to back (their mean is that round's
    sample). The shuffle keeps a periodic disturbance (another process's
    scheduler slice, which on a loaded machine comes every few milliseconds)
    from falling on the same call in every round. A machine that slows down
    or speeds up during the run then shifts every column alike, so the ratios
    between ours and the peers stay fair; timing one call's repeats before
    the next call's would put the drift into the ratio. A :class:`SelfTimedPeer` takes its turn the same way
    and reports the time of its timed calls itself.
    """
    device = torch.device(device) if device is not None else None
    repeats = {}
    for name, fn in calls.items():  # warm-up; its time picks the repeats per round
        elapsed_ms = _round_ms(fn, 1, device)
        repeats[name] = max(1, min(100, int(round_ms / max(elapsed_ms, 1e-3))))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            samples[name].append(_round_ms(calls[name], repeats[name], device))
    return samples


THREADS_CHECK_ROUNDS = 120
"""Rounds of a threads check: ours against :func:`one_thread` alone (``--threads-check``). Other peers in the
rounds, another process's threads above all, disturb a comparison of two calls of a millisecond."""


def time_against_peers(calls: dict[str, Callable[[], object]], *, rounds: int = 9
                       ) -> tuple[float, dict[str, float], dict[str, float]]:
    """Our median time (ms, ``calls["ours"]``), each peer's, and each peer's paired ratio: the median over
    :func:`time_rounds`' rounds of the round's peer time over our time (for :attr:`BenchRow.paired`; with
    ``read`` and ``peak`` peers also ``roof``, of the longer of the two).

    On a shared machine the speed of every call drifts (other tenants' work:
    the peak peer took 87-171 us for the same work from one run to the
    next), and on a busy one each call's time is bimodal
    (preempted or not, about half the calls each), so each median falls on
    one mode or the other by chance: ``1thread``'s ratio of the medians
    swung from 0.57 to 1.6 from run to run on a single row. The calls of a
    round run back to back, and the median of their ratios is the op's own
    ratio whenever the disturbances fall on both alike. Two busy processes on
    2 cores, bf16 block score at 32768 blocks: the medians' ratio 0.50 in one
    run, the paired ratio 1.01; in the next, every decile of the two samples
    within 3% of each other, the paired ratio 0.99."""
    samples = time_rounds(calls, rounds=rounds)
    ours = samples.pop("ours")
    paired = {peer: statistics.median(t / o for t, o in zip(times, ours)) for peer, times in samples.items()}
    if "read" in samples and "peak" in samples:
        paired["roof"] = statistics.median(max(r, p) / o for r, p, o in zip(samples["read"], samples["peak"], ours))
    return statistics.median(ours), {peer: statistics.median(times) for peer, times in samples.items()}, paired


def threads_check(call: Callable[[], object]) -> tuple[float, dict[str, float], dict[str, float]]:
    """:func:`time_against_peers` of ours and the ``1thread`` peer alone, :data:`THREADS_CHECK_ROUNDS` rounds."""
    return time_against_peers({"ours": call, "1thread": one_thread(call)}, rounds=THREADS_CHECK_ROUNDS)


def one_thread(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with numba and torch on one thread: the same-run single-thread peer (``1thread``)."""

    def run() -> object:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with numba_threads(1):
                return fn()
        finally:
            torch.set_num_threads(threads)

    return run


@dataclass
class LoadReport:
    """The load a benchmark ran under: ``busy`` competing processes it started, their ids, and the
    1-minute load average when they started and just before they were stopped (``None`` while running)."""

    busy: int
    load_before: float
    load_after: float | None = None
    pids: list[int] = field(default_factory=list)

    def describe(self) -> str:
        after = f"{self.load_after:.2f}" if self.load_after is not None else "?"
        return (f"load: {self.busy} busy process{'es' if self.busy != 1 else ''} (a busy loop) for the run; "
                f"1-minute load average {self.load_before:.2f} before, {after} after, on {os.cpu_count()} CPUs")

    def to_dict(self) -> dict:
        return {"busy_processes": self.busy, "load_before": self.load_before, "load_after": self.load_after}


@contextlib.contextmanager
def busy_processes(count: int, *, settle_s: float = 0.3) -> Iterator[LoadReport]:
    """Run the block with ``count`` processes spinning on the CPUs (``python -c BUSY_LOOP``).

    They start ``settle_s`` seconds before the block and are killed and
    reaped by their own ids when it ends, also on an error or ``KeyboardInterrupt``.
    Yields the :class:`LoadReport` (its ``load_after`` is filled in when the block ends).
    """
    if count < 0:
        raise ValueError(f"busy_processes: count must be >= 0, got {count}")
    report = LoadReport(count, os.getloadavg()[0])
    processes: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            program = BUSY_LOOP.format(parent=os.getpid())
            processes.append(subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            report.pids.append(processes[-1].pid)
        if processes:
            time.sleep(settle_s)
        yield report
    finally:
        report.load_after = os.getloadavg()[0]
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def copy_peer(nbytes: int, device: torch.device | str = "cpu") -> Callable[[], object]:
    """A same-run peer: ``dst.copy_(src)`` of ``nbytes`` bytes (reads and writes them once).

    Its ``bytes_moved`` is counted as ``nbytes`` (the payload), like ours, so
    GB/s compare like for like.
    """
    numel = max(1, nbytes // 4)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def read_peer(nbytes: int, device: torch.device | str = "cpu") -> Callable[[], object]:
    """A same-run peer: the sum of ``nbytes`` bytes of float32 (reads them once, writes nothing): the time
    to stream an op's bytes from one span at the machine's read bandwidth, on torch's threads (an op over
    pages reads them where they lie: :func:`.page_read.page_read_peer`, :func:`gather_peer`)."""
    src = torch.randn(max(1, nbytes // 4), device=device)
    out = torch.empty((), device=device)
    return lambda: torch.sum(src, dim=0, out=out)


def layer_turns(layers: int) -> Iterator[int]:
    """Layer indices ``0, 1, ..., layers - 1, 0, ...`` for calls that score one layer after another as a
    model's decode step does: past the last-level cache, each call then finds its keys in memory."""
    return itertools.cycle(range(layers))


def time_layers_in_turn(call: Callable[[], object], read: Callable[[], object], peak: Callable[[], object],
                        rounds: int = 9) -> tuple[float, dict[str, float], dict[str, float]]:
    """:func:`time_against_peers` for a ``call`` that reads the next of a cache's layers each time
    (:func:`layer_turns`), against peers whose data lies where its own does: ``call`` on one thread, ``read``
    (the same layers' bytes in turn, e.g. :func:`.page_read.page_read_peer`), and ``peak`` (operands in L1)."""
    return time_against_peers({"ours": call, "1thread": one_thread(call), "read": read, "peak": peak}, rounds=rounds)


def gather_peer(blocks: torch.Tensor, lookup_table: torch.Tensor, indices: torch.Tensor,
                counts: torch.Tensor) -> Callable[[], object]:
    """A same-run ``read`` peer for sparse attention: the selected tokens' key and value rows of every KV head
    copied out of the paged ``blocks [pages, 2, 1, page_size, kv_heads, D]`` with ``index_select`` (torch's
    threads), for one query row per sequence (``indices [B, W]``, ``counts [B]``): the op's bytes read where
    they lie, scattered rows of one head's ``D`` elements, which a contiguous read does not model."""
    _, planes, _, page_size, kv_heads, dim = blocks.shape
    flat = blocks.reshape(-1, dim)
    starts = []
    for b in range(indices.shape[0]):
        tokens = indices[b, : int(counts[b])].long()
        row0 = (lookup_table[b, tokens // page_size].long() * planes * page_size + tokens % page_size) * kv_heads
        for plane in range(planes):
            for head in range(kv_heads):
                starts.append(row0 + plane * page_size * kv_heads + head)
    rows = torch.cat(starts)
    out = flat.new_empty(rows.numel(), dim)
    return lambda: torch.index_select(flat, 0, rows, out=out)


def format_table(rows: list[BenchRow], load: LoadReport | None = None) -> str:
    """A fixed-width table: op, shape, dtype, backend, time, GB/s, then one ratio per peer; the load it ran
    under, when given, on the last line."""
    peers: list[str] = []
    for r in rows:
        peers += [p for p in r.ratios() if p not in peers]
    header = ["op", "shape", "dtype", "backend", "ms", "MB", "GB/s"] + [f"x{p}" for p in peers]
    body = []
    for r in rows:
        cells = [r.op, r.shape, r.dtype, r.backend, f"{r.time_ms:.3f}", f"{r.bytes_moved / 1e6:.1f}",
                 f"{r.gb_per_s:.2f}"]
        ratios = r.ratios()
        cells += [f"{ratios[p]:.2f}" if p in ratios else "-" for p in peers]
        body.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = ["x<peer> = peer time / our time (above 1: faster than the peer)"
              + ("; the median of the rounds' ratios (each round times every call back to back)"
                 if any(r.paired for r in rows) else "")]
    if "1thread" in peers:
        legend.append("x1thread = our op on one thread / our op (above 1: the threads help)")
    if "roof" in peers:
        legend.append("xroof = max(read, peak) time / our time: the fraction of the roofline (the op's bytes read once "
                      "at the machine's read bandwidth, or for ops over pages read where they lie: sparse attention's "
                      "gathered rows, the paged scores' page runs; the multiply-adds at the tile's peak) reached")
    if load is not None:
        legend.append(load.describe())
    return "\n".join(lines + legend)


def rows_to_json(rows: list[BenchRow], load: LoadReport | None = None) -> str:
    """The rows as a JSON list; each row carries the ``load`` it ran under when given."""
    extra = {"load": load.to_dict()} if load is not None else {}
    return json.dumps([{**r.to_dict(), **extra} for r in rows], indent=2)


@contextlib.contextmanager
def backend(name: str):
    """Run the ops with ``SPARSEKV_BACKEND=name`` inside the block."""
    previous = os.environ.get("SPARSEKV_BACKEND")
    os.environ["SPARSEKV_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("SPARSEKV_BACKEND", None)
        else:
            os.environ["SPARSEKV_BACKEND"] = previous


def random_paged_blocks(batch: int, tokens: int, planes: int, heads: int, dim: int, dtype: torch.dtype,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pages for ``tokens`` per sequence, scattered through a pool with spare pages (allocated as
    the cache manager allocates them: :func:`sparsekv.cache.allocate_pages`).

    Returns ``blocks [num_pages, planes, 1, PAGE_SIZE, heads, dim]`` of ``dtype`` and ``lookup_table
    [batch, pages per sequence + 1]`` int32 (a trailing ``SENTINEL`` column)."""
    pages_per_seq = -(-tokens // PAGE_SIZE)
    used = batch * pages_per_seq
    num_pages = used + used // 8 + 1
    shape = (num_pages, planes, 1, PAGE_SIZE, heads, dim)
    blocks = allocate_pages(shape, dtype, "cpu")  # as the cache manager allocates its pages
    blocks.copy_(torch.randn(shape, generator=generator))
    table = torch.randperm(num_pages, generator=generator)[:used].reshape(batch, pages_per_seq)
    table = torch.cat([table, torch.full((batch, 1), SENTINEL)], dim=1).to(torch.int32)
    return blocks, table
