"""Fast CPU k-pool kernels (SPEC 3): numba for the pool math, vectorised torch for the rest.

Same functions and signatures as :mod:`sparsekv.kernels.reference.kpool` (the
contract); the pooled keys agree with the reference bit for bit (up to the rare
exp rounding case described below).

What each kernel is made of, and why (measured with ``benchmarks/bench_kpool.py``):

* compress / ring close, modes softmax and mean: one numba pass
  (``@njit(parallel=True, cache=True)``, ``prange`` over chunks of pools) that
  reads each member row once, keeps the pool in registers/L1 and writes the
  pooled key. The vectorised-torch reference materialises ~10 float32
  temporaries of the members (4x the input bytes each). Pooled keys are
  rounded to bf16/fp16 in the kernel, by integer arithmetic on their raw
  16-bit patterns (numba has neither type; :mod:`._bits`), exactly as torch
  casts. bf16 members are widened there too (a 16-bit shift); fp16 members
  are widened by torch first, which is several times faster than numba's
  integer path for fp16.
* ``exp``: the contract is the float32 rounding of a float64 exp. The kernel
  evaluates it with a branch-free Cody-Waite reduction and a degree-13
  polynomial in float64 (error ~1e-16 relative, so its float32 rounding equals
  the reference's but in ~1e-8 of cases, then by one float32 ulp of one
  weight), which LLVM vectorises; a libm call per element does not (5x slower).
  ``error_model="numpy"`` keeps float division free of Python's zero check,
  which would otherwise stop vectorisation.
* threads: a parallel region costs a barrier, milliseconds on oversubscribed
  cores, so a call gets one thread per 1024 pools (at least one).
* mode last, seed tail: pure gathers/scatters, already memory-bound in torch.
* score: the work is a (pools x D) @ (D x heads) product per sequence, which
  BLAS does best: a page-wise gather of each sequence's visible pooled keys
  (validated first), one float32 GEMM per chunk of rows, relu in place, the
  head-weighted sum as a batched GEMV, then ``-inf`` past each row's pools.
  The reference does the same GEMM per row after a per-pool page lookup, so
  at decode shapes the two are within a small factor of each other.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ...cache.layout import resolve_pages
from ..reference.kpool import compress_member_rows
from ..reference.kpool import mla_kpool_seed_tail as mla_kpool_seed_tail  # scatter of whole rows: memory-bound
from ._bits import as_numba, narrow, widen
from ._parallel import numba_threads

_MODE_SOFTMAX, _MODE_MEAN = 0, 1
_POOLS_PER_TASK = 64  # pools per prange task: enough work to amortise scheduling, small scratch
_POOLS_PER_THREAD = 1024  # below this many pools per thread a parallel region costs more than it saves

# exp(x) = 2**n * exp(r), x = n*ln2 + r, |r| <= ln2/2 (fdlibm's split of ln2: n*_LN2_HI is exact).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_LOG2_E = 1.44269504088896338700e00
_EXP_FLOOR = -110.0  # exp(-110) rounds to 0 in float32; keeps 2**n a normal float64
_INV_FACTORIALS = tuple(1.0 / math.factorial(i) for i in range(14))


@intrinsic
def _bits_to_f64(typingctx, bits):
    """Reinterpret an int64 as the float64 with the same bits (a register move)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@numba.njit(inline="always", cache=True, error_model="numpy")
def _exp_f32(x: float) -> np.float32:
    """float32(exp(x)) for float64 ``x <= 0``, computed in float64 (branch-free, vectorisable).

    Cody-Waite reduction ``x = n*ln2 + r``, ``|r| <= ln2/2``, then the degree-13
    Taylor polynomial of ``exp(r)`` (truncation ~4e-18) evaluated by Estrin's
    scheme (short dependency chains), scaled by ``2**n`` built from its bits.
    """
    x = x if x > _EXP_FLOOR else _EXP_FLOOR
    n = math.floor(x * _LOG2_E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    c = _INV_FACTORIALS
    r2 = r * r
    r4 = r2 * r2
    r8 = r4 * r4
    q0 = (c[0] + c[1] * r) + (c[2] + c[3] * r) * r2
    q1 = (c[4] + c[5] * r) + (c[6] + c[7] * r) * r2
    q2 = (c[8] + c[9] * r) + (c[10] + c[11] * r) * r2
    q3 = c[12] + c[13] * r
    p = (q0 + q1 * r4) + (q2 + q3 * r4) * r8
    scale = _bits_to_f64((np.int64(n) + np.int64(1023)) << np.int64(52))  # 2**n, n >= -159: a normal float64
    return np.float32(p * scale)


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
            exps[m, d] = _exp_f32(np.float64(logits[m, d] - denom[d]))
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
    if k.dtype == torch.float16:  # see the module docstring: torch widens fp16 faster
        k, gate = k.float(), gate.float()
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    with numba_threads(out.shape[0] // _POOLS_PER_THREAD):
        _pools_kernel(as_numba(target), as_numba(k.contiguous()), as_numba(gate.contiguous()),
                      ape.contiguous().numpy(), starts.to(torch.int64).numpy(), code)
    if target is not out:
        out.copy_(target)


def mla_kpool_compress(pooled, k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths, kpool, mode):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_compress`."""
    if pooled.shape[0] == 0:
        return
    starts = compress_member_rows(input_row_offsets, pool_row_offsets, cache_lengths, kpool)[:, 0]
    _pool_rows(pooled, k, gate, ape, starts, mode)


def mla_kpool_ring_close(closed, closed_ids, ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths,
                         kpool, mode):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_ring_close`.

    Gathers each closing pool's members (ring part, then this call's rows) into
    ``[S*kpool, D]`` and runs the same pool kernel as compress on them.
    """
    closed.zero_()
    closed_ids.fill_(-1)
    if cache_lengths.shape[0] == 0 or kpool == 1:
        return
    offsets = input_row_offsets.to(torch.int64)
    cached = cache_lengths.to(torch.int64)
    align = (kpool - cached % kpool) % kpool
    seqs = torch.nonzero((align > 0) & (offsets[1:] - offsets[:-1] >= align)).flatten()
    if seqs.numel() == 0:
        return
    member = torch.arange(kpool)
    from_ring = member[None, :] < (cached[seqs] % kpool)[:, None]
    rows = (offsets[seqs] - cached[seqs] % kpool)[:, None] + member[None, :]
    rows = torch.where(from_ring, torch.zeros_like(rows), rows)
    slots = slot_ids.to(torch.int64)[seqs]
    mask = from_ring[:, :, None]
    members_k = torch.where(mask, ring[slots, 0], k[rows]).reshape(-1, k.shape[1])
    members_gate = torch.where(mask, ring[slots, 1], gate[rows]).reshape(-1, k.shape[1])
    result = torch.empty(seqs.shape[0], k.shape[1], dtype=k.dtype)
    _pool_rows(result, members_k, members_gate, ape, torch.arange(seqs.shape[0]) * kpool, mode)
    closed[seqs] = result
    closed_ids[seqs] = torch.div(cached[seqs], kpool, rounding_mode="floor").to(closed_ids.dtype)


_SCORE_CHUNK_ELEMENTS = 1 << 22  # float32 dot products held at once per sequence (16 MiB)


def _sequence_keys(pooled_blocks, lookup_table, layer, seq, num_pools):
    """Sequence ``seq``'s pools ``0 .. num_pools-1`` as float32 ``[num_pools, D]``, gathered page by page.

    Validates the table entries first (the same error as the reference: the first bad pool).
    """
    per_page = pooled_blocks.shape[3]
    num_pages = -(-num_pools // per_page)
    if num_pages > lookup_table.shape[1] or bool(
        ((lookup_table[seq, :num_pages] < 0) | (lookup_table[seq, :num_pages] >= pooled_blocks.shape[0])).any()
    ):
        first_pools = torch.arange(0, num_pages * per_page, per_page)
        resolve_pages(lookup_table, pooled_blocks.shape[0], per_page, torch.full_like(first_pools, seq), first_pools)
    pages = lookup_table[seq, :num_pages].to(torch.int64)
    layer_view = pooled_blocks[:, 0, layer, :, 0, :]  # [num_pages, per_page, D], each page contiguous
    keys = layer_view.index_select(0, pages)  # whole-page copies (advanced indexing is ~10x slower here)
    return keys.reshape(num_pages * per_page, pooled_blocks.shape[5])[:num_pools].float()


def mla_kpool_score(scores, q, head_weights, pooled_blocks, lookup_table, query_positions, input_row_offsets,
                    kpool, layer):
    """See :func:`sparsekv.kernels.reference.kpool.mla_kpool_score`.

    Per sequence: one page-wise gather of the pooled keys its rows can see,
    then, per chunk of rows, a float32 GEMM ``q @ K^T`` (BLAS), relu in place
    and the head-weighted sum as a batched GEMV, then ``-inf`` past each
    row's visible pools. Every sequence's pages are validated before the
    first write.
    """
    total_q, out_cols = scores.shape
    if total_q == 0:
        return
    heads, dim = q.shape[1], q.shape[2]
    visible = torch.div(query_positions.to(torch.int64) + 1, kpool, rounding_mode="floor").clamp(0, out_cols)
    offsets = input_row_offsets.tolist()
    per_sequence = []
    for seq in range(len(offsets) - 1):
        lo, hi = offsets[seq], offsets[seq + 1]
        if hi > lo:
            most = int(visible[lo:hi].max())
            per_sequence.append((lo, hi, _sequence_keys(pooled_blocks, lookup_table, layer, seq, most)))
    columns = torch.arange(out_cols)
    for lo, hi, keys in per_sequence:
        num_pools = keys.shape[0]
        rows_per_chunk = max(1, _SCORE_CHUNK_ELEMENTS // max(1, heads * num_pools))
        for start in range(lo, hi, rows_per_chunk):
            stop = min(hi, start + rows_per_chunk)
            block = scores[start:stop]
            if num_pools:
                dots = torch.matmul(q[start:stop].reshape(-1, dim).float(), keys.T)  # [(rows*H), pools]
                dots.clamp_(min=0)
                weighted = torch.bmm(head_weights[start:stop, None, :], dots.view(stop - start, heads, num_pools))
                block[:, :num_pools] = weighted[:, 0]
            block.masked_fill_(columns[None, :] >= visible[start:stop, None], float("-inf"))


__all__ = ["mla_kpool_compress", "mla_kpool_ring_close", "mla_kpool_score", "mla_kpool_seed_tail"]
