"""Triton QSA kernels (SPEC 2.2, 2.3, 2.5), same functions and signatures as ``kernels/reference/qsa.py``.

Differences from the reference, all about invalid input on the device (the
reference raises; here nothing may synchronise with the host):

* a missing page (sentinel or outside ``[0, num_pages)``) reads as absent:
  zeros for raw keys, a skipped entry for attention;
* a ``-1`` or out-of-range position inside the counted region of an index
  row is skipped; a row whose every counted entry is skipped outputs zeros
  and ``lse = -inf``;
* a missing ``freqs_cis`` row reads as ``cos = sin = 0``.

On CPU tensors (the interpreter) and with ``SPARSEKV_DEBUG=1`` each op first
runs the reference's host-side checks and raises the same ``ValueError``.

Rounding follows the reference's points exactly: every fp32 division and
square root that feeds a cast is correctly rounded (``div_rn``, ``sqrt_rn``),
floating-point contraction is disabled for the compress kernel, bf16 casts
round to nearest even on every backend (``round_to``), and compress sums in
the reference's orders (raw keys token by token, the RMSNorm squares channel
by channel), so its bf16/fp16 output equals the reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import check_freqs_cis_rows
from ...cache.layout import check_needed_pages
from ..reference.qsa import keys_seen
from . import _common
from ._attention import qsa_sparse_attention_paged
from ._common import (
    TL_DTYPES,
    lookup_page,
    next_pow2,
    page_stride_of,
    round_to,
    unit_stride,
)
from ._score import launch_score

__all__ = ["qsa_block_score", "qsa_block_score_paged", "qsa_compress_keys_paged", "qsa_load_block_keys_paged",
           "qsa_sparse_attention_paged", "qsa_store_block_keys_paged"]


# ---------------------------------------------------------------------------
# compress (SPEC 2.2)
# ---------------------------------------------------------------------------
@triton.jit
def _add_squares_in_order(total, x, NUM_COLUMNS: tl.constexpr):
    """``total [BJ]`` plus ``x[:, c] * x[:, c]`` for the columns ``c < NUM_COLUMNS`` of ``x [BJ, W]``, added one
    column at a time, in column order, as the reference's channel loop adds them.

    A plain ``tl.sum`` reduces in a tree, and a one-ulp change of the sum of
    squares can grow into several ulps of the key after the RoPE subtraction.
    Each column is picked out of the tile by a sum of its square and ``-0.0``
    everywhere else, which is exact in any order. ``c`` is a compile-time
    constant: the compiler then drops the ``-0.0`` terms of the columns a
    thread holds (``x + -0.0 == x``), so a column costs a select and a sum
    over the few lanes that share a tile row. Loading each column again from
    global memory would instead cost a 2-byte gather per token and channel
    (32 cache lines per warp-wide load) and the block mean computed twice.
    """
    columns = tl.arange(0, x.shape[1])
    squares = x * x
    for c in tl.static_range(x.shape[1]):
        if c < NUM_COLUMNS:
            total += tl.sum(tl.where(columns[None, :] == c, squares, -0.0), axis=1)
    return total


@triton.jit
def _divide_by_ratio(total, RATIO: tl.constexpr):
    """``total / RATIO`` correctly rounded (fp32, any shape). For a power of two this is the product with
    its exact reciprocal, the same value without ``div_rn``'s refinement steps and special-case branch."""
    if (RATIO & (RATIO - 1)) == 0:
        return total * (1.0 / RATIO)
    else:
        return tl.div_rn(total, tl.zeros_like(total) + RATIO)


@triton.jit
def _compress_kernel(
    out_ptr, gamma_ptr, freqs_ptr, key_counts_ptr, blocks_ptr, lookup_ptr, first_ptr,
    max_blocks, num_pages, max_pages, lookup_stride, page_stride, layer_offset, freq_rows, freqs_stride,
    out_stride, out_layer_offset, eps,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ROW_WIDTH: tl.constexpr, DTYPE: tl.constexpr,
    BJ: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, PAGED_OUT: tl.constexpr,
):
    """Blocks of one sequence, ``BJ`` per program. ``PAGED_OUT`` false: blocks ``0 .. max_blocks - 1`` into rows
    ``seq * max_blocks + j`` of ``out`` (``out_stride`` apart), zeros past the complete ones. ``PAGED_OUT``
    true: blocks ``first[seq] ..`` up to the complete ones into a block-key cache, block ``j`` in row ``j %
    (PAGE_SIZE // RATIO)`` of the page the lookup table gives (pages ``out_stride`` apart, the layer at
    ``out_layer_offset``); nothing else is written."""
    seq = tl.program_id(0)
    if PAGED_OUT:
        blocks_j = tl.load(first_ptr + seq) + tl.program_id(1) * BJ + tl.arange(0, BJ)
        num_blocks = tl.maximum(tl.load(key_counts_ptr + seq), 0) // RATIO
    else:
        blocks_j = tl.program_id(1) * BJ + tl.arange(0, BJ)
        num_blocks = tl.minimum(tl.maximum(tl.load(key_counts_ptr + seq), 0) // RATIO, max_blocks)
    j_ok = blocks_j < num_blocks

    # Channels in four tiles: the two rotated halves, so the NeoX partner of
    # channel i (i + HALF) sits at the same tile column, and the pass-through
    # rest in two halves. Each column of the in-order sum of squares costs a
    # reduction over the lanes that share a tile row (16 bytes each), so one
    # rest tile twice as wide would make its columns cost about twice as much.
    half_ch = tl.arange(0, BH)
    half_ok = half_ch < HALF
    rest_a_ch = 2 * HALF + tl.arange(0, BR)
    rest_a_ok = rest_a_ch < HEAD_DIM
    rest_b_ch = rest_a_ch + BR
    rest_b_ok = rest_b_ch < HEAD_DIM

    # 1. mean of the block's R raw keys, summed in token order in fp32.
    for i in tl.static_range(RATIO):
        page, page_row, valid = lookup_page(lookup_ptr, lookup_stride, seq, blocks_j * RATIO + i, max_pages,
                                            num_pages, PAGE_SIZE)
        row_at = blocks_ptr + (page * page_stride + layer_offset + page_row.to(tl.int64) * ROW_WIDTH)[:, None]
        valid = (valid & j_ok)[:, None]
        lo = tl.load(row_at + half_ch[None, :], mask=valid & half_ok[None, :], other=0.0).to(tl.float32)
        hi = tl.load(row_at + HALF + half_ch[None, :], mask=valid & half_ok[None, :], other=0.0).to(tl.float32)
        rest_a = tl.load(row_at + rest_a_ch[None, :], mask=valid & rest_a_ok[None, :], other=0.0).to(tl.float32)
        rest_b = tl.load(row_at + rest_b_ch[None, :], mask=valid & rest_b_ok[None, :], other=0.0).to(tl.float32)
        if i == 0:
            sum_lo, sum_hi, sum_rest_a, sum_rest_b = lo, hi, rest_a, rest_b
        else:
            sum_lo += lo
            sum_hi += hi
            sum_rest_a += rest_a
            sum_rest_b += rest_b
    mean_lo = round_to(_divide_by_ratio(sum_lo, RATIO), DTYPE).to(tl.float32)
    mean_hi = round_to(_divide_by_ratio(sum_hi, RATIO), DTYPE).to(tl.float32)
    mean_rest_a = round_to(_divide_by_ratio(sum_rest_a, RATIO), DTYPE).to(tl.float32)
    mean_rest_b = round_to(_divide_by_ratio(sum_rest_b, RATIO), DTYPE).to(tl.float32)

    # 2. zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + gamma), the sum of
    #    squares in channel order d = 0..D-1: the low half, the high half, the rest.
    square_sum = tl.zeros([BJ], dtype=tl.float32)
    square_sum = _add_squares_in_order(square_sum, mean_lo, HALF)
    square_sum = _add_squares_in_order(square_sum, mean_hi, HALF)
    square_sum = _add_squares_in_order(square_sum, mean_rest_a, HEAD_DIM - 2 * HALF)
    square_sum = _add_squares_in_order(square_sum, mean_rest_b, HEAD_DIM - 2 * HALF - BR)
    mean_square = tl.div_rn(square_sum, tl.zeros_like(square_sum) + HEAD_DIM)
    inv_rms = tl.div_rn(tl.zeros_like(mean_square) + 1.0, tl.sqrt_rn(mean_square + eps))[:, None]
    g_lo = 1.0 + tl.load(gamma_ptr + half_ch, mask=half_ok, other=0.0).to(tl.float32)
    g_hi = 1.0 + tl.load(gamma_ptr + HALF + half_ch, mask=half_ok, other=0.0).to(tl.float32)
    g_rest_a = 1.0 + tl.load(gamma_ptr + rest_a_ch, mask=rest_a_ok, other=0.0).to(tl.float32)
    g_rest_b = 1.0 + tl.load(gamma_ptr + rest_b_ch, mask=rest_b_ok, other=0.0).to(tl.float32)
    x_lo = round_to(mean_lo * inv_rms * g_lo[None, :], DTYPE).to(tl.float32)
    x_hi = round_to(mean_hi * inv_rms * g_hi[None, :], DTYPE).to(tl.float32)
    x_rest_a = round_to(mean_rest_a * inv_rms * g_rest_a[None, :], DTYPE)
    x_rest_b = round_to(mean_rest_b * inv_rms * g_rest_b[None, :], DTYPE)

    # 3. NeoX RoPE at the block's first token; cos/sin rounded to the key dtype.
    freq_row = blocks_j * RATIO
    freq_ok = (j_ok & (freq_row < freq_rows))[:, None] & half_ok[None, :]
    freq_at = freqs_ptr + freq_row.to(tl.int64)[:, None] * freqs_stride + 2 * half_ch[None, :]
    cos = round_to(tl.load(freq_at, mask=freq_ok, other=0.0).to(tl.float32), DTYPE).to(tl.float32)
    sin = round_to(tl.load(freq_at + 1, mask=freq_ok, other=0.0).to(tl.float32), DTYPE).to(tl.float32)
    y_lo = round_to(x_lo * cos - x_hi * sin, DTYPE)
    y_hi = round_to(x_hi * cos + x_lo * sin, DTYPE)

    # 4. store; blocks past the sequence's complete blocks are zero rows (in a block-key cache: not written).
    keep = j_ok[:, None]
    if PAGED_OUT:
        page, page_row, valid = lookup_page(lookup_ptr, lookup_stride, seq, blocks_j, max_pages, num_pages,
                                            PAGE_SIZE // RATIO)
        out_at = out_ptr + (page * out_stride + out_layer_offset + page_row.to(tl.int64) * HEAD_DIM)[:, None]
        store_ok = (j_ok & valid)[:, None]
    else:
        out_at = out_ptr + (seq * max_blocks + blocks_j).to(tl.int64)[:, None] * out_stride
        store_ok = (blocks_j < max_blocks)[:, None]
    tl.store(out_at + half_ch[None, :], tl.where(keep, y_lo, 0.0), mask=store_ok & half_ok[None, :])
    tl.store(out_at + HALF + half_ch[None, :], tl.where(keep, y_hi, 0.0), mask=store_ok & half_ok[None, :])
    tl.store(out_at + rest_a_ch[None, :], tl.where(keep, x_rest_a, 0.0), mask=store_ok & rest_a_ok[None, :])
    tl.store(out_at + rest_b_ch[None, :], tl.where(keep, x_rest_b, 0.0), mask=store_ok & rest_b_ok[None, :])


@triton.jit
def _load_blocks_kernel(
    out_ptr, key_counts_ptr, blocks_ptr, lookup_ptr,
    max_blocks, num_pages, max_pages, lookup_stride, page_stride, layer_offset, out_stride,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, PER_PAGE: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr,
):
    """Rows ``seq * max_blocks + j`` of ``out``, ``BJ`` per program: block ``j`` of the block-key cache (row ``j %
    PER_PAGE`` of its page) while ``j`` is below the sequence's complete blocks, else zero."""
    seq = tl.program_id(0)
    blocks_j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    num_blocks = tl.minimum(tl.maximum(tl.load(key_counts_ptr + seq), 0) // RATIO, max_blocks)
    page, page_row, valid = lookup_page(lookup_ptr, lookup_stride, seq, blocks_j, max_pages, num_pages, PER_PAGE)
    channels = tl.arange(0, BD)
    channel_ok = channels < HEAD_DIM
    read = ((blocks_j < num_blocks) & valid)[:, None] & channel_ok[None, :]
    rows = tl.load(blocks_ptr + (page * page_stride + layer_offset + page_row.to(tl.int64) * HEAD_DIM)[:, None]
                   + channels[None, :], mask=read, other=0.0)
    out_at = out_ptr + (seq * max_blocks + blocks_j).to(tl.int64)[:, None] * out_stride + channels[None, :]
    tl.store(out_at, rows, mask=(blocks_j < max_blocks)[:, None] & channel_ok[None, :])


def _compress_launch(head_dim: int) -> dict:
    """Launch parameters of the compress kernel for keys of ``head_dim`` channels: ``BJ`` blocks per program,
    and its warps. One warp of 8 blocks at ``D = 128`` (an H200, bf16, B=64 x 32k and B=4 x 128k keys): 1.25x
    and 1.31x the 32 blocks on 4 warps, the same bits."""
    return {"BJ": max(1, min(8, 1024 // next_pow2(head_dim))), "num_warps": 1}


def _load_blocks_launch(head_dim: int) -> dict:
    """Launch parameters of the block-key load kernel for keys of ``head_dim`` channels: ``BJ`` rows per
    program, and its warps."""
    return {"BJ": max(1, min(64, 8192 // next_pow2(head_dim))), "num_warps": 4}


def _rest_tile_width(head_dim: int, half: int) -> int:
    """Width of each of the compress kernel's two pass-through tiles (``head_dim - 2 * half`` channels)."""
    return max(1, next_pow2(head_dim - 2 * half) // 2)


def qsa_compress_keys_paged(
    block_keys: torch.Tensor,
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
    eps: float,
) -> None:
    """Pool every complete ``ratio``-token block into one normed, rotated key (see the reference).

    ``block_keys [B*max_blocks, D]``, one program per (sequence, ``BJ`` blocks);
    every row is written (zeros past a sequence's complete blocks). Example:
    ``key_counts = [9, 3]``, ``ratio = 4``, 2 rows per sequence: rows 0, 1 pool
    tokens 0..3 and 4..7, rows 2, 3 are zero.
    """
    batch = key_counts.shape[0]
    if batch == 0 or block_keys.shape[0] == 0:
        return
    max_blocks = block_keys.shape[0] // batch
    if max_blocks == 0:
        return
    head_dim = block_keys.shape[1]
    rotary_dim = freqs_cis.shape[1]
    _, _, _, page_size, num_heads, _ = blocks.shape
    if _common.host_checks(block_keys.device):
        needed = torch.clamp(key_counts.to(torch.int64) // ratio, max=max_blocks)
        check_freqs_cis_rows(freqs_cis.shape[0], needed, ratio)
        check_needed_pages(lookup_table, blocks.shape[0], page_size, needed * ratio)
    if block_keys.stride(1) != 1:
        packed = torch.empty(block_keys.shape, dtype=block_keys.dtype, device=block_keys.device)
        qsa_compress_keys_paged(packed, gamma, freqs_cis, key_counts, blocks, lookup_table, layer, ratio, eps)
        block_keys.copy_(packed)
        return
    gamma, freqs_cis = gamma.contiguous(), unit_stride(freqs_cis)
    key_counts, lookup_table = unit_stride(key_counts), unit_stride(lookup_table)
    half = rotary_dim // 2
    launch = _compress_launch(head_dim)
    grid = (batch, triton.cdiv(max_blocks, launch["BJ"]))
    row_width = num_heads * head_dim
    _compress_kernel[grid](
        block_keys, gamma, freqs_cis, key_counts, blocks, lookup_table, key_counts,
        max_blocks, blocks.shape[0], lookup_table.shape[1], lookup_table.stride(0), page_stride_of(blocks),
        layer * page_size * row_width, freqs_cis.shape[0], freqs_cis.stride(0),
        block_keys.stride(0), 0, float(eps),
        RATIO=ratio, HEAD_DIM=head_dim, HALF=half, PAGE_SIZE=page_size, ROW_WIDTH=row_width,
        DTYPE=TL_DTYPES[block_keys.dtype],
        BH=next_pow2(half), BR=_rest_tile_width(head_dim, half), PAGED_OUT=False,
        enable_fp_fusion=False,  # keep each product rounded like the reference
        **launch,
    )


def qsa_store_block_keys_paged(
    block_blocks: torch.Tensor,
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    first_blocks: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
    eps: float,
    max_new_blocks: int,
) -> None:
    """The compress kernel over blocks ``first_blocks[b] ..`` of each sequence, written into the block-key
    cache (see the reference); one program per (sequence, ``BJ`` of at most ``max_new_blocks`` new blocks)."""
    batch = key_counts.shape[0]
    if batch == 0 or max_new_blocks <= 0:
        return
    head_dim = block_blocks.shape[-1]
    _, _, _, page_size, num_heads, _ = blocks.shape
    if _common.host_checks(block_blocks.device):
        needed = key_counts.to(torch.int64) // ratio
        check_freqs_cis_rows(freqs_cis.shape[0], needed, ratio)
        check_needed_pages(lookup_table, blocks.shape[0], page_size, needed * ratio)
        check_needed_pages(lookup_table, block_blocks.shape[0], block_blocks.shape[3], needed)
    gamma, freqs_cis = gamma.contiguous(), unit_stride(freqs_cis)
    key_counts, first_blocks = unit_stride(key_counts), unit_stride(first_blocks)
    lookup_table = unit_stride(lookup_table)
    half = freqs_cis.shape[1] // 2
    launch = _compress_launch(head_dim)
    grid = (batch, triton.cdiv(max_new_blocks, launch["BJ"]))
    row_width = num_heads * head_dim
    per_page = block_blocks.shape[3]
    _compress_kernel[grid](
        block_blocks, gamma, freqs_cis, key_counts, blocks, lookup_table, first_blocks,
        0, blocks.shape[0], lookup_table.shape[1], lookup_table.stride(0), page_stride_of(blocks),
        layer * page_size * row_width, freqs_cis.shape[0], freqs_cis.stride(0),
        page_stride_of(block_blocks), layer * per_page * head_dim, float(eps),
        RATIO=ratio, HEAD_DIM=head_dim, HALF=half, PAGE_SIZE=page_size, ROW_WIDTH=row_width,
        DTYPE=TL_DTYPES[block_blocks.dtype],
        BH=next_pow2(half), BR=_rest_tile_width(head_dim, half), PAGED_OUT=True,
        enable_fp_fusion=False, **launch,
    )


def qsa_load_block_keys_paged(
    block_keys: torch.Tensor,
    key_counts: torch.Tensor,
    block_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
) -> None:
    """Rows of a block-key cache copied out in compress's layout (see the reference); one program per
    (sequence, ``BJ`` rows). A missing page reads as zeros."""
    batch = key_counts.shape[0]
    if batch == 0 or block_keys.shape[0] == 0:
        return
    max_blocks = block_keys.shape[0] // batch
    head_dim, per_page = block_keys.shape[1], block_blocks.shape[3]
    if _common.host_checks(block_keys.device):
        needed = torch.clamp(key_counts.to(torch.int64) // ratio, max=max_blocks)
        check_needed_pages(lookup_table, block_blocks.shape[0], per_page, needed)
    if block_keys.stride(1) != 1:
        packed = torch.empty(block_keys.shape, dtype=block_keys.dtype, device=block_keys.device)
        qsa_load_block_keys_paged(packed, key_counts, block_blocks, lookup_table, layer, ratio)
        block_keys.copy_(packed)
        return
    key_counts, lookup_table = unit_stride(key_counts), unit_stride(lookup_table)
    launch = _load_blocks_launch(head_dim)
    _load_blocks_kernel[(batch, triton.cdiv(max_blocks, launch["BJ"]))](
        block_keys, key_counts, block_blocks, lookup_table,
        max_blocks, block_blocks.shape[0], lookup_table.shape[1], lookup_table.stride(0),
        page_stride_of(block_blocks), layer * per_page * head_dim, block_keys.stride(0),
        RATIO=ratio, HEAD_DIM=head_dim, PER_PAGE=per_page, BD=next_pow2(head_dim), **launch,
    )


# ---------------------------------------------------------------------------
# block score (SPEC 2.3)
# ---------------------------------------------------------------------------
def qsa_block_score(
    scores: torch.Tensor,
    q: torch.Tensor,
    block_keys: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    ratio: int,
    score_scale: float,
) -> None:
    """``scores[r, g] = sum_h relu(q[r, h] . block_keys[b*max_blocks + g]) / score_scale`` (see the reference).

    Fused per (row tile of one sequence, 64 blocks): ReLU per head, head sum,
    division, block-causal mask, ``-inf`` beyond ``max_blocks``.
    """
    batch = input_row_offsets.shape[0] - 1
    if batch <= 0:
        return
    max_blocks = block_keys.shape[0] // batch
    launch_score(scores, q, block_keys, query_positions, input_row_offsets, ratio,
                 min(max_blocks, scores.shape[1]), keys_per_seq=max_blocks, score_scale=score_scale)


def qsa_block_score_paged(
    scores: torch.Tensor,
    q: torch.Tensor,
    block_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    ratio: int,
    score_scale: float,
) -> None:
    """The block score over a block-key cache's pages (see the reference): the score kernel's paged keys,
    without head weights. A missing page reads as zeros (checked on the host where the reference would)."""
    if scores.shape[0] == 0 or input_row_offsets.shape[0] <= 1:
        return
    if _common.host_checks(scores.device):
        check_needed_pages(lookup_table, block_blocks.shape[0], block_blocks.shape[3],
                           keys_seen(query_positions, input_row_offsets, ratio, scores.shape[1]))
    launch_score(scores, q, block_blocks, query_positions, input_row_offsets, ratio, scores.shape[1],
                 score_scale=score_scale, lookup_table=lookup_table, layer=layer)
