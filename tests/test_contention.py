"""The CPU kernels' contention policy (fake timings, not speed) and the benchmarks under load: busy
processes, single-thread and fastest-layout dense peers."""

from __future__ import annotations

import contextlib

import numba
import pytest

from script_support import alive
from sparsekv.kernels.cpu import _parallel
from sparsekv.kernels.cpu._parallel import ContentionPolicy, numba_threads, threads_for


def test_parallel_region_that_ran_in_parallel_keeps_threads():
    policy = ContentionPolicy()
    policy.record(2, wall=0.010, cpu=0.019, now=1.0)
    assert policy.allow_parallel(1.0)
    assert policy.contended_regions == 0


def test_contended_region_falls_back_then_probes_with_growing_backoff():
    policy = ContentionPolicy(first_backoff=0.1, first_calls=2, max_level=2)
    policy.record(2, wall=0.050, cpu=0.022, now=1.0)  # 0.44 threads' worth of CPU: a worker sat descheduled
    assert [policy.allow_parallel(1.05) for _ in range(3)] == [False] * 3  # too early, however many calls
    assert policy.allow_parallel(1.1)  # the try: 0.1 s passed and 2 calls declined
    policy.record(2, wall=0.040, cpu=0.030, now=1.2)  # still contended: 0.2 s and 4 calls
    assert not policy.allow_parallel(1.4) and not policy.allow_parallel(1.5)  # late enough, 2 calls of 4
    assert [policy.allow_parallel(2.0) for _ in range(3)] == [False] * 2 + [True]
    policy.record(2, wall=0.040, cpu=0.030, now=2.0)
    policy.record(2, wall=0.040, cpu=0.030, now=3.0)  # capped at max_level: 0.4 s and 8 calls
    assert policy.level == 2
    assert not any(policy.allow_parallel(3.39) for _ in range(20))
    assert policy.allow_parallel(3.4)
    policy.record(2, wall=0.010, cpu=0.019, now=4.0)  # a try that ran in parallel lowers the level
    assert policy.level == 1 and policy.allow_parallel(4.0)
    assert policy.contended_regions == 4


@pytest.mark.parametrize(("threads", "wall", "cpu", "contended"), [
    (1, 0.050, 0.001, False),   # one thread: nothing to judge
    (2, 0.0001, 0.0001, False),  # too short to judge (serial dispatch weighs on it)
    (2, 0.010, 0.0129, True),   # just below 1.3 threads' worth
    (2, 0.010, 0.0131, False),
    (4, 0.010, 0.0189, True),   # 4 threads must show 1.9 threads' worth
    (4, 0.010, 0.0191, False),
])
def test_contention_threshold(threads, wall, cpu, contended):
    policy = ContentionPolicy()
    policy.record(threads, wall=wall, cpu=cpu, now=0.0)
    assert policy.allow_parallel(0.0) is not contended


def test_numba_threads_follows_the_policy(monkeypatch):
    policy = ContentionPolicy()
    monkeypatch.setattr(_parallel, "CONTENTION", policy)
    available = numba.get_num_threads()
    with threads_for(_parallel.PARALLEL_MIN_WORK):
        assert numba.get_num_threads() == available
    with threads_for(0), numba_threads(0):
        assert numba.get_num_threads() == 1
    policy.serial_until = float("inf")
    with numba_threads(available):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == available
    policy.reset()
    assert policy.allow_parallel(0.0)


def test_numba_threads_restores_a_count_set_after_it_was_last_read(monkeypatch):
    """A block that runs on fewer threads restores numba's count as it is then, not the count it trusted."""
    monkeypatch.setattr(_parallel, "CONTENTION", ContentionPolicy())
    available = numba.get_num_threads()
    if available < 2:
        pytest.skip("needs two numba threads")
    try:
        with numba_threads(available):  # reads the count and trusts it for a while
            pass
        numba.set_num_threads(available - 1)
        with numba_threads(1) as threads:
            assert threads == 1 and numba.get_num_threads() == 1
        assert numba.get_num_threads() == available - 1
        with numba_threads(available) as threads:  # the count it restored is the one it trusts
            assert threads == available - 1
    finally:
        numba.set_num_threads(available)


def test_thread_count_functions_read_and_set_numbas_count_or_fall_back(monkeypatch):
    """The threading layer's own getter and setter act on the count numba's public functions see; where
    numba's module lacks them, the public functions are used."""
    from numba.np.ufunc import parallel
    get, set_ = _parallel._thread_count_functions()
    if callable(getattr(parallel, "_set_num_threads", None)):  # the numba versions supported have them
        assert (get, set_) == (parallel._get_num_threads, parallel._set_num_threads)
    available = numba.get_num_threads()
    assert get() == available
    try:
        set_(1)
        assert numba.get_num_threads() == 1 and get() == 1
    finally:
        numba.set_num_threads(available)
    monkeypatch.delattr(parallel, "_set_num_threads")
    assert _parallel._thread_count_functions() == (numba.get_num_threads, numba.set_num_threads)


@pytest.mark.parametrize("fail", [False, True])
def test_busy_processes_run_for_the_block_and_are_stopped_after(fail):
    from sparsekv.bench.common import busy_processes, format_table

    with pytest.raises(KeyboardInterrupt) if fail else contextlib.nullcontext():
        with busy_processes(2, settle_s=0.0) as load:
            pids = list(load.pids)
            assert len(pids) == 2 and all(alive(pid) for pid in pids)
            if fail:
                raise KeyboardInterrupt
    assert not any(alive(pid) for pid in pids)
    assert load.load_after is not None
    assert "load: 2 busy processes" in format_table([], load)


def test_balanced_order_pairs_early_and_late_tasks():
    from sparsekv.kernels.cpu._parallel import balanced_order

    for tasks in (1, 2, 5, 8):
        order = [balanced_order(task, tasks) for task in range(tasks)]
        assert sorted(order) == list(range(tasks))
    assert [balanced_order(task, 6) for task in range(6)] == [0, 5, 1, 4, 2, 3]


def test_worker_runs_cover_every_task_once_in_order():
    from sparsekv.kernels.cpu._parallel import worker_tasks

    for tasks, workers in ((1, 1), (7, 2), (64, 2), (3, 3), (10, 4)):
        runs = [worker_tasks(worker, workers, tasks) for worker in range(workers)]
        assert runs[0][0] == 0 and runs[-1][1] == tasks
        assert all(end == next_first for (_, end), (next_first, _) in zip(runs, runs[1:]))
        assert max(end - first for first, end in runs) - min(end - first for first, end in runs) <= 1


def test_roof_column_is_the_longer_of_read_and_peak_over_ours():
    from sparsekv.bench.common import BenchRow, format_table

    memory_bound = BenchRow("op", "s", "fp32", "cpu", 2.0, 10, {"read": 1.0, "peak": 0.5, "copy": 3.0})
    compute_bound = BenchRow("op", "s", "fp32", "cpu", 2.0, 10, {"read": 0.5, "peak": 1.5})
    assert memory_bound.ratios()["roof"] == 0.5 and compute_bound.ratios()["roof"] == 0.75
    assert "roof" not in BenchRow("op", "s", "fp32", "cpu", 2.0, 10, {"peak": 1.0}).ratios()
    table = format_table([memory_bound, compute_bound])
    assert "xroof" in table.splitlines()[0] and table.splitlines()[3].split()[-1] == "0.75"


def test_busy_processes_end_with_a_benchmark_killed_by_a_signal():
    """SIGKILL skips the cleanup; the busy processes notice their parent is gone and exit."""
    import signal
    import subprocess
    import sys
    import time

    program = ("from sparsekv.bench.common import busy_processes\n"
               "with busy_processes(1, settle_s=0.0) as load:\n"
               "    print(load.pids[0], flush=True)\n"
               "    input()\n")
    parent = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        busy = int(parent.stdout.readline())
        assert alive(busy)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(busy)


def test_busy_processes_rejects_a_negative_count():
    from sparsekv.bench.common import busy_processes

    with pytest.raises(ValueError, match="count must be >= 0, got -1"), busy_processes(-1):
        pass


def test_sparse_attention_bench_compares_against_the_faster_dense_layout():
    import torch

    from sparsekv.bench.qsa import bench_sparse_attention

    row = bench_sparse_attention(1, 512, torch.bfloat16)
    dense = [name for name in row.peers_ms if name.startswith("sdpa")]
    assert len(dense) == 1 and "1thread" in row.peers_ms
    times = dict(part.rsplit(" ", 2)[:2] for part in row.note.split(": ", 1)[1].split(", "))
    assert set(times) == {"sdpa(rows)", "sdpa(gqa)"}
    assert row.peers_ms[dense[0]] == pytest.approx(min(float(t) for t in times.values()), abs=1e-3)


def test_torch_threads_follow_the_policy_and_are_given_back():
    import torch

    before, threads = torch.get_num_threads(), 2
    torch.set_num_threads(threads)
    policy = ContentionPolicy(torch_threads=True)
    try:
        policy.record(2, wall=0.050, cpu=0.022, now=0.0)
        assert torch.get_num_threads() == 1 and policy.saved_torch_threads == threads
        policy.record(2, wall=0.050, cpu=0.022, now=1.0)  # still contended: nothing more to save
        assert policy.saved_torch_threads == threads
        policy.record(2, wall=0.010, cpu=0.019, now=2.0)
        assert torch.get_num_threads() == threads and policy.saved_torch_threads is None
        policy.record(2, wall=0.050, cpu=0.022, now=3.0)
        torch.set_num_threads(threads)  # the user's own setting meanwhile stands
        policy.reset()
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("taken", "contended"), [(True, True), (None, True), (False, False)])
def test_low_ratio_is_confirmed_by_the_cores_taken(taken, contended):
    """An uneven region on an idle machine also runs below the threshold: it falls back only when the
    other runnable tasks leave too few cores (or when that is unknown)."""
    asked = []
    policy = ContentionPolicy(cores_taken=lambda threads: asked.append(threads) or taken)
    policy.record(2, wall=0.010, cpu=0.011, now=0.0)
    assert asked == [2]
    assert policy.allow_parallel(0.0) is not contended
    policy.record(2, wall=0.010, cpu=0.019, now=1.0)  # ran in parallel: not asked
    assert asked == [2]


def test_cores_free_answer_is_trusted_for_a_while():
    asked = []
    policy = ContentionPolicy(cores_taken=lambda threads: asked.append(threads) or False, confirm_ttl=0.05)
    for now in (0.0, 0.01, 0.04):
        policy.record(2, wall=0.010, cpu=0.011, now=now)
    assert asked == [2] and policy.allow_parallel(0.04)
    policy.record(2, wall=0.010, cpu=0.011, now=0.06)
    assert asked == [2, 2]


def test_cores_taken_now_counts_runnable_tasks():
    taken = _parallel.cores_taken_now(1)
    assert taken in (True, False, None)
    assert _parallel.cores_taken_now(1 << 20) in (True, None)  # more threads than any machine has cores


@pytest.mark.parametrize(("taken", "tries"), [(True, False), (None, True), (False, True)])
def test_a_try_waits_while_other_processes_take_the_cores(taken, tries):
    """When the backoff has passed, a machine still busy (confirmed) gets another, longer backoff instead of a
    try."""
    asked, answer = [], [True]
    policy = ContentionPolicy(first_backoff=0.1, first_calls=2,
                              cores_taken=lambda threads: asked.append(threads) or answer[0])
    policy.record(2, wall=0.050, cpu=0.022, now=1.0)  # confirmed: contended
    asked.clear()
    answer[0] = taken
    assert not policy.allow_parallel(1.05, 3) and not policy.allow_parallel(1.06, 3)  # backoff: not asked
    assert asked == []
    assert policy.allow_parallel(1.2, 3) is tries
    assert asked == [3]
    if not tries:
        assert policy.level == 2 and policy.serial_until == pytest.approx(1.2 + 0.4)


def test_threads_check_times_ours_against_one_thread_only():
    """``--threads-check``: every row of the QSA, k-pool and MLA benchmarks has the 1thread peer alone."""
    from sparsekv.bench import kpool, mla, qsa

    rows = (qsa.run(quick=True, ops=["compress", "sparse_attention"], check_threads=True)
            + kpool.run(quick=True, check_threads=True) + mla.run(quick=True, check_threads=True))
    assert len(rows) == 5  # QSA: 1 compress, 1 attention; k-pool: compress, score; MLA: 1
    assert all(set(row.peers_ms) == {"1thread"} and row.time_ms > 0 for row in rows)


def test_threads_check_reports_the_median_of_the_rounds_ratios(monkeypatch):
    """On a busy machine each call is preempted or not: the medians can fall on different modes (here 0.5)
    while the calls timed back to back in each round agree (their ratios' median: 1)."""
    from sparsekv.bench import common

    samples = {"ours": [1.0, 1.0, 2.0, 2.0, 2.0], "1thread": [1.0, 1.0, 1.0, 2.0, 2.0]}
    monkeypatch.setattr(common, "time_rounds", lambda calls, rounds: {name: samples[name] for name in calls})
    ours, peers, paired = common.threads_check(lambda: None)
    assert (ours, peers, paired) == (2.0, {"1thread": 1.0}, {"1thread": 1.0})
    row = common.BenchRow("op", "shape", "bf16", "cpu", ours, 1, peers, paired=paired)
    assert row.ratio("1thread") == 0.5 and row.ratios()["1thread"] == 1.0
    assert "median of the rounds' ratios" in common.format_table([row])


def test_every_peer_and_the_roof_get_the_median_of_the_rounds_ratios(monkeypatch):
    """A table's ratios come from each round's own times: a slow round slows ours and the peak alike."""
    from sparsekv.bench import common

    samples = {"ours": [1.0, 2.0, 2.0], "read": [0.5, 0.5, 0.5], "peak": [0.8, 1.6, 1.6]}
    monkeypatch.setattr(common, "time_rounds", lambda calls, rounds: {name: samples[name] for name in calls})
    ours, peers, paired = common.time_against_peers({name: lambda: None for name in samples})
    assert (ours, peers) == (2.0, {"read": 0.5, "peak": 1.6})
    assert paired == {"read": 0.25, "peak": 0.8, "roof": 0.8}
    row = common.BenchRow("op", "shape", "bf16", "cpu", ours, 1, peers, paired=paired)
    assert row.ratio("peak") == 0.8 and row.ratios()["roof"] == 0.8
    samples["peak"] = [0.8, 1.2, 1.6]  # the medians' ratio 0.6, each round's 0.8, 0.6, 0.8
    assert common.time_against_peers({name: lambda: None for name in samples})[2]["peak"] == 0.8
