"""Pieces shared by the Triton kernels: dtype rounding, ragged-row lookup, paging, launch helpers.

Device-side helpers (``@triton.jit``) are inlined into the kernels that call
them. Host-side helpers never read device values: launch grids come from
tensor shapes only, so no op synchronises with the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..._env import host_checks

__all__ = [
    "TL_DTYPES",
    "find_sequence",
    "find_tile",
    "host_checks",
    "interpreting",
    "lookup_page",
    "mma",
    "next_pow2",
    "page_stride_of",
    "round_bf16_in_integers",
    "round_to",
    "search_steps",
    "unit_stride",
]

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Read once at import: TRITON_INTERPRET must be set before any kernel module is imported.
_INTERPRETED = tl.constexpr(interpreting())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def search_steps(batch: int) -> int:
    """Bisection steps that ``find_sequence`` needs for ``batch`` sequences (a compile-time constant)."""
    return max(1, int(batch).bit_length())


def page_stride_of(blocks: torch.Tensor) -> int:
    """Elements between consecutive pages (``blocks.stride(0)``; packed size for a single page)."""
    if blocks.shape[0] > 1:
        return blocks.stride(0)
    return blocks.stride(1) * blocks.shape[1]


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` when its last dim has unit stride, else a contiguous copy.

    Kernels step through the last dim (channels, table columns, 1-d index
    vectors) one element at a time; other strides are passed explicitly.
    """
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


@triton.jit
def round_bf16_in_integers(x):
    """fp32 ``x`` to bfloat16, rounded to nearest even in integer arithmetic (any shape).

    The final cast is exact, so the result does not depend on how a backend
    rounds that cast. NaN stays NaN (its payload is not preserved).
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    # A NaN keeps its bits with the quiet bit set: its high half is then a NaN
    # too, also where the payload sat in the low half only.
    rounded = tl.where(x != x, bits | 0x400000, rounded)  # noqa: PLR0124 - NaN test
    return rounded.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Cast fp32 ``x`` to ``DTYPE`` with round-to-nearest-even; NaN stays NaN.

    On a GPU that is the plain cast (``cvt.rn``). The interpreter's float32 ->
    bfloat16 cast truncates, so there bfloat16 goes through
    :func:`round_bf16_in_integers`, which gives the GPU cast's bits.
    """
    if _INTERPRETED and DTYPE == tl.bfloat16:
        return round_bf16_in_integers(x)
    else:
        return x.to(DTYPE)


@triton.jit
def find_sequence(offsets_ptr, rows, NUM_SEQS, STEPS: tl.constexpr):
    """Sequence of each row: the largest ``b < NUM_SEQS`` with ``offsets[b] <= row``.

    ``rows`` may be a scalar or a tensor; empty sequences are skipped because
    the largest matching ``b`` is taken. ``STEPS = search_steps(NUM_SEQS)``.
    """
    lo = rows * 0
    hi = lo + NUM_SEQS - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        go_up = tl.load(offsets_ptr + mid) <= rows
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    return lo


@triton.jit
def lookup_page(lookup_ptr, lookup_stride, seq, positions, MAX_PAGES, NUM_PAGES, PAGE_SIZE: tl.constexpr):
    """Physical page (int64) and row of (``seq``, ``positions``), and whether it may be touched.

    Invalid: a negative position, a logical page beyond the table, or a page
    outside ``[0, NUM_PAGES)`` (the sentinel included). Invalid entries get page 0.
    """
    logical = positions // PAGE_SIZE
    in_table = (positions >= 0) & (logical < MAX_PAGES)
    page = tl.load(lookup_ptr + seq.to(tl.int64) * lookup_stride + tl.where(in_table, logical, 0),
                   mask=in_table, other=-1)
    valid = in_table & (page >= 0) & (page < NUM_PAGES)
    return tl.where(valid, page, 0).to(tl.int64), positions % PAGE_SIZE, valid


@triton.jit
def mma(a, b):
    """``a @ b`` of two 16-bit tiles with fp32 accumulation (tensor cores on the GPU).

    The interpreter multiplies bfloat16 tiles as their raw 16-bit integers, so
    there they are widened to fp32 first (exact: products of 16-bit floats
    are exact in fp32).
    """
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def find_tile(offsets_ptr, tile, NUM_SEQS, TILE_ROWS: tl.constexpr, SEQS_P: tl.constexpr):
    """Row tile ``tile`` when every sequence's rows are cut into tiles of ``TILE_ROWS``.

    Returns (sequence, first row, end row); past the last tile: (-1, 0, 0),
    an empty range. The tile counts' prefix sum is taken here, over the
    ``SEQS_P >= NUM_SEQS`` lanes, so the launch needs no host-side preparation:
    a grid of ``ceil(T / TILE_ROWS) + B`` programs covers every tile.

    Example: offsets ``[0, 5, 5, 21]``, 16-row tiles: tile 0 = sequence 0 rows
    0..4, tile 1 = sequence 2 rows 5..20, tile 2 = past the end.
    """
    seqs = tl.arange(0, SEQS_P)
    seq_ok = seqs < NUM_SEQS
    starts = tl.load(offsets_ptr + seqs, mask=seq_ok, other=0)
    ends = tl.load(offsets_ptr + seqs + 1, mask=seq_ok, other=0)
    tiles = tl.where(seq_ok, (ends - starts + TILE_ROWS - 1) // TILE_ROWS, 0)
    first_tile = tl.cumsum(tiles, axis=0) - tiles
    mine = seq_ok & (first_tile <= tile) & (tile < first_tile + tiles)
    seq = tl.max(tl.where(mine, seqs, -1), axis=0)
    row_start = tl.sum(tl.where(mine, starts + (tile - first_tile) * TILE_ROWS, 0), axis=0)
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return seq, row_start, row_end
