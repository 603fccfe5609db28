"""Tensor-parallel check: a head-sharded run over ``torch.distributed`` equals the single-process run.

:func:`run_tp_check` (what ``sparsekv demo --tp N`` reports) builds a
Qwen4Exp QSA slice with seeded weights, saves it as an (unsharded) safetensors
checkpoint, serves a small workload in this process, then spawns ``tp``
processes (gloo on CPU, NCCL on CUDA) that each load only their slices of the
checkpoint and serve the same workload through their own cache manager
(replicated, see ``layers/tensor_parallel.py``). It compares, step by step:

* the slice's final hidden states (sharded versus single process, within
  float32 rounding: the row-parallel ``o_proj`` sums in another order);
* the QSA selections of every layer (equal on every rank and to the single run);
* the page tables and the prefix-cache hits (equal on every rank and to the single run).

The report dict holds ``tp``, the KV bytes each rank allocates (main cache and
indexer cache) next to the single process's, and the all-reduce time and volume.

:func:`launch` is the process launcher behind it, usable on its own: it runs
``worker(process_group, *args)`` on ``world_size`` spawned ranks with a hard
deadline; the first rank to raise makes :func:`launch` kill the others and
raise :class:`RankError` with that rank's traceback (no rank is left waiting
in a collective).
"""

from __future__ import annotations

import datetime
import io
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cache.manager import CacheGroupSpec, PagedKVCacheManager
from .demo import DEFAULT_QWEN, StageTimer, seed_parameters
from .layers.checkpoint import open_checkpoint, save_checkpoint, slice_state
from .layers.config import Qwen4ExpConfig
from .layers.qsa import Qwen4ExpSlice, qsa_cache_groups
from .layers.tensor_parallel import kv_head_range, load_tensor_parallel_weights


class RankError(RuntimeError):
    """A spawned rank raised (or died, or missed the deadline); ``rank`` names it, the message carries its traceback."""

    def __init__(self, rank: int | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, threads: int | None,
               worker: Callable, args: tuple, report: Connection) -> None:
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        payload = worker(dist.group.WORLD, *args)
        dist.barrier()  # no rank leaves (closing its connections) while another still needs them
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        # The report is in the pipe before this rank's sockets close, so it precedes the errors it causes.
        report.send((False, time.time(), traceback.format_exc()))
        report.close()
        os._exit(1)  # no process-group teardown: it could wait on the ranks this error leaves behind
    report.send((True, time.time(), payload))
    report.close()
    dist.destroy_process_group()


def launch(worker: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0,
           threads_per_rank: int | None = None) -> list:
    """Run ``worker(process_group, *args)`` on ``world_size`` new processes; return each rank's result.

    Args:
        worker: a module-level function (it is pickled to the ranks); its
            result must pickle (tensors are best sent as bytes, see :func:`record_bytes`).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one CUDA device per rank).
        timeout_s: hard deadline for the whole run, and the process group's
            collective timeout.
        threads_per_rank: ``torch.set_num_threads`` in each rank (``None``: torch's default).

    Raises :class:`RankError` for the rank that raised first (its traceback
    in the message; errors other ranks raise within a moment after, such as
    a closed connection, are named too), for a rank that dies without
    reporting, or when ranks are still running at the deadline; the other
    ranks are killed first. Every rank process is reaped whatever happens.
    """
    context = _process_context()
    with tempfile.TemporaryDirectory(prefix="sparsekv-tp-") as scratch:
        init_file = os.path.join(scratch, "store")
        ranks, reports = [], []
        try:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(target=_rank_main, daemon=True,
                                          args=(rank, world_size, init_file, backend, timeout_s, threads_per_rank,
                                                worker, args, writer))
                process.start()
                writer.close()  # the rank holds the only writer: its exit reads as end of file here
                ranks.append(process)
                reports.append(reader)
            return _collect(reports, time.monotonic() + timeout_s)
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
            for process in ranks:
                process.join()
            for reader in reports:
                reader.close()


def _process_context():
    """Fork server where the platform has one, else spawn.

    Ranks fork from a server that imported torch and sparsekv once and started
    no threads, instead of importing them each (seconds per rank). The server
    also preloads ``torch._dynamo``, which torch imports on the first call of
    a custom op that goes through the dispatcher.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", __name__])
    return context


ERROR_GRACE_S = 0.5  # after a rank's error, how long to wait for the errors it causes elsewhere


def _collect(reports: Sequence[Connection], deadline: float) -> list:
    payloads: dict[int, object] = {}
    errors: list[tuple[float, int, str]] = []  # (time raised, rank, traceback)
    errors_deadline = deadline
    pending = dict(enumerate(reports))
    while pending:
        now = time.monotonic()
        if errors and now > errors_deadline:
            break
        if now > deadline:
            raise RankError(min(pending), f"ranks {sorted(pending)} did not finish before the deadline")
        limit = (errors_deadline if errors else deadline) - now
        for reader in wait(list(pending.values()), timeout=min(limit, 1.0)):
            rank = next(r for r, conn in pending.items() if conn is reader)
            del pending[rank]
            try:
                ok, stamp, payload = reader.recv()
            except EOFError:  # its death time is unknown; ranks' errors follow a death, not the reverse
                ok, stamp, payload = False, float("-inf"), "exited without reporting (killed, or crashed)"
            if ok:
                payloads[rank] = payload
                continue
            if not errors:
                errors_deadline = time.monotonic() + ERROR_GRACE_S
            errors.append((stamp, rank, payload))
    if errors:
        stamp, rank, text = min(errors)
        others = [r for _, r, _ in sorted(errors) if r != rank]
        also = f" (ranks {others} failed after it)" if others else ""
        raise RankError(rank, f"rank {rank} failed{also}:\n{text}")
    return [payloads[rank] for rank in range(len(reports))]


def record_bytes(record: object) -> bytes:
    """``torch.save`` of a record into bytes (sent between processes by value, not by shared memory)."""
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def record_from_bytes(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------------------
# the workload
# ---------------------------------------------------------------------------
@dataclass
class TPCheckOptions:
    """What :func:`run_tp_check` runs: a QSA slice, a page pool and a prefix-sharing workload."""

    tp: int = 2
    config: Qwen4ExpConfig = field(default_factory=lambda: replace(DEFAULT_QWEN, indexer_budget=32))
    vocab: int = 512
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    page_size: int = 8
    num_pages: int = 64
    requests: int = 3
    prompt_tokens: int = 45
    shared_tokens: int = 24  # leading tokens every prompt shares (whole pages hit the prefix cache)
    decode_tokens: int = 4
    seed: int = 0
    timeout_s: float = 120.0
    threads_per_rank: int | None = None


def _prompts(options: TPCheckOptions) -> list[list[int]]:
    generator = torch.Generator().manual_seed(options.seed + 101)
    shared = torch.randint(0, options.vocab, (options.shared_tokens,), generator=generator).tolist()
    rest = options.prompt_tokens - options.shared_tokens
    return [shared + torch.randint(0, options.vocab, (rest,), generator=generator).tolist()
            for _ in range(options.requests + 1)]  # the last one arrives after request 0 left


def cache_groups(model: Qwen4ExpSlice, dtype: torch.dtype, page_size: int) -> list[CacheGroupSpec]:
    """The slice's cache groups on this rank: the main cache holds this rank's KV heads, the indexer's (and its
    block keys, ``"index_blocks"``, where the indexer's ratio divides ``page_size``) are replicated."""
    return qsa_cache_groups(model.config, dtype, page_size, num_kv_heads=model.attentions[0].num_kv_heads,
                            indexer="index")


def serve(model: Qwen4ExpSlice, options: TPCheckOptions) -> dict:
    """Serve the workload; returns the record the ranks are compared by (CPU tensors and ints).

    Request 0 prefills alone; the others then claim the shared prefix
    (prefix-cache hits) and prefill together; all decode ``decode_tokens``
    steps; request 0 is released and a new request with the same prefix
    claims its cached pages and prefills.
    """
    device = torch.device(options.device)
    manager = PagedKVCacheManager(cache_groups(model, options.dtype, options.page_size), page_size=options.page_size,
                                  num_pages=options.num_pages, device=device)
    timer = StageTimer(device)
    prompts = _prompts(options)
    decode = torch.randint(0, options.vocab, (options.decode_tokens, options.requests),
                           generator=torch.Generator().manual_seed(options.seed + 202)).tolist()
    record: dict = {"hits": [], "tables": [], "outputs": [], "selections": []}
    state: dict[str, int] = {}  # request id -> index of its prompt

    def claim(rid: str, prompt_index: int) -> None:
        state[rid] = prompt_index
        record["hits"].append((rid, manager.claim(rid, prompts[prompt_index])))

    def step(plan: list[tuple[str, list[int]]]) -> None:
        for rid, tokens in plan:
            manager.allocate(rid, len(tokens))
        batch = manager.prepare([rid for rid, _ in plan], [len(tokens) for _, tokens in plan])
        token_ids = torch.tensor([t for _, tokens in plan for t in tokens], device=device)
        with torch.no_grad():
            hidden, results = model(token_ids, input_row_offsets=batch.input_row_offsets,
                                    kv_cache=batch.collection("main"), index_cache=batch.collection("index"),
                                    timer=timer, block_cache=batch.collection("index_blocks")
                                    if "index_blocks" in batch.groups else None)
        record["outputs"].append(hidden.float().cpu())
        record["selections"].append([(r.indices.cpu(), r.counts.cpu()) for r in results])
        record["tables"].append((batch.lookup_table.cpu(), batch.cache_lengths.cpu()))
        for rid, tokens in plan:
            manager.step(rid, tokens)

    def prefill(rids: list[str]) -> None:
        step([(rid, prompts[state[rid]][manager.cache_length(rid):]) for rid in rids])

    started = time.perf_counter()
    claim("r0", 0)
    prefill(["r0"])
    others = [f"r{i}" for i in range(1, options.requests)]
    for rid in others:
        claim(rid, int(rid[1:]))
    prefill(others)
    live = ["r0", *others]
    for tokens in decode:
        step([(rid, [token]) for rid, token in zip(live, tokens)])
    manager.release("r0")
    claim("late", options.requests)
    prefill(["late"])
    manager.check_invariants()
    metrics = manager.metrics()
    attention = model.attentions[0].tensor_parallel
    record.update(
        seconds=time.perf_counter() - started,
        prefix_hit_tokens=metrics.prefix_hit_tokens,
        prefix_query_tokens=metrics.prefix_query_tokens,
        kv_bytes={spec.name: manager.blocks(spec.name).numel() * manager.blocks(spec.name).element_size()
                  for spec in manager.groups},
        stage_seconds=dict(timer.totals),
        all_reduce_calls=sum(a.tensor_parallel.all_reduce_calls for a in model.attentions),
        all_reduce_bytes=sum(a.tensor_parallel.all_reduce_bytes for a in model.attentions),
        rank=attention.rank,
        world_size=attention.world_size,
    )
    return record


def _tp_rank(process_group: dist.ProcessGroup, runs: list[tuple[str, TPCheckOptions]]) -> list[bytes]:
    """One rank: per run, load this rank's slices of the checkpoint, serve, return the record as bytes."""
    records = []
    for checkpoint, options in runs:
        config, reader = open_checkpoint(checkpoint)
        model = Qwen4ExpSlice(config, options.vocab, dtype=options.dtype, device=options.device,
                              process_group=process_group)
        load_tensor_parallel_weights(model, reader)
        record = serve(model, options)
        model.attentions[0].tensor_parallel.check_identical(
            "page tables and prefix hits", (record["hits"], [table.tolist() for table, _ in record["tables"]]))
        records.append(record_bytes(record))
    return records


def check_tp_options(options: TPCheckOptions) -> None:
    """Raise ``ValueError`` unless ``options.tp`` ranks can run: the heads split over them, one CUDA device each."""
    if not isinstance(options.tp, int) or options.tp < 1:
        raise ValueError(f"tp: expected a number of ranks >= 1, got {options.tp!r}")
    kv_head_range(options.config.num_key_value_heads, options.config.num_attention_heads, 0, options.tp)
    if torch.device(options.device).type == "cuda" and options.tp > (devices := torch.cuda.device_count()):
        raise ValueError(f"tp: {options.tp} ranks over NCCL need one CUDA device each, found {devices}")


def tp_records(runs: Sequence[TPCheckOptions]) -> list[tuple[dict, list[dict]]]:
    """Per run, ``(single-process record, [record of each rank])`` of the workload (see :func:`serve`).

    Every run must share ``tp``, ``device``, ``timeout_s`` and
    ``threads_per_rank``: one launch of ``tp`` processes serves them all.
    Raises ``ValueError`` before any process starts when the heads do not
    split over ``tp`` or a CUDA run has fewer devices than ranks.
    """
    first = runs[0]
    for options in runs[1:]:
        if (options.tp, options.device, options.timeout_s, options.threads_per_rank) != (
                first.tp, first.device, first.timeout_s, first.threads_per_rank):
            raise ValueError("runs: expected the same tp, device, timeout_s and threads_per_rank in every run")
    for options in runs:
        check_tp_options(options)
    references = []
    with tempfile.TemporaryDirectory(prefix="sparsekv-tp-ckpt-") as scratch:
        checkpoints = []
        for index, options in enumerate(runs):
            single = Qwen4ExpSlice(options.config, options.vocab, dtype=options.dtype, device=options.device)
            seed_parameters(single, options.seed)
            checkpoint = os.path.join(scratch, f"run{index}")
            save_checkpoint(checkpoint, options.config, slice_state(single))
            checkpoints.append(checkpoint)
            references.append(serve(single, options))
        backend = "nccl" if torch.device(first.device).type == "cuda" else "gloo"
        payloads = launch(_tp_rank, first.tp, list(zip(checkpoints, runs)), backend=backend,
                          timeout_s=first.timeout_s, threads_per_rank=first.threads_per_rank)
    return [(reference, [record_from_bytes(payload[index]) for payload in payloads])
            for index, reference in enumerate(references)]


def compare_records(reference: dict, ranks: Sequence[dict], *, rtol: float = 1e-4, atol: float = 1e-5) -> dict:
    """Which of the sharded-equals-single checks hold: ``{check name: bool}`` plus ``max_abs_diff``."""
    def same_selections(a: dict, b: dict) -> bool:
        return all(torch.equal(ia, ib) and torch.equal(ca, cb)
                   for step_a, step_b in zip(a["selections"], b["selections"], strict=True)
                   for (ia, ca), (ib, cb) in zip(step_a, step_b, strict=True))

    def same_tables(a: dict, b: dict) -> bool:
        return all(torch.equal(ta, tb) and torch.equal(la, lb)
                   for (ta, la), (tb, lb) in zip(a["tables"], b["tables"], strict=True))

    diffs = [float((rank_out - ref_out).abs().max())
             for record in ranks for rank_out, ref_out in zip(record["outputs"], reference["outputs"], strict=True)]
    close = all(torch.allclose(rank_out, ref_out, rtol=rtol, atol=atol)
                for record in ranks for rank_out, ref_out in zip(record["outputs"], reference["outputs"]))
    return {
        "outputs equal the single-process run": close,
        "selections equal on every rank and to the single-process run": all(
            same_selections(record, reference) for record in ranks),
        "page tables equal on every rank and to the single-process run": all(
            same_tables(record, reference) for record in ranks),
        "prefix-cache hits equal on every rank and to the single-process run": all(
            record["hits"] == reference["hits"] and record["prefix_hit_tokens"] == reference["prefix_hit_tokens"]
            for record in ranks),
        "max_abs_diff": max(diffs),
    }


def run_tp_check(options: TPCheckOptions | None = None) -> dict:
    """Serve the workload single-process and on ``options.tp`` ranks; the report dict (:func:`summarize`)."""
    options = options or TPCheckOptions()
    [(reference, ranks)] = tp_records([options])
    return summarize(options, reference, ranks)


def summarize(options: TPCheckOptions, reference: dict, ranks: Sequence[dict]) -> dict:
    """The JSON-ready report of one run (:func:`tp_records`).

    Keys: ``tp``, ``backend``, ``kv_bytes_per_rank`` / ``kv_bytes_single``
    (``{group: bytes}``: the main cache shrinks by the KV heads a rank holds,
    the indexer cache is replicated), ``all_reduce_seconds`` (per rank, stage
    timer), ``all_reduce_calls`` / ``all_reduce_bytes`` (per rank),
    ``seconds`` (single, per rank), ``max_abs_diff``, ``checks``
    (``{name: bool}``) and ``passed``.
    """
    checks = compare_records(reference, ranks)
    max_abs_diff = checks.pop("max_abs_diff")
    return {
        "tp": options.tp,
        "backend": "nccl" if torch.device(options.device).type == "cuda" else "gloo",
        "kv_bytes_per_rank": ranks[0]["kv_bytes"],
        "kv_bytes_single": reference["kv_bytes"],
        "all_reduce_seconds": [r["stage_seconds"].get("tp.all_reduce", 0.0) for r in ranks],
        "all_reduce_calls": ranks[0]["all_reduce_calls"],
        "all_reduce_bytes": ranks[0]["all_reduce_bytes"],
        "seconds": {"single": reference["seconds"], "ranks": [r["seconds"] for r in ranks]},
        "max_abs_diff": max_abs_diff,
        "checks": checks,
        "passed": all(checks.values()),
    }


def format_tp_report(result: dict) -> str:
    """The text lines of a :func:`run_tp_check` result, for the demo report.

    Example::

        tensor parallel: tp=2 over gloo: passed (max |sharded - single| 9.5e-07)
          KV bytes per rank: main 2.0 MiB (single process 4.0 MiB), index 512.0 KiB (replicated)
          all-reduce: 14 calls, 240.0 KiB per rank; 0.297 s / 0.393 s (rank 0 / rank 1)
    """
    def size(count: int) -> str:
        return f"{count / 2 ** 20:.1f} MiB" if count >= 2 ** 20 else f"{count / 2 ** 10:.1f} KiB"

    single = result["kv_bytes_single"]
    groups = ", ".join(f"{name} {size(count)}" + (" (replicated)" if count == single[name]
                                                   else f" (single process {size(single[name])})")
                       for name, count in result["kv_bytes_per_rank"].items())
    seconds = " / ".join(f"{s:.3f} s" for s in result["all_reduce_seconds"])
    ranks = " / ".join(f"rank {r}" for r in range(len(result["all_reduce_seconds"])))
    lines = [f"tensor parallel: tp={result['tp']} over {result['backend']}: "
             f"{'passed' if result['passed'] else 'FAILED'} (max |sharded - single| {result['max_abs_diff']:.2g})",
             f"  KV bytes per rank: {groups}",
             f"  all-reduce: {result['all_reduce_calls']} calls, {size(result['all_reduce_bytes'])} per rank; "
             f"{seconds} ({ranks})"]
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in result["checks"].items()]
    return "\n".join(lines)


__all__ = ["RankError", "TPCheckOptions", "cache_groups", "check_tp_options", "compare_records", "format_tp_report",
           "launch", "record_bytes", "record_from_bytes", "run_tp_check", "serve", "summarize", "tp_records"]
