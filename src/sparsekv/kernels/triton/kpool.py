"""Triton MLA k-pool kernels (SPEC 3), same functions and signatures as ``kernels/reference/kpool.py``.

The pool math (softmax / mean / last, per channel) lives in one device
function, :func:`_pool`, used by both the in-call compress and the ring close,
so a pool gives the same bits whichever of the two closes it. Members are
combined in member order with each product and division rounded separately
(contraction disabled, ``div_rn``) and ``exp`` evaluated in float64 and
rounded once, as the reference does.

Device-side safety without host syncs: member rows are masked to ``[0, T)``,
ring slots to ``[0, max_slots)``, pages of the pooled cache to valid entries
(a missing page scores as a zero key). On CPU tensors (the interpreter) and
with ``SPARSEKV_DEBUG=1`` the ops first run the reference's host-side checks
and raise its ``ValueError``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.kpool import check_score_pages
from . import _common
from ._common import (
    TL_DTYPES,
    find_sequence,
    next_pow2,
    round_to,
    search_steps,
    unit_stride,
)
from ._score import launch_score

__all__ = ["mla_kpool_compress", "mla_kpool_ring_close", "mla_kpool_score", "mla_kpool_seed_tail"]

_MODES = {"softmax": 0, "mean": 1, "last": 2}
_MAX_CHANNELS = 256
_ROWS_PER_PROGRAM = 16


def _mode_id(mode: str) -> int:
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {tuple(_MODES)}, got {mode!r}")
    return _MODES[mode]


@triton.jit
def _exp_rn(x):
    """fp32 ``exp(x)`` evaluated in float64 and rounded once, as the reference rounds it (``tl.exp`` on fp32
    is an approximation on the GPU, and its error grows into many ulps of a pooled key that cancels)."""
    return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _member(m, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
            ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok, ok,
            HAS_RING: tl.constexpr):
    """Key and gate (fp32 ``[BP, BD]``) of member ``m`` of each pool in the tile.

    With ``HAS_RING``, members ``m < from_ring`` come from the ring (``ring_slot``
    = offset of the slot's plane 0), the others from row ``first_row + m -
    from_ring`` of this call; without it (in-call compress: no ring read is
    compiled, which Triton 3.6's layout pass also needs) every member is row
    ``first_row + m``.
    """
    row = first_row + m - from_ring
    in_rows = ok & (m >= from_ring) & (row >= 0) & (row < num_rows)
    row = row.to(tl.int64)  # rows outside [0, num_rows) are masked, never read
    row_mask = in_rows[:, None] & chan_ok[None, :]
    key = tl.load(k_ptr + (row * k_stride)[:, None] + chans[None, :], mask=row_mask, other=0.0)
    gate = tl.load(gate_ptr + (row * gate_stride)[:, None] + chans[None, :], mask=row_mask, other=0.0)
    if HAS_RING:
        in_ring = ok & (m < from_ring) & ring_ok
        ring_at = (ring_slot + m * ring_member_stride)[:, None] + chans[None, :]
        ring_mask = in_ring[:, None] & chan_ok[None, :]
        key = tl.where(ring_mask, tl.load(ring_ptr + ring_at, mask=ring_mask, other=0.0), key)
        gate = tl.where(ring_mask, tl.load(ring_ptr + ring_gate_offset + ring_at, mask=ring_mask, other=0.0), gate)
    return key.to(tl.float32), gate.to(tl.float32)


@triton.jit
def _pool(k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
          ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride,
          ape_ptr, ape_stride, chans, chan_ok, ok,
          KPOOL: tl.constexpr, MODE: tl.constexpr, DTYPE: tl.constexpr, HAS_RING: tl.constexpr):
    """One pooled key per pool of the tile, in ``DTYPE`` (SPEC 3.1, rounding as the reference)."""
    if MODE == 2:  # last member, unchanged
        key, _ = _member(KPOOL - 1, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                         ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok,
                         ok, HAS_RING)
        pooled = key
    elif MODE == 1:  # mean, summed in member order
        pooled, _ = _member(0, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                            ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok,
                            ok, HAS_RING)
        for m in tl.static_range(1, KPOOL):
            key, _ = _member(m, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                             ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok,
                             ok, HAS_RING)
            pooled = pooled + key
        pooled = tl.div_rn(pooled, tl.zeros_like(pooled) + KPOOL)
    else:  # softmax over members per channel; three passes keep every sum in member order
        for m in tl.static_range(KPOOL):
            _, gate = _member(m, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                              ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok,
                              ok, HAS_RING)
            logit = gate + tl.load(ape_ptr + m * ape_stride + chans, mask=chan_ok, other=0.0)[None, :]
            if m == 0:
                peak = logit
            else:
                peak = tl.maximum(peak, logit)
        for m in tl.static_range(KPOOL):
            _, gate = _member(m, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                              ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok,
                              ok, HAS_RING)
            logit = gate + tl.load(ape_ptr + m * ape_stride + chans, mask=chan_ok, other=0.0)[None, :]
            if m == 0:
                denom = _exp_rn(logit - peak)
            else:
                denom = denom + _exp_rn(logit - peak)
        for m in tl.static_range(KPOOL):
            key, gate = _member(m, k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                                ring_ptr, ring_slot, ring_ok, ring_gate_offset, ring_member_stride, chans, chan_ok,
                                ok, HAS_RING)
            logit = gate + tl.load(ape_ptr + m * ape_stride + chans, mask=chan_ok, other=0.0)[None, :]
            term = tl.div_rn(_exp_rn(logit - peak), denom) * key
            if m == 0:
                pooled = term
            else:
                pooled = pooled + term
    return round_to(pooled, DTYPE)


@triton.jit
def _compress_kernel(
    pooled_ptr, k_ptr, gate_ptr, ape_ptr, offsets_ptr, pool_offsets_ptr, cache_lengths_ptr,
    total_pools, num_rows, num_seqs, pooled_stride, k_stride, gate_stride, ape_stride, head_dim,
    KPOOL: tl.constexpr, MODE: tl.constexpr, DTYPE: tl.constexpr,
    BP: tl.constexpr, BD: tl.constexpr, STEPS: tl.constexpr,
):
    pools = tl.program_id(0) * BP + tl.arange(0, BP)
    ok = pools < total_pools
    pools = tl.where(ok, pools, 0)
    seq = find_sequence(pool_offsets_ptr, pools, num_seqs, STEPS)
    cached = tl.load(cache_lengths_ptr + seq)
    align = (KPOOL - cached % KPOOL) % KPOOL
    first_row = tl.load(offsets_ptr + seq) + align + (pools - tl.load(pool_offsets_ptr + seq)) * KPOOL
    chans = tl.program_id(1) * BD + tl.arange(0, BD)
    chan_ok = chans < head_dim
    no_ring = tl.zeros_like(first_row)
    result = _pool(k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, no_ring,
                   k_ptr, no_ring.to(tl.int64), pools < 0, 0, 0,
                   ape_ptr, ape_stride, chans, chan_ok, ok, KPOOL, MODE, DTYPE, False)
    out_at = pooled_ptr + (pools.to(tl.int64) * pooled_stride)[:, None] + chans[None, :]
    tl.store(out_at, result, mask=ok[:, None] & chan_ok[None, :])


def _compress_launch(head_dim: int) -> dict:
    """Launch parameters of the in-call compress kernel for keys of ``head_dim`` channels: ``BP`` pools times
    ``BD`` channels per program, and its warps. 8 pools x 64 channels at ``D = 128`` (an H200, bf16, 4 x 8192
    rows): 1.39x the 16 pools x 128 channels, the same bits."""
    return {"BP": 8, "BD": min(next_pow2(head_dim), 64), "num_warps": 4}


def mla_kpool_compress(
    pooled: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    input_row_offsets: torch.Tensor,
    pool_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    kpool: int,
    mode: str,
) -> None:
    """Write every pool completed inside this call's rows (see the reference).

    ``pooled [pool_row_offsets[B], D]``: the grid comes from its row count (a
    shape), ``BP`` pools per program, each pool's sequence found by bisecting
    ``pool_row_offsets``. Example, kpool 4, cache lengths ``[6, 0]``, offsets
    ``[0, 7, 10]``: pooled row 0 = pool 2 of sequence 0 from rows 2..5.
    """
    mode_id = _mode_id(mode)
    total_pools, head_dim = pooled.shape
    num_seqs = cache_lengths.shape[0]
    if total_pools == 0 or num_seqs == 0:
        return
    if pooled.stride(1) != 1:
        packed = torch.empty(pooled.shape, dtype=pooled.dtype, device=pooled.device)
        mla_kpool_compress(packed, k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths, kpool, mode)
        pooled.copy_(packed)
        return
    k, gate, ape = unit_stride(k), unit_stride(gate), unit_stride(ape)
    input_row_offsets, pool_row_offsets = unit_stride(input_row_offsets), unit_stride(pool_row_offsets)
    cache_lengths = unit_stride(cache_lengths)
    launch = _compress_launch(head_dim)
    grid = (triton.cdiv(total_pools, launch["BP"]), triton.cdiv(head_dim, launch["BD"]))
    _compress_kernel[grid](
        pooled, k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths,
        total_pools, k.shape[0], num_seqs, pooled.stride(0), k.stride(0), gate.stride(0), ape.stride(0), head_dim,
        KPOOL=kpool, MODE=mode_id, DTYPE=TL_DTYPES[pooled.dtype],
        STEPS=search_steps(num_seqs), enable_fp_fusion=False, **launch,
    )


@triton.jit
def _ring_close_kernel(
    closed_ptr, closed_ids_ptr, ring_ptr, slot_ids_ptr, k_ptr, gate_ptr, ape_ptr, offsets_ptr, cache_lengths_ptr,
    num_seqs, num_rows, max_slots, closed_stride, k_stride, gate_stride, ape_stride, head_dim,
    ring_slot_stride, ring_gate_offset, ring_member_stride,
    KPOOL: tl.constexpr, MODE: tl.constexpr, DTYPE: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
):
    seqs = tl.program_id(0) * BS + tl.arange(0, BS)
    ok = seqs < num_seqs
    seqs = tl.where(ok, seqs, 0)
    cached = tl.load(cache_lengths_ptr + seqs)
    first_row = tl.load(offsets_ptr + seqs)
    new_rows = tl.load(offsets_ptr + seqs + 1) - first_row
    from_ring = cached % KPOOL
    align = (KPOOL - from_ring) % KPOOL
    closing = ok & (align > 0) & (new_rows >= align)
    slot = tl.load(slot_ids_ptr + seqs)
    slot_ok = (slot >= 0) & (slot < max_slots)
    ring_slot = tl.where(slot_ok, slot, 0).to(tl.int64) * ring_slot_stride
    chans = tl.program_id(1) * BD + tl.arange(0, BD)
    chan_ok = chans < head_dim
    result = _pool(k_ptr, gate_ptr, k_stride, gate_stride, num_rows, first_row, from_ring,
                   ring_ptr, ring_slot, slot_ok, ring_gate_offset, ring_member_stride,
                   ape_ptr, ape_stride, chans, chan_ok, closing, KPOOL, MODE, DTYPE, True)
    result = tl.where(closing[:, None], result, tl.zeros_like(result))
    out_at = closed_ptr + (seqs.to(tl.int64) * closed_stride)[:, None] + chans[None, :]
    tl.store(out_at, result, mask=ok[:, None] & chan_ok[None, :])
    if tl.program_id(1) == 0:
        tl.store(closed_ids_ptr + seqs, tl.where(closing, cached // KPOOL, -1), mask=ok)


def mla_kpool_ring_close(
    closed: torch.Tensor,
    closed_ids: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    kpool: int,
    mode: str,
) -> None:
    """Close the pool each sequence left open in an earlier call (see the reference).

    ``closed [B, D]`` (zeros where nothing closes), ``closed_ids [B]`` int32
    (``-1`` where nothing closes). Example, kpool 4, ``c = 6``, ``n = 3``:
    pool 1 takes members 0, 1 from the ring and 2, 3 from rows 0, 1.
    """
    mode_id = _mode_id(mode)
    num_seqs = cache_lengths.shape[0]
    if num_seqs == 0:
        return
    if _common.host_checks(ring.device):
        _check_slots(slot_ids, ring.shape[0])
    if closed.stride(1) != 1 or not closed_ids.is_contiguous():
        packed = torch.empty(closed.shape, dtype=closed.dtype, device=closed.device)
        packed_ids = torch.empty(closed_ids.shape, dtype=closed_ids.dtype, device=closed_ids.device)
        mla_kpool_ring_close(packed, packed_ids, ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths,
                             kpool, mode)
        closed.copy_(packed)
        closed_ids.copy_(packed_ids)
        return
    k, gate, ape, ring = unit_stride(k), unit_stride(gate), unit_stride(ape), unit_stride(ring)
    slot_ids, input_row_offsets, cache_lengths = (unit_stride(t) for t in (slot_ids, input_row_offsets,
                                                                          cache_lengths))
    head_dim = closed.shape[1]
    block_d = min(next_pow2(head_dim), _MAX_CHANNELS)
    block_s = 16
    grid = (triton.cdiv(num_seqs, block_s), triton.cdiv(head_dim, block_d))
    _ring_close_kernel[grid](
        closed, closed_ids, ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths,
        num_seqs, k.shape[0], ring.shape[0], closed.stride(0), k.stride(0), gate.stride(0), ape.stride(0), head_dim,
        ring.stride(0), ring.stride(1), ring.stride(2),
        KPOOL=kpool, MODE=mode_id, DTYPE=TL_DTYPES[closed.dtype], BS=block_s, BD=block_d,
        enable_fp_fusion=False,
    )


@triton.jit
def _seed_tail_kernel(
    ring_ptr, slot_ids_ptr, k_ptr, gate_ptr, offsets_ptr, cache_lengths_ptr,
    num_rows, num_seqs, max_slots, k_stride, gate_stride, head_dim,
    ring_slot_stride, ring_gate_offset, ring_member_stride,
    KPOOL: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, STEPS: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < num_rows
    rows = tl.where(row_ok, rows, 0)
    seq = find_sequence(offsets_ptr, rows, num_seqs, STEPS)
    cached = tl.load(cache_lengths_ptr + seq)
    first_row = tl.load(offsets_ptr + seq)
    end = cached + tl.load(offsets_ptr + seq + 1) - first_row
    position = cached + rows - first_row
    open_from = tl.maximum((end // KPOOL) * KPOOL, cached)
    slot = tl.load(slot_ids_ptr + seq)
    keep = row_ok & (position >= open_from) & (slot >= 0) & (slot < max_slots)
    chans = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = keep[:, None] & (chans < head_dim)[None, :]
    ring_at = (tl.where(keep, slot, 0).to(tl.int64) * ring_slot_stride
               + (position % KPOOL) * ring_member_stride)[:, None] + chans[None, :]
    src = rows.to(tl.int64)[:, None]
    tl.store(ring_ptr + ring_at, tl.load(k_ptr + src * k_stride + chans[None, :], mask=mask), mask=mask)
    tl.store(ring_ptr + ring_gate_offset + ring_at, tl.load(gate_ptr + src * gate_stride + chans[None, :], mask=mask),
             mask=mask)


def mla_kpool_seed_tail(
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    kpool: int,
) -> None:
    """Store this call's members of each still-open pool into the ring (see the reference).

    Example, kpool 4, ``c = 6``, ``n = 7`` (positions 6..12): position 12 goes
    to member 0 of the sequence's slot; the other rows are not stored.
    """
    num_rows = k.shape[0]
    num_seqs = cache_lengths.shape[0]
    if kpool == 1 or num_rows == 0 or num_seqs == 0:
        return
    if _common.host_checks(ring.device):
        _check_slots(slot_ids, ring.shape[0])
    if ring.stride(3) != 1:
        packed = ring.contiguous()
        mla_kpool_seed_tail(packed, slot_ids, k, gate, input_row_offsets, cache_lengths, kpool)
        ring.copy_(packed)
        return
    k, gate = unit_stride(k), unit_stride(gate)
    slot_ids, input_row_offsets, cache_lengths = (unit_stride(t) for t in (slot_ids, input_row_offsets,
                                                                          cache_lengths))
    head_dim = k.shape[1]
    block_d = min(next_pow2(head_dim), _MAX_CHANNELS)
    grid = (triton.cdiv(num_rows, _ROWS_PER_PROGRAM), triton.cdiv(head_dim, block_d))
    _seed_tail_kernel[grid](
        ring, slot_ids, k, gate, input_row_offsets, cache_lengths,
        num_rows, num_seqs, ring.shape[0], k.stride(0), gate.stride(0), head_dim,
        ring.stride(0), ring.stride(1), ring.stride(2),
        KPOOL=kpool, BR=_ROWS_PER_PROGRAM, BD=block_d, STEPS=search_steps(num_seqs),
    )


def mla_kpool_score(
    scores: torch.Tensor,
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    kpool: int,
    layer: int,
) -> None:
    """``scores[r, p] = sum_h head_weights[r, h] * relu(q[r, h] . K_p)`` over the paged pooled cache.

    Visible pools ``p < min((t+1) // kpool, out_cols)``, ``-inf`` elsewhere
    (see the reference). Example, kpool 4, 2 pools per page: a row at ``t = 10``
    sees pools 0, 1, both in logical page 0.
    """
    if scores.shape[0] == 0:
        return
    if _common.host_checks(scores.device):
        check_score_pages(lookup_table, pooled_blocks.shape[0], pooled_blocks.shape[3], query_positions,
                          input_row_offsets, kpool, scores.shape[1])
    launch_score(scores, q, pooled_blocks, query_positions, input_row_offsets, kpool, scores.shape[1],
                 head_weights=head_weights, lookup_table=lookup_table, layer=layer)


def _check_slots(slot_ids: torch.Tensor, max_slots: int) -> None:
    bad = torch.nonzero((slot_ids < 0) | (slot_ids >= max_slots)).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"slot_ids: sequence {b} has slot {int(slot_ids[b])}, expected one in [0, {max_slots})")
