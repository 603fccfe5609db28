"""Triton top-k block selection and expansion (SPEC 2.4, 3.3), same signature as ``reference/select.py``.

One program per query row. Rows with ``v <= K`` visible blocks take them all
(their expansion is simply ``0 .. v*ratio - 1``). Other rows find the K-th
largest score exactly, without sorting: scores are mapped to order-preserving
32-bit keys and a radix select builds the threshold 8 bits at a time, most
significant first, from a 256-bin histogram of the keys that share the bits
found so far (4 passes over the row, which stays in cache). A last pass in ascending block order
keeps every key above the threshold plus the first ``K - above`` keys equal
to it (ties to the lower block id) and writes each kept block's tokens at its
rank among the kept blocks, so the output comes out in ascending block order.

Scores are ranked like the reference ranks them: NaN as ``-inf``, ``-0.0``
equal to ``0.0``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, unit_stride

__all__ = ["select_blocks_expand"]

_SCORE_TILE = 2048
_FILL_TILE = 512


@triton.jit
def _order_keys(scores_ptr, cols, visible):
    """Order-preserving int64 keys in ``[0, 2**32)`` of ``scores[cols]``; ``-1`` for ``cols >= visible``."""
    ok = cols < visible
    s = tl.load(scores_ptr + cols, mask=ok, other=0.0)
    s = tl.where(s != s, float("-inf"), s)  # noqa: PLR0124 - NaN ranks as -inf
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ranks equal to +0.0
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
    return tl.where(ok, keys, -1)


@triton.jit
def _select_kernel(
    indices_ptr, counts_ptr, scores_ptr, positions_ptr,
    num_cols, max_selected, width, scores_stride, indices_stride,
    RATIO: tl.constexpr, RATIO_P: tl.constexpr, INCLUDE_TAIL: tl.constexpr,
    BLOCK: tl.constexpr, FILL: tl.constexpr,
):
    row = tl.program_id(0)
    t = tl.load(positions_ptr + row)
    complete = tl.maximum(t + 1, 0) // RATIO
    visible = tl.minimum(complete, num_cols)
    take_all = visible <= max_selected
    selected_tokens = tl.minimum(visible, max_selected) * RATIO
    tail_start = RATIO * complete
    tail_length = tl.where(t >= 0, t + 1 - tail_start, 0)
    if not INCLUDE_TAIL:
        tail_length = 0
    count = selected_tokens + tail_length
    tl.store(counts_ptr + row, count)

    # Everything but the selected blocks of a top-k row: all-visible tokens, tail, -1 padding.
    out_row = indices_ptr + row.to(tl.int64) * indices_stride
    fill_from = tl.where(take_all, 0, selected_tokens)
    for start in range(0, width, FILL):
        e = start + tl.arange(0, FILL)
        value = tl.where(e < selected_tokens, e, tl.where(e < count, tail_start + e - selected_tokens, -1))
        tl.store(out_row + e, value, mask=(e < width) & (e >= fill_from))

    if visible > max_selected:
        row_scores = scores_ptr + row.to(tl.int64) * scores_stride
        lanes = tl.arange(0, BLOCK)
        # Radix select, 8 bits per pass from the top: after the pass for bits
        # [shift, shift+8), ``threshold`` holds the K-th largest key's bits down
        # to ``shift`` and ``ties_wanted`` how many keys sharing those bits to take.
        threshold = (t * 0).to(tl.int64)
        ties_wanted = max_selected
        digits = tl.arange(0, 256)
        for level in tl.static_range(4):
            shift = 24 - 8 * level
            counts = tl.zeros((256,), tl.int32)
            for start in range(0, visible, BLOCK):
                keys = _order_keys(row_scores, start + lanes, visible)
                same_prefix = (keys >> (shift + 8)) == (threshold >> (shift + 8))  # invalid keys (-1) never match
                counts += tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=same_prefix)
            at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # keys with digit >= d
            digit = tl.max(tl.where(at_least >= ties_wanted, digits, -1), axis=0)
            ties_wanted -= tl.sum(tl.where(digits > digit, counts, 0), axis=0)
            threshold = threshold | (digit.to(tl.int64) << shift)

        kept_before = 0
        ties_before = 0
        member = tl.arange(0, RATIO_P)
        for start in range(0, visible, BLOCK):
            cols = start + lanes
            keys = _order_keys(row_scores, cols, visible)
            tie = (keys == threshold).to(tl.int32)
            tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie
            kept = ((keys > threshold) | ((tie == 1) & (tie_rank < ties_wanted))).to(tl.int32)
            rank = kept_before + tl.cumsum(kept, axis=0) - kept
            tokens = cols[:, None] * RATIO + member[None, :]
            slots = rank[:, None] * RATIO + member[None, :]
            tl.store(out_row + slots, tokens, mask=(kept == 1)[:, None] & (member < RATIO)[None, :])
            kept_before += tl.sum(kept, axis=0)
            ties_before += tl.sum(tie, axis=0)


def select_blocks_expand(
    indices: torch.Tensor,
    counts: torch.Tensor,
    scores: torch.Tensor,
    query_positions: torch.Tensor,
    ratio: int,
    budget: int,
    include_tail: bool,
) -> None:
    """Pick each row's top ``budget // ratio`` visible blocks and list their tokens (see the reference).

    ``indices [total_q, W]`` int32, ``counts [total_q]`` int32, ``scores
    [total_q, num_cols]`` float32. Example: ``ratio = 4``, ``budget = 8``,
    ``t = 13``, scores ``[0.5, 0.9, 0.5]``: blocks 0 and 1 (0 wins the tie
    with 2), row ``[0..7, 12, 13, -1]``, count 10.
    """
    total_q = indices.shape[0]
    if total_q == 0:
        return
    if indices.stride(1) != 1 or not counts.is_contiguous():
        packed_indices = torch.empty(indices.shape, dtype=indices.dtype, device=indices.device)
        packed_counts = torch.empty(counts.shape, dtype=counts.dtype, device=counts.device)
        select_blocks_expand(packed_indices, packed_counts, scores, query_positions, ratio, budget, include_tail)
        indices.copy_(packed_indices)
        counts.copy_(packed_counts)
        return
    scores, query_positions = unit_stride(scores.float()), unit_stride(query_positions)
    _select_kernel[(total_q,)](
        indices, counts, scores, query_positions,
        scores.shape[1], budget // ratio, indices.shape[1], scores.stride(0), indices.stride(0),
        RATIO=ratio, RATIO_P=next_pow2(ratio), INCLUDE_TAIL=bool(include_tail),
        BLOCK=_SCORE_TILE, FILL=_FILL_TILE, num_warps=8,
    )
