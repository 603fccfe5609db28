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
"""

from __future__ import annotations

import itertools

import torch

from ..cache.manager import CacheGroupSpec, PagedKVCacheManager
from .common import BenchRow, time_call

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


def _decode_rows(batch: int, context: int, repeat: int) -> list[BenchRow]:
    steps = 2 + repeat  # time_call's warmup + timed calls, one token each
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

    peer = _DictOfListsPeer(batch * pages_per_request)
    for rid in ids:
        peer.add(rid, context)
    shape = f"B={batch} ctx={context} page={PAGE_SIZE}"
    ours = time_call(manager_step, repeat=repeat)
    peer_ms = time_call(lambda: peer.step(ids, 1), repeat=repeat)
    width = pages_per_request
    rows = [BenchRow("manager.decode_step", shape, "int32", "python", ours, _index_bytes(batch, width),
                     {"dict_lists": peer_ms},
                     f"{ours * 1e3 / batch:.2f} us/request (allocate+prepare+step, 1 token)")]
    prepare_ms = time_call(lambda: mgr.prepare(ids, 0), repeat=repeat)
    rows.append(BenchRow("manager.prepare", shape, "int32", "python", prepare_ms, _index_bytes(batch, width),
                         {"dict_lists": time_call(lambda: peer.step(ids, 0), repeat=repeat)},
                         f"{prepare_ms * 1e3 / batch:.2f} us/request (index inputs only)"))
    mgr.check_invariants()
    return rows


def _prefill_rows(batch: int, prompt_len: int, repeat: int) -> list[BenchRow]:
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
                      for _ in range(2 + repeat)])

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

        peer = _DictOfListsPeer(num_pages)

        def peer_prefill() -> None:
            ids = [f"p{i}" for i in range(batch)]
            for rid in ids:
                peer.add(rid, 0)
            peer.step(ids, prompt_len)
            for rid in ids:
                peer.drop(rid)

        ours = time_call(manager_prefill, repeat=repeat)
        peer_ms = time_call(peer_prefill, repeat=repeat)
        mgr.check_invariants()
        rows.append(BenchRow(f"manager.prefill_{label}", f"B={batch} prompt={prompt_len} page={PAGE_SIZE}", "int32",
                             "python", ours, _index_bytes(batch, pages_per_request), {"dict_lists": peer_ms},
                             f"{ours * 1e3 / batch:.1f} us/request (claim+allocate+prepare+step+release; "
                             f"hit rate {mgr.metrics().prefix_hit_rate:.2f})"))
    return rows


def run(quick: bool = False) -> list[BenchRow]:
    """Decode step of 256 requests (1024 cached tokens), prepare alone, and prefill lifecycles."""
    if quick:
        return _decode_rows(32, 64, repeat=3) + _prefill_rows(4, 64, repeat=3)
    return _decode_rows(256, 1024, repeat=20) + _prefill_rows(32, 2048, repeat=10)
