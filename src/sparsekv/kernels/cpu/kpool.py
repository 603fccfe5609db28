"""Fast CPU k-pool kernels (SPEC 3): numba for the pool math, vectorised torch for the rest.

Same functions and signatures as :mod:`sparsekv.kernels.reference.kpool` (the
contract). The pooled keys follow the reference's rounding points in its
order, but for ``exp``: modes mean and last agree with it bit for bit, mode
softmax within SPEC 4 (each weight within one float32 ulp of the reference's
correctly rounded one). Every schedule still gives bit-identical pooled keys:
each element goes through the same arithmetic wherever it sits in a call.

What each kernel is made of, and why (measured with ``benchmarks/bench_kpool.py``):

* compress / ring close, modes softmax and mean: one numba pass
  (``@njit(parallel=True, cache=True)``, ``prange`` over chunks of pools) that
  reads each member row once and writes the pooled key. At kpool 4 (the GLM
  shape) the softmax runs in a single loop over the channels with all four
  members in registers; other pool sizes go member by member through small
  float32 scratch rows. 16-bit members are widened and pooled keys rounded
  in the kernel, on their raw 16-bit patterns (numba has neither type;
  :mod:`._bits`: a 16-bit shift and integer rounding for bf16, the CPU's own
  conversions for fp16), exactly as torch casts (widening fp16 with torch
  first measured 3.5x slower).
* ``exp``: float32, fused multiply-adds (:func:`._math.exp_f32`: Cody-Waite
  reduction, a degree-7 polynomial fitted for relative error, ``2**n`` from
  its bits), at most one ulp from the correctly rounded value, 16 lanes per
  AVX-512 vector. The reference's float64 exp, vectorised the same way, made
  compress 2.5x slower; a libm call per element does not vectorise at all.
  ``error_model="numpy"`` keeps float division free of Python's zero check,
  which would otherwise stop vectorisation.
* threads: a parallel region costs a barrier, milliseconds on oversubscribed
  cores, so a call gets one thread per 1024 pools (at least one).
* mode last: a pure gather, already memory-bound in torch; the seed tail (a scatter of
  whole rows) is the reference's, which the op registry runs for the ops this module leaves out.
* score: one numba pass, one task per (sequence, chunk of 128 pools): the
  chunk's pooled keys are read in place, page by page, through the page table
  (bf16 as bits, no copy; the next page prefetched), by each group of the
  sequence's rows in register tiles (:mod:`._tile_ops`: every dot product the
  same chain in a fixed channel order; bf16 pairs through ``VDPBF16PS``), then
  relu and the head-weighted sum in head order, on the tiles in registers
  (:func:`._score_tasks.write_group_scores`; for GLM's 32 heads 0.51 -> 0.36 us
  per 128 pools against summing over the transposed dots).
  So a row's scores do not depend on the rows that share the call (BLAS
  does not promise that), and nothing is gathered into a copy first.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from ..reference.kpool import score_page_error
from ._bits import as_numba, copy_row, narrow, widen
from ._score_tasks import plan_score_tasks, row_group, score_task, write_group_scores
from ._tile_ir import KEYS_PER_TILE
from ._tile_ops import KEYS_PER_TASK, dots_of_rows, new_scratch, prefetch_span
from ._math import exp_f32
from ._pages import first_missing_page
from ._parallel import numba_threads, threads_for, worker_tasks

_MODE_SOFTMAX, _MODE_MEAN = 0, 1
_POOLS_PER_TASK = 64  # pools per prange task: enough work to amortise scheduling, small scratch
_POOLS_PER_THREAD = 1024  # below this many pools per thread a parallel region costs more than it saves

@numba.njit(inline="always", cache=True, error_model="numpy")
def _pool_one(kf, gf, ape, mode, logits, exps, denom, out):
    """One pool, per channel, float32: ``kf``/``gf`` ``[kpool, D]`` -> ``out [D]`` (reference order)."""
    kpool, dim = kf.shape
    if mode == _MODE_MEAN:
        for d in range(dim):
            out[d] = kf[0, d]
        for m in range(1, kpool):
            for d in range(dim):
                out[d] = out[d] + kf[m, d]
        scale = np.float32(kpool)
        for d in range(dim):
            out[d] = out[d] / scale
        return
    for m in range(kpool):
        for d in range(dim):
            logits[m, d] = gf[m, d] + ape[m, d]
    for d in range(dim):
        denom[d] = logits[0, d]  # running max first, then reused for the sum
    for m in range(1, kpool):
        for d in range(dim):
            v = logits[m, d]
            denom[d] = v if v > denom[d] else denom[d]
    for m in range(kpool):
        for d in range(dim):
            exps[m, d] = exp_f32(logits[m, d] - denom[d])
    for d in range(dim):
        denom[d] = exps[0, d]
    for m in range(1, kpool):
        for d in range(dim):
            denom[d] = denom[d] + exps[m, d]
    for d in range(dim):
        out[d] = (exps[0, d] / denom[d]) * kf[0, d]
    for m in range(1, kpool):
        for d in range(dim):
            out[d] = out[d] + (exps[m, d] / denom[d]) * kf[m, d]


def _pool_members(k, gate, start, kpool, k_scratch, gate_scratch):
    """Rows ``start .. start+kpool-1`` of ``k`` and ``gate`` as float32 ``[kpool, D]`` (numba only).

    float32 arrays give their own rows; bf16/fp16 bits are widened into the
    scratch arrays, both in one loop (two loops are measurably slower).
    """
    raise NotImplementedError


@overload(_pool_members, inline="always")
def _pool_members_overload(k, gate, start, kpool, k_scratch, gate_scratch):
    if k.dtype == types.float32:
        return lambda k, gate, start, kpool, k_scratch, gate_scratch: (k[start : start + kpool],
                                                                       gate[start : start + kpool])

    def widen_members(k, gate, start, kpool, k_scratch, gate_scratch):
        for m in range(kpool):
            for d in range(k.shape[1]):
                k_scratch[m, d] = widen(k[start + m, d])
                gate_scratch[m, d] = widen(gate[start + m, d])
        return k_scratch, gate_scratch

    return widen_members


@numba.njit(inline="always", cache=True, error_model="numpy")
def _softmax_pool_of_four(out, i, k, gate, ape, start):
    """``out[i]`` = softmax pool of rows ``start .. start+3``: the math of :func:`_pool_one` in one pass
    over the channels, every member in registers (the GLM shape, kpool 4)."""
    for d in range(ape.shape[1]):
        logit0 = widen(gate[start, d]) + ape[0, d]
        logit1 = widen(gate[start + 1, d]) + ape[1, d]
        logit2 = widen(gate[start + 2, d]) + ape[2, d]
        logit3 = widen(gate[start + 3, d]) + ape[3, d]
        peak = logit1 if logit1 > logit0 else logit0
        peak = logit2 if logit2 > peak else peak
        peak = logit3 if logit3 > peak else peak
        e0 = exp_f32(logit0 - peak)
        e1 = exp_f32(logit1 - peak)
        e2 = exp_f32(logit2 - peak)
        e3 = exp_f32(logit3 - peak)
        total = ((e0 + e1) + e2) + e3
        acc = (e0 / total) * widen(k[start, d])
        acc = acc + (e1 / total) * widen(k[start + 1, d])
        acc = acc + (e2 / total) * widen(k[start + 2, d])
        acc = acc + (e3 / total) * widen(k[start + 3, d])
        out[i, d] = narrow(acc, out)


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _pools_kernel(out, k, gate, ape, starts, mode):
    """``out[i] = pool(k[starts[i] : starts[i] + kpool], gate[...])``; 16-bit arrays as bits (``as_numba``).

    A pool's members are pooled in float32 (16-bit ones widened into scratch
    first) and rounded once, to nearest even, on the way out.
    """
    kpool, dim = ape.shape
    num = starts.shape[0]
    tasks = (num + _POOLS_PER_TASK - 1) // _POOLS_PER_TASK
    for task in numba.prange(tasks):
        kf = np.empty((kpool, dim), np.float32)
        gf = np.empty((kpool, dim), np.float32)
        logits = np.empty((kpool, dim), np.float32)
        exps = np.empty((kpool, dim), np.float32)
        denom = np.empty(dim, np.float32)
        pooled = np.empty(dim, np.float32)
        for i in range(task * _POOLS_PER_TASK, min(num, (task + 1) * _POOLS_PER_TASK)):
            if kpool == 4 and mode == _MODE_SOFTMAX:
                _softmax_pool_of_four(out, i, k, gate, ape, starts[i])
                continue
            members_k, members_gate = _pool_members(k, gate, starts[i], kpool, kf, gf)
            _pool_one(members_k, members_gate, ape, mode, logits, exps, denom, pooled)
            for d in range(dim):
                out[i, d] = narrow(pooled[d], out)


def _pool_rows(out: torch.Tensor, k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
               starts: torch.Tensor, mode: str) -> None:
    """``out[i]`` = pool of rows ``starts[i] .. starts[i] + kpool - 1`` of ``k``/``gate`` (contiguous)."""
    if out.shape[0] == 0:
        return
    kpool = ape.shape[0]
    if mode == "last":
        out.copy_(k[starts.to(torch.int64) + kpool - 1])
        return
    code = _MODE_SOFTMAX if mode == "softmax" else _MODE_MEAN
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    with numba_threads(out.shape[0] // _POOLS_PER_THREAD):
        _pools_kernel(as_numba(target), as_numba(k.contiguous()), as_numba(gate.contiguous()),
                      ape.contiguous().numpy(), starts.to(torch.int64).numpy(), code)
    if target is not out:
        out.copy_(target)


@numba.njit(cache=True, nogil=True)
def _first_member_rows(offsets, pool_offsets, cached, kpool):
    """Input row of every emitted pool's first member (the first column of the reference's
    ``compress_member_rows``), int64 ``[pool_offsets[B]]``, without its ``[pools, kpool]`` temporaries."""
    starts = np.empty(pool_offsets[-1], np.int64)
    for b in range(offsets.shape[0] - 1):
        first = offsets[b] + (kpool - cached[b] % kpool) % kpool
        for j in range(pool_offsets[b + 1] - pool_offsets[b]):
            starts[pool_offsets[b] + j] = first + j * kpool
    return starts


@numba.njit(cache=True, nogil=True)
def _seed_tail_kernel(ring, slots, k, gate, offsets, cached, kpool):
    """Row ``r`` of sequence ``b`` at position ``p = cached[b] + r - offsets[b] >= max(floor((c+n)/kpool)*kpool,
    c)`` to ``ring[slots[b], 0 / 1, p % kpool] = k[r] / gate[r]`` (16-bit values as bits)."""
    for b in range(offsets.shape[0] - 1):
        c, n = np.int64(cached[b]), np.int64(offsets[b + 1] - offsets[b])
        for position in range(max((c + n) // kpool * kpool, c), c + n):
            row = offsets[b] + position - c
            member = position % kpool
            copy_row(ring[slots[b], 0, member], k[row])
            copy_row(ring[slots[b], 1, member], gate[row])


def mla_kpool_seed_tail(ring, slot_ids, k, gate, input_row_offsets, cache_lengths, kpool):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_seed_tail`: one numba pass over the rows (the
    reference's dozen torch ops took about 0.1 ms of a decode step)."""
    if kpool == 1 or k.shape[0] == 0:
        return
    _seed_tail_kernel(as_numba(ring), slot_ids.numpy(), as_numba(k.contiguous()), as_numba(gate.contiguous()),
                      input_row_offsets.numpy(), cache_lengths.numpy(), kpool)


def mla_kpool_compress(pooled, k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths, kpool, mode):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_compress`."""
    if pooled.shape[0] == 0:
        return
    starts = _first_member_rows(input_row_offsets.to(torch.int64).numpy(), pool_row_offsets.to(torch.int64).numpy(),
                                cache_lengths.to(torch.int64).numpy(), kpool)
    _pool_rows(pooled, k, gate, ape, torch.from_numpy(starts), mode)


@numba.njit(cache=True, nogil=True)
def _closing_sequences(offsets, cached, kpool):
    """The sequences whose open pool this call completes (``c % kpool != 0`` and ``n >= kpool - c % kpool``),
    int64, in order."""
    closing = np.empty(offsets.shape[0] - 1, np.int64)
    count = 0
    for b in range(offsets.shape[0] - 1):
        held = cached[b] % kpool
        if held and offsets[b + 1] - offsets[b] >= kpool - held:
            closing[count] = b
            count += 1
    return closing[:count]


@numba.njit(cache=True, nogil=True)
def _closing_members(members_k, members_gate, ring, slots, k, gate, offsets, cached, closing, kpool):
    """Rows ``i*kpool .. i*kpool + kpool - 1`` of ``members_k``/``members_gate``: the members of the pool that
    sequence ``closing[i]`` closes, the ring's first (``c % kpool`` of them), then this call's first rows."""
    for i in range(closing.shape[0]):
        b = closing[i]
        held = cached[b] % kpool
        for m in range(kpool):
            if m < held:
                key_source, gate_source = ring[slots[b], 0, m], ring[slots[b], 1, m]
            else:
                key_source, gate_source = k[offsets[b] - held + m], gate[offsets[b] - held + m]
            copy_row(members_k[i * kpool + m], key_source)
            copy_row(members_gate[i * kpool + m], gate_source)


def mla_kpool_ring_close(closed, closed_ids, ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths,
                         kpool, mode):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_ring_close`.

    Finds the closing sequences in one numba scan (a decode step closes a pool
    in one call of ``kpool``: the others end there), gathers each closing pool's
    members (ring part, then this call's rows) into ``[S*kpool, D]`` and runs
    the same pool kernel as compress on them.
    """
    closed.zero_()
    closed_ids.fill_(-1)
    if cache_lengths.shape[0] == 0 or kpool == 1:
        return
    offsets, cached = input_row_offsets.numpy(), cache_lengths.numpy()
    closing = _closing_sequences(offsets, cached, kpool)
    if closing.shape[0] == 0:
        return
    members_k = k.new_empty(closing.shape[0] * kpool, k.shape[1])
    members_gate = torch.empty_like(members_k)
    _closing_members(as_numba(members_k), as_numba(members_gate), as_numba(ring), slot_ids.numpy(),
                     as_numba(k.contiguous()), as_numba(gate.contiguous()), offsets, cached, closing, kpool)
    seqs = torch.from_numpy(closing)
    result = k.new_empty(closing.shape[0], k.shape[1])
    _pool_rows(result, members_k, members_gate, ape, torch.arange(closing.shape[0]) * kpool, mode)
    closed[seqs] = result
    closed_ids[seqs] = torch.from_numpy(cached[closing] // kpool).to(closed_ids.dtype)


@numba.njit(cache=True, nogil=True)
def _visibility(positions, offsets, kpool, out_cols):
    """``(visible [total_q], needed [B], total)``: the pools each row sees (``(t+1)//kpool`` capped at
    ``out_cols``), the most any row of each sequence sees, and their sum (the work to split)."""
    batch = offsets.shape[0] - 1
    visible = np.empty(positions.shape[0], np.int64)
    needed = np.zeros(batch, np.int64)
    total = 0
    for b in range(batch):
        for r in range(offsets[b], offsets[b + 1]):
            visible[r] = min(max((np.int64(positions[r]) + 1) // kpool, 0), out_cols)
            needed[b] = max(needed[b], visible[r])
            total += visible[r]
    return visible, needed, total


def _check_score_pages(pooled_blocks, lookup_table, needed, query_positions, input_row_offsets, kpool):
    """The reference's :func:`~sparsekv.kernels.reference.kpool.score_page_error` unless every visible pool
    has a page (found by a numba loop over the table, without temporaries)."""
    per_page = pooled_blocks.shape[3]
    seq, pool = first_missing_page(lookup_table.numpy(), pooled_blocks.shape[0], per_page, needed)
    if seq >= 0:
        raise score_page_error(lookup_table, pooled_blocks.shape[0], per_page, query_positions, input_row_offsets,
                               kpool, seq, pool)


@numba.njit(cache=True, nogil=True, inline="always")
def _prefetch_pools(cache, table, b, pool, num_pools, page_stride, base, per_page, dim):
    """Ask for sequence ``b``'s pools from ``pool`` to the end of its page (none at or past ``num_pools``,
    whose pages are validated): the page after the one being scored, fetched while it computes. Pages lie
    anywhere, so the hardware prefetcher cannot run ahead from one to the next (measured with the keys
    out of the caches: 13-15% of a bf16 decode call)."""
    if pool < num_pools:
        slot = pool % per_page
        start = table[b, pool // per_page] * page_stride + base + slot * dim
        prefetch_span(cache, start, min(per_page - slot, num_pools - pool) * dim)


@numba.njit(parallel=True, cache=True, nogil=True)
def _score_kernel(scores, q, head_weights, cache, page_stride, base, per_page, table, visible, offsets, threads):
    """``scores [total_q, out_cols]``; ``q [total_q, heads, D]``; ``cache`` the pooled cache as one flat array:
    pool slot ``s`` of page ``n`` (this layer) starts at ``cache[n*page_stride + base + s*D]``.

    Task = (sequence, chunk of its pools): each group of the sequence's rows
    runs over the chunk's pooled keys it sees (none: the group is skipped),
    page by page, read in place through the page table (:func:`._tile_ops.dots_of_rows`) while the
    next page is prefetched (:func:`_prefetch_pools`); a row's score is
    ``sum_h w_h * relu(dot_h)`` summed in head order. ``q_t[group]``
    holds a row group's queries transposed, ``[D, lanes]``, zero padding lanes.
    The tasks run as ``threads`` contiguous runs (:func:`._parallel.worker_tasks`), each with one set of scratch.
    """
    total_q, heads, dim = q.shape
    batch = offsets.shape[0] - 1
    num_keys, task_starts, group_starts, q_t, group_rows = plan_score_tasks(scores, q, offsets, visible)
    group_lanes = q_t.shape[2]
    tasks = task_starts[batch]
    workers = max(1, min(threads, tasks))
    for worker in numba.prange(workers):
        scratch = new_scratch(cache, dim)
        dots = np.empty((KEYS_PER_TASK + KEYS_PER_TILE, group_lanes), np.float32)
        work = np.empty((group_lanes, KEYS_PER_TASK + KEYS_PER_TILE), np.float32)
        # a group's rows (at most group_rows) first; the register epilogue reads up to lanes // heads rows
        group_weights = np.zeros((max(group_rows, group_lanes), heads), np.float32)
        first_task, end_task = worker_tasks(worker, workers, tasks)
        for task in range(first_task, end_task):
            b, first_row, end_row, p0, chunk = score_task(task, task_starts, group_starts, num_keys, offsets)
            for r0 in range(first_row, end_row, group_rows):
                r1, needed, lanes = row_group(r0, end_row, group_rows, visible, p0, chunk, heads)
                if needed <= 0:
                    continue
                group_q = q_t[group_starts[b] + (r0 - first_row) // group_rows]
                column = 0
                while column < needed:  # page by page: a page's pools are consecutive rows
                    pool = p0 + column
                    slot = pool % per_page
                    run = min(per_page - slot, needed - column)
                    start = table[b, pool // per_page] * page_stride + base + slot * dim
                    _prefetch_pools(cache, table, b, pool + run, num_keys[b], page_stride, base, per_page, dim)
                    dots_of_rows(dots[column:], group_q, cache[start : start + run * dim].reshape((run, dim)),
                                 lanes, scratch)
                    column += run
                group_weights[: r1 - r0] = head_weights[r0:r1]
                write_group_scores(scores, dots, work, r0, r1, p0, chunk, needed, visible, lanes, heads,
                                   group_weights, np.float32(1.0))


def mla_kpool_score(scores, q, head_weights, pooled_blocks, lookup_table, query_positions, input_row_offsets,
                    kpool, layer):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_score`.

    Every sequence's pages are validated first; then one numba pass (see
    ``_score_kernel``) reads the pooled keys straight from their pages.
    """
    total_q, out_cols = scores.shape
    if total_q == 0:
        return
    offsets = input_row_offsets.numpy()
    visible, needed, total_visible = _visibility(query_positions.numpy(), offsets, kpool, out_cols)
    _check_score_pages(pooled_blocks, lookup_table, needed, query_positions, input_row_offsets, kpool)
    num_pages, planes, layers, per_page, _, dim = pooled_blocks.shape
    if num_pages == 0:  # validated above: no row sees a pool
        cache, page_stride = pooled_blocks.new_empty(0), 0
    else:
        # pages may be strided, not their insides (the whole tensor is asked first: indexing a page costs ~1 us)
        if not (pooled_blocks.is_contiguous() or pooled_blocks[0].is_contiguous()):
            pooled_blocks = pooled_blocks.contiguous()
        page_stride = pooled_blocks.stride(0)
        span = (num_pages - 1) * page_stride + planes * layers * per_page * dim
        cache = pooled_blocks.as_strided((span,), (1,))  # flat: numba vectorises contiguous slices only
    base = layer * per_page * dim  # plane 0 of this layer
    target = scores if scores.is_contiguous() else torch.empty_like(scores, memory_format=torch.contiguous_format)
    with threads_for(total_visible * q.shape[1] * q.shape[2]) as threads:
        _score_kernel(target.numpy(), as_numba(q.contiguous()), head_weights.float().contiguous().numpy(),
                      as_numba(cache), page_stride, base, per_page, lookup_table.numpy(), visible, offsets, threads)
    if target is not scores:
        scores.copy_(target)


__all__ = ["mla_kpool_compress", "mla_kpool_ring_close", "mla_kpool_score", "mla_kpool_seed_tail"]
