"""Sparse MLA attention benchmark cases at GLM-5 shapes: decode over a 2048-token selection.

Latent cache: one head of ``kv_lora_rank + qk_rope_head_dim = 512 + 64``
channels, page size 128, pages scattered through a pool as the cache manager
allocates them; one sequence with ``cached`` tokens and one new token, whose
query row selects 2048 distinct positions (the DSA indexer's ``topk``).

Every row times the public op (``SPARSEKV_BACKEND=auto``: the CPU path) and,
in the same run, its peers: the same op on one thread (``1thread``), the
reference backend (``reference``), dense
absorbed MLA over the whole history in torch's fastest forms on a contiguous
copy of the latent rows (``dense``: ``softmax(q_lat @ latent.T * scale) @
latent[:, :512]`` in the cache dtype; ``sdpa``: the same through
``scaled_dot_product_attention``), and the same multiply-adds at the register
tile's peak (``peak``, :mod:`.peak`; its column is the fraction of the peak
reached).

``best_of``: on a busy machine the medians carry the other work's noise;
the fastest of ``n`` back-to-back calls of ours, the reference and the peak
peer is the least disturbed figure of each.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..cache.layout import PagedKVCacheCollection
from ..ops.mla import mla_sparse_attention_paged
from .common import (DTYPE_NAMES, PAGE_SIZE, BenchRow, backend, one_thread, random_paged_blocks, threads_check,
                     time_against_peers)
from .peak import tile_peak_peer

KV_LORA_RANK, ROPE_DIM, TOPK = 512, 64, 2048
LATENT_DIM = KV_LORA_RANK + ROPE_DIM
QK_HEAD_DIM = 192  # qk_nope_head_dim 128 + qk_rope_head_dim 64: the softmax scale's head dim


def _decode_case(cached: int, heads: int, dtype: torch.dtype):
    """One decode row over ``TOPK`` of its ``cached + 1`` tokens (the new token among them): returns
    ``(call, peers, nbytes, shape)``; ``peers`` maps names to calls (see the module docstring)."""
    generator = torch.Generator().manual_seed(heads + cached)
    total = cached + 1
    blocks, table = random_paged_blocks(1, total, 1, 1, LATENT_DIM, dtype, generator)
    cache = PagedKVCacheCollection(blocks, torch.tensor([cached], dtype=torch.int32), table,
                                   max_seq_length=1, max_cache_length=cached)
    q = torch.randn(1, heads, LATENT_DIM, generator=generator).to(dtype)
    chosen = torch.randperm(cached, generator=generator)[: TOPK - 1].sort().values
    indices = torch.cat([chosen, torch.tensor([cached])]).to(torch.int32)[None]
    counts = torch.tensor([TOPK], dtype=torch.int32)
    offsets = torch.tensor([0, 1], dtype=torch.int32)
    scale = QK_HEAD_DIM ** -0.5
    out = torch.empty(1, heads, KV_LORA_RANK, dtype=dtype)

    def call():
        mla_sparse_attention_paged(q, cache, 0, indices, counts, offsets, scale=scale, v_head_dim=KV_LORA_RANK,
                                   out=out)

    def reference():
        with backend("reference"):
            call()

    # the dense peers: every cached latent row, already contiguous (their best case)
    pages = table[0, : -(-total // PAGE_SIZE)].long()
    latent = blocks[pages, 0, 0, :, 0].reshape(-1, LATENT_DIM)[:total].contiguous()
    values = latent[:, :KV_LORA_RANK]
    q_lat = q[0]

    def dense():
        torch.softmax(q_lat @ latent.T * scale, dim=-1) @ values

    def sdpa():
        F.scaled_dot_product_attention(q_lat[None], latent[None], values[None], scale=scale)

    size = blocks.element_size()
    nbytes = TOPK * LATENT_DIM * size + q.numel() * size + out.numel() * size
    qk, pv = TOPK * heads * LATENT_DIM, TOPK * heads * KV_LORA_RANK  # P.V runs in float32
    peak = tile_peak_peer({dtype: qk, torch.float32: pv} if dtype == torch.bfloat16 else {torch.float32: qk + pv})
    peers = {"reference": reference, "dense": dense, "sdpa": sdpa, "peak": peak}
    return call, peers, nbytes, f"decode cached={cached} topk={TOPK} heads={heads} D=512+64"


def bench_decode(cached: int, heads: int, dtype: torch.dtype, check_threads: bool = False) -> BenchRow:
    """Our median time, the peers' and their paired ratios (:func:`.common.time_against_peers`);
    ``check_threads``: the ``1thread`` peer alone (:func:`.common.threads_check`)."""
    call, peers, nbytes, shape = _decode_case(cached, heads, dtype)
    if check_threads:
        ours, times, paired = threads_check(call)
        return BenchRow("mla_sparse_attention_paged", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes, times,
                        paired=paired)
    ours, times, paired = time_against_peers({"ours": call, "1thread": one_thread(call), **peers})
    return BenchRow("mla_sparse_attention_paged", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes, times,
                    paired=paired)


def best_of_decode(cached: int, heads: int, dtype: torch.dtype, calls: int) -> BenchRow:
    """The fastest of ``calls`` back-to-back calls of ours, the reference and the peak peer (no dense peers):
    on a machine that other work keeps busy, the fastest call is the one least disturbed."""
    call, peers, nbytes, shape = _decode_case(cached, heads, dtype)
    best = {}
    for name, fn in {"ours": call, "reference": peers["reference"], "peak": peers["peak"]}.items():
        fn()
        samples = []
        for _ in range(calls):
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e3)
        best[name] = min(samples)
    return BenchRow("mla_sparse_attention_paged", shape, DTYPE_NAMES[dtype], "cpu", best.pop("ours"), nbytes, best,
                    note=f"best of {calls}")


def run(quick: bool = False, best_of: int = 0, check_threads: bool = False) -> list[BenchRow]:
    """Decode rows at 32k and 128k cached tokens, 64 and 128 heads, bf16 and fp32; ``quick``: one small row.
    ``best_of > 0`` times each row with :func:`best_of_decode` instead; ``check_threads``: against the
    same op on one thread only."""
    shapes = [(4096, 16, torch.bfloat16)] if quick else [
        (cached, heads, dtype) for dtype in (torch.bfloat16, torch.float32) for cached in (32768, 131072)
        for heads in (64, 128)]
    if best_of > 0:
        return [best_of_decode(cached, heads, dtype, best_of) for cached, heads, dtype in shapes]
    return [bench_decode(cached, heads, dtype, check_threads) for cached, heads, dtype in shapes]
