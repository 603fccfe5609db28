"""How both score kernels split their work: tasks of ``KEYS_PER_TASK`` keys, query groups in the tile's layout.

:func:`plan_score_tasks` turns a batch (``offsets``, each row's visible keys)
into tasks and transposed query groups; :func:`task_in_order` the order the
threads take them in; :func:`score_task` says which rows and keys an
iteration's task covers, :func:`row_group` which rows form a group, how many
of the keys they need (:func:`keys_seen`) and their tile lanes;
:func:`write_group_scores` is the epilogue both score kernels end with, the
weighted ReLU sum over heads: in registers on the tiles where a row's heads
divide the tile's 16 lanes or are 32 or 64, else :func:`relu_sums` over the
transposed dots.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from ._parallel import balanced_order
from ._tile_ir import KEYS_PER_TILE, VECTOR, relu_head_sums_block, relu_head_sums_pair
from ._tile_ops import KEYS_PER_TASK, new_query_tiles, put_queries, transpose_dots

LANES_PER_GROUP = 32
"""(row, head) pairs whose dot products run together over a task's keys."""


@numba.njit(cache=True)
def plan_score_tasks(scores, q, offsets, visible):
    """The set-up both score kernels share, run serially (a parallel region costs a barrier).

    Args: ``scores [total_q, out_cols]`` (columns ``>= visible[r]`` get
    ``-inf`` here), ``q [total_q, heads, D]`` (any float dtype), ``offsets
    [B+1]``, ``visible [total_q]`` keys each row sees.

    Returns ``(num_keys [B], task_starts [B+1], group_starts [B+1], q_t,
    group_rows)``: sequence ``b`` needs its first ``num_keys[b]`` keys (its
    rows' largest visibility), split into tasks ``task_starts[b] ..
    task_starts[b+1]`` of ``KEYS_PER_TASK`` keys; its rows form groups
    ``group_starts[b] ..`` of ``group_rows`` rows, and ``q_t[group]`` ``[D,
    lanes]`` (bf16: int32 pairs ``[P, lanes]``) holds a group's queries transposed (lane
    ``row*heads + h``, zeros in the padding lanes).
    """
    total_q, heads, dim = q.shape
    batch = offsets.shape[0] - 1
    group_rows = max(1, LANES_PER_GROUP // max(heads, 1))
    group_lanes = (group_rows * heads + VECTOR - 1) // VECTOR * VECTOR
    num_keys = np.zeros(batch, np.int64)
    task_starts = np.zeros(batch + 1, np.int64)
    group_starts = np.zeros(batch + 1, np.int64)
    for b in range(batch):
        for r in range(offsets[b], offsets[b + 1]):
            num_keys[b] = max(num_keys[b], visible[r])
        task_starts[b + 1] = task_starts[b] + (num_keys[b] + KEYS_PER_TASK - 1) // KEYS_PER_TASK
        group_starts[b + 1] = group_starts[b] + (offsets[b + 1] - offsets[b] + group_rows - 1) // group_rows
    q_t = new_query_tiles(q, group_starts[batch], group_lanes)
    for r in range(total_q):
        b = np.searchsorted(offsets, r, side="right") - 1
        local = r - offsets[b]
        block = q_t[group_starts[b] + local // group_rows]
        put_queries(block, local % group_rows * heads, q[r])
        score_row = scores[r]
        for k in range(visible[r], scores.shape[1]):
            score_row[k] = -np.inf
    return num_keys, task_starts, group_starts, q_t, group_rows


@numba.njit(cache=True, nogil=True, inline="always")
def task_in_order(task, task_starts, group_starts):
    """Which task of :func:`plan_score_tasks` the ``task``-th iteration runs: in key order when every
    sequence has one row group (decode: the tasks cost the same, and each run of tasks a worker takes,
    :func:`._parallel.claim_tasks`, is then one stream of a sequence's keys for the hardware prefetcher;
    10% of a 32k-block bf16 block score on one thread),
    else :func:`._parallel.balanced_order` (a causal prefill's row groups see more keys the later they
    are, so the early tasks serve more of them)."""
    batch = task_starts.shape[0] - 1
    task = np.int64(task)  # a prange index may be unsigned: one signed type for both returns
    if group_starts[batch] > batch:
        return balanced_order(task, task_starts[batch])
    return task


@numba.njit(cache=True, nogil=True, inline="always")
def score_task(iteration, task_starts, group_starts, num_keys, offsets):
    """``(b, first_row, end_row, key0, chunk)`` of the task of :func:`plan_score_tasks` that iteration
    ``iteration`` runs (:func:`task_in_order`): sequence ``b``'s rows ``first_row .. end_row - 1`` against
    its keys ``key0 .. key0 + chunk - 1``."""
    task = task_in_order(iteration, task_starts, group_starts)
    b = np.searchsorted(task_starts, task, side="right") - 1
    key0 = (task - task_starts[b]) * KEYS_PER_TASK
    return b, offsets[b], offsets[b + 1], key0, min(KEYS_PER_TASK, num_keys[b] - key0)


@numba.njit(cache=True, nogil=True, inline="always")
def keys_seen(visible, r0, r1, key0, chunk):
    """How many of a task's keys ``key0 .. key0 + chunk - 1`` rows ``r0 .. r1 - 1`` see together (``visible[r]``
    keys each): a row group computes dots for those only, none where every row ends before the chunk (the
    first rows of a causal prefill)."""
    seen = 0
    for r in range(r0, r1):
        seen = max(seen, min(chunk, visible[r] - key0))
    return seen


@numba.njit(cache=True, nogil=True, inline="always")
def row_group(r0, end_row, group_rows, visible, key0, chunk, heads):
    """``(r1, needed, lanes)`` of the row group from ``r0``: its rows ``r0 .. r1 - 1`` (at most ``group_rows``,
    none past ``end_row``), the task's keys they need (:func:`keys_seen`; none: skip the group) and its tile
    lanes (``(r1 - r0) * heads`` rounded up to a whole vector)."""
    r1 = min(r0 + group_rows, end_row)
    return r1, keys_seen(visible, r0, r1, key0, chunk), ((r1 - r0) * heads + VECTOR - 1) // VECTOR * VECTOR


@numba.njit(cache=True, nogil=True, inline="always")
def relu_sums(totals, lane_dots, lane0, heads, weights, divisor):
    """``totals[i] = (sum_h weights[h] * relu(lane_dots[lane0 + h, i])) / divisor`` for ``i <
    len(totals)``, each sum ``0 + ...`` in head order ``h = 0 .. heads-1``, one multiply and one add per
    term (a weight or a divisor of 1 changes no bit); relu keeps NaN. ``lane_dots [lanes, keys]`` from
    :func:`._tile_ops.transpose_dots`, so each pass runs over contiguous keys, vectorised: the first
    head's pass writes the totals, the last one divides them (``heads`` passes in all; no heads: ``0 /
    divisor``)."""
    seen = totals.shape[0]
    if heads == 0:  # the empty sum
        totals[:] = np.float32(0.0) / divisor
        return
    last = heads - 1
    # one loop per kind of pass: with the first/last choice inside a single loop it was not taken
    # out of the loop, and the passes ran 1.7-2.5x slower
    for h in range(heads):
        weight = weights[h]
        key_dots = lane_dots[lane0 + h, :seen]
        if h == 0 and h == last:
            for i in range(seen):
                x = key_dots[i]
                totals[i] = (np.float32(0.0) + weight * (x if not x <= np.float32(0.0) else np.float32(0.0))) / divisor
        elif h == 0:
            for i in range(seen):
                x = key_dots[i]
                totals[i] = np.float32(0.0) + weight * (x if not x <= np.float32(0.0) else np.float32(0.0))
        elif h == last:
            for i in range(seen):
                x = key_dots[i]
                totals[i] = (totals[i] + weight * (x if not x <= np.float32(0.0) else np.float32(0.0))) / divisor
        else:
            for i in range(seen):
                x = key_dots[i]
                totals[i] += weight * (x if not x <= np.float32(0.0) else np.float32(0.0))


def _unit_weights(weights, heads):
    """``heads`` float32 ones where ``weights`` is ``None``, else ``weights`` itself, unread (numba only): what
    :func:`_row_weights` hands out for a call without weights, allocated only for one."""
    raise NotImplementedError


@overload(_unit_weights, inline="always")
def _unit_weights_overload(weights, heads):
    if isinstance(weights, (numba.types.NoneType, numba.types.Omitted)):
        return lambda weights, heads: np.ones(heads, np.float32)
    return lambda weights, heads: weights


def _row_weights(weights, i, unit):
    """Row ``i`` of ``weights``, or ``unit`` where ``weights`` is ``None`` (numba only)."""
    raise NotImplementedError


@overload(_row_weights, inline="always")
def _row_weights_overload(weights, i, unit):
    if isinstance(weights, (numba.types.NoneType, numba.types.Omitted)):
        return lambda weights, i, unit: unit
    return lambda weights, i, unit: weights[i]


@numba.njit(cache=True, nogil=True, inline="always")
def _head_sums_in_registers(row_totals, dots, num_keys, lanes, heads, weights, divisor, column0):
    """:func:`._tile_ir.relu_head_sums_block` over every tile of ``dots [keys, lanes]``, key ``k`` of row
    ``i`` into ``row_totals[i, column0 + k]``, for a head count that divides the tile's 16 lanes or is 32 or
    64 (a literal per branch); returns ``False``, having written nothing, for any other (no heads
    included). Where a row's heads fill whole tiles (16, 32, 64) two tiles of keys go at once
    (:func:`._tile_ir.relu_head_sums_pair`: GLM's 32-head decode pool score 4-5% faster in bf16)."""
    if heads not in (1, 2, 4, 8, 16, 32, 64):
        return False
    first = 0
    if heads >= VECTOR:  # a row's heads fill whole tiles: two tiles' keys at once while two are left
        rounded = -(-num_keys // KEYS_PER_TILE) * KEYS_PER_TILE
        while first + 2 * KEYS_PER_TILE <= rounded:
            for lane0 in range(0, lanes, heads):
                if heads == 16:
                    relu_head_sums_pair(dots, row_totals, first, lane0, 16, weights, divisor, column0)
                elif heads == 32:
                    relu_head_sums_pair(dots, row_totals, first, lane0, 32, weights, divisor, column0)
                else:
                    relu_head_sums_pair(dots, row_totals, first, lane0, 64, weights, divisor, column0)
            first += 2 * KEYS_PER_TILE
    for key0 in range(first, num_keys, KEYS_PER_TILE):
        for lane0 in range(0, lanes, max(VECTOR, heads)):
            if heads == 1:
                relu_head_sums_block(dots, row_totals, key0, lane0, 1, weights, divisor, column0)
            elif heads == 2:
                relu_head_sums_block(dots, row_totals, key0, lane0, 2, weights, divisor, column0)
            elif heads == 4:
                relu_head_sums_block(dots, row_totals, key0, lane0, 4, weights, divisor, column0)
            elif heads == 8:
                relu_head_sums_block(dots, row_totals, key0, lane0, 8, weights, divisor, column0)
            elif heads == 16:
                relu_head_sums_block(dots, row_totals, key0, lane0, 16, weights, divisor, column0)
            elif heads == 32:
                relu_head_sums_block(dots, row_totals, key0, lane0, 32, weights, divisor, column0)
            else:
                relu_head_sums_block(dots, row_totals, key0, lane0, 64, weights, divisor, column0)
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _sees_every_key(visible, r0, r1, key0, keys):
    """Whether each of rows ``r0 .. r1 - 1`` sees keys ``key0 .. key0 + keys - 1``."""
    for r in range(r0, r1):
        if visible[r] < key0 + keys:
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def write_group_scores(scores, dots, work, r0, r1, key0, chunk, needed, visible, lanes, heads, weights, divisor):
    """``scores[r, key0 + i] = (sum_h w_rh * relu(dots[i, (r - r0) * heads + h])) / divisor`` for rows ``r0 ..
    r1 - 1`` and the ``i < min(chunk, visible[r] - key0)`` keys each row sees: the epilogue of both score
    kernels, :func:`relu_sums`' bits.

    ``dots [>= needed rounded up to 8, >= lanes]`` one row group's dot products (lane ``(r - r0) * heads +
    h``) for the ``needed`` keys its rows see (:func:`row_group`); ``work`` float32 ``[>= lanes, >= needed
    rounded up to 8]`` scratch; ``weights`` ``None`` (all 1) or float32 ``[>= lanes // heads, heads]`` (row
    ``r - r0``; rows past ``r1 - r0`` are read when ``heads`` divides 16: keep them finite). Where ``heads``
    divides 16 or is 32 or 64 the sums run on the tiles in registers (:func:`._tile_ir.relu_head_sums_block`):
    straight into ``scores`` where ``heads`` divides 16, the rows fill the lanes and each sees every key the
    tiles write (a decode step's chunks but its last; a 2 MB score matrix then wrote 10% faster than through
    ``work``, while 32 heads, one row per tile, measured 2% slower), else into ``work``'s rows, copied out;
    other head counts transpose ``dots`` into ``work`` and run :func:`relu_sums` over each lane's keys.
    """
    written = -(-needed // KEYS_PER_TILE) * KEYS_PER_TILE  # keys per row a tile epilogue writes
    if (heads <= VECTOR and (r1 - r0) * heads == lanes and written <= chunk
            and _sees_every_key(visible, r0, r1, key0, written)):
        # every lane group a real row that sees every key written: the tiles write the scores themselves
        if _head_sums_in_registers(scores[r0:r1], dots, needed, lanes, heads, weights, divisor, key0):
            return
    if _head_sums_in_registers(work, dots, needed, lanes, heads, weights, divisor, 0):
        for r in range(r0, r1):
            seen = max(0, min(chunk, visible[r] - key0))
            scores[r, key0 : key0 + seen] = work[r - r0, :seen]
        return
    transpose_dots(dots, work, needed, lanes)
    unit = _unit_weights(weights, heads)
    for r in range(r0, r1):
        seen = max(0, min(chunk, visible[r] - key0))
        relu_sums(scores[r, key0 : key0 + seen], work, (r - r0) * heads, heads, _row_weights(weights, r - r0, unit),
                  divisor)
