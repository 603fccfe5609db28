"""k-pool indexer benchmarks at GLM-5.3 shapes: compress and decode pool score.

Shapes: ``D = 128``, ``kpool = 4``, 32 index heads, ``topk = 2048``; ``B = 4``
requests of 8192 and 32768 tokens; bf16 and fp32. Peers measured in the same
run: our op on one thread (``x1thread``: above 1 when the threads help), the
reference kernel (``xreference``: how many times faster the fast path is), a
torch copy of the same bytes (``xcopy``: our GB/s over the copy's) and, for
score, a read of the same pooled keys where they lie in the pages
(:mod:`.page_read`) and the same multiply-adds at the register
tile's peak (``xpeak``: the fraction of the peak reached, :mod:`.peak`;
``xroof``: of the longer of the two, :meth:`.common.BenchRow.ratios`).

* compress: one prefill call per request (cache empty), mode softmax, through
  the public op. Bytes: ``k`` and ``gate`` read once, pooled keys written.
* score: decode rows (one query per request at its last position) over all
  its visible pools, pooled keys read through a paged cache of 64-token pages
  (16 pools per page, scattered). Bytes: pooled keys, ``q`` and head weights
  read, scores written. Ours is a layer's call as a model makes it, the
  step's plan made once for every indexer layer (``plan_kpool_score``, then
  ``KPoolScorePlan.run``); ``xop`` is the one-shot ``mla_kpool_score``
  (plan and run in each call) against it, and the note gives the plan's own
  time. The last row scores 16 layers' pages one layer a call, as a model's
  step does, so that each call's keys come from memory (against a read of
  that layer's pages, the peak and one thread); the others repeat one
  layer, whose keys stay in the last-level cache.
"""

from __future__ import annotations

import torch

from ..cache.memory import allocate_pages
from ..cache.pooled import make_pooled_collection
from ..kernels.reference import kpool as reference
from ..ops.kpool import kpool_pool_row_offsets, mla_kpool_compress, mla_kpool_score, plan_kpool_score
from .common import (DTYPE_NAMES, BenchRow, copy_peer, layer_turns, one_thread, threads_check,
                     time_against_peers, time_interleaved, time_layers_in_turn)
from .page_read import page_read_peer
from .peak import tile_peak_peer

HEAD_DIM, KPOOL, INDEX_HEADS, TOPK, PAGE_SIZE = 128, 4, 32, 2048, 64
MODEL_LAYERS = 16
"""Layers of the decode-score row scored one after another (134 MB of bf16 pages at 32k tokens, past the
last-level cache): each call's keys come from memory, as in a model's step."""


def _agreement(ours: torch.Tensor, reference: torch.Tensor) -> str:
    """How far ``ours`` is from ``reference``: ulps and equal share for 16-bit floats, else relative error."""
    if ours.dtype in (torch.bfloat16, torch.float16):
        bits = [t.view(torch.int16).to(torch.int32) for t in (ours, reference)]
        ordered = [torch.where(b < 0, -(b & 0x7FFF), b) for b in bits]
        ulps = (ordered[0] - ordered[1]).abs()
        return f"max {int(ulps.max())} ulp, {float((ulps == 0).float().mean()):.4%} equal"
    err = (ours - reference).abs().max() / reference.abs().max().clamp_min(1e-30)
    return f"max error {float(err):.1e} of max |value|"


def _compress_row(batch: int, tokens: int, dtype: torch.dtype, rounds: int, check_threads: bool) -> BenchRow:
    gen = torch.Generator().manual_seed(0)
    total = batch * tokens
    k = torch.randn(total, HEAD_DIM, generator=gen).to(dtype)
    gate = (2 * torch.randn(total, HEAD_DIM, generator=gen)).to(dtype)
    ape = torch.randn(KPOOL, HEAD_DIM, generator=gen)
    offsets = torch.arange(0, total + 1, tokens, dtype=torch.int32)
    cache = torch.zeros(batch, dtype=torch.int32)
    pool_offsets = kpool_pool_row_offsets(offsets, cache, kpool=KPOOL)
    out = torch.empty(int(pool_offsets[-1]), HEAD_DIM, dtype=dtype)
    ref_out = torch.empty_like(out)
    nbytes = 2 * k.numel() * k.element_size() + out.numel() * out.element_size()
    def ours():
        mla_kpool_compress(k, gate, ape, offsets, pool_offsets, cache, kpool=KPOOL, out=out)

    shape = f"B={batch} T={tokens} D={HEAD_DIM} kpool={KPOOL}"
    if check_threads:
        time_ms, peers, paired = threads_check(ours)
        return BenchRow("mla_kpool_compress", shape, DTYPE_NAMES[dtype], "cpu", time_ms, nbytes, peers, paired=paired)
    ours, times, paired = time_against_peers({
        "ours": ours,
        "1thread": one_thread(ours),
        "reference": lambda: reference.mla_kpool_compress(ref_out, k, gate, ape, offsets, pool_offsets, cache, KPOOL,
                                                          "softmax"),
        "copy": copy_peer(nbytes)}, rounds=rounds)
    agreement = _agreement(out, ref_out)
    return BenchRow("mla_kpool_compress", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes, times,
                    note=f"vs reference: {agreement}", paired=paired)


def _score_row(batch: int, tokens: int, dtype: torch.dtype, rounds: int, check_threads: bool,
               layers: int = 1) -> BenchRow:
    gen = torch.Generator().manual_seed(1)
    pools = tokens // KPOOL
    per_page = PAGE_SIZE // KPOOL
    pages_per_seq = -(-pools // per_page)
    num_pages = batch * pages_per_seq + 1
    shape = (num_pages, 1, layers, per_page, 1, HEAD_DIM)
    blocks = allocate_pages(shape, dtype, "cpu")  # as the cache manager allocates its pages
    blocks.copy_(torch.randn(shape, generator=gen))
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    cache = make_pooled_collection(blocks, torch.full((batch,), tokens), table.to(torch.int32), kpool=KPOOL)
    q = torch.randn(batch, INDEX_HEADS, HEAD_DIM, generator=gen).to(dtype)
    weights = torch.randn(batch, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5 * HEAD_DIM**-0.5
    positions = torch.full((batch,), tokens - 1, dtype=torch.int32)
    offsets = torch.arange(batch + 1, dtype=torch.int32)
    out = torch.empty(batch, pools)
    ref_out = torch.empty_like(out)
    elt = blocks.element_size()
    nbytes = batch * pools * HEAD_DIM * elt + q.numel() * elt + weights.numel() * 4 + out.numel() * 4
    plan = plan_kpool_score(cache, positions, offsets, kpool=KPOOL)
    turns = layer_turns(layers)

    def ours():
        plan.run(q, weights, next(turns), out=out)

    def one_shot():
        mla_kpool_score(q, weights, cache, 0, positions, offsets, kpool=KPOOL, out=out)

    shape_text = f"B={batch} decode t={tokens - 1} H={INDEX_HEADS} D={HEAD_DIM} plan.run"
    if layers > 1:
        shape_text += f" {layers} layers in turn"
    if check_threads:
        time_ms, peers, paired = threads_check(ours)
        return BenchRow("mla_kpool_score", shape_text, DTYPE_NAMES[dtype], "cpu", time_ms, nbytes, peers,
                        paired=paired)
    peak = tile_peak_peer({dtype: batch * pools * INDEX_HEADS * HEAD_DIM})
    read = page_read_peer(blocks, table, [pools] * batch, layers)  # the pools each row sees, where they lie
    if layers > 1:
        ours_ms, times, paired = time_layers_in_turn(ours, read, peak, rounds)
        return BenchRow("mla_kpool_score", shape_text, DTYPE_NAMES[dtype], "cpu", ours_ms, nbytes, times,
                        note=f"each call the next of {layers} layers ({blocks.numel() * elt / 1e6:.0f} MB of pages)",
                        paired=paired)
    planning_ms = time_interleaved({"plan": lambda: plan_kpool_score(cache, positions, offsets, kpool=KPOOL)},
                                   rounds=rounds)["plan"]
    ours_ms, times, paired = time_against_peers({
        "ours": ours,
        "1thread": one_thread(ours),
        "op": one_shot,
        "reference": lambda: reference.mla_kpool_score(ref_out, q, weights, blocks, cache.lookup_table, positions,
                                                       offsets, KPOOL, 0),
        "copy": copy_peer(nbytes),
        "read": read,
        "peak": peak}, rounds=rounds)
    err = float(((out - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-30)))
    return BenchRow("mla_kpool_score", shape_text, DTYPE_NAMES[dtype], "cpu", ours_ms, nbytes, times,
                    note=f"max rel err vs reference {err:.1e}; the plan {planning_ms * 1000:.0f} us once a step",
                    paired=paired)


def run(quick: bool = False, check_threads: bool = False) -> list[BenchRow]:
    """Compress and decode-score rows (quick: one small bf16 shape each); ``check_threads``: against the
    same op on one thread only (:func:`.common.threads_check`)."""
    batch = 4
    lengths = [1024] if quick else [8192, 32768]
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float32]
    rounds = 3 if quick else 9
    rows: list[BenchRow] = []
    for op in (_compress_row, _score_row):
        for dtype in dtypes:
            for tokens in lengths:
                rows.append(op(batch, tokens, dtype, rounds, check_threads))
    if not quick:  # a model's step: each layer's keys from memory
        rows.append(_score_row(batch, lengths[-1], torch.bfloat16, rounds, check_threads, layers=MODEL_LAYERS))
    return rows
