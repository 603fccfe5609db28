"""Fast CPU sparse MLA attention (SPEC 3.4): numba, same signature as the reference.

The QSA sparse attention kernel (:mod:`.qsa`) with one KV head shared by
every query head, wider rows and values that are the rows' first
``v_head_dim`` channels. Per task (a query row and a chunk of its heads):

* the chunk's queries are the lanes of one query tile; Q.K runs with the
  register tile of :mod:`._tile_ir` on the selected latent rows where they
  lie in the pages (:func:`._tile_ops.dots_of_gathered_rows` through the rows'
  flat starts; bf16 as channel pairs on ``VDPBF16PS``, fp16 widened into
  scratch first), ``[rows x heads]`` logits over ``D = kv_lora_rank +
  qk_rope_head_dim`` channels;
* softmax per head with the vectorised float32 :func:`._math.exp_f32` (:func:`._math.scaled_softmax_in_place`);
* P.V with :func:`._tile_ops.weighted_rows` (tiles of 12, 8 or 4 heads x 32
  channels, rows in order) over the rows' first ``v_head_dim`` channels,
  copied ``KEYS_PER_TASK`` rows at a time with a prefetch ahead; one division
  per output.

Every head reads the same rows, so one row brings ``heads * (D + v_head_dim)``
multiply-adds per ``D`` elements read: at 64-128 heads the kernel is bound
by the multiply-add rate, not by memory. Nothing the size of the history is
materialised.

With at most 8 heads a row fills half a tile or less. In a prefill, where one
sequence has many consecutive rows whose selections overlap (every causal
token below the top-k, neighbours' top-k beyond), ``16 // heads`` consecutive
rows share one tile (:func:`_attend_packed_rows`): their queries are its lanes,
the keys the union of their selections in position order, and a key a row did
not select weighs an exact 0 for that row's lanes, so each row's bits are the
ones it gets alone. Rows whose union is too large, whose positions are not
increasing, or that span two sequences run one by one.

Heads are split into chunks only as far as needed to give every thread a
task (a decode step of one sequence still uses every core); each head's
arithmetic is the same whatever chunk it lands in (lanes are independent,
the channel and row orders fixed), so results do not depend on the thread
count or the batch. Counted entries are validated (negative positions,
missing pages) before the kernel starts, so a raising call writes nothing.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange

from ._bits import as_numba, narrow
from ._math import scaled_softmax_in_place, scaled_softmax_of_members
from ._pages import check_counted_entries
from ._paged_rows import flat_plane, query_tile_of_heads, sequence_of_rows, token_starts, zero_heads
from ._parallel import PARALLEL_JIT, threads_for
from ._tile_ir import KEYS_PER_TILE, VECTOR, WEIGHTED_CHANNELS
from ._tile_ops import (KEYS_PER_TASK, dots_of_gathered_rows, gather_rows, new_query_tiles, new_scratch,
                        new_value_scratch, put_query, weighted_rows)

__all__ = ["mla_sparse_attention_paged"]


@numba.njit(cache=True, nogil=True)
def _attend_positions(q_t, positions, table_row, cache, page_stride, base, page_size, dim, scale, selected,
                      lanes_used, v_dim, padded_v):
    """One pass of the query tile ``q_t`` (``lanes`` wide) over the latent rows (``dim`` channels) at
    ``positions`` of one sequence: Q.K where the rows lie, the softmax per lane (``selected [count, lanes]``:
    only the keys each lane counts, :func:`._math.scaled_softmax_of_members`; ``None``: every key), then P.V
    over the rows' first ``v_dim`` channels, ``KEYS_PER_TASK`` gathered at a time with a prefetch ahead.
    Returns the unnormalised ``acc [lanes, padded_v]`` and the lanes' ``row_max`` and ``denom``."""
    count, lanes = positions.shape[0], q_t.shape[1]
    logits = np.empty((count + KEYS_PER_TILE, lanes), np.float32)
    starts = np.empty(count + 2 * KEYS_PER_TILE, np.int64)
    token_starts(starts, positions, table_row, page_size, page_stride, base, 1, 0, dim)
    dots_of_gathered_rows(logits, q_t, cache, starts, count, dim, lanes, new_scratch(cache, dim))
    if selected is None:
        row_max, denom = scaled_softmax_in_place(logits, count, lanes, scale)
    else:
        row_max, denom = scaled_softmax_of_members(logits, count, selected, scale)
    acc = np.zeros((lanes, padded_v), np.float32)
    values = new_value_scratch(cache, v_dim, padded_v)  # bf16 stays bits; padding channels 0
    for n0 in range(0, count, KEYS_PER_TASK):
        rows = min(KEYS_PER_TASK, count - n0)
        gather_rows(values, cache, starts[n0:], rows, v_dim)  # the rows' first v_dim channels
        weighted_rows(acc, logits[n0:], values, lanes_used, rows)
    return acc, row_max, denom


@numba.njit(cache=True, nogil=True)
def _write_heads(out, lse, acc, row_max, denom, r, h0, lane0, group):
    """Row ``r``'s heads ``h0 ..`` from lanes ``lane0 ..`` of the tile: ``lse`` and ``acc / denom``."""
    v_dim = out.shape[2]
    for h in range(group):
        lane = lane0 + h
        lse[r, h0 + h] = row_max[lane] + np.log(denom[lane])
        out_row, acc_row = out[r, h0 + h], acc[lane]
        for d in range(v_dim):
            out_row[d] = narrow(acc_row[d] / denom[lane], out)


@numba.njit(cache=True, nogil=True)
def _attend_heads(out, lse, q, cache, page_stride, base, page_size, table, indices, counts, seq_of_row, scale,
                  r, h0, group, lanes, padded_v):
    """Row ``r``'s heads ``h0 .. h0+group-1`` in the lanes of one query tile."""
    dim = q.shape[2]
    count = min(counts[r], indices.shape[1])
    if count <= 0:
        zero_heads(out, lse, r, h0, group)
        return
    q_t = query_tile_of_heads(q, r, h0, group, lanes)
    acc, row_max, denom = _attend_positions(q_t, indices[r, :count], table[seq_of_row[r]], cache, page_stride, base,
                                            page_size, dim, scale, None, group, out.shape[2], padded_v)
    _write_heads(out, lse, acc, row_max, denom, r, h0, 0, group)


@numba.njit(cache=True, nogil=True)
def merged_selection(indices, counts, r0, rows, heads, merged, selected):
    """The union of rows ``r0 .. r0+rows-1``'s counted positions, increasing, into ``merged``, and
    ``selected[n, j*heads : (j+1)*heads]`` = row ``r0 + j`` selected ``merged[n]`` (``selected`` zeroed,
    ``[>= union, lanes]`` bool). Returns the union's size, or -1 when a row selects nothing or its counted
    positions are not strictly increasing (duplicates, any order)."""
    width = indices.shape[1]
    ends = np.empty(rows, np.int64)
    nexts = np.zeros(rows, np.int64)  # each row's next entry
    for j in range(rows):
        ends[j] = min(counts[r0 + j], width)
        if ends[j] <= 0:
            return -1
        for i in range(1, ends[j]):
            if indices[r0 + j, i] <= indices[r0 + j, i - 1]:
                return -1
    size = 0
    while True:
        lowest = -1
        for j in range(rows):
            if nexts[j] < ends[j]:
                position = indices[r0 + j, nexts[j]]
                lowest = position if lowest < 0 or position < lowest else lowest
        if lowest < 0:
            return size
        merged[size] = lowest
        for j in range(rows):
            if nexts[j] < ends[j] and indices[r0 + j, nexts[j]] == lowest:
                selected[size, j * heads : (j + 1) * heads] = True
                nexts[j] += 1
        size += 1


@numba.njit(cache=True, nogil=True)
def _attend_packed_rows(out, lse, q, cache, page_stride, base, page_size, table, indices, counts, seq_of_row,
                        scale, r0, rows, lanes, padded_v):
    """Rows ``r0 .. r0+rows-1`` (all heads each) in the lanes of one query tile, over the union of their
    selections, when they belong to one sequence, each selects strictly increasing positions and the union
    holds at most 3/4 of their entries together (else one tile costs more than a tile per row). Each
    lane's bits equal :func:`_attend_heads`' (the union keeps each row's order; unselected keys weigh an
    exact 0). Returns False, writing nothing, when the rows do not qualify."""
    heads, dim = q.shape[1], q.shape[2]
    b = seq_of_row[r0]
    total = 0
    for j in range(rows):
        if seq_of_row[r0 + j] != b:
            return False
        total += max(min(counts[r0 + j], indices.shape[1]), 0)
    merged = np.empty(total, indices.dtype)
    selected = np.zeros((total, lanes), np.bool_)
    size = merged_selection(indices, counts, r0, rows, heads, merged, selected)
    if size < 0 or 4 * size > 3 * total:
        return False
    q_t = new_query_tiles(q, 1, lanes)[0]
    for j in range(rows):
        for h in range(heads):
            put_query(q_t, j * heads + h, q[r0 + j, h])
    acc, row_max, denom = _attend_positions(q_t, merged[:size], table[b], cache, page_stride, base, page_size, dim,
                                            scale, selected[:size], rows * heads, out.shape[2], padded_v)
    for j in range(rows):
        _write_heads(out, lse, acc, row_max, denom, r0 + j, 0, j * heads, heads)
    return True


@numba.njit(**PARALLEL_JIT)
def _mla_attention_kernel(out, lse, q, cache, page_stride, base, page_size, table, indices, counts, seq_of_row, scale,
                          heads_per_task, rows_per_task):
    """One task per (``rows_per_task`` rows, chunk of ``heads_per_task`` heads). ``cache`` is the flat latent
    cache (``flat_plane``: plane 0, one head, rows of ``D`` channels from ``base`` in each page); ``q
    [total_q, q_heads, D]``, ``out [total_q, q_heads, v_head_dim]``, ``lse [total_q, q_heads]`` float32;
    bf16/fp16 as bits. ``rows_per_task > 1`` needs every head in one task (``heads_per_task == q_heads``)
    and ``rows_per_task * q_heads <= VECTOR``: those rows share one tile where they qualify
    (:func:`_attend_packed_rows`), else run one after the other.
    """
    total_q, q_heads, dim = q.shape
    chunks = (q_heads + heads_per_task - 1) // heads_per_task
    lanes = (heads_per_task * rows_per_task + VECTOR - 1) // VECTOR * VECTOR
    padded_v = (out.shape[2] + WEIGHTED_CHANNELS - 1) // WEIGHTED_CHANNELS * WEIGHTED_CHANNELS
    row_groups = (total_q + rows_per_task - 1) // rows_per_task
    for task in prange(row_groups * chunks):
        r0, h0 = task // chunks * rows_per_task, task % chunks * heads_per_task
        rows = min(rows_per_task, total_q - r0)
        if rows > 1 and _attend_packed_rows(out, lse, q, cache, page_stride, base, page_size, table, indices,
                                            counts, seq_of_row, scale, r0, rows, lanes, padded_v):
            continue
        group = min(heads_per_task, q_heads - h0)
        for r in range(r0, r0 + rows):
            _attend_heads(out, lse, q, cache, page_stride, base, page_size, table, indices, counts, seq_of_row,
                          scale, r, h0, group, lanes, padded_v)


def _heads_per_task(total_q: int, q_heads: int) -> int:
    """Heads per task: all of a row's heads, or as few whole 16-lane vectors as give every thread a task."""
    splits = max(1, min(-(-numba.get_num_threads() // max(total_q, 1)), -(-q_heads // VECTOR)))
    return -(-math.ceil(q_heads / splits) // VECTOR) * VECTOR if splits > 1 else q_heads


def _rows_per_task(offsets: np.ndarray, q_heads: int, heads_per_task: int) -> int:
    """Rows that may share a query tile: as many as fill its ``VECTOR`` lanes with whole rows (at most 8
    heads), where some sequence has several rows and there are tasks enough for every thread."""
    rows = VECTOR // q_heads if q_heads <= VECTOR // 2 and heads_per_task == q_heads else 1
    total_q = int(offsets[-1])
    if rows > 1 and (int(np.diff(offsets).max()) < 2 or total_q < 4 * rows * numba.get_num_threads()):
        return 1
    return rows


def mla_sparse_attention_paged(out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale):
    """Same contract as :func:`sparsekv.kernels.reference.mla.mla_sparse_attention_paged`."""
    total_q, q_heads, dim = q.shape
    if total_q == 0 or q_heads == 0:
        return
    seq_of_row = sequence_of_rows(input_row_offsets.numpy())
    check_counted_entries(lookup_table, blocks.shape[0], blocks.shape[3], indices, counts, seq_of_row)
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    lse_target = lse if lse.is_contiguous() else torch.empty_like(lse, memory_format=torch.contiguous_format)
    cache, page_stride, base = flat_plane(blocks, 0, layer)
    work = int(counts.clamp(min=0).sum()) * q_heads * (dim + out.shape[2])
    with threads_for(work):  # the split follows the threads the block gets (one while the cores are taken)
        heads_per_task = _heads_per_task(total_q, q_heads)
        _mla_attention_kernel(as_numba(target), lse_target.numpy(), as_numba(q.contiguous()), cache, page_stride,
                              base, blocks.shape[3], lookup_table.numpy(), indices.numpy(), counts.numpy(),
                              seq_of_row, float(scale), heads_per_task,
                              _rows_per_task(input_row_offsets.numpy(), q_heads, heads_per_task))
    if target is not out:
        out.copy_(target)
    if lse_target is not lse:
        lse.copy_(lse_target)
