"""Host overhead of the paged KV cache manager per scheduler step.

A manager step moves no tensor bytes except the kernel index inputs it
builds, so ``bytes_moved`` counts the lookup table, offsets and cache lengths,
and the figure that matters, microseconds per request, is in the note.

Peer: a plain Python dict-of-lists page table (append a page when a request
crosses a page boundary, pad rows with -1, build the tensors) for the same
batch. It has no reference counts, prefix hashing or checks, so it is the
floor a manager's bookkeeping is measured against, not an equal.

The manager runs on the calling thread (Python bookkeeping and small index
tensors), so its rows have no ``1thread`` column: it would time the same thing.

The groups are tiny (one head of width 1): a step never touches the blocks,
so their size does not change the overhead, only the memory the run needs.

Peer ``max`` (only with a :class:`MaxManagerPeer`): Modular MAX's paged KV
cache manager on the same workload (page size, lengths, batch, token ids,
prefix-hit pattern), run by ``benchmarks/max_manager_peer.py --serve`` in MAX's
own environment. Its calls and ours alternate in rounds (ours twice, then
MAX's twice, the second call of each timed), and each side's time is the
median over the rounds; the peer times itself, so the pipe between the
processes is not counted.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..cache.manager import CacheGroupSpec, PagedKVCacheManager
from .common import BenchRow, time_call
from .remote import PeerProcess

PAGE_SIZE = 16
_GROUPS = (
    CacheGroupSpec("main", kv_planes=2, num_layers=1, num_heads=1, head_size=1, dtype=torch.bfloat16),
    CacheGroupSpec("indexer", kv_planes=1, num_layers=1, num_heads=1, head_size=1, dtype=torch.bfloat16),
)


def _index_bytes(batch: int, width: int) -> int:
    """int32 lookup table + offsets + cache lengths."""
    return 4 * (batch * width + (batch + 1) + batch)


class _DictOfListsPeer:
    """The simplest page table: ``{request: [page ids]}`` plus a free list."""

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def add(self, rid: str, tokens: int) -> None:
        self.tables[rid] = [self.free.pop() for _ in range(-(-tokens // PAGE_SIZE))]
        self.lengths[rid] = tokens

    def drop(self, rid: str) -> None:
        self.free.extend(self.tables.pop(rid))
        del self.lengths[rid]

    def step(self, ids: list[str], new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for rid in ids:
            need = -(-(self.lengths[rid] + new) // PAGE_SIZE) - len(self.tables[rid])
            self.tables[rid].extend(self.free.pop() for _ in range(need))
        width = max(len(self.tables[rid]) for rid in ids)
        table = torch.tensor([self.tables[r] + [-1] * (width - len(self.tables[r])) for r in ids], dtype=torch.int32)
        lengths = torch.tensor([self.lengths[r] for r in ids], dtype=torch.int32)
        offsets = torch.arange(0, new * len(ids) + 1, max(new, 1), dtype=torch.int32)
        for rid in ids:
            self.lengths[rid] += new
        return table, lengths, offsets


def peer_request_line(case: str, batch: int, length: int, calls: int, capacity: int = 64) -> str:
    """One request of the MAX manager peer's ``--serve`` protocol (a JSON line, no newline)."""
    return json.dumps({"case": case, "batch": batch, "length": length, "calls": calls, "capacity": capacity})


def parse_peer_response(line: str) -> dict:
    """The peer's answer to a request as a dict; ``RuntimeError`` with the peer's message for an error
    answer or anything that is not a JSON object with a ``case``."""
    try:
        answer = json.loads(line)
    except json.JSONDecodeError:
        raise RuntimeError(f"MAX manager peer: expected a JSON line, got {line.strip()!r:.200}") from None
    if not isinstance(answer, dict) or ("error" not in answer and "case" not in answer):
        raise RuntimeError(f"MAX manager peer: unexpected answer {line.strip()!r:.200}")
    if "error" in answer:
        raise RuntimeError(f"MAX manager peer failed: {answer['error']}")
    return answer


class MaxManagerPeer:
    """``max_manager_peer.py --serve`` running under another Python (MAX's environment), driven over pipes.

    Args:
        python: the interpreter of the environment MAX is installed in.
        script: path of ``benchmarks/max_manager_peer.py``.
        start_timeout_s: how long to wait for its first line (MAX imported, ``info`` below).
        call_timeout_s: how long to wait for the answer to one request.
        grace_s: how long :meth:`close` waits for it to exit at the end of its stdin before killing it.

    ``info`` is the peer's first answer (MAX's version, page hash, page size). A peer that exits,
    stops answering or answers an error or something unreadable raises
    :class:`.remote.RemotePeerError` (a ``RuntimeError``) quoting the end of its stderr.
    """

    def __init__(self, python: str | Path, script: str | Path, *, start_timeout_s: float = 900.0,
                 call_timeout_s: float = 300.0, grace_s: float = 30.0) -> None:
        self.call_timeout_s = call_timeout_s
        self.process = PeerProcess([str(python), str(script), "--serve"], name="MAX manager peer", grace_s=grace_s)
        self.info = self.process.handshake(parse_peer_response, start_timeout_s)

    def time(self, case: str, batch: int, length: int, calls: int, capacity: int = 64) -> dict:
        """``calls`` timed calls of ``case``; the answer's ``ms`` lists each call's milliseconds."""
        return self.process.exchange(peer_request_line(case, batch, length, calls, capacity) + "\n",
                                     parse_peer_response, self.call_timeout_s, f"a {case} request")

    def close(self) -> None:
        """End the peer's process (idempotent)."""
        self.process.close()

    def __enter__(self) -> MaxManagerPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alternate(ours: Callable[[], object], peer: MaxManagerPeer, case: str, batch: int, length: int,
               repeat: int, capacity: int = 64) -> tuple[float, float, str]:
    """Median ms of ``ours`` and of the peer's ``case`` over ``repeat`` rounds (after one untimed round).

    A round runs ours twice, then the peer's twice, and keeps the second call
    of each: the first brings that side's data back into the CPU caches the
    other process just used. Returns both medians and a note with both sides'
    fastest calls (on a busy machine, the closest to an idle CPU) and MAX's
    prefix hit rate.
    """
    our_ms: list[float] = []
    peer_ms: list[float] = []
    for _ in range(repeat + 1):
        ours()
        started = time.perf_counter()
        ours()
        our_ms.append((time.perf_counter() - started) * 1e3)
        answer = peer.time(case, batch, length, 2, capacity)
        peer_ms.append(answer["ms"][-1])
    our_ms, peer_ms = our_ms[1:], peer_ms[1:]
    note = (f"; fastest calls ms: ours {min(our_ms):.3f}, MAX {min(peer_ms):.3f}"
            + (f"; MAX hit rate {answer['hit_rate']:.2f}" if case.startswith("prefill") else ""))
    return statistics.median(our_ms), statistics.median(peer_ms), note


def _decode_rows(batch: int, context: int, repeat: int, peer: MaxManagerPeer | None = None) -> list[BenchRow]:
    steps = 2 + repeat if peer is None else 2 * (repeat + 1)  # warm-up + timed calls, one token each
    pages_per_request = -(-(context + steps) // PAGE_SIZE)
    mgr = PagedKVCacheManager(_GROUPS, page_size=PAGE_SIZE, num_pages=batch * pages_per_request)
    ids = [f"r{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [(i * 7919 + t) % 50_000 for t in range(context)]
        mgr.claim(rid, prompt)
        mgr.allocate(rid, context)
        mgr.step(rid, prompt)
    next_token = [[t % 50_000] for t in range(batch)]

    def manager_step() -> None:
        for rid in ids:
            mgr.allocate(rid, 1)
        mgr.prepare(ids, 1)
        for rid, token in zip(ids, next_token):
            mgr.step(rid, token)

    table = _DictOfListsPeer(batch * pages_per_request)
    for rid in ids:
        table.add(rid, context)
    shape = f"B={batch} ctx={context} page={PAGE_SIZE}"
    peers: dict[str, float] = {}
    max_note = ""
    if peer is None:
        ours = time_call(manager_step, repeat=repeat)
    else:
        ours, peers["max"], max_note = _alternate(manager_step, peer, "decode", batch, context, repeat,
                                                  capacity=steps)
    width = pages_per_request
    rows = [BenchRow("manager.decode_step", shape, "int32", "python", ours, _index_bytes(batch, width),
                     {"dict_lists": time_call(lambda: table.step(ids, 1), repeat=repeat), **peers},
                     f"{ours * 1e3 / batch:.2f} us/request (allocate+prepare+step, 1 token){max_note}")]
    peers = {}
    if peer is None:
        prepare_ms = time_call(lambda: mgr.prepare(ids, 0), repeat=repeat)
    else:
        prepare_ms, peers["max"], max_note = _alternate(lambda: mgr.prepare(ids, 0), peer, "prepare", batch,
                                                        context, repeat, capacity=steps)
    rows.append(BenchRow("manager.prepare", shape, "int32", "python", prepare_ms, _index_bytes(batch, width),
                         {"dict_lists": time_call(lambda: table.step(ids, 0), repeat=repeat), **peers},
                         f"{prepare_ms * 1e3 / batch:.2f} us/request (index inputs only){max_note}"))
    mgr.check_invariants()
    return rows


def _prefill_rows(batch: int, prompt_len: int, repeat: int, peer: MaxManagerPeer | None = None) -> list[BenchRow]:
    """A whole request life per call: claim + allocate + prepare + step(prompt) + release."""
    pages_per_request = -(-prompt_len // PAGE_SIZE)
    num_pages = 2 * batch * pages_per_request
    counter = itertools.count()
    rows = []
    for label, reuse in (("miss", False), ("hit", True)):
        mgr = PagedKVCacheManager(_GROUPS, page_size=PAGE_SIZE, num_pages=num_pages)
        shared = [[(i * 104_729 + t) % 50_000 for t in range(prompt_len)] for i in range(batch)]
        # fresh prompts for every call when measuring misses (built before timing)
        fresh = iter([[[(next(counter) * 31 + t) % 50_000 for t in range(prompt_len)] for _ in range(batch)]
                      for _ in range(2 + repeat if peer is None else 2 * (repeat + 1))])

        def manager_prefill() -> None:
            prompts = shared if reuse else next(fresh)
            ids = [f"p{i}" for i in range(batch)]
            hits = [mgr.claim(rid, prompt) for rid, prompt in zip(ids, prompts)]
            new = [prompt_len - hit for hit in hits]
            for rid, n in zip(ids, new):
                mgr.allocate(rid, n)
            mgr.prepare(ids, new)
            for rid, prompt, hit in zip(ids, prompts, hits):
                mgr.step(rid, prompt[hit:])
            for rid in ids:
                mgr.release(rid)

        table = _DictOfListsPeer(num_pages)

        def table_prefill() -> None:
            ids = [f"p{i}" for i in range(batch)]
            for rid in ids:
                table.add(rid, 0)
            table.step(ids, prompt_len)
            for rid in ids:
                table.drop(rid)

        peers: dict[str, float] = {}
        max_note = ""
        if peer is None:
            ours = time_call(manager_prefill, repeat=repeat)
        else:
            ours, peers["max"], max_note = _alternate(manager_prefill, peer, f"prefill_{label}", batch,
                                                      prompt_len, repeat)
        peers = {"dict_lists": time_call(table_prefill, repeat=repeat), **peers}
        mgr.check_invariants()
        rows.append(BenchRow(f"manager.prefill_{label}", f"B={batch} prompt={prompt_len} page={PAGE_SIZE}", "int32",
                             "python", ours, _index_bytes(batch, pages_per_request), peers,
                             f"{ours * 1e3 / batch:.1f} us/request (claim+allocate+prepare+step+release; "
                             f"hit rate {mgr.metrics().prefix_hit_rate:.2f}){max_note}"))
    return rows


def run(quick: bool = False, max_peer: MaxManagerPeer | None = None) -> list[BenchRow]:
    """Decode step of 256 requests (1024 cached tokens), prepare alone, and prefill lifecycles; with
    ``max_peer``, a ``max`` column timed in alternation with ours."""
    if quick:
        return _decode_rows(32, 64, 3, max_peer) + _prefill_rows(4, 64, 3, max_peer)
    return _decode_rows(256, 1024, 20, max_peer) + _prefill_rows(32, 2048, 10, max_peer)
