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
from ._math import scaled_softmax_in_place
from ._pages import check_counted_entries
from ._paged_rows import flat_plane, query_tile_of_heads, sequence_of_rows, token_starts, zero_heads
from ._parallel import PARALLEL_JIT, threads_for
from ._tile_ir import KEYS_PER_TILE, VECTOR, WEIGHTED_CHANNELS
from ._tile_ops import KEYS_PER_TASK, dots_of_gathered_rows, gather_rows, new_scratch, new_value_scratch, weighted_rows

__all__ = ["mla_sparse_attention_paged"]


@numba.njit(**PARALLEL_JIT)
def _mla_attention_kernel(out, lse, q, cache, page_stride, base, page_size, table, indices, counts, seq_of_row, scale,
                          heads_per_task):
    """One task per (row, chunk of ``heads_per_task`` heads). ``cache`` is the flat latent cache
    (``flat_plane``: plane 0, one head, rows of ``D`` channels from ``base`` in each page);
    ``q [total_q, q_heads, D]``, ``out [total_q, q_heads, v_head_dim]``, ``lse [total_q, q_heads]``
    float32; bf16/fp16 as bits.

    ``logits [count, lanes]`` holds the chunk's scaled logits, then its
    softmax weights; ``acc [lanes, v_head_dim rounded up to 32]`` the
    unnormalised output.
    """
    total_q, q_heads, dim = q.shape
    v_dim = out.shape[2]
    chunks = (q_heads + heads_per_task - 1) // heads_per_task
    lanes = (heads_per_task + VECTOR - 1) // VECTOR * VECTOR
    padded_v = (v_dim + WEIGHTED_CHANNELS - 1) // WEIGHTED_CHANNELS * WEIGHTED_CHANNELS
    width = indices.shape[1]
    for task in prange(total_q * chunks):
        r, h0 = task // chunks, task % chunks * heads_per_task
        group = min(heads_per_task, q_heads - h0)
        count = min(counts[r], width)
        if count <= 0:
            zero_heads(out, lse, r, h0, group)
            continue
        b = seq_of_row[r]
        q_t = query_tile_of_heads(q, r, h0, group, lanes)
        logits = np.empty((count + KEYS_PER_TILE, lanes), np.float32)
        starts = np.empty(count + 2 * KEYS_PER_TILE, np.int64)
        token_starts(starts, indices[r, :count], table[b], page_size, page_stride, base, 1, 0, dim)
        dots_of_gathered_rows(logits, q_t, cache, starts, count, dim, lanes, new_scratch(cache, dim))
        row_max, denom = scaled_softmax_in_place(logits, count, lanes, scale)
        acc = np.zeros((lanes, padded_v), np.float32)
        values = new_value_scratch(cache, v_dim, padded_v)  # bf16 stays bits; padding channels 0
        for n0 in range(0, count, KEYS_PER_TASK):
            rows = min(KEYS_PER_TASK, count - n0)
            gather_rows(values, cache, starts[n0:], rows, v_dim)  # the same rows' first v_dim channels
            weighted_rows(acc, logits[n0:], values, group, rows)
        for h in range(group):
            lse[r, h0 + h] = row_max[h] + np.log(denom[h])
            out_row, acc_row = out[r, h0 + h], acc[h]
            for d in range(v_dim):
                out_row[d] = narrow(acc_row[d] / denom[h], out)


def _heads_per_task(total_q: int, q_heads: int) -> int:
    """Heads per task: all of a row's heads, or as few whole 16-lane vectors as give every thread a task."""
    splits = max(1, min(-(-numba.get_num_threads() // max(total_q, 1)), -(-q_heads // VECTOR)))
    return -(-math.ceil(q_heads / splits) // VECTOR) * VECTOR if splits > 1 else q_heads


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
    with threads_for(work):
        _mla_attention_kernel(as_numba(target), lse_target.numpy(), as_numba(q.contiguous()), cache, page_stride,
                              base, blocks.shape[3], lookup_table.numpy(), indices.numpy(), counts.numpy(),
                              seq_of_row, float(scale), _heads_per_task(total_q, q_heads))
    if target is not out:
        out.copy_(target)
    if lse_target is not lse:
        lse.copy_(lse_target)
