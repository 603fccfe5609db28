"""Triton paged store: scatter a ragged batch of ``[H, D]`` rows into their pages (SPEC 1.1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache.layout import ragged_rows, resolve_pages
from . import _common
from ._common import (
    find_sequence,
    lookup_page,
    next_pow2,
    page_stride_of,
    search_steps,
    unit_stride,
)

# Rows per program: enough bytes per program to stream at memory speed.
_TARGET_ELEMENTS = 4096


@triton.jit
def _paged_store_kernel(
    blocks_ptr, values_ptr, lookup_ptr, cache_lengths_ptr, offsets_ptr,
    total_rows, num_seqs, num_pages, max_pages, lookup_stride, page_stride, plane_layer_offset,
    values_stride_row, values_stride_head,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STEPS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < total_rows
    rows = tl.where(row_ok, rows, 0)
    seq = find_sequence(offsets_ptr, rows, num_seqs, STEPS)
    positions = tl.load(cache_lengths_ptr + seq) + rows - tl.load(offsets_ptr + seq)
    page, page_row, valid = lookup_page(lookup_ptr, lookup_stride, seq, positions, max_pages, num_pages,
                                        PAGE_SIZE)
    valid = valid & row_ok
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < NUM_HEADS * HEAD_SIZE
    head = cols // HEAD_SIZE
    channel = cols % HEAD_SIZE
    src = (rows.to(tl.int64) * values_stride_row)[:, None] + (head * values_stride_head + channel)[None, :]
    dst = (page * page_stride + plane_layer_offset + page_row.to(tl.int64) * (NUM_HEADS * HEAD_SIZE))[:, None] \
        + cols[None, :]
    mask = valid[:, None] & col_ok[None, :]
    tl.store(blocks_ptr + dst, tl.load(values_ptr + src, mask=mask), mask=mask)


def _store_launch(row_width: int) -> dict:
    """Launch parameters of the paged-store kernel for rows of ``row_width`` elements: a tile of
    ``BLOCK_ROWS x BLOCK_COLS`` elements (about ``_TARGET_ELEMENTS``) per program, and its warps."""
    block_cols = min(next_pow2(row_width), _TARGET_ELEMENTS)
    block_rows = max(1, min(64, _TARGET_ELEMENTS // block_cols))
    return {"BLOCK_ROWS": block_rows, "BLOCK_COLS": block_cols, "num_warps": 4}


def paged_store(
    blocks: torch.Tensor,
    values: torch.Tensor,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    plane: int,
    layer: int,
) -> None:
    """Write ``values [T, H, D]``: row ``i`` of sequence ``b`` to position ``cache_lengths[b] + i``.

    Same contract as the reference, except for missing pages: rows whose page
    is a sentinel or outside ``[0, num_pages)`` are skipped on a GPU (masked
    on the device, no host sync). On CPU tensors and with ``SPARSEKV_DEBUG=1``
    every destination is validated first and a missing page raises
    ``ValueError`` before any write.

    Example: cache lengths ``[5, 0]``, offsets ``[0, 2, 3]``, page size 4:
    sequence 0's rows go to positions 5, 6 (logical page 1, rows 1 and 2),
    sequence 1's row to position 0.
    """
    total_rows = values.shape[0]
    num_seqs = cache_lengths.shape[0]
    if total_rows == 0 or num_seqs == 0:
        return
    if _common.host_checks(blocks.device):
        seq_ids, local = ragged_rows(input_row_offsets)
        resolve_pages(lookup_table, blocks.shape[0], blocks.shape[3], seq_ids,
                      cache_lengths.to(torch.int64)[seq_ids] + local)
    _, _, num_layers, page_size, num_heads, head_size = blocks.shape
    values, lookup_table = unit_stride(values), unit_stride(lookup_table)
    cache_lengths, input_row_offsets = unit_stride(cache_lengths), unit_stride(input_row_offsets)
    row_width = num_heads * head_size
    launch = _store_launch(row_width)
    grid = (triton.cdiv(total_rows, launch["BLOCK_ROWS"]), triton.cdiv(row_width, launch["BLOCK_COLS"]))
    _paged_store_kernel[grid](
        blocks, values, lookup_table, cache_lengths, input_row_offsets,
        total_rows, num_seqs, blocks.shape[0], lookup_table.shape[1], lookup_table.stride(0),
        page_stride_of(blocks), (plane * num_layers + layer) * page_size * row_width,
        values.stride(0), values.stride(1),
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, PAGE_SIZE=page_size,
        STEPS=search_steps(num_seqs), **launch,
    )
