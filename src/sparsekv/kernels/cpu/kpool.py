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
* score: the paged score kernel of :mod:`._paged_score` (shared with the QSA
  block score over a block-key cache), with the head weights.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from ..reference.kpool import score_page_error
from ._bits import as_numba, copy_row, narrow, widen
from ._math import exp_f32
from ._paged_score import PagedScorePlan
from ._parallel import numba_threads

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


class ScorePlan(PagedScorePlan):
    """:func:`mla_kpool_score`'s rows set up once for every layer (:class:`._paged_score.PagedScorePlan`,
    one key per pool; :class:`sparsekv.ops.kpool.KPoolScorePlan` uses it)."""

    __slots__ = ()

    def __init__(self, pooled_blocks: torch.Tensor, lookup_table: torch.Tensor, query_positions: torch.Tensor,
                 input_row_offsets: torch.Tensor, kpool: int, out_cols: int) -> None:
        super().__init__(pooled_blocks, lookup_table, query_positions, input_row_offsets, kpool, out_cols, 1.0)

    def page_error(self, seq: int, key: int) -> ValueError:
        return score_page_error(self.lookup_table, self.keys.num_pages, self.keys.per_page,
                                torch.from_numpy(self.positions), torch.from_numpy(self.offsets), self.ratio, seq, key)

    def run(self, scores: torch.Tensor, q: torch.Tensor, head_weights: torch.Tensor, layer: int) -> None:
        """:func:`mla_kpool_score` of ``layer`` into ``scores [total_q, out_cols]``."""
        if head_weights.dtype != torch.float32:  # a torch op even where there is nothing to convert
            head_weights = head_weights.float()
        self.run_scores(scores, q, head_weights, layer)


def mla_kpool_score(scores, q, head_weights, pooled_blocks, lookup_table, query_positions, input_row_offsets,
                    kpool, layer):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_score`.

    Every sequence's pages are validated first; then one numba pass
    (:class:`._paged_score.PagedScorePlan`, shared with the QSA block score over a
    block-key cache) reads the pooled keys straight from their pages (:class:`ScorePlan`).
    """
    ScorePlan(pooled_blocks, lookup_table, query_positions, input_row_offsets, kpool, scores.shape[1]).run(
        scores, q, head_weights, layer)


__all__ = ["ScorePlan", "mla_kpool_compress", "mla_kpool_ring_close", "mla_kpool_score", "mla_kpool_seed_tail"]
