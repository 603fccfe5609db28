"""Register tiles for the numba score and attention kernels: every dot product and weighted sum in a fixed order.

:func:`tile_dots` fills ``dots [keys, lanes]`` with ``keys[i] . q_t[:, lane]``
for float32 ``q_t [D, lanes]`` (query heads as columns, ``lanes`` a multiple
of ``VECTOR``) and ``keys [rows, D]`` (row-major, as stored). A tile of 16
lanes x 8 keys keeps its accumulators in vector registers while it runs
down the channels: per channel it loads the lanes' query values as vectors and
broadcasts each key's value. numba alone keeps such accumulators in memory (it
leaves LLVM's SLP vectoriser off and cannot prove its arrays do not alias),
one store per multiply-add, ~3x slower; a keys-as-lanes tile needs the keys
transposed first, which cost as much as the products at decode shapes.

Order, the same for every (lane, key) whatever the tile: ``acc = 0``, then
``acc = fma(q[d], k[d], acc)`` for ``d = 0 .. D-1`` (one rounding per channel).
So a dot product does not depend on the lanes or keys that share its tile or
call, and the score kernels' results do not depend on how rows are batched.

bf16 keys and queries take a channel-pair path instead: the tile multiplies
bf16 pairs straight from the keys' bits with AVX-512 BF16's ``VDPBF16PS``
(twice the multiply-adds per instruction, and no widening pass). Its order,
per pair ``j``: ``acc = fma(q[2j+1], k[2j+1], acc)``, then ``acc =
fma(q[2j], k[2j], acc)`` (bf16 products are exact in float32, so each step
rounds once; checked against the instruction bit for bit). Machines without
the instruction run those two fused multiply-adds, so a dot product is the
same on every machine but for subnormal inputs, which the instruction treats
as zero. Odd ``D`` gets a zero channel to make the last pair.
For this path the keys stay ``uint16`` (``[keys, 2P]``, ``P`` pairs) and the
queries are packed as ``int32`` pairs ``[P, lanes]`` (channel ``2j`` in the
low half); :func:`dots_of_rows` and :func:`plan_score_tasks` pick the layout
from the dtypes.

:func:`dots_of_rows` runs the tiles on keys read in place (a page's
consecutive pooled keys, a sequence's block keys): whole tiles straight from
memory, the last ``n % 8`` keys from a zero-padded copy, and each tile
prefetches the next tile's keys. :func:`dots_of_gathered_rows` does the same
for keys anywhere (attention's selected tokens): the tile reads each key
from its own start (``row_starts``), and :func:`gather_rows` copies rows
with a prefetch ahead where a copy is needed. :func:`transpose_dots` turns
``dots [keys, lanes]`` into ``[lanes, keys]`` (an 8 x 16 shuffle network per
block) so that the score epilogues run over each lane's keys contiguously;
:func:`square_sums_in_order` runs the same network to sum the squares of
16 rows at once in channel order (compress's RMSNorm).
:func:`weighted_rows` is the other half of attention, ``acc[h] += sum_n p[n,
h] * v[n]``: tiles of 12, 8 or 4 heads x 32 channels, rows in order, one
fused multiply-add each, bf16 values widened in registers.

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
from numba.extending import intrinsic, overload

from ._bits import target_cpu_features, widen

VECTOR = 16  # float32 lanes per vector (AVX-512); LLVM splits the vectors on narrower machines
KEYS_PER_TILE = 8


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no class for it): the element type of the BF16 intrinsic's operands."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash(_BFloat)


def _target_has_bf16_dot() -> bool:
    """Whether numba compiles for a CPU with ``VDPBF16PS`` (:func:`._bits.target_cpu_features`)."""
    return "+avx512bf16" in target_cpu_features()


def _is_c_matrix(array, dtype) -> bool:
    return isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C" and array.dtype == dtype


def _vector_at(builder, data, offset, kind):
    """Pointer to a ``kind`` vector at element ``offset`` of ``data``."""
    return builder.bitcast(builder.gep(data, [offset]), kind.as_pointer())


def _splat(builder, value, kind):
    """A ``kind`` vector (``VECTOR`` lanes) with ``value`` in every lane."""
    one = builder.insert_element(ir.Constant(kind, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(kind, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), VECTOR), [0] * VECTOR))


@intrinsic
def _tile(typingctx, dots, q_t, keys, lane0, key0, row_starts):
    """The dot products of ``VECTOR`` lanes x ``KEYS_PER_TILE`` keys, eight vector accumulators (one per
    key) in registers.

    ``dots`` float32; either ``q_t`` float32 and float32 ``keys`` (channels),
    or ``q_t`` int32 ``[P, lanes]`` and uint16 ``keys`` (bf16 channel pairs);
    ``dots`` and ``q_t`` 2-d, all C-contiguous. With ``row_starts`` ``None``,
    ``keys`` is ``[rows, D]`` (bf16: ``[rows, 2P]``) and key ``i`` is its row
    ``i``; with an int64 array, ``keys`` is 1-d and key ``i`` is the ``D``
    elements from ``keys[row_starts[i]]`` (any offset, even an odd one for
    bf16). The caller keeps ``lane0 + VECTOR`` within ``q_t``'s and
    ``dots``' columns, ``key0 + KEYS_PER_TILE`` within ``dots``' rows and the
    keys', and ``key0 + 2*KEYS_PER_TILE`` within ``row_starts`` (the prefetch
    of the next tile reads it; no bounds checks here). One vector of lanes,
    not two: a two-vector tile (16 accumulators) measured 1-7% slower on one
    core and 10-30% slower on two (bf16 and float32).
    """
    if not _is_c_matrix(dots, types.float32):
        return None
    gathered = isinstance(row_starts, types.Array)
    if gathered and not (row_starts.ndim == 1 and row_starts.dtype == types.int64
                         and isinstance(keys, types.Array) and keys.ndim == 1 and keys.layout == "C"):
        return None
    if not gathered and not (isinstance(row_starts, (types.NoneType, types.Omitted)) and isinstance(keys, types.Array)
                             and keys.ndim == 2 and keys.layout == "C"):
        return None
    if _is_c_matrix(q_t, types.float32) and keys.dtype == types.float32:
        pairs = False
    elif _is_c_matrix(q_t, types.int32) and keys.dtype == types.uint16:
        pairs = True
    else:
        return None
    signature = types.void(dots, q_t, keys, types.intp, types.intp, row_starts)

    def codegen(context, builder, sig, args):
        dots_arr, q_arr, keys_arr = (context.make_array(t)(context, builder, a)
                                     for t, a in zip(sig.args[:3], args[:3]))
        lane0, key0 = args[3], args[4]
        index = ir.IntType(64)
        vector = ir.VectorType(ir.FloatType(), VECTOR)
        words = ir.VectorType(ir.IntType(32), VECTOR)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             "llvm.fma.v16f32")
        q_cols = builder.extract_value(q_arr.shape, 1)
        depth = builder.extract_value(q_arr.shape, 0)  # channels, or channel pairs
        q_type = words if pairs else vector
        element = ir.IntType(32) if pairs else ir.FloatType()  # what one channel step loads
        if gathered:
            starts_data = context.make_array(sig.args[5])(context, builder, args[5]).data

            def key_row(k):  # keys + row_starts[k] elements, as a channel-step pointer
                start = builder.load(builder.gep(starts_data, [k]))
                return builder.bitcast(builder.gep(keys_arr.data, [start]), element.as_pointer())
        else:
            row_length = builder.extract_value(keys_arr.shape, 1)

            def key_row(k):  # row k of keys
                return builder.bitcast(builder.gep(keys_arr.data, [builder.mul(k, row_length)]),
                                       element.as_pointer())
        dots_cols = builder.extract_value(dots_arr.shape, 1)
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0")

        def constant(value):
            return ir.Constant(index, value)

        def vector_at(data, offset, kind):
            return _vector_at(builder, data, offset, kind)

        def splat(value, kind):
            return _splat(builder, value, kind)

        if pairs and _target_has_bf16_dot():
            bf16_pairs = ir.VectorType(_BFloat(), 2 * VECTOR)
            dot_pairs = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vector, [vector, bf16_pairs, bf16_pairs]),
                "llvm.x86.avx512bf16.dpbf16ps.512")

            def multiply_add(q_vec, key_word, acc):
                return builder.call(dot_pairs, [acc, builder.bitcast(q_vec, bf16_pairs),
                                                builder.bitcast(splat(key_word, words), bf16_pairs)])
        elif pairs:
            high_mask = ir.Constant(words, [-65536] * VECTOR)
            shift = ir.Constant(words, [16] * VECTOR)

            def multiply_add(q_vec, key_word, acc):
                key_vec = splat(key_word, words)
                halves = []
                for value in (q_vec, key_vec):
                    halves.append((builder.bitcast(builder.and_(value, high_mask), vector),
                                   builder.bitcast(builder.shl(value, shift), vector)))
                acc = builder.call(fma, [halves[0][0], halves[1][0], acc])  # channel 2j+1 first, as VDPBF16PS
                return builder.call(fma, [halves[0][1], halves[1][1], acc])
        else:
            def multiply_add(q_vec, key_value, acc):
                return builder.call(fma, [q_vec, splat(key_value, vector), acc])

        key_rows = [key_row(builder.add(key0, constant(k))) for k in range(KEYS_PER_TILE)]
        entry = builder.block
        loop = builder.append_basic_block("tile_channels")
        done = builder.append_basic_block("tile_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        channel = builder.phi(index)
        channel.add_incoming(constant(0), entry)
        accumulators = [builder.phi(vector) for _ in range(KEYS_PER_TILE)]
        for acc in accumulators:
            acc.add_incoming(ir.Constant(vector, [0.0] * VECTOR), entry)
        q_start = builder.add(builder.mul(channel, q_cols), lane0)
        q_vector = builder.load(vector_at(q_arr.data, q_start, q_type), align=4)
        # Prefetch the next tile's keys meanwhile (keys stream from memory in place): at
        # channel step c, step 8*(c // 8) of key key0 + 8 + c % 8, so over the loop every
        # 32 bytes of the next 8 keys. A prefetch never faults: rows past the end need no guard.
        ahead = key_row(builder.add(builder.add(key0, constant(KEYS_PER_TILE)), builder.and_(channel, constant(7))))
        builder.call(prefetch, [builder.bitcast(builder.gep(ahead, [builder.and_(channel, constant(-8))]),
                                                ir.IntType(8).as_pointer()),
                                ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 3),
                                ir.Constant(ir.IntType(32), 1)])
        updated = []
        for k in range(KEYS_PER_TILE):
            key_value = builder.load(builder.gep(key_rows[k], [channel]))
            updated.append(multiply_add(q_vector, key_value, accumulators[k]))
        next_channel = builder.add(channel, constant(1))
        body_end = builder.block
        channel.add_incoming(next_channel, body_end)
        for k in range(KEYS_PER_TILE):
            accumulators[k].add_incoming(updated[k], body_end)
        builder.cbranch(builder.icmp_signed("<", next_channel, depth), loop, done)
        builder.position_at_end(done)
        for k in range(KEYS_PER_TILE):
            row_start = builder.add(builder.mul(builder.add(key0, constant(k)), dots_cols), lane0)
            builder.store(updated[k], vector_at(dots_arr.data, row_start, vector), align=4)
        return context.get_dummy_value()

    return signature, codegen




WEIGHTED_HEADS = 8
WEIGHTED_CHANNELS = 2 * VECTOR


def _make_weighted_rows_tile(heads: int):
    """An intrinsic ``tile(acc, weights, rows, head0, chan0, num_rows)`` for ``heads`` heads x 32 channels:
    ``acc[head0 + k, chan0 : chan0 + 32] += sum_n weights[n, head0 + k] * rows[n, chan0 : chan0 + 32]``
    for ``k < heads``, one fused multiply-add per row ``n = 0, 1, ...`` in order, the accumulators in
    registers. 2-d C arrays, float32 (``rows`` may be bf16 bits, ``uint16``); the caller keeps every
    index in bounds."""

    @intrinsic
    def tile(typingctx, acc, weights, rows, head0, chan0, num_rows):
        if not (_is_c_matrix(acc, types.float32) and _is_c_matrix(weights, types.float32)
                and (_is_c_matrix(rows, types.float32) or _is_c_matrix(rows, types.uint16))):
            return None
        bf16_rows = rows.dtype == types.uint16
        signature = types.void(acc, weights, rows, types.intp, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            acc_arr, weights_arr, rows_arr = (context.make_array(t)(context, builder, a)
                                              for t, a in zip(sig.args[:3], args[:3]))
            head0, chan0, num_rows = args[3], args[4], args[5]
            index = ir.IntType(64)
            vector = ir.VectorType(ir.FloatType(), VECTOR)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                                 "llvm.fma.v16f32")
            acc_cols = builder.extract_value(acc_arr.shape, 1)
            weight_cols = builder.extract_value(weights_arr.shape, 1)
            row_cols = builder.extract_value(rows_arr.shape, 1)

            def constant(value):
                return ir.Constant(index, value)

            def vector_at(data, offset):
                return _vector_at(builder, data, offset, vector)

            acc_starts = [builder.add(builder.mul(builder.add(head0, constant(k)), acc_cols), chan0)
                          for k in range(heads)]
            initial = [[builder.load(vector_at(acc_arr.data, builder.add(acc_starts[k], constant(v * VECTOR))), align=4)
                        for v in range(2)] for k in range(heads)]
            entry = builder.block
            loop = builder.append_basic_block("weighted_rows")
            done = builder.append_basic_block("weighted_done")
            builder.cbranch(builder.icmp_signed(">", num_rows, constant(0)), loop, done)
            builder.position_at_end(loop)
            n = builder.phi(index)
            n.add_incoming(constant(0), entry)
            accumulators = [[builder.phi(vector) for _ in range(2)] for _ in range(heads)]
            for k in range(heads):
                for v in range(2):
                    accumulators[k][v].add_incoming(initial[k][v], entry)
            row_start = builder.add(builder.mul(n, row_cols), chan0)
            if bf16_rows:  # widened in registers: the bf16 bits shifted into the high half
                halves = ir.VectorType(ir.IntType(16), VECTOR)
                words = ir.VectorType(ir.IntType(32), VECTOR)
                values = []
                for v in range(2):
                    address = builder.gep(rows_arr.data, [builder.add(row_start, constant(v * VECTOR))])
                    bits = builder.load(builder.bitcast(address, halves.as_pointer()), align=2)
                    shifted = builder.shl(builder.zext(bits, words), ir.Constant(words, [16] * VECTOR))
                    values.append(builder.bitcast(shifted, vector))
            else:
                values = [builder.load(vector_at(rows_arr.data, builder.add(row_start, constant(v * VECTOR))),
                                       align=4) for v in range(2)]
            weight_start = builder.add(builder.mul(n, weight_cols), head0)
            updated = []
            for k in range(heads):
                weight = builder.load(builder.gep(weights_arr.data, [builder.add(weight_start, constant(k))]))
                spread = _splat(builder, weight, vector)
                updated.append([builder.call(fma, [spread, values[v], accumulators[k][v]]) for v in range(2)])
            next_n = builder.add(n, constant(1))
            body_end = builder.block
            n.add_incoming(next_n, body_end)
            for k in range(heads):
                for v in range(2):
                    accumulators[k][v].add_incoming(updated[k][v], body_end)
            builder.cbranch(builder.icmp_signed("<", next_n, num_rows), loop, done)
            builder.position_at_end(done)
            finals = [[builder.phi(vector) for _ in range(2)] for _ in range(heads)]  # phis first
            for k in range(heads):
                for v in range(2):
                    finals[k][v].add_incoming(initial[k][v], entry)
                    finals[k][v].add_incoming(updated[k][v], body_end)
            for k in range(heads):
                for v in range(2):
                    target = vector_at(acc_arr.data, builder.add(acc_starts[k], constant(v * VECTOR)))
                    builder.store(finals[k][v], target, align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile


_weighted_rows_12, _weighted_rows_8, _weighted_rows_4 = (_make_weighted_rows_tile(12), _make_weighted_rows_tile(8),
                                                         _make_weighted_rows_tile(4))


@numba.njit(cache=True, nogil=True)
def weighted_rows(acc, weights, rows, heads, num_rows):
    """``acc[h, :] += sum_n weights[n, h] * rows[n, :]`` for ``h < heads`` (rounded up to a multiple of 4),
    ``n < num_rows``: per (head, channel) one fused multiply-add per row, rows in order. Heads run 12 at a
    time while 12 are left (24 accumulators: a GQA group of 12 reads each value row once per 32
    channels; bf16 values 10% faster than 8 + 4), then 8 or 4.

    ``acc [>= heads rounded up to 8, C]``, ``weights [>= num_rows, >= heads rounded up to 8]``,
    ``rows [>= num_rows, C]`` float32 or bf16 bits (``uint16``, widened in registers); all
    C-contiguous, ``C`` a multiple of ``WEIGHTED_CHANNELS`` (32).
    """
    head0 = 0
    while head0 < heads:
        left = heads - head0
        step = 12 if left >= 12 else (8 if left > 4 else 4)  # e.g. 12 heads in one pass over the rows
        for chan0 in range(0, acc.shape[1], WEIGHTED_CHANNELS):
            if step == 12:
                _weighted_rows_12(acc, weights, rows, head0, chan0, num_rows)
            elif step == 8:
                _weighted_rows_8(acc, weights, rows, head0, chan0, num_rows)
            else:
                _weighted_rows_4(acc, weights, rows, head0, chan0, num_rows)
        head0 += step


def _shuffle_indices(step: int, half: int) -> list[int]:
    """Shuffle indices of one stage of the 8 x 16 transpose: interleave ``step``-element groups of two
    vectors, from their low (``half`` 0) or high (1) eight elements' worth of groups."""
    groups = VECTOR // (2 * step)  # groups taken from each input
    first = half * groups
    return [offset + step * g + e for g in range(first, first + groups) for offset in (0, VECTOR)
            for e in range(step)]


def _block_columns(builder, data, row_length, row0, col0):
    """The 16 columns of the 8 x 16 block at (``row0``, ``col0``) of a float32 C matrix (``data`` its
    element pointer, ``row_length`` its columns), each an 8-float vector of rows ``row0 .. row0+7``, in
    column order: eight vector loads and three shuffle stages (pairs, quads, octets of rows)."""
    index = ir.IntType(64)
    vector = ir.VectorType(ir.FloatType(), VECTOR)

    def shuffle(a, b, indices):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), indices))

    rows = [builder.load(_vector_at(builder, data, builder.add(
        builder.mul(builder.add(row0, ir.Constant(index, k)), row_length), col0), vector), align=4)
        for k in range(KEYS_PER_TILE)]
    columns = []
    for half in range(2):  # columns 0-7, 8-15
        pairs = [shuffle(rows[2 * p], rows[2 * p + 1], _shuffle_indices(1, half)) for p in range(4)]
        for quarter in range(2):  # columns 0-3, 4-7 of the half
            quads = [shuffle(pairs[2 * q], pairs[2 * q + 1], _shuffle_indices(2, quarter)) for q in range(2)]
            for eighth in range(2):  # two columns each: every row of the column, in order
                both = shuffle(quads[0], quads[1], _shuffle_indices(4, eighth))
                columns += [shuffle(both, both, list(range(8 * second, 8 * second + 8))) for second in range(2)]
    return columns


@intrinsic
def _transpose_block(typingctx, dots, dots_t, key0, lane0):
    """``dots_t[lane0 + j, key0 + k] = dots[key0 + k, lane0 + j]`` for ``k < 8``, ``j < 16``
    (:func:`_block_columns`, then sixteen 8-float stores). float32 2-d C arrays; the caller keeps every
    index in bounds."""
    if not (_is_c_matrix(dots, types.float32) and _is_c_matrix(dots_t, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        dots_arr, t_arr = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2]))
        key0, lane0 = args[2], args[3]
        octet = ir.VectorType(ir.FloatType(), KEYS_PER_TILE)
        t_cols = builder.extract_value(t_arr.shape, 1)
        columns = _block_columns(builder, dots_arr.data, builder.extract_value(dots_arr.shape, 1), key0, lane0)
        for lane, keys in enumerate(columns):
            start = builder.add(builder.mul(builder.add(lane0, ir.Constant(ir.IntType(64), lane)), t_cols), key0)
            builder.store(keys, _vector_at(builder, t_arr.data, start, octet), align=4)
        return context.get_dummy_value()

    return types.void(dots, dots_t, types.intp, types.intp), codegen


SQUARE_SUM_ROWS = 2 * KEYS_PER_TILE
"""Rows whose sums of squares :func:`square_sums_in_order` computes at once (two independent chains of 8)."""


@intrinsic
def _add_block_squares(typingctx, rows, sums, col0):
    """``sums[k] += rows[k, col0 + j]**2`` for ``j = 0 .. 15`` in order, ``k < 16``: two chains of eight
    rows (:func:`_block_columns`; a multiply, then an add, each rounded), interleaved so that neither
    waits on its own adds. ``rows`` float32 2-d C with at least 16 rows and ``col0 + 16`` columns,
    ``sums`` float32 1-d C with at least 16 elements (not checked)."""
    if not (_is_c_matrix(rows, types.float32) and isinstance(sums, types.Array) and sums.ndim == 1
            and sums.layout == "C" and sums.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        rows_arr, sums_arr = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2]))
        octet = ir.VectorType(ir.FloatType(), KEYS_PER_TILE)
        index = ir.IntType(64)
        row_length = builder.extract_value(rows_arr.shape, 1)
        chains = range(SQUARE_SUM_ROWS // KEYS_PER_TILE)
        where = [_vector_at(builder, sums_arr.data, ir.Constant(index, KEYS_PER_TILE * c), octet) for c in chains]
        totals = [builder.load(w, align=4) for w in where]
        columns = [_block_columns(builder, rows_arr.data, row_length, ir.Constant(index, KEYS_PER_TILE * c),
                                  args[2]) for c in chains]
        for j in range(VECTOR):
            for c in chains:
                totals[c] = builder.fadd(totals[c], builder.fmul(columns[c][j], columns[c][j]))
        for total, w in zip(totals, where):
            builder.store(total, w, align=4)
        return context.get_dummy_value()

    return types.void(rows, sums, types.intp), codegen


@numba.njit(cache=True, nogil=True)
def square_sums_in_order(rows, sums):
    """``sums[k] = sum_d rows[k, d]**2`` over ``d = 0 .. D-1`` in order, each square and each add rounded,
    for the ``SQUARE_SUM_ROWS`` (16) rows of ``rows [16, D]`` at once (sixteen channels per step, rows as
    vector lanes). float32, C-contiguous; ``sums`` at least 16 elements. Rows that hold no data just give
    sums to ignore."""
    sums[:SQUARE_SUM_ROWS] = 0.0
    dim = rows.shape[1]
    whole = dim - dim % VECTOR
    for col0 in range(0, whole, VECTOR):
        _add_block_squares(rows, sums, col0)
    for k in range(SQUARE_SUM_ROWS):
        row = rows[k]
        total = sums[k]
        for d in range(whole, dim):
            total += row[d] * row[d]
        sums[k] = total


@numba.njit(cache=True, nogil=True)
def transpose_dots(dots, dots_t, num_keys, lanes):
    """``dots_t[l, i] = dots[i, l]`` for ``l < lanes``, ``i < num_keys`` rounded up to ``KEYS_PER_TILE``:
    a score epilogue then runs over each lane's keys contiguously (vectorised) instead of with a stride.
    ``dots [>= rounded keys, >= lanes]``, ``dots_t [>= lanes, >= rounded keys]``, float32, C-contiguous;
    ``lanes`` a multiple of ``VECTOR``."""
    for key0 in range(0, num_keys, KEYS_PER_TILE):
        for lane0 in range(0, lanes, VECTOR):
            _transpose_block(dots, dots_t, key0, lane0)


@numba.njit(cache=True, nogil=True)
def tile_dots(dots, q_t, keys, lanes, num_keys, row_starts=None):
    """``dots[i, l] = key_i . q_t[:, l]`` for ``l < lanes``, ``i < num_keys`` rounded up to ``KEYS_PER_TILE``.

    ``q_t [D, >= lanes]`` float32 with float32 keys, or the bf16 pair layout
    (``q_t`` int32 ``[P, >= lanes]``, uint16 keys of ``2P`` channels);
    ``dots [>= rounded keys, >= lanes]`` float32; all C-contiguous; ``lanes``
    a multiple of ``VECTOR``. ``key_i`` is row ``i`` of ``keys [>= rounded
    keys, D]``, or, given ``row_starts`` (int64, ``>= rounded keys +
    KEYS_PER_TILE`` entries, all pointing at whole keys), the ``D`` elements
    of the 1-d ``keys`` from ``row_starts[i]``: keys gathered from anywhere
    (e.g. cached tokens through a page table) without copying them first.
    """
    if q_t.shape[0] == 0:  # the tile's channel loop runs at least once
        dots[: (num_keys + KEYS_PER_TILE - 1) // KEYS_PER_TILE * KEYS_PER_TILE, :lanes] = 0.0
        return
    for key0 in range(0, num_keys, KEYS_PER_TILE):
        for lane0 in range(0, lanes, VECTOR):
            _tile(dots, q_t, keys, lane0, key0, row_starts)


def new_scratch(keys, dim):
    """Scratch rows in the tile's layout for keys like ``keys`` (numba only), enough for
    :func:`dots_of_rows` on up to ``KEYS_PER_TASK`` rows: uint16 ``[KEYS_PER_TASK + KEYS_PER_TILE, 2P]``
    for bf16 (``uint16``) keys (the zero channel of an odd ``D`` set), else float32 ``[..., dim]``."""
    raise NotImplementedError


@overload(new_scratch, inline="always")
def _new_scratch_overload(keys, dim):
    if keys.dtype == types.uint16:
        def bf16_scratch(keys, dim):
            scratch = np.empty((KEYS_PER_TASK + KEYS_PER_TILE, 2 * ((dim + 1) // 2)), np.uint16)
            scratch[:, dim:] = 0  # the zero channel that completes an odd D's last pair
            return scratch
        return bf16_scratch
    return lambda keys, dim: np.empty((KEYS_PER_TASK + KEYS_PER_TILE, dim), np.float32)


def _in_tile_layout(rows, scratch):
    """``rows [n, D]`` as stored, in the tile's layout (numba only): ``rows`` themselves for float32 and
    for bf16 with an even ``D`` (read in place), else converted into ``scratch[:n]``."""
    raise NotImplementedError


@overload(_in_tile_layout, inline="always")
def _in_tile_layout_overload(rows, scratch):
    if rows.dtype == types.float32:
        return lambda rows, scratch: rows
    bf16_rows = rows.dtype == types.uint16  # read in place when D is even: channel pairs as stored

    def converted_rows(rows, scratch):
        if bf16_rows and rows.shape[1] % 2 == 0:
            return rows
        for i in range(rows.shape[0]):
            put_key_row(scratch, i, rows[i])
        return scratch[: rows.shape[0]]
    return converted_rows


def _dots_in_place(dots, q_t, flat, row_starts, n, dim, lanes):
    """:func:`tile_dots` on the keys where they lie, if the tile reads them as stored (float32, or bf16 bits
    with an even ``dim``: channel pairs as stored); returns whether it did (numba only)."""
    raise NotImplementedError


@overload(_dots_in_place, inline="always")
def _dots_in_place_overload(dots, q_t, flat, row_starts, n, dim, lanes):
    if flat.dtype not in (types.float32, types.uint16):
        return lambda dots, q_t, flat, row_starts, n, dim, lanes: False
    bf16_keys = flat.dtype == types.uint16

    def in_place(dots, q_t, flat, row_starts, n, dim, lanes):
        if bf16_keys and dim % 2 != 0:
            return False
        tile_dots(dots, q_t, flat, lanes, n, row_starts)
        return True
    return in_place


@numba.njit(cache=True, nogil=True)
def dots_of_rows(dots, q_t, rows, lanes, scratch):
    """``dots[i, l] = rows[i] . q_t[:, l]`` for ``i < n``, ``l < lanes``; may write up to
    ``KEYS_PER_TILE - 1`` more rows of ``dots``, never reads past ``rows``.

    ``rows [n, D]`` (``n <= KEYS_PER_TASK``) as stored: float32, bf16 bits
    (``uint16``) or fp16 bits (``int16``), C-contiguous, e.g. consecutive
    pooled keys of one page. float32 and even-``D`` bf16 rows are read in
    place; whole tiles of 8 rows run on them directly and the last ``n % 8``
    rows from a zero-padded copy in ``scratch`` (:func:`new_scratch`). So the
    keys stream from memory while the tile computes, instead of being copied
    first (the copy had cost as much as the products).
    """
    n = rows.shape[0]
    keys = _in_tile_layout(rows, scratch)
    full = n - n % KEYS_PER_TILE
    if full > 0:
        tile_dots(dots, q_t, keys, lanes, full)
    if n > full:
        tail = scratch[KEYS_PER_TASK:]
        tail[: n - full] = keys[full:n]
        tail[n - full :] = 0
        tile_dots(dots[full:], q_t, tail, lanes, n - full)


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask for the cache line of ``array[index]`` (into every cache level); never faults."""
    if not (isinstance(array, types.Array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0")
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        builder.call(prefetch, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


GATHER_AHEAD = 8
"""Rows :func:`gather_rows` asks for ahead of the one it copies (scattered rows defeat the hardware prefetcher)."""
CACHE_LINE = 64


@numba.njit(cache=True, nogil=True)
def gather_rows(target, flat, row_starts, n, dim):
    """``target[i, :dim]`` = ``flat[row_starts[i] : row_starts[i] + dim]`` in ``target``'s layout
    (:func:`put_key_row`) for ``i < n``, while prefetching row ``i + GATHER_AHEAD`` (while
    ``row_starts`` has it: pass the rows after ``n`` too). ``row_starts`` int64, 1-d."""
    line = max(1, CACHE_LINE // flat.itemsize)
    for i in range(n):
        if i + GATHER_AHEAD < row_starts.shape[0]:
            ahead = row_starts[i + GATHER_AHEAD]
            for offset in range(0, dim, line):
                _prefetch(flat, ahead + offset)
        start = row_starts[i]
        put_key_row(target, i, flat[start : start + dim])


@numba.njit(cache=True, nogil=True)
def dots_of_gathered_rows(dots, q_t, flat, row_starts, n, dim, lanes, scratch):
    """``dots[i, l] = key_i . q_t[:, l]`` for ``i < n``, ``l < lanes``, ``key_i`` the ``dim`` elements of the
    1-d ``flat`` from ``row_starts[i]`` (e.g. selected tokens anywhere in a paged cache); may write up
    to ``KEYS_PER_TILE - 1`` more rows of ``dots``.

    ``row_starts`` int64 with ``>= n + 2*KEYS_PER_TILE`` entries, every one
    a whole key (pad with, e.g., the last start). Keys the tile reads in
    place (float32, even-``dim`` bf16) are read where they lie, each tile
    prefetching the next tile's keys; others are converted ``KEYS_PER_TASK``
    at a time into ``scratch`` (:func:`new_scratch`).
    """
    if _dots_in_place(dots, q_t, flat, row_starts, n, dim, lanes):
        return
    for n0 in range(0, n, KEYS_PER_TASK):
        chunk = min(KEYS_PER_TASK, n - n0)
        gather_rows(scratch, flat, row_starts[n0:], chunk, dim)
        scratch[chunk : chunk + KEYS_PER_TILE] = 0
        tile_dots(dots[n0:], q_t, scratch, lanes, chunk)


def new_value_scratch(values, dim, channels):
    """Scratch for ``KEYS_PER_TASK`` value rows of ``channels >= dim`` in :func:`weighted_rows`' layout for
    values like ``values`` (numba only): bf16 bits (``uint16``) stay bits, other floats float32. Only the
    padding channels ``dim ..`` are zeroed (the rows are written before they are read)."""
    raise NotImplementedError


@overload(new_value_scratch, inline="always")
def _new_value_scratch_overload(values, dim, channels):
    dtype = np.uint16 if values.dtype == types.uint16 else np.float32

    def value_scratch(values, dim, channels):
        scratch = np.empty((KEYS_PER_TASK, channels), dtype)
        scratch[:, dim:] = 0
        return scratch
    return value_scratch


def put_key_row(scratch, i, key):
    """``scratch[i, :len(key)] = key`` in the tile's layout (numba only): bf16 bits copied (``scratch`` from
    :func:`new_scratch`, so an odd ``D``'s zero channel stays), other floats widened to float32."""
    raise NotImplementedError


@overload(put_key_row, inline="always")
def _put_key_row_overload(scratch, i, key):
    if scratch.dtype == types.uint16:
        def copy_bits(scratch, i, key):
            row = scratch[i]
            for d in range(key.shape[0]):
                row[d] = key[d]
        return copy_bits

    def widen_row(scratch, i, key):
        row = scratch[i]
        for d in range(key.shape[0]):
            row[d] = widen(key[d])
    return widen_row


def new_query_tiles(q, groups, lanes):
    """Zeroed query tiles for ``groups`` row groups (numba only): int32 pairs ``[groups, P, lanes]`` for
    bf16 (``uint16``) queries, else float32 ``[groups, D, lanes]``."""
    raise NotImplementedError


@overload(new_query_tiles, inline="always")
def new_query_tiles_overload(q, groups, lanes):
    if q.dtype == types.uint16:
        return lambda q, groups, lanes: np.zeros((groups, (q.shape[2] + 1) // 2, lanes), np.int32)
    return lambda q, groups, lanes: np.zeros((groups, q.shape[2], lanes), np.float32)


def put_query(tile, lane, q_row):
    """Column ``lane`` of one group's query tile = ``q_row`` in the tile's layout (numba only)."""
    raise NotImplementedError


@overload(put_query, inline="always")
def put_query_overload(tile, lane, q_row):
    if tile.dtype == types.int32:
        def pack_pairs(tile, lane, q_row):
            for d in range(q_row.shape[0]):
                tile[d // 2, lane] |= np.int32(np.int64(q_row[d]) << (16 * (d % 2)))
        return pack_pairs

    def widen_column(tile, lane, q_row):
        for d in range(q_row.shape[0]):
            tile[d, lane] = widen(q_row[d])
    return widen_column


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
        for h in range(heads):
            put_query(block, local % group_rows * heads + h, q[r, h])
        score_row = scores[r]
        for k in range(visible[r], scores.shape[1]):
            score_row[k] = -np.inf
    return num_keys, task_starts, group_starts, q_t, group_rows


@numba.njit(cache=True, nogil=True, inline="always")
def score_task(task, task_starts, num_keys, offsets):
    """``(b, first_row, end_row, key0, chunk)`` of task ``task`` of :func:`plan_score_tasks`: sequence
    ``b``'s rows ``first_row .. end_row - 1`` against its keys ``key0 .. key0 + chunk - 1``."""
    b = np.searchsorted(task_starts, task, side="right") - 1
    key0 = (task - task_starts[b]) * KEYS_PER_TASK
    return b, offsets[b], offsets[b + 1], key0, min(KEYS_PER_TASK, num_keys[b] - key0)


@numba.njit(cache=True, nogil=True, inline="always")
def relu_sums(totals, lane_dots, lane0, heads, weights):
    """``totals[i] = sum_h weights[h] * relu(lane_dots[lane0 + h, i])`` for ``i < len(totals)``, each sum
    ``0 + ... `` in head order ``h = 0 .. heads-1``, one multiply and one add per term (a weight of 1
    changes no bit); relu keeps NaN. ``lane_dots [lanes, keys]`` from :func:`transpose_dots`, so the
    inner loop runs over contiguous keys, vectorised."""
    seen = totals.shape[0]
    totals[:] = 0.0
    for h in range(heads):
        weight = weights[h]
        key_dots = lane_dots[lane0 + h, :seen]
        for i in range(seen):
            x = key_dots[i]
            totals[i] += weight * (x if not x <= np.float32(0.0) else np.float32(0.0))
