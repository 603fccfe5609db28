"""Register-blocked float32 dot products for the numba score kernels: every dot product in a fixed order.

:func:`tile_dots` fills ``dots [keys, lanes]`` with ``keys[i] . q_t[:, lane]``
for float32 ``q_t [D, lanes]`` (query heads as columns, ``lanes`` a multiple
of ``VECTOR``) and ``keys [rows, D]`` (row-major, as stored). A tile of 16 or
32 lanes x 8 keys keeps its accumulators in vector registers while it runs
down the channels: per channel it loads the lanes' query values as vectors and
broadcasts each key's value. numba alone keeps such accumulators in memory (it
leaves LLVM's SLP vectoriser off and cannot prove its arrays do not alias),
one store per multiply-add, ~3x slower; a keys-as-lanes tile needs the keys
transposed first, which cost as much as the products at decode shapes.

Order, the same for every (lane, key) whatever the tile: ``acc = 0``, then
``acc = fma(q[d], k[d], acc)`` for ``d = 0 .. D-1`` (one rounding per channel).
So a dot product does not depend on the lanes or keys that share its tile or
call, and the score kernels' results do not depend on how rows are batched.

Example: ``q_t`` ``[128, 16]`` (4 rows x 4 heads), ``keys`` ``[128, 128]``:
``tile_dots(dots, q_t, keys, 16, 100)`` runs 13 tiles and writes
``dots[:104]``; rows 100..103 come from ``keys``' rows 100..103 (keep them
finite, e.g. zeros) and are to be ignored.

As with :mod:`._bits`, numba's cache does not notice when this module changes
under a cached caller in another module: clear the ``__pycache__``
``*.nbi``/``*.nbc`` files after editing it.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._bits import widen

VECTOR = 16  # float32 lanes per vector (AVX-512); LLVM splits the vectors on narrower machines
KEYS_PER_TILE = 8


def _make_tile(lane_vectors: int):
    """An intrinsic ``tile(dots, q_t, keys, lane0, key0)`` for ``lane_vectors * VECTOR`` lanes x ``KEYS_PER_TILE`` keys.

    All three arrays are float32, 2-d, C-contiguous; the caller keeps
    ``lane0 + lane_vectors*VECTOR`` within ``q_t``'s and ``dots``' columns and
    ``key0 + KEYS_PER_TILE`` within ``keys``' and ``dots``' rows (no bounds checks here).
    """

    @intrinsic
    def tile(typingctx, dots, q_t, keys, lane0, key0):
        for array in (dots, q_t, keys):
            if not (isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C"
                    and array.dtype == types.float32):
                return None
        signature = types.void(dots, q_t, keys, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            dots_arr, q_arr, keys_arr = (context.make_array(t)(context, builder, a)
                                         for t, a in zip(sig.args[:3], args[:3]))
            lane0, key0 = args[3], args[4]
            index = ir.IntType(64)
            vector = ir.VectorType(ir.FloatType(), VECTOR)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                                 "llvm.fma.v16f32")
            q_cols = builder.extract_value(q_arr.shape, 1)
            depth = builder.extract_value(keys_arr.shape, 1)
            dots_cols = builder.extract_value(dots_arr.shape, 1)

            def constant(value):
                return ir.Constant(index, value)

            def vector_at(data, offset):
                return builder.bitcast(builder.gep(data, [offset]), vector.as_pointer())

            key_starts = [builder.mul(builder.add(key0, constant(k)), depth) for k in range(KEYS_PER_TILE)]
            entry = builder.block
            loop = builder.append_basic_block("tile_channels")
            done = builder.append_basic_block("tile_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            channel = builder.phi(index)
            channel.add_incoming(constant(0), entry)
            accumulators = [[builder.phi(vector) for _ in range(lane_vectors)] for _ in range(KEYS_PER_TILE)]
            for row in accumulators:
                for acc in row:
                    acc.add_incoming(ir.Constant(vector, [0.0] * VECTOR), entry)
            q_start = builder.add(builder.mul(channel, q_cols), lane0)
            q_vectors = [builder.load(vector_at(q_arr.data, builder.add(q_start, constant(v * VECTOR))), align=4)
                         for v in range(lane_vectors)]
            splat = ir.Constant(ir.VectorType(ir.IntType(32), VECTOR), [0] * VECTOR)
            updated = []
            for k in range(KEYS_PER_TILE):
                key_value = builder.load(builder.gep(keys_arr.data, [builder.add(key_starts[k], channel)]))
                spread = builder.insert_element(ir.Constant(vector, ir.Undefined), key_value,
                                                ir.Constant(ir.IntType(32), 0))
                spread = builder.shuffle_vector(spread, ir.Constant(vector, ir.Undefined), splat)
                updated.append([builder.call(fma, [q_vectors[v], spread, accumulators[k][v]])
                                for v in range(lane_vectors)])
            next_channel = builder.add(channel, constant(1))
            body_end = builder.block
            channel.add_incoming(next_channel, body_end)
            for k in range(KEYS_PER_TILE):
                for v in range(lane_vectors):
                    accumulators[k][v].add_incoming(updated[k][v], body_end)
            builder.cbranch(builder.icmp_signed("<", next_channel, depth), loop, done)
            builder.position_at_end(done)
            for k in range(KEYS_PER_TILE):
                row_start = builder.add(builder.mul(builder.add(key0, constant(k)), dots_cols), lane0)
                for v in range(lane_vectors):
                    builder.store(updated[k][v], vector_at(dots_arr.data, builder.add(row_start, constant(v * VECTOR))),
                                  align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile


_tile_16_lanes, _tile_32_lanes = _make_tile(1), _make_tile(2)


@numba.njit(cache=True, nogil=True)
def tile_dots(dots, q_t, keys, lanes, num_keys):
    """``dots[i, l] = keys[i] . q_t[:, l]`` for ``l < lanes``, ``i < num_keys`` rounded up to ``KEYS_PER_TILE``.

    ``q_t [D, >= lanes]``, ``keys [>= rounded keys, D]``, ``dots [>= rounded keys, >= lanes]``,
    float32 C-contiguous; ``lanes`` a multiple of ``VECTOR``; ``D >= 1``.
    """
    if keys.shape[1] == 0:  # the tile's channel loop runs at least once
        dots[: (num_keys + KEYS_PER_TILE - 1) // KEYS_PER_TILE * KEYS_PER_TILE, :lanes] = 0.0
        return
    for key0 in range(0, num_keys, KEYS_PER_TILE):
        lane0 = 0
        while lane0 + 2 * VECTOR <= lanes:
            _tile_32_lanes(dots, q_t, keys, lane0, key0)
            lane0 += 2 * VECTOR
        if lane0 < lanes:
            _tile_16_lanes(dots, q_t, keys, lane0, key0)


KEYS_PER_TASK = 128
"""Keys (block keys or pooled keys) per score task: enough work per task, little scratch; a multiple of KEYS_PER_TILE."""
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
    lanes]`` holds a group's queries widened and transposed (lane
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
    q_t = np.zeros((group_starts[batch], dim, group_lanes), np.float32)
    for r in range(total_q):
        b = np.searchsorted(offsets, r, side="right") - 1
        local = r - offsets[b]
        block = q_t[group_starts[b] + local // group_rows]
        for h in range(heads):
            q_row, lane = q[r, h], local % group_rows * heads + h
            for d in range(dim):
                block[d, lane] = widen(q_row[d])
        score_row = scores[r]
        for k in range(visible[r], scores.shape[1]):
            score_row[k] = -np.inf
    return num_keys, task_starts, group_starts, q_t, group_rows
