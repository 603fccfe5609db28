"""Triton sparse paged attention (SPEC 2.5); exported by ``kernels/triton/qsa.py``.

One program per (query row, KV head, split): the ``group`` query heads that
share a KV head are the rows of the matrix products; the row's index entries
are read ``BN`` at a time (page-table lookup per entry) with an fp32 online
softmax. Decode and prefill rows run the same way: every row has its own
index list, so nothing is shared between rows.

When rows x KV heads are too few to fill the GPU (small-batch decode), the
index row is cut into ``num_splits`` spans; each program writes an
unnormalised partial (``acc``, running max, denominator) to an fp32
workspace and a second kernel merges the spans. The split count comes from
shapes only (rows, KV heads, index width, SM count).

Invalid entries inside the counted region (``-1``, a position past the
lookup table, a missing page) are skipped on the device; a row with nothing
valid outputs zeros and ``lse = -inf``. On CPU tensors (the interpreter) and
with ``SPARSEKV_DEBUG=1`` the op raises instead, like the reference.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..reference.qsa import check_counted_entries
from . import _common
from ._common import (
    TL_DTYPES,
    find_sequence,
    lookup_page,
    mma,
    next_pow2,
    page_stride_of,
    round_to,
    search_steps,
    unit_stride,
)

__all__ = ["qsa_sparse_attention_paged"]

#: Programs per SM below which a row's entries are split across programs (a fraction: with fewer programs than
#: half the SMs). On an H200 (bf16, 2048 entries a row) not splitting the 128 programs of a B=64 QSA decode was
#: 1.15x faster than the 3 splits that 2 programs per SM asked for, and the 8 programs of B=4 ran alike with 1, 12
#: or 16 splits; MLA likewise.
PROGRAMS_PER_SM = 0.5
#: Programs per SM up to which a QSA launch takes the decode tiles (:func:`_attention_launch`).
_DECODE_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 32


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def num_splits(total_q: int, kv_heads: int, width: int, block_n: int, device: torch.device) -> int:
    """Spans per index row: enough programs for ``PROGRAMS_PER_SM`` per SM, each span >= 2 tiles."""
    programs = total_q * kv_heads
    wanted = math.ceil(PROGRAMS_PER_SM * _sm_count(device))
    if programs >= wanted:
        return 1
    return max(1, min(triton.cdiv(wanted, programs), triton.cdiv(width, 2 * block_n), _MAX_SPLITS))


def _attention_launch(total_q: int, kv_heads: int, width: int, block_d: int, is_fp32: bool,
                      device: torch.device) -> dict:
    """Launch parameters of :func:`_attention_kernel` for ``total_q`` rows x ``kv_heads`` KV heads over index
    rows of ``width`` entries whose channels fill a ``block_d``-wide tile: ``BN`` entries per iteration,
    ``splits`` spans per index row (1: no merge), and the warps and software-pipeline stages.

    bf16/fp16 launches of a few programs per SM at most (decode) take 64 entries an iteration (up to ``D =
    256``) on 8 warps in 2 stages: an H200 sweep of 200 launches (2048 entries a row, D=256) measured that
    1.08x the 32 entries on 4 warps in 3 stages at B=64 x 32k (no split) and 1.74x at B=4 x 128k (12 splits;
    1 and 16 alike). Larger launches (prefill) keep the latter, which ran a B=4 x 2048-row prefill 1.08-1.13x
    faster. The fp32 launch was not swept."""
    if is_fp32:
        block_n, warps, stages = 16, 4, 3
    elif total_q * kv_heads <= _DECODE_PROGRAMS_PER_SM * _sm_count(device):
        block_n, warps, stages = max(16, min(64, 16384 // block_d)), 8, 2
    else:
        block_n, warps, stages = max(16, min(64, 8192 // block_d)), 4, 3
    return {"BN": block_n, "splits": num_splits(total_q, kv_heads, width, block_n, device),
            "num_warps": warps, "num_stages": stages}


@triton.jit
def finish(acc, running_max, denom, row, heads, head_ok, dims, dim_ok,
            out_ptr, lse_ptr, gate_ptr, out_stride_row, out_stride_head, gate_stride_row, gate_stride_head,
            lse_stride_row, lse_stride_head, HAS_GATE: tl.constexpr, DTYPE: tl.constexpr):
    """Normalise, gate, cast and store one row's heads; zeros and ``-inf`` where nothing was attended."""
    attended = denom > 0
    safe_denom = tl.where(attended, denom, 1.0)
    result = tl.div_rn(acc, tl.zeros_like(acc) + safe_denom[:, None])
    result = tl.where(attended[:, None], result, 0.0)
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if HAS_GATE:
        gate_at = gate_ptr + row.to(tl.int64) * gate_stride_row + heads[:, None] * gate_stride_head + dims[None, :]
        result = result * tl.sigmoid(tl.load(gate_at, mask=out_mask, other=0.0).to(tl.float32))
    out_at = out_ptr + row.to(tl.int64) * out_stride_row + heads[:, None] * out_stride_head + dims[None, :]
    tl.store(out_at, round_to(result, DTYPE), mask=out_mask)
    lse = tl.where(attended, running_max + tl.log(safe_denom), float("-inf"))
    tl.store(lse_ptr + row.to(tl.int64) * lse_stride_row + heads * lse_stride_head, lse, mask=head_ok)


@triton.jit
def store_partials(acc, running_max, denom, row, heads, head_ok, dims, split, part_acc_ptr, part_stats_ptr,
                   Q_HEADS: tl.constexpr, BD: tl.constexpr):
    """Store one span's unnormalised partial of one row's heads for :func:`merge_kernel`.

    ``acc [heads, BD]``, ``running_max`` and ``denom [heads]`` fp32; partial
    ``(row * Q_HEADS + head) * num_splits + split`` holds ``acc`` in
    ``part_acc [parts, BD]`` and (max, denominator) in ``part_stats [parts, 2]``.
    """
    part = (row * Q_HEADS + heads).to(tl.int64) * tl.num_programs(2) + split
    tl.store(part_acc_ptr + part[:, None] * BD + dims[None, :], acc, mask=head_ok[:, None])
    tl.store(part_stats_ptr + part * 2, running_max, mask=head_ok)
    tl.store(part_stats_ptr + part * 2 + 1, denom, mask=head_ok)


@triton.jit
def selected_entries(indices_ptr, indices_stride, row, start, entries, end, lookup_ptr, lookup_stride, seq,
                     max_pages, num_pages, PAGE_SIZE: tl.constexpr):
    """Pages and in-page rows of index entries ``start + entries`` of ``row`` (those before ``end``), and
    whether each is a real, resolvable entry."""
    entry_ok = start + entries < end
    positions = tl.load(indices_ptr + row.to(tl.int64) * indices_stride + start + entries, mask=entry_ok, other=-1)
    page, page_row, valid = lookup_page(lookup_ptr, lookup_stride, seq, positions, max_pages, num_pages, PAGE_SIZE)
    return page, page_row, valid & entry_ok


@triton.jit
def online_softmax(logits, running_max, denom):
    """One tile of the running softmax: ``(weights, rescale, new_max, new_denom)`` from the tile's scaled
    ``logits [heads, entries]`` (``-inf`` where invalid); an all-``-inf`` row keeps weight 0."""
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(running_max - shift)
    weights = tl.exp(logits - shift[:, None])
    return weights, rescale, new_max, denom * rescale + tl.sum(weights, axis=1)


@triton.jit
def split_mma(weights, values, SPLIT_SCALE: tl.constexpr):
    """``weights @ values`` for fp32 ``weights`` and 16-bit ``values``, to about fp32 precision.

    One cast of the weights to the values' dtype would move about a quarter of
    bf16 outputs by an ulp (and near-zero outputs by many); instead the weights
    are written as a sum of three 16-bit parts (the residual is ~2^-24 of a
    weight) and multiplied with three native products (exact products, fp32
    accumulation). ``SPLIT_SCALE`` (a power of two) lifts float16 weights away
    from subnormals first and is divided out exactly.
    """
    scaled = weights * SPLIT_SCALE
    high = scaled.to(values.dtype)
    rest = scaled - high.to(tl.float32)
    middle = rest.to(values.dtype)
    low = (rest - middle.to(tl.float32)).to(values.dtype)
    return (mma(high, values) + mma(middle, values) + mma(low, values)) * (1.0 / SPLIT_SCALE)


@triton.jit
def _attention_kernel(
    out_ptr, lse_ptr, q_ptr, gate_ptr, blocks_ptr, lookup_ptr, indices_ptr, counts_ptr, offsets_ptr,
    part_acc_ptr, part_stats_ptr,
    num_seqs, width, span, num_pages, max_pages, lookup_stride, page_stride, key_offset, value_offset, scale,
    q_stride_row, q_stride_head, out_stride_row, out_stride_head, gate_stride_row, gate_stride_head,
    indices_stride, lse_stride_row, lse_stride_head,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_WIDTH: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_GATE: tl.constexpr, DTYPE: tl.constexpr, IS_FP32: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_SCALE: tl.constexpr,
    BGP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = find_sequence(offsets_ptr, row, num_seqs, STEPS)
    count = tl.minimum(tl.load(counts_ptr + row), width)
    begin = split * span
    end = tl.minimum(count, begin + span)

    member = tl.arange(0, BGP)
    head_ok = member < GROUP
    heads = kv_head * GROUP + member
    dims = tl.arange(0, BD)
    dim_ok = dims < HEAD_DIM
    q_at = q_ptr + row.to(tl.int64) * q_stride_row + heads[:, None] * q_stride_head + dims[None, :]
    q = tl.load(q_at, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    running_max = tl.full((BGP,), float("-inf"), tl.float32)
    denom = tl.zeros((BGP,), tl.float32)
    acc = tl.zeros((BGP, BD), tl.float32)
    entries = tl.arange(0, BN)
    for start in range(begin, end, BN):
        page, page_row, valid = selected_entries(indices_ptr, indices_stride, row, start, entries, end, lookup_ptr,
                                                 lookup_stride, seq, max_pages, num_pages, PAGE_SIZE)
        base = (page * page_stride + page_row.to(tl.int64) * ROW_WIDTH + kv_head * HEAD_DIM)[:, None] + dims[None, :]
        tile_ok = valid[:, None] & dim_ok[None, :]
        keys = tl.load(blocks_ptr + key_offset + base, mask=tile_ok, other=0.0)
        if IS_FP32:
            logits = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scale
        else:
            logits = mma(q, tl.trans(keys)) * scale
        logits = tl.where(valid[None, :], logits, float("-inf"))
        weights, rescale, new_max, denom = online_softmax(logits, running_max, denom)
        values = tl.load(blocks_ptr + value_offset + base, mask=tile_ok, other=0.0)
        if IS_FP32:
            update = tl.dot(weights, values.to(tl.float32), input_precision="ieee")
        else:
            update = split_mma(weights, values, SPLIT_SCALE)
        acc = acc * rescale[:, None] + update
        running_max = new_max

    if SPLIT:
        store_partials(acc, running_max, denom, row, heads, head_ok, dims, split, part_acc_ptr, part_stats_ptr,
                       Q_HEADS, BD)
    else:
        finish(acc, running_max, denom, row, heads, head_ok, dims, dim_ok,
                out_ptr, lse_ptr, gate_ptr, out_stride_row, out_stride_head, gate_stride_row, gate_stride_head,
                lse_stride_row, lse_stride_head, HAS_GATE, DTYPE)


@triton.jit
def merge_kernel(
    out_ptr, lse_ptr, gate_ptr, part_acc_ptr, part_stats_ptr, num_splits,
    out_stride_row, out_stride_head, gate_stride_row, gate_stride_head, lse_stride_row, lse_stride_head,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_GATE: tl.constexpr, DTYPE: tl.constexpr, BGP: tl.constexpr, BD: tl.constexpr,
):
    row = tl.program_id(0)
    member = tl.arange(0, BGP)
    head_ok = member < GROUP
    heads = tl.program_id(1) * GROUP + member
    dims = tl.arange(0, BD)
    dim_ok = dims < HEAD_DIM
    first_part = (row * Q_HEADS + heads).to(tl.int64) * num_splits

    top = tl.full((BGP,), float("-inf"), tl.float32)
    for s in range(num_splits):
        top = tl.maximum(top, tl.load(part_stats_ptr + (first_part + s) * 2, mask=head_ok, other=float("-inf")))
    shift = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.zeros((BGP,), tl.float32)
    acc = tl.zeros((BGP, BD), tl.float32)
    for s in range(num_splits):
        part = first_part + s
        weight = tl.exp(tl.load(part_stats_ptr + part * 2, mask=head_ok, other=float("-inf")) - shift)
        denom += weight * tl.load(part_stats_ptr + part * 2 + 1, mask=head_ok, other=0.0)
        acc += weight[:, None] * tl.load(part_acc_ptr + part[:, None] * BD + dims[None, :], mask=head_ok[:, None],
                                         other=0.0)
    finish(acc, top, denom, row, heads, head_ok, dims, dim_ok,
            out_ptr, lse_ptr, gate_ptr, out_stride_row, out_stride_head, gate_stride_row, gate_stride_head,
            lse_stride_row, lse_stride_head, HAS_GATE, DTYPE)


def qsa_sparse_attention_paged(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    scale: float,
    gate: torch.Tensor | None,
) -> None:
    """Attention of each query row over the cached tokens its index row selects (see the reference).

    ``out [total_q, q_heads, D]`` (q's dtype), ``lse [total_q, q_heads]`` float32.
    Example: ``indices[1] = [0, 1, 2, 3, 4, -1]``, ``counts[1] = 5``: row 1
    attends over tokens 0..4 of its sequence; the ``-1`` is never read.
    """
    total_q, q_heads, head_dim = q.shape
    num_seqs = input_row_offsets.shape[0] - 1
    if total_q == 0:
        return
    _, _, num_layers, page_size, kv_heads, _ = blocks.shape
    if _common.host_checks(q.device):
        check_counted_entries(lookup_table, blocks.shape[0], blocks.shape[3], indices, counts, input_row_offsets)
    if out.stride(2) != 1:
        packed = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        qsa_sparse_attention_paged(packed, lse, q, blocks, lookup_table, indices, counts, input_row_offsets,
                                   layer, scale, gate)
        out.copy_(packed)
        return
    q, indices, lookup_table = unit_stride(q), unit_stride(indices), unit_stride(lookup_table)
    counts, input_row_offsets = unit_stride(counts), unit_stride(input_row_offsets)
    if gate is not None:
        gate = unit_stride(gate)
    group = q_heads // kv_heads
    row_width = kv_heads * head_dim
    plane_size = num_layers * page_size * row_width
    layer_offset = layer * page_size * row_width
    width = indices.shape[1]
    block_d = max(next_pow2(head_dim), 16)
    is_fp32 = q.dtype == torch.float32 or q.dtype != blocks.dtype
    block_g = max(next_pow2(group), 16)
    launch = _attention_launch(total_q, kv_heads, width, block_d, is_fp32, q.device)
    block_n, splits = launch["BN"], launch["splits"]
    span = triton.cdiv(triton.cdiv(max(width, 1), splits), block_n) * block_n
    if splits > 1:
        parts = total_q * q_heads * splits
        part_acc = torch.empty(parts * block_d, dtype=torch.float32, device=q.device)
        part_stats = torch.empty(parts * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_stats = lse
    gate_arg = gate if gate is not None else q
    shared = {"Q_HEADS": q_heads, "GROUP": group, "HEAD_DIM": head_dim, "HAS_GATE": gate is not None,
              "DTYPE": TL_DTYPES[out.dtype], "BGP": block_g, "BD": block_d}
    _attention_kernel[(total_q, kv_heads, splits)](
        out, lse, q, gate_arg, blocks, lookup_table, indices, counts, input_row_offsets, part_acc, part_stats,
        num_seqs, width, span, blocks.shape[0], lookup_table.shape[1], lookup_table.stride(0),
        page_stride_of(blocks), layer_offset, plane_size + layer_offset, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), gate_arg.stride(0), gate_arg.stride(1),
        indices.stride(0), lse.stride(0), lse.stride(1),
        ROW_WIDTH=row_width, PAGE_SIZE=page_size, IS_FP32=is_fp32,
        SPLIT=splits > 1, SPLIT_SCALE=4096.0 if blocks.dtype == torch.float16 else 1.0,
        BN=block_n, STEPS=search_steps(num_seqs), num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        **shared,
    )
    if splits > 1:
        merge_kernel[(total_q, kv_heads)](
            out, lse, gate_arg, part_acc, part_stats, splits,
            out.stride(0), out.stride(1), gate_arg.stride(0), gate_arg.stride(1), lse.stride(0), lse.stride(1),
            **shared,
        )
