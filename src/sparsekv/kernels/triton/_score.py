"""One score kernel for both indexers: QSA block scores (SPEC 2.3) and k-pool pool scores (SPEC 3.3).

For query row ``r`` of sequence ``b`` at position ``t`` and key ``g``::

    qsa:    score[r, g] = sum_h relu(q[r, h] . K_g) / score_scale
    k-pool: score[r, g] = sum_h w[r, h] * relu(q[r, h] . K_g)

for the visible keys ``g < min((t+1) // ratio, col_limit)``, ``-inf`` elsewhere.
QSA keys are dense rows ``block_keys[b*max_blocks + g]``; k-pool keys live in a
paged cache (pool ``g`` is row ``g % pools_per_page`` of page
``lookup[b, g // pools_per_page]``; a missing page reads as zeros).

Work split: a program owns ``BQ`` consecutive rows of ONE sequence (so the key
tile it loads serves all of them) and ``BG`` key columns. Heads go into the
``M`` side of the matrix product, ``HB`` at a time: ``M = BQ*HB`` rows of
(query row, head) pairs against ``BG`` keys. ``BQ`` is picked from the shapes
(average rows per sequence), which keeps decode (one row per sequence) from
wasting tensor-core rows; it never depends on values in device tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    find_tile,
    lookup_page,
    mma,
    next_pow2,
    page_stride_of,
    unit_stride,
)

_KEY_TILE = 128
"""Keys per program of the tensor-core (bf16/fp16) score; the fp32 one, on FMA units, takes 32. On an H200 (B=64 x
32k keys) the QSA block score ran 1.07x and the k-pool score 1.09x faster than with 64, the same bits."""


@triton.jit
def _score_kernel(
    scores_ptr, q_ptr, keys_ptr, weights_ptr, lookup_ptr, positions_ptr, offsets_ptr,
    num_seqs, col_limit, out_cols, keys_per_seq, score_scale,
    scores_stride, q_stride_row, q_stride_head, keys_stride, weights_stride,
    lookup_stride, max_pages, num_pages, page_stride, layer_offset,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, RATIO: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_WEIGHTS: tl.constexpr, DOT_FP32: tl.constexpr,
    BQ: tl.constexpr, HB: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, SEQS_P: tl.constexpr,
):
    pid = tl.program_id(0)
    seq, row_start, row_end = find_tile(offsets_ptr, pid, num_seqs, BQ, SEQS_P)
    seq = tl.maximum(seq, 0)  # past the last tile: an empty row range, nothing is read or written

    rows = row_start + tl.arange(0, BQ)
    row_ok = rows < row_end
    t = tl.load(positions_ptr + rows, mask=row_ok, other=-1)
    visible = tl.minimum(tl.maximum(t + 1, 0) // RATIO, col_limit)
    visible = tl.where(row_ok, visible, 0)
    most_visible = tl.max(visible, axis=0)

    cols = tl.program_id(1) * BG + tl.arange(0, BG)
    acc = tl.zeros((BQ, BG), dtype=tl.float32)
    if tl.program_id(1) * BG < most_visible:
        dims = tl.arange(0, BD)
        dim_ok = dims < HEAD_DIM
        key_ok = cols < most_visible
        if PAGED:
            page, page_row, valid = lookup_page(lookup_ptr, lookup_stride, seq, cols, max_pages, num_pages,
                                                PAGE_SIZE)
            key_ok = key_ok & valid
            key_rows = page * page_stride + layer_offset + page_row.to(tl.int64) * keys_stride
        else:
            key_rows = (seq * keys_per_seq + cols).to(tl.int64) * keys_stride
        keys = tl.load(keys_ptr + key_rows[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                       other=0.0)
        if DOT_FP32:
            keys = keys.to(tl.float32)
        pair = tl.arange(0, BQ * HB)
        pair_row = row_start + pair // HB
        pair_row_ok = pair_row < row_end
        for h0 in tl.static_range(0, NUM_HEADS, HB):
            pair_head = h0 + pair % HB
            pair_ok = pair_row_ok & (pair_head < NUM_HEADS)
            q_offsets = pair_row.to(tl.int64) * q_stride_row + pair_head * q_stride_head
            q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=pair_ok[:, None] & dim_ok[None, :],
                        other=0.0)
            if DOT_FP32:
                dots = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")
            else:
                dots = mma(q, tl.trans(keys))
            dots = tl.maximum(dots, 0.0)
            if HAS_WEIGHTS:
                w = tl.load(weights_ptr + pair_row.to(tl.int64) * weights_stride + pair_head, mask=pair_ok,
                            other=0.0)
                dots = dots * w[:, None]
            acc += tl.sum(tl.reshape(dots, (BQ, HB, BG)), axis=1)
        if not HAS_WEIGHTS:
            acc = acc / score_scale
    result = tl.where(cols[None, :] < visible[:, None], acc, float("-inf"))
    out = scores_ptr + rows.to(tl.int64)[:, None] * scores_stride + cols[None, :]
    tl.store(out, result, mask=row_ok[:, None] & (cols < out_cols)[None, :])


def _score_launch(total_q: int, num_seqs: int, num_heads: int, dot_fp32: bool) -> dict:
    """Launch parameters of the score kernel: ``BQ`` query rows of one sequence times ``HB`` heads per matrix
    product, ``BG`` keys per program, and its warps.

    ``M = BQ * HB`` (query rows x heads) is 16..64, 32 for fp32, which runs on FMA units.
    """
    max_m = 32 if dot_fp32 else 64
    heads_per_dot = min(next_pow2(num_heads), max_m)
    rows_per_seq = -(-total_q // num_seqs)
    rows_per_tile = min(max(next_pow2(rows_per_seq), max(1, 16 // heads_per_dot)), max(1, max_m // heads_per_dot))
    return {"BQ": rows_per_tile, "HB": heads_per_dot, "BG": 32 if dot_fp32 else _KEY_TILE,
            "num_warps": 8 if dot_fp32 else 4}


def launch_score(
    scores: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    ratio: int,
    col_limit: int,
    *,
    keys_per_seq: int = 0,
    score_scale: float = 1.0,
    head_weights: torch.Tensor | None = None,
    lookup_table: torch.Tensor | None = None,
    layer: int = 0,
) -> None:
    """Fill ``scores [T, out_cols]`` float32 (see the module docstring).

    Dense keys: ``keys [B*keys_per_seq, D]``. Paged keys: ``keys`` is the pooled
    cache ``[num_pages, KV, L, pools_per_page, 1, D]`` and ``lookup_table`` is given.
    """
    total_q, num_heads, head_dim = q.shape
    out_cols = scores.shape[1]
    num_seqs = input_row_offsets.shape[0] - 1
    if total_q == 0 or out_cols == 0 or num_seqs <= 0:
        return
    q, query_positions, input_row_offsets = unit_stride(q), unit_stride(query_positions), unit_stride(input_row_offsets)
    if head_weights is not None:
        head_weights = unit_stride(head_weights)
    if lookup_table is None:
        keys = unit_stride(keys)
    else:
        lookup_table = unit_stride(lookup_table)
    if scores.stride(1) != 1:  # the kernel writes unit-stride rows; go through a packed buffer
        packed = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
        launch_score(packed, q, keys, query_positions, input_row_offsets, ratio, col_limit,
                     keys_per_seq=keys_per_seq, score_scale=score_scale, head_weights=head_weights,
                     lookup_table=lookup_table, layer=layer)
        scores.copy_(packed)
        return
    paged = lookup_table is not None
    dot_fp32 = q.dtype == torch.float32 or q.dtype != keys.dtype
    if paged:
        _, _, _, page_size, _, _ = keys.shape
        page_stride = page_stride_of(keys)
        layer_offset = layer * page_size * keys.shape[4] * head_dim
        keys_stride = keys.shape[4] * head_dim
        lookup = lookup_table
        lookup_stride, max_pages, num_pages = lookup.stride(0), lookup.shape[1], keys.shape[0]
    else:
        page_size, page_stride, layer_offset, keys_stride = 1, 0, 0, keys.stride(0)
        lookup, lookup_stride, max_pages, num_pages = input_row_offsets, 0, 0, 0
    weights = head_weights if head_weights is not None else scores
    launch = _score_launch(total_q, num_seqs, num_heads, dot_fp32)
    grid = (triton.cdiv(total_q, launch["BQ"]) + num_seqs, triton.cdiv(out_cols, launch["BG"]))
    _score_kernel[grid](
        scores, q, keys, weights, lookup, query_positions, input_row_offsets,
        num_seqs, col_limit, out_cols, keys_per_seq, float(score_scale),
        scores.stride(0), q.stride(0), q.stride(1), keys_stride, weights.stride(0),
        lookup_stride, max_pages, num_pages, page_stride, layer_offset,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, RATIO=ratio, PAGED=paged, PAGE_SIZE=page_size,
        HAS_WEIGHTS=head_weights is not None,
        DOT_FP32=dot_fp32, BD=max(next_pow2(head_dim), 16), SEQS_P=next_pow2(num_seqs), **launch,
    )
