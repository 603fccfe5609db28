"""Paged store/load throughput against a same-run torch copy of the same bytes and the op on one thread.

The store row times the op ``sparsekv.paged_store`` (what the layers call; the
CPU backend here) and, as its ``reference`` peer, the storage's own
``PagedKVCache.store`` (vectorised torch, the reference kernel's code); the
load row times ``PagedKVCache.load``.
"""

from __future__ import annotations

import torch

from ..cache.layout import SENTINEL, PagedKVCacheCollection
from ..ops.cache import paged_store
from .common import DTYPE_NAMES, BenchRow, copy_peer, one_thread, time_call


def _collection(batch: int, tokens: int, cached: int, dtype: torch.dtype, *, page_size=128, heads=2,
                head_size=256, device="cpu") -> PagedKVCacheCollection:
    pages_per_seq = -(-(cached + tokens) // page_size)
    num_pages = batch * pages_per_seq + 1
    blocks = torch.zeros(num_pages, 2, 1, page_size, heads, head_size, dtype=dtype, device=device)
    table = torch.randperm(num_pages - 1)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    table = torch.cat([table, torch.full((batch, 1), SENTINEL)], dim=1).to(torch.int32)
    lengths = torch.full((batch,), cached, dtype=torch.int32)
    return PagedKVCacheCollection(blocks, lengths, table, max_seq_length=tokens, max_cache_length=cached)


def run(quick: bool = False) -> list[BenchRow]:
    """Store a prefill chunk and load whole histories (main KV: 2 heads x 256, page 128)."""
    batch = 4
    cases = [(512, 0)] if quick else [(2048, 0), (2048, 6144)]
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float32]
    rows: list[BenchRow] = []
    for dtype in dtypes:
        for tokens, cached in cases:
            coll = _collection(batch, tokens, cached, dtype)
            view = coll.get_key_cache(0)
            values = torch.randn(batch * tokens, 2, 256).to(dtype)
            offsets = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
            nbytes = values.numel() * values.element_size()
            shape = f"B={batch} new={tokens} cached={cached} 2x256 page=128"
            def store():
                paged_store(coll, values, offsets, layer_idx=0, plane=0)

            ours = time_call(store, repeat=5)
            single = time_call(one_thread(store), repeat=5)
            storage = time_call(lambda: view.store(values, offsets), repeat=5)
            peer = time_call(copy_peer(nbytes), repeat=5)
            rows.append(BenchRow("paged_store", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes,
                                 {"1thread": single, "reference": storage, "copy": peer}))
            positions = torch.arange(cached + tokens)
            view.store(values, offsets)
            load_bytes = batch * (cached + tokens) * 2 * 256 * values.element_size()
            def load():
                return [view.load(b, positions) for b in range(batch)]

            ours = time_call(load, repeat=5)
            single = time_call(one_thread(load), repeat=5)
            peer = time_call(copy_peer(load_bytes), repeat=5)
            rows.append(BenchRow("paged_load", f"B={batch} tokens={cached + tokens} 2x256 page=128",
                                 DTYPE_NAMES[dtype], "cpu", ours, load_bytes, {"1thread": single, "copy": peer}))
    return rows
