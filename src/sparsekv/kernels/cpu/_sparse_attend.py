"""Attention of query rows over the paged rows each selected: the CPU kernel behind QSA's (SPEC 2.5) and
MLA's (SPEC 3.4) sparse attention, and behind MLA's expanded prefill (one query head per KV head).

Per task (a query row, one KV head, a chunk of that KV head's query heads):

* the chunk's queries are the lanes of one query tile; Q.K runs with the
  register tile of :mod:`._tile_ir` on the selected keys where they lie in
  the pages (:func:`._tile_ops.dots_of_gathered_rows` through the rows' flat
  starts; bf16 as channel pairs on ``VDPBF16PS``, fp16 widened into scratch
  first), ``[keys x lanes]`` logits;
* softmax per lane with the vectorised float32 :func:`._math.exp_f32`;
* P.V with :func:`._tile_ops.weighted_rows` (tiles of 12, 8 or 4 lanes x 32
  channels, keys in order) over the values, gathered into scratch a batch
  at a time; P.V on one batch of ``VALUE_ROWS`` prefetches the next (a line
  per row per 32 channels), so their scattered rows arrive during the
  multiply-adds and the gather copies them from cache; one division per
  output (times ``sigmoid(gate)`` for QSA's gated attention).

Where the values lie is the caller's: QSA's in the value plane, MLA's in the
first ``v_dim`` channels of the latent row itself (``value_shift = 0``).

A KV head with at most 8 query heads fills half a tile or less. In a
prefill, where one sequence has many consecutive rows whose selections
overlap (every causal token below the top-k, neighbours' top-k beyond),
``16 // group`` consecutive rows share one tile, 32 rows (two vectors) with
one query head per KV head (:func:`attend_packed_rows`): their queries are
its lanes, the keys the union of their selections in position order, and a
key a row did not select weighs an exact 0 for that row's lanes, so each
row's bits are the ones it gets alone. Rows whose union is too large, whose
positions are not increasing, or that span two sequences run one by one.
The union of a group serves every KV head; with several KV heads a task
takes up to ``GROUPS_PER_TASK`` groups and runs them KV head by KV head
(:func:`attend_row_groups`), so a head's keys, read again by the next group,
are still in cache.

A KV head with more than 8 query heads (MLA's 16-128) may instead sum its
softmax denominators and P.V in chunks of ``key_chunk`` keys, added in
order at the end. When a call has fewer (row, KV head) pairs than threads
(a decode step of one sequence), the chunks are the tasks
(:func:`split_rows_kernel`): each thread reads its chunk's rows for every
head, where a split of the heads had each thread read every row (at 16 heads
on two threads: one task, one thread, 1.27 -> 0.85 ms). The chunking is a
property of the row, so the bits do not depend on which way it ran.

Heads are split into chunks only as far as needed to give every thread a
task (a decode step of one sequence still uses every core); each head's
arithmetic is the same whatever chunk or tile it lands in (lanes are
independent, the channel and key orders fixed), so results do not depend on
the thread count or the batch. Tasks run in :func:`._parallel.balanced_order`
(a causal prefill's late rows select more keys than its early ones).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange

from ..._address import array_at
from ._bits import narrow, numba_dtype, widen
from ._math import exp_weights, scale_logits, scaled_softmax_in_place, scaled_softmax_of_members
from ._pages import plan_counted_rows
from ._paged_rows import flat_span, plane_base, plane_span, query_tile_of_heads, token_starts, zero_heads
from ._parallel import PARALLEL_JIT, balanced_order, threads_for
from ._tile_ir import KEYS_PER_TILE, VECTOR, WEIGHTED_CHANNELS
from ._tile_ops import (VALUE_ROWS, dots_of_gathered_rows, gather_rows, new_query_tiles, new_scratch,
                        new_value_scratch, put_queries, weighted_rows)

GROUPS_PER_TASK = 8  # groups of rows sharing a tile per task, at most (several KV heads)


@numba.njit(cache=True, nogil=True)
def dots_at_positions(logits, starts, q_t, positions, table_row, cache, page_stride, key_base, page_size, kv_heads,
                      kv_head, dim):
    """Q.K of the query tile ``q_t`` with KV head ``kv_head``'s keys (``dim`` channels) at ``positions`` of one
    sequence, read where they lie: ``starts`` (``>= count + 2 * KEYS_PER_TILE``) gets the keys' flat starts
    (:func:`._paged_rows.token_starts`), ``logits`` (``>= count + KEYS_PER_TILE`` rows) the dots."""
    count, lanes = positions.shape[0], q_t.shape[1]
    token_starts(starts, positions, table_row, page_size, page_stride, key_base, kv_heads, kv_head, dim)
    dots_of_gathered_rows(logits, q_t, cache, starts, count, dim, lanes, new_scratch(cache, dim))


@numba.njit(cache=True, nogil=True)
def add_weighted_values(acc, weights, value_starts, cache, count, lanes_used, v_dim):
    """``acc[l] += sum_n weights[n, l] * value_n`` over the ``count`` rows of ``v_dim`` channels at ``value_starts``
    (keys in order), gathered ``VALUE_ROWS`` at a time; P.V on one batch prefetches the next, so its
    scattered rows arrive during the multiply-adds. That holds for MLA's values too, which are the latent
    rows Q.K read: Q.K has passed 1-2 MB of rows since (the whole selection, or a key chunk), so the first
    ones have left the L2 (64 heads, 2048 rows, caches flushed between calls: 1-4% faster, 3 shapes)."""
    values = new_value_scratch(cache, v_dim, acc.shape[1])  # bf16 stays bits; padding channels 0
    for n0 in range(0, count, VALUE_ROWS):
        rows = min(VALUE_ROWS, count - n0)
        gather_rows(values, cache, value_starts[n0:], rows, v_dim)
        # the next batch's starts (fewer near the end: the slice stops at the array's end)
        weighted_rows(acc, weights[n0:], values, lanes_used, rows, cache,
                      value_starts[n0 + VALUE_ROWS : n0 + 2 * VALUE_ROWS])


@numba.njit(cache=True, nogil=True)
def add_chunk(acc, denom, part, part_denom, lanes_used):
    """``acc += part``, ``denom += part_denom``: a key chunk's partial sums joining those before it."""
    for lane in range(lanes_used):
        denom[lane] += part_denom[lane]
        for d in range(acc.shape[1]):
            acc[lane, d] += part[lane, d]


@numba.njit(cache=True, nogil=True)
def attend_positions(q_t, positions, table_row, cache, page_stride, key_base, value_shift, page_size, kv_heads,
                     kv_head, dim, scale, selected, lanes_used, v_dim, padded_v, key_chunk):
    """One pass of the query tile ``q_t`` (``lanes`` wide) over KV head ``kv_head``'s keys (``dim`` channels)
    at ``positions`` of one sequence: Q.K where the keys lie, the softmax per lane (``selected [count,
    lanes]``: only the keys each lane counts, :func:`._math.scaled_softmax_of_members`; ``None``: every key),
    then P.V over the first ``v_dim`` channels of the rows ``value_shift`` elements after the keys.
    With ``key_chunk > 0`` (and ``selected`` None) the denominators and P.V sum each ``key_chunk`` keys
    apart, then add the chunks' sums in order: the arithmetic of :func:`split_rows_kernel`. Returns the
    unnormalised ``acc [lanes, padded_v]`` and the lanes' ``row_max`` and ``denom``."""
    count, lanes = positions.shape[0], q_t.shape[1]
    logits = np.empty((count + KEYS_PER_TILE, lanes), np.float32)
    starts = np.empty(count + 2 * KEYS_PER_TILE, np.int64)
    dots_at_positions(logits, starts, q_t, positions, table_row, cache, page_stride, key_base, page_size, kv_heads,
                      kv_head, dim)
    starts += value_shift
    acc = np.zeros((lanes, padded_v), np.float32)
    if key_chunk > 0 and count > key_chunk:
        row_max = np.full(lanes, -np.inf, np.float32)
        scale_logits(logits, 0, count, lanes, scale, row_max)
        denom = np.zeros(lanes, np.float32)
        part = np.empty((lanes, padded_v), np.float32)
        part_denom = np.empty(lanes, np.float32)
        for c0 in range(0, count, key_chunk):
            c1 = min(c0 + key_chunk, count)
            part[:] = 0.0
            part_denom[:] = 0.0
            exp_weights(logits, c0, c1, lanes, row_max, part_denom)
            add_weighted_values(part, logits[c0:], starts[c0:], cache, c1 - c0, lanes_used, v_dim)
            add_chunk(acc, denom, part, part_denom, lanes_used)
        return acc, row_max, denom
    if selected is None:
        row_max, denom = scaled_softmax_in_place(logits, count, lanes, scale)
    else:
        row_max, denom = scaled_softmax_of_members(logits, count, selected, scale)
    add_weighted_values(acc, logits, starts, cache, count, lanes_used, v_dim)
    return acc, row_max, denom


@numba.njit(cache=True, nogil=True, error_model="numpy")
def write_heads(out, lse, acc, row_max, denom, r, h0, lane0, heads, gate, has_gate):
    """Row ``r``'s heads ``h0 ..`` from lanes ``lane0 ..`` of the tile: ``lse`` and ``acc / denom`` (times
    ``sigmoid(gate[r, h])`` in float32 when ``has_gate``). numpy's error model: without a zero-division check
    per element the division vectorises (64 heads x 512 channels, bf16: 34 -> 5 us)."""
    v_dim = out.shape[2]
    for h in range(heads):
        lane = lane0 + h
        lse[r, h0 + h] = row_max[lane] + np.log(denom[lane])
        out_row, acc_row = out[r, h0 + h], acc[lane]
        if has_gate:
            gate_row = gate[r, h0 + h]
            for d in range(v_dim):
                sigmoid = np.float32(1.0) / (np.float32(1.0) + np.exp(-widen(gate_row[d])))
                out_row[d] = narrow(acc_row[d] / denom[lane] * sigmoid, out)
        else:
            for d in range(v_dim):
                out_row[d] = narrow(acc_row[d] / denom[lane], out)


@numba.njit(cache=True, nogil=True)
def merged_selection(indices, counts, r0, rows, heads, merged, selected):
    """The union of rows ``r0 .. r0+rows-1``'s counted positions, increasing, into ``merged``, and
    ``selected[n, j*heads : (j+1)*heads]`` = row ``r0 + j`` selected ``merged[n]`` (``selected [>= union,
    lanes]`` bool; the rows written are cleared first, the rest untouched). Returns the union's size, or -1
    when a row selects nothing or its counted positions are not strictly increasing (duplicates, any
    order)."""
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
        selected[size, :] = False
        for j in range(rows):
            if nexts[j] < ends[j] and indices[r0 + j, nexts[j]] == lowest:
                selected[size, j * heads : (j + 1) * heads] = True
                nexts[j] += 1
        size += 1


@numba.njit(cache=True, nogil=True)
def packed_selection(indices, counts, seq_of_row, r0, rows, group, merged, selected):
    """:func:`merged_selection` of rows ``r0 .. r0+rows-1`` when they may share a tile: they belong to one
    sequence, each selects strictly increasing positions, and the union holds at most 3/4 of their entries
    together (else one tile costs more than a tile per row). Returns the union's size, or -1."""
    total = 0
    for j in range(rows):
        if seq_of_row[r0 + j] != seq_of_row[r0]:
            return -1
        total += max(min(counts[r0 + j], indices.shape[1]), 0)
    size = merged_selection(indices, counts, r0, rows, group, merged, selected)
    return size if size >= 0 and 4 * size <= 3 * total else -1


@numba.njit(cache=True, nogil=True)
def attend_packed_rows(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table, seq_of_row,
                       scale, gate, has_gate, r0, rows, kv_head, merged, selected, lanes, padded_v):
    """Rows ``r0 .. r0+rows-1`` (all of KV head ``kv_head``'s query heads each) in the lanes of one query tile,
    over ``merged`` (their union, :func:`packed_selection`; ``selected`` which lane counts which key). Each
    lane's bits equal a row alone's (the union keeps each row's order; unselected keys weigh an exact 0)."""
    group, dim = q.shape[1] // kv_heads, q.shape[2]
    h0 = kv_head * group
    q_t = new_query_tiles(q, 1, lanes)[0]
    for j in range(rows):
        put_queries(q_t, j * group, q[r0 + j, h0 : h0 + group])
    acc, row_max, denom = attend_positions(q_t, merged, table[seq_of_row[r0]], cache, page_stride, key_base,
                                           value_shift, page_size, kv_heads, kv_head, dim, scale, selected,
                                           rows * group, out.shape[2], padded_v, 0)
    for j in range(rows):
        write_heads(out, lse, acc, row_max, denom, r0 + j, h0, j * group, group, gate, has_gate)


@numba.njit(cache=True, nogil=True)
def attend_heads(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table, indices, counts,
                 seq_of_row, scale, gate, has_gate, r, kv_head, h0, heads, lanes, padded_v, key_chunk):
    """Row ``r``'s query heads ``h0 .. h0+heads-1`` (all reading KV head ``kv_head``) in the lanes of one tile
    (``key_chunk``: :func:`attend_positions`)."""
    dim = q.shape[2]
    count = min(counts[r], indices.shape[1])
    if count <= 0:
        zero_heads(out, lse, r, h0, heads)
        return
    q_t = query_tile_of_heads(q, r, h0, heads, lanes)
    acc, row_max, denom = attend_positions(q_t, indices[r, :count], table[seq_of_row[r]], cache, page_stride,
                                           key_base, value_shift, page_size, kv_heads, kv_head, dim, scale, None,
                                           heads, out.shape[2], padded_v, key_chunk)
    write_heads(out, lse, acc, row_max, denom, r, h0, 0, heads, gate, has_gate)


@numba.njit(cache=True, nogil=True)
def attend_row_groups(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table, indices,
                      counts, seq_of_row, scale, gate, has_gate, first_row, end_row, rows_per_group, lanes, padded_v):
    """Rows ``first_row .. end_row-1`` in groups of ``rows_per_group`` consecutive rows that share a tile
    where they qualify (:func:`packed_selection`, computed once for every KV head), else run one by one;
    KV head by KV head, so that one head's keys and values stay in cache from one group to the next."""
    group = q.shape[1] // kv_heads
    groups = (end_row - first_row + rows_per_group - 1) // rows_per_group
    most = 1
    for g in range(groups):
        total = 0
        for r in range(first_row + g * rows_per_group, min(first_row + (g + 1) * rows_per_group, end_row)):
            total += max(min(counts[r], indices.shape[1]), 0)
        most = max(most, total)
    merged = np.empty((groups, most), indices.dtype)
    selected = np.empty((groups, most, lanes), np.bool_)
    sizes = np.full(groups, -1, np.int64)
    for g in range(groups):
        r0 = first_row + g * rows_per_group
        rows = min(rows_per_group, end_row - r0)
        if rows > 1:
            sizes[g] = packed_selection(indices, counts, seq_of_row, r0, rows, group, merged[g], selected[g])
    for kv_head in range(kv_heads):
        for g in range(groups):
            r0 = first_row + g * rows_per_group
            rows = min(rows_per_group, end_row - r0)
            size = sizes[g]
            if size >= 0:
                attend_packed_rows(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table,
                                   seq_of_row, scale, gate, has_gate, r0, rows, kv_head, merged[g, :size],
                                   selected[g, :size], lanes, padded_v)
            else:
                for r in range(r0, r0 + rows):
                    attend_heads(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table,
                                 indices, counts, seq_of_row, scale, gate, has_gate, r, kv_head, kv_head * group,
                                 group, lanes, padded_v, 0)


@numba.njit(**PARALLEL_JIT)
def sparse_attention_kernel(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table,
                            indices, counts, seq_of_row, scale, gate, has_gate, heads_per_task, rows_per_task,
                            groups_per_task, key_chunk):
    """One task per (row, KV head, chunk of ``heads_per_task`` of its query heads); with ``rows_per_task > 1``
    one task per ``groups_per_task`` groups of ``rows_per_task`` rows (:func:`attend_row_groups`).

    ``cache`` is the flat cache (:func:`._paged_rows.flat_plane`): KV head ``k`` of token ``t`` has its key
    at ``key_base + (slot * kv_heads + k) * D`` in the page and its value ``value_shift`` elements further
    on (first ``Dv`` channels). ``q [total_q, q_heads, D]``; ``out [total_q, q_heads, Dv]``, ``gate`` (when
    ``has_gate``) ``[total_q, q_heads, Dv]``; ``lse [total_q, q_heads]`` float32; bf16/fp16 as bits.
    ``rows_per_task > 1`` needs every head of a KV head in one task (``heads_per_task == q_heads //
    kv_heads``) and ``rows_per_task * heads_per_task <= VECTOR``, and ``key_chunk == 0``
    (:func:`attend_positions`).
    """
    total_q, q_heads, _ = q.shape
    group = q_heads // kv_heads
    lanes = (heads_per_task * rows_per_task + VECTOR - 1) // VECTOR * VECTOR
    padded_v = (out.shape[2] + WEIGHTED_CHANNELS - 1) // WEIGHTED_CHANNELS * WEIGHTED_CHANNELS
    if rows_per_task > 1:
        rows_per_block = rows_per_task * groups_per_task
        blocks = (total_q + rows_per_block - 1) // rows_per_block
        for task in prange(blocks):
            first_row = balanced_order(task, blocks) * rows_per_block
            attend_row_groups(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table,
                              indices, counts, seq_of_row, scale, gate, has_gate, first_row,
                              min(first_row + rows_per_block, total_q), rows_per_task, lanes, padded_v)
        return
    chunks = (group + heads_per_task - 1) // heads_per_task
    for task in prange(total_q * kv_heads * chunks):
        r = balanced_order(task // (kv_heads * chunks), total_q)
        kv_head, chunk = task // chunks % kv_heads, task % chunks
        h0 = kv_head * group + chunk * heads_per_task
        attend_heads(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table, indices,
                     counts, seq_of_row, scale, gate, has_gate, r, kv_head, h0,
                     min(heads_per_task, (kv_head + 1) * group - h0), lanes, padded_v, key_chunk)


@numba.njit(**PARALLEL_JIT)
def split_rows_kernel(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table, indices,
                      counts, seq_of_row, scale, gate, has_gate, key_chunk, longest):
    """:func:`sparse_attention_kernel` with ``heads_per_task`` the whole group and ``rows_per_task == 1``, for
    a few rows, the longest counting ``longest >= 1`` entries (:func:`._pages.plan_counted_rows`), with more
    keys than ``key_chunk``: each (row, KV head)'s keys run as chunks of ``key_chunk`` in tasks of their own,
    so that every thread gets work without splitting the heads (the tile keeps all of a KV head's query heads
    as lanes, and each thread reads only its chunk's rows). Three passes: Q.K of each
    chunk with the chunk's largest logit; weights against the row's largest and the chunk's P.V; the chunks'
    sums added in order. The bits are :func:`attend_positions`' with the same ``key_chunk``."""
    total_q, q_heads, dim = q.shape
    group = q_heads // kv_heads
    lanes = (group + VECTOR - 1) // VECTOR * VECTOR
    v_dim = out.shape[2]
    padded_v = (v_dim + WEIGHTED_CHANNELS - 1) // WEIGHTED_CHANNELS * WEIGHTED_CHANNELS
    width = indices.shape[1]
    chunks = (longest + key_chunk - 1) // key_chunk
    units = total_q * kv_heads
    logits = np.empty((units, chunks, key_chunk + KEYS_PER_TILE, lanes), np.float32)
    starts = np.empty((units, chunks, key_chunk + 2 * KEYS_PER_TILE), np.int64)
    chunk_max = np.empty((units, chunks, lanes), np.float32)
    denoms = np.empty((units, chunks, lanes), np.float32)
    accs = np.empty((units, chunks, lanes, padded_v), np.float32)
    for task in prange(units * chunks):
        unit, c = task // chunks, task % chunks
        r, kv_head = unit // kv_heads, unit % kv_heads
        count = min(counts[r], width)
        if c * key_chunk >= count:
            continue
        c1 = min((c + 1) * key_chunk, count)
        q_t = query_tile_of_heads(q, r, kv_head * group, group, lanes)
        dots_at_positions(logits[unit, c], starts[unit, c], q_t, indices[r, c * key_chunk : c1],
                          table[seq_of_row[r]], cache, page_stride, key_base, page_size, kv_heads, kv_head, dim)
        chunk_max[unit, c] = -np.inf
        scale_logits(logits[unit, c], 0, c1 - c * key_chunk, lanes, scale, chunk_max[unit, c])
    for task in prange(units * chunks):
        unit, c = task // chunks, task % chunks
        r = unit // kv_heads
        count = min(counts[r], width)
        if c * key_chunk >= count:
            continue
        rows = min(key_chunk, count - c * key_chunk)
        row_max = row_max_of_chunks(chunk_max[unit], (count + key_chunk - 1) // key_chunk)
        accs[unit, c] = 0.0
        denoms[unit, c] = 0.0
        exp_weights(logits[unit, c], 0, rows, lanes, row_max, denoms[unit, c])
        value_starts = starts[unit, c]
        value_starts += value_shift
        add_weighted_values(accs[unit, c], logits[unit, c], value_starts, cache, rows, group, v_dim)
    for unit in prange(units):
        r, kv_head = unit // kv_heads, unit % kv_heads
        count = min(counts[r], width)
        if count <= 0:
            zero_heads(out, lse, r, kv_head * group, group)
            continue
        row_chunks = (count + key_chunk - 1) // key_chunk
        acc = np.zeros((lanes, padded_v), np.float32)
        denom = np.zeros(lanes, np.float32)
        for c in range(row_chunks):
            add_chunk(acc, denom, accs[unit, c], denoms[unit, c], group)
        write_heads(out, lse, acc, row_max_of_chunks(chunk_max[unit], row_chunks), denom, r, kv_head * group, 0,
                    group, gate, has_gate)


@numba.njit(cache=True, nogil=True)
def row_max_of_chunks(chunk_max, chunks):
    """The largest of the first ``chunks`` rows of ``chunk_max [>= chunks, lanes]`` per lane, in chunk order
    (the first of equal values, as one pass over the row's keys keeps)."""
    row_max = chunk_max[0].copy()
    for c in range(1, chunks):
        for lane in range(row_max.shape[0]):
            value = chunk_max[c, lane]
            row_max[lane] = value if value > row_max[lane] else row_max[lane]
    return row_max


def chunks_as_tasks(total_q: int, kv_heads: int, threads: int) -> bool:
    """Whether rows split into key chunks run them as tasks of their own (:func:`split_rows_kernel`): when
    there are fewer (row, KV head) pairs than threads."""
    return total_q * kv_heads < threads


def heads_per_task(total_q: int, kv_heads: int, group: int, threads: int) -> int:
    """Query heads per task: all ``group`` heads of a KV head, or as few whole 16-lane vectors of them as give
    each of ``threads`` threads a task."""
    splits = max(1, min(-(-threads // max(total_q * kv_heads, 1)), -(-group // VECTOR)))
    return -(-math.ceil(group / splits) // VECTOR) * VECTOR if splits > 1 else group


def rows_per_task(total_q: int, most_rows: int, group: int, per_task: int, threads: int) -> int:
    """Rows that may share a query tile: as many as fill its ``VECTOR`` lanes with whole rows' heads (at most
    8 per KV head), two vectors' worth with one head per KV head (MLA's expanded form: 32 rows were 10%
    faster than 16 on a 4k prefill, the larger union included; 4 rows of 8 heads were not faster than 2),
    where some sequence has several rows (``most_rows``: the most of one sequence) and there are tasks
    enough for each of ``threads`` threads."""
    rows = VECTOR // group if group <= VECTOR // 2 and per_task == group else 1
    rows = 2 * VECTOR if group == 1 else rows
    if rows > 1 and (most_rows < 2 or total_q < 4 * rows * threads):
        return 1
    return rows


def groups_per_task(total_q: int, kv_heads: int, rows: int, threads: int) -> int:
    """Groups of ``rows`` rows per task: with several KV heads up to ``GROUPS_PER_TASK``, as many as leave
    four tasks per thread (a KV head's keys, read again by the next group, stay in cache); one with one."""
    if kv_heads == 1 or rows == 1:
        return 1
    return max(1, min(GROUPS_PER_TASK, total_q // (rows * 4 * threads)))


def sparse_attention(out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale, gate,
                     value_plane, key_chunk=0):
    """Run :func:`sparse_attention_kernel` on torch tensors (the contract of the reference
    ``qsa_sparse_attention_paged`` / ``mla_sparse_attention_paged``): values in plane ``value_plane`` of the
    cache, or (``None``) the first ``out.shape[2]`` channels of the key rows. Counted entries are validated
    (negative positions, missing pages) before the kernel starts, so a raising call writes nothing.

    ``key_chunk > 0``: where a KV head has more than ``VECTOR // 2`` query heads (its rows never share a
    tile), a row with more keys than that sums its softmax denominators and P.V ``key_chunk`` keys at a
    time (:func:`attend_positions`); when there are fewer (row, KV head) pairs than threads, the chunks
    are the tasks (:func:`split_rows_kernel`). The bits depend on ``key_chunk``, never on the threads.

    Everything before the kernel is one pass over the rows, and the kernel takes every tensor by address
    (:func:`_attend_at`): the kernel before it (a decode step's, or the previous layer's) has evicted this
    code from the caches, where each numba or torch call measured 20-50 us (the row scan, page check and work
    count as four calls 73 us, as one pass 23 us; the whole op up to its kernel 99-124 -> 83-97 us at B=4,
    2048 selected tokens) and a numpy view of a tensor (``Tensor.numpy()``) up to 57 us.
    """
    total_q, q_heads, dim = q.shape
    if total_q == 0 or q_heads == 0:
        return
    if out.dtype != q.dtype or blocks.dtype != q.dtype or (gate is not None and gate.dtype != q.dtype):
        raise TypeError(f"sparse_attention: expected q, out, gate and the cache of one dtype, got {q.dtype}, "
                        f"{out.dtype}, {None if gate is None else gate.dtype}, {blocks.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"sparse_attention: expected float32 lse, got {lse.dtype}")
    index_dtypes = (lookup_table.dtype, indices.dtype, counts.dtype, input_row_offsets.dtype)
    if any(dtype != torch.int32 for dtype in index_dtypes):  # the kernel reads them by address as int32
        raise TypeError("sparse_attention: expected int32 lookup_table, indices, counts and input_row_offsets, got "
                        + ", ".join(str(dtype) for dtype in index_dtypes))
    kv_heads = blocks.shape[4]
    table, indices, counts = lookup_table.contiguous(), indices.contiguous(), counts.contiguous()
    seq_of_row, counted, most_rows, longest = plan_counted_rows(table, blocks.shape[0], blocks.shape[3], indices,
                                                                counts, input_row_offsets.contiguous())
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    lse_target = lse if lse.is_contiguous() else torch.empty_like(lse, memory_format=torch.contiguous_format)
    q = q.contiguous()
    gate_rows = q if gate is None else gate.contiguous()  # unread without a gate (no rows of it are made)
    value_shift = 0 if value_plane is None else value_plane * plane_span(blocks)
    group = q_heads // kv_heads
    key_chunk = key_chunk if group > VECTOR // 2 else 0
    # the split follows the threads the block gets (one while the cores are taken)
    with threads_for(counted * q_heads * (dim + out.shape[2])) as threads:
        split = 0 < key_chunk < longest and chunks_as_tasks(total_q, kv_heads, threads)
        per_task = heads_per_task(total_q, kv_heads, group, threads)
        rows = rows_per_task(total_q, most_rows, group, per_task, threads)
        _attend_at(target.data_ptr(), lse_target.data_ptr(), q.data_ptr(), gate_rows.data_ptr(), gate is not None,
                   total_q, q_heads, dim, out.shape[2], numba_dtype(q.dtype), blocks.data_ptr(), flat_span(blocks),
                   blocks.stride(0), plane_base(blocks, 0, layer), value_shift, blocks.shape[3], kv_heads,
                   table.data_ptr(), table.shape[0], table.shape[1], indices.data_ptr(), indices.shape[1],
                   counts.data_ptr(), seq_of_row, float(scale), split, key_chunk, longest, per_task, rows,
                   groups_per_task(total_q, kv_heads, rows, threads))
    if target is not out:
        out.copy_(target)
    if lse_target is not lse:
        lse.copy_(lse_target)


@numba.njit(cache=True, nogil=True)
def _attend_at(out_at, lse_at, q_at, gate_at, has_gate, total_q, q_heads, dim, v_dim, element, cache_at, span,
               page_stride, key_base, value_shift, page_size, kv_heads, table_at, batch, max_pages, indices_at, width,
               counts_at, seq_of_row, scale, split, key_chunk, longest, per_task, rows, groups):
    """:func:`split_rows_kernel` (``split``) or :func:`sparse_attention_kernel` over tensors given by address
    (:func:`sparsekv._address.array_at`; each C-contiguous): ``out [total_q, q_heads, v_dim]``, ``q`` and
    ``gate`` ``[total_q, q_heads, dim]`` and the flat cache (``span`` elements from ``cache_at``,
    :func:`._paged_rows.flat_span`) of ``element`` (:func:`._bits.numba_dtype`), float32 ``lse [total_q,
    q_heads]``, int32 ``table [batch, max_pages]``, ``indices [total_q, width]`` and ``counts [total_q]``.
    ``gate_at`` is not read without ``has_gate``."""
    out = array_at(out_at, (total_q, q_heads, v_dim), element)
    lse = array_at(lse_at, (total_q, q_heads), np.float32)
    q = array_at(q_at, (total_q, q_heads, dim), element)
    gate = array_at(gate_at, (total_q if has_gate else 0, q_heads, dim), element)
    cache = array_at(cache_at, (span,), element)
    table = array_at(table_at, (batch, max_pages), np.int32)
    indices = array_at(indices_at, (total_q, width), np.int32)
    counts = array_at(counts_at, (total_q,), np.int32)
    if split:
        split_rows_kernel(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table, indices,
                          counts, seq_of_row, scale, gate, has_gate, key_chunk, longest)
    else:
        sparse_attention_kernel(out, lse, q, cache, page_stride, key_base, value_shift, page_size, kv_heads, table,
                                indices, counts, seq_of_row, scale, gate, has_gate, per_task, rows, groups, key_chunk)
