"""The register tiles in LLVM IR (numba intrinsics): every dot product and weighted sum in a fixed order.

:func:`dot_tile` computes ``dots [keys, lanes]`` = ``keys[i] . q_t[:, lane]``
for one tile of ``VECTOR`` (16) lanes x ``KEYS_PER_TILE`` (8) keys, float32
``q_t [D, lanes]`` (query heads as columns) and ``keys [rows, D]`` (row-major,
as stored). The tile keeps its accumulators in vector registers while it runs
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
low half).

The other tiles: ``weighted_rows_tile_{12,8,4}`` (``acc[h] += sum_n p[n, h] *
v[n]`` for 12, 8 or 4 heads x 32 channels, rows in order, one fused
multiply-add each, bf16 values widened in registers), :func:`transpose_block`
(an 8 x 16 shuffle network), :func:`relu_head_sums_block` (a score tile's ReLU
sum over heads, in registers) and :func:`add_block_squares` (the same network
summing the squares of 16 rows at once, in channel order), and
:func:`prefetch_element`.
:mod:`._tile_ops` runs them over whole arrays.
"""

from __future__ import annotations

import re

import llvmlite
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._bits import target_cpu_features

_BFLOAT_LLVMLITE = (0, 45)
"""The first llvmlite (LLVM 20) whose LLVM types ``VDPBF16PS``'s operands as ``bfloat`` vectors."""


def _check_llvmlite_for_bfloat() -> None:
    """Refuse an llvmlite that :class:`_BFloat` (a subclass of llvmlite's ``ir.Type`` overriding its private
    ``_to_string``) does not work with, with an error that names the versions supported."""
    found = tuple(int(part) for part in re.findall(r"\d+", llvmlite.__version__)[:2])
    supported = (f"llvmlite >= {_BFLOAT_LLVMLITE[0]}.{_BFLOAT_LLVMLITE[1]} (numba >= 0.62); "
                 f"this llvmlite is {llvmlite.__version__}")
    if found < _BFLOAT_LLVMLITE:
        raise ImportError(f"sparsekv's CPU kernels need {supported}: older LLVMs type VDPBF16PS's operands "
                          "as i32 vectors and fail verification")
    if str(ir.VectorType(_BFloat(), 2)) != "<2 x bfloat>":
        raise ImportError(f"sparsekv's CPU kernels need {supported}, whose ir.Type prints a subclass "
                          "through _to_string; this one does not")


VECTOR = 16  # float32 lanes per vector (AVX-512); LLVM splits the vectors on narrower machines (AVX2: two
# registers each), where the tiles keep fewer accumulators per pass (_keys_per_pass, _weighted_passes)
KEYS_PER_TILE = 8


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no class for it): the element type of the BF16 intrinsic's operands."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash(_BFloat)


_check_llvmlite_for_bfloat()


def _target_has_bf16_dot() -> bool:
    """Whether numba compiles for a CPU with ``VDPBF16PS`` (:func:`._bits.target_cpu_features`)."""
    return "+avx512bf16" in target_cpu_features()


def _target_has_wide_registers() -> bool:
    """Whether numba compiles for a CPU with AVX-512's 32 registers of 16 float32 lanes (else AVX2's 16 of 8:
    a ``VECTOR`` takes two)."""
    return "+avx512f" in target_cpu_features()


def _keys_per_pass() -> int:
    """Keys whose accumulators one channel pass of :func:`dot_tile` keeps in registers: all 8 with
    AVX-512's 32 vector registers; 4 (8 of AVX2's 16 registers, the 16 lanes taking two each) otherwise,
    where 8 keys' accumulators spill to memory."""
    return KEYS_PER_TILE if _target_has_wide_registers() else KEYS_PER_TILE // 2


def _prefetching_passes(pairs: bool) -> int:
    """How many of :func:`dot_tile`'s channel passes ask for the next tile's keys: 1 (the first pass asks
    for all eight, one per channel step), or every pass for its own keys, one every ``passes``-th
    channel step. float32 keys on AVX2 (two passes) spread them: they need twice bf16's bytes per
    multiply-add, and the tile streaming them from DRAM measured 6-34% faster with the requests
    spread over the whole tile than with all of them in its first half; bf16 keys measured no gain
    (0.94-1.02 of the rate), so they keep the first pass alone."""
    passes = KEYS_PER_TILE // _keys_per_pass()
    return passes if passes > 1 and not pairs else 1


def _is_c_matrix(array, dtype) -> bool:
    return isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C" and array.dtype == dtype


def _vector_at(builder, data, offset, kind):
    """Pointer to a ``kind`` vector at element ``offset`` of ``data``."""
    return builder.bitcast(builder.gep(data, [offset]), kind.as_pointer())


def _splat(builder, value, kind):
    """A ``kind`` vector with ``value`` in every lane."""
    one = builder.insert_element(ir.Constant(kind, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(kind, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), kind.count), [0] * kind.count))


PREFETCH_KEEP_EVERYWHERE = 3
"""``llvm.prefetch`` locality: 0 (use once, keep in no cache) .. 3 (keep in every cache level)."""
PREFETCH_BELOW_L1 = 2
"""``llvm.prefetch`` locality 2 (``PREFETCHT1``): into the L2 and below, not the L1. :func:`dot_tile` asks for the
keys it streams this way (likely why it helps: requests into the L1 hold its few miss buffers, which the tile's own
key loads then wait for). Measured on Zen 4 with the keys from memory (two runs each, alternated; fraction of the
tile's peak): on one thread, the paged QSA block score over 16 layers 0.37-0.50 -> 0.64-0.66, the k-pool score over
16 layers 0.50-0.63 -> 0.63-0.69, the contiguous fp32 block score at 32768 blocks 0.53-0.59 -> 0.63-0.65, bf16 the
same (0.58-0.61); with another process busy on the second core, the contiguous block score bf16 3.9 -> 2.9-3.1 ms and
fp32 6.8 -> 5.7-5.9 ms; on two threads the same within the run-to-run spread (0.43-0.74 either way)."""
CACHE_LINE = 64  # bytes


def _prefetch(builder, address, *, write: bool, locality: int) -> None:
    """Emit ``llvm.prefetch`` of the cache line holding ``address`` (any pointer) into the data cache, for a
    read or a ``write``, with ``locality`` 0 .. 3 (:data:`PREFETCH_KEEP_EVERYWHERE`). Never faults."""
    i32 = ir.IntType(32)
    byte_pointer = ir.IntType(8).as_pointer()
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), "llvm.prefetch.p0")
    data_cache = 1  # the intrinsic's last operand: 1 data cache, 0 instruction cache
    builder.call(prefetch, [builder.bitcast(address, byte_pointer), ir.Constant(i32, int(write)),
                            ir.Constant(i32, locality), ir.Constant(i32, data_cache)])


def _close_loop(builder, counter, accumulators, updated, bound, loop, done):
    """End the body of a counted loop whose header holds the phis ``counter`` and ``accumulators``: feed
    them ``counter + 1`` and ``updated``, loop back while ``counter + 1 < bound``, continue at ``done``.
    Returns the body's last block (the incoming block of phis in ``done``)."""
    following = builder.add(counter, ir.Constant(counter.type, 1))
    body_end = builder.block
    counter.add_incoming(following, body_end)
    for acc, value in zip(accumulators, updated):
        acc.add_incoming(value, body_end)
    builder.cbranch(builder.icmp_signed("<", following, bound), loop, done)
    builder.position_at_end(done)
    return body_end


@intrinsic
def dot_tile(typingctx, dots, q_t, keys, lane0, key0, row_starts, ahead_rows):
    """The dot products of ``VECTOR`` lanes x ``KEYS_PER_TILE`` keys, a vector accumulator per key in
    registers (all eight in one pass over the channels, or two passes of four: :func:`_keys_per_pass`).

    ``dots`` float32; either ``q_t`` float32 and float32 ``keys`` (channels),
    or ``q_t`` int32 ``[P, lanes]`` and uint16 ``keys`` (bf16 channel pairs);
    ``dots`` and ``q_t`` 2-d, all C-contiguous. With ``row_starts`` ``None``,
    ``keys`` is ``[rows, D]`` (bf16: ``[rows, 2P]``) and key ``i`` is its row
    ``i``; with an int64 array, ``keys`` is 1-d and key ``i`` is the ``D``
    elements from ``keys[row_starts[i]]`` (any offset, even an odd one for
    bf16). The caller keeps ``lane0 + VECTOR`` within ``q_t``'s and
    ``dots``' columns, ``key0 + KEYS_PER_TILE`` within ``dots``' rows and the
    keys', and ``key0 + 2*KEYS_PER_TILE`` within ``row_starts`` (the prefetch
    of the next tile reads it; no bounds checks here). While it computes, the
    tile asks for the keys ``ahead_rows`` rows after its own (rows of
    ``keys``, any distance, even negative: a prefetch never faults):
    ``KEYS_PER_TILE``, the next tile's, or for the paged score the same slots
    of a page further on. With ``row_starts``, pass ``KEYS_PER_TILE`` (it
    indexes ``row_starts``). One vector of lanes,
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
    signature = types.void(dots, q_t, keys, types.intp, types.intp, row_starts, types.intp)

    def codegen(context, builder, sig, args):
        dots_arr, q_arr, keys_arr = (context.make_array(t)(context, builder, a)
                                     for t, a in zip(sig.args[:3], args[:3]))
        lane0, key0, ahead_rows = args[3], args[4], args[6]
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
        per_pass = _keys_per_pass()
        prefetching = _prefetching_passes(pairs)
        asked = KEYS_PER_TILE // prefetching  # next-tile keys each prefetching pass asks for
        for first in range(0, KEYS_PER_TILE, per_pass):
            keys = range(first, first + per_pass)
            entry = builder.block
            loop = builder.append_basic_block("tile_channels")
            done = builder.append_basic_block("tile_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            channel = builder.phi(index)
            channel.add_incoming(constant(0), entry)
            accumulators = [builder.phi(vector) for _ in keys]
            for acc in accumulators:
                acc.add_incoming(ir.Constant(vector, [0.0] * VECTOR), entry)
            q_start = builder.add(builder.mul(channel, q_cols), lane0)
            q_vector = builder.load(vector_at(q_arr.data, q_start, q_type), align=4)
            if first // per_pass < prefetching:  # the first pass, or every pass
                # Prefetch the keys ahead meanwhile (keys stream from memory in place): with p =
                # prefetching, every p-th channel step c asks for step 8p*(c // 8p) of the ahead tile's
                # key first + (c // p) % asked (the pass's keys in turn), so every cache line of them
                # twice over the loop, one request at a time (a burst of them stalls the products).
                turn = builder.lshr(channel, constant(prefetching.bit_length() - 1))
                ahead = key_row(builder.add(builder.add(builder.add(key0, ahead_rows), constant(first)),
                                            builder.and_(turn, constant(asked - 1))))
                target = builder.gep(ahead, [builder.and_(channel, constant(-8 * prefetching))])
                if prefetching == 1:  # no test: even one LLVM folds away changes the AVX-512 tile's code
                    _prefetch(builder, target, write=False, locality=PREFETCH_BELOW_L1)
                else:
                    step_asks = builder.icmp_signed(
                        "==", builder.and_(channel, constant(prefetching - 1)), constant(0))
                    with builder.if_then(step_asks):
                        _prefetch(builder, target, write=False, locality=PREFETCH_BELOW_L1)
            updated = [multiply_add(q_vector, builder.load(builder.gep(key_rows[k], [channel])), acc)
                       for k, acc in zip(keys, accumulators)]
            _close_loop(builder, channel, accumulators, updated, depth, loop, done)
            for k, value in zip(keys, updated):
                row_start = builder.add(builder.mul(builder.add(key0, constant(k)), dots_cols), lane0)
                builder.store(value, vector_at(dots_arr.data, row_start, vector), align=4)
        return context.get_dummy_value()

    return signature, codegen


WEIGHTED_HEADS = 8
WEIGHTED_CHANNELS = 2 * VECTOR


def _weighted_passes(heads: int) -> list[tuple[range, tuple[int, ...]]]:
    """The passes over the rows of a ``heads`` x 32-channel weighted-rows tile, each ``(heads, halves)``:
    one pass holding every accumulator (``2 * heads`` vectors of 16) with AVX-512's 32 registers; with
    AVX2's 16, passes of at most 6 heads x one 16-channel half (12 of the registers, a 16-lane vector
    taking two), where more accumulators spill to memory. Each (head, channel) sums its rows in order
    either way."""
    if _target_has_wide_registers():
        return [(range(heads), (0, 1))]
    per_pass = 6 if heads % 6 == 0 else 4
    return [(range(first, first + per_pass), (half,)) for first in range(0, heads, per_pass) for half in (0, 1)]


def _make_weighted_rows_tile(heads: int):
    """An intrinsic ``tile(acc, weights, rows, head0, chan0, num_rows, ahead, ahead_starts, ahead_rows)`` for
    ``heads`` heads x 32 channels: ``acc[head0 + k, chan0 : chan0 + 32] += sum_n weights[n, head0 + k] *
    rows[n, chan0 : chan0 + 32]`` for ``k < heads``, one fused multiply-add per row ``n = 0, 1, ...`` in
    order, the accumulators in registers. 2-d C arrays, float32 (``rows`` may be bf16 bits, ``uint16``);
    the caller keeps every index in bounds.

    With a 1-d array ``ahead`` and int64 ``ahead_starts`` (``None`` for neither), the step of each row
    ``n < ahead_rows`` also prefetches the same 32 channels of the row at ``ahead[ahead_starts[n]]`` (never
    faults; ``ahead_starts`` has ``ahead_rows`` entries or more): rows the caller reads next, whose trip
    from memory then overlaps these multiply-adds."""

    @intrinsic
    def tile(typingctx, acc, weights, rows, head0, chan0, num_rows, ahead, ahead_starts, ahead_rows):
        if not (_is_c_matrix(acc, types.float32) and _is_c_matrix(weights, types.float32)
                and (_is_c_matrix(rows, types.float32) or _is_c_matrix(rows, types.uint16))):
            return None
        prefetching = isinstance(ahead_starts, types.Array)
        if prefetching and not (isinstance(ahead, types.Array) and ahead.ndim == 1 and ahead_starts.ndim == 1
                                and ahead_starts.dtype == types.int64):
            return None
        bf16_rows = rows.dtype == types.uint16
        signature = types.void(acc, weights, rows, types.intp, types.intp, types.intp, ahead, ahead_starts,
                               types.intp)

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
            halves_type = ir.VectorType(ir.IntType(16), VECTOR)
            words = ir.VectorType(ir.IntType(32), VECTOR)

            def constant(value):
                return ir.Constant(index, value)

            def vector_at(data, offset):
                return _vector_at(builder, data, offset, vector)

            acc_starts = [builder.add(builder.mul(builder.add(head0, constant(k)), acc_cols), chan0)
                          for k in range(heads)]
            if prefetching:
                ahead_data = context.make_array(sig.args[6])(context, builder, args[6]).data
                starts_data = context.make_array(sig.args[7])(context, builder, args[7]).data
            for first_pass, (pass_heads, halves) in enumerate(_weighted_passes(heads)):
                # (head, half) pairs: accumulator k, v holds acc[head0 + k, chan0 + 16 v : + 16]
                tiles = [(k, v) for k in pass_heads for v in halves]
                initial = [builder.load(vector_at(acc_arr.data, builder.add(acc_starts[k], constant(v * VECTOR))),
                                        align=4) for k, v in tiles]
                entry = builder.block
                loop = builder.append_basic_block("weighted_rows")
                done = builder.append_basic_block("weighted_done")
                builder.cbranch(builder.icmp_signed(">", num_rows, constant(0)), loop, done)
                builder.position_at_end(loop)
                n = builder.phi(index)
                n.add_incoming(constant(0), entry)
                accumulators = [builder.phi(vector) for _ in tiles]
                for acc, value in zip(accumulators, initial):
                    acc.add_incoming(value, entry)
                if prefetching and first_pass == 0:
                    with builder.if_then(builder.icmp_signed("<", n, args[8]), likely=True):
                        ahead_row = builder.add(builder.load(builder.gep(starts_data, [n])), chan0)
                        per_line = CACHE_LINE // context.get_abi_sizeof(context.get_data_type(sig.args[6].dtype))
                        for line in range(0, WEIGHTED_CHANNELS, per_line):
                            _prefetch(builder, builder.gep(ahead_data, [builder.add(ahead_row, constant(line))]),
                                      write=False, locality=PREFETCH_KEEP_EVERYWHERE)
                row_start = builder.add(builder.mul(n, row_cols), chan0)
                values = {}
                for v in halves:
                    address = builder.gep(rows_arr.data, [builder.add(row_start, constant(v * VECTOR))])
                    if bf16_rows:  # widened in registers: the bf16 bits shifted into the high half
                        bits = builder.load(builder.bitcast(address, halves_type.as_pointer()), align=2)
                        shifted = builder.shl(builder.zext(bits, words), ir.Constant(words, [16] * VECTOR))
                        values[v] = builder.bitcast(shifted, vector)
                    else:
                        values[v] = builder.load(builder.bitcast(address, vector.as_pointer()), align=4)
                weight_start = builder.add(builder.mul(n, weight_cols), head0)
                spreads = {k: _splat(builder, builder.load(builder.gep(weights_arr.data, [
                    builder.add(weight_start, constant(k))])), vector) for k in pass_heads}
                updated = [builder.call(fma, [spreads[k], values[v], acc]) for (k, v), acc in zip(tiles, accumulators)]
                body_end = _close_loop(builder, n, accumulators, updated, num_rows, loop, done)
                finals = [builder.phi(vector) for _ in tiles]  # phis first
                for final, before, after in zip(finals, initial, updated):
                    final.add_incoming(before, entry)
                    final.add_incoming(after, body_end)
                for (k, v), final in zip(tiles, finals):
                    builder.store(final, vector_at(acc_arr.data, builder.add(acc_starts[k], constant(v * VECTOR))),
                                  align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile


weighted_rows_tile_12, weighted_rows_tile_8, weighted_rows_tile_4 = (
    _make_weighted_rows_tile(12), _make_weighted_rows_tile(8), _make_weighted_rows_tile(4))

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
def transpose_block(typingctx, dots, dots_t, key0, lane0):
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


def _segment_transpose(builder, vectors, heads):
    """Transpose each ``heads``-lane segment of ``heads`` vectors: ``out[j][s*heads + k] = vectors[k][s*heads +
    j]`` (segment ``s``). One butterfly stage per bit of ``heads``: the pairs of vectors that differ in that
    bit of their index swap the segment elements that differ in it, two shuffles a pair (for 4 heads,
    in-lane shuffles only: 8 for 4 vectors)."""
    segments = VECTOR // heads
    bit = 1
    while bit < heads:
        swapped = list(vectors)
        for k in range(heads):
            if k & bit:
                continue
            low, high = vectors[k], vectors[k | bit]  # shuffle operands: low's lanes 0..15, high's 16..31
            keep_low = [s * heads + (j if not j & bit else VECTOR + (j ^ bit)) for s in range(segments)
                        for j in range(heads)]
            keep_high = [s * heads + (j | bit if not j & bit else VECTOR + j) for s in range(segments)
                         for j in range(heads)]
            lanes = ir.VectorType(ir.IntType(32), VECTOR)
            swapped[k] = builder.shuffle_vector(low, high, ir.Constant(lanes, keep_low))
            swapped[k | bit] = builder.shuffle_vector(low, high, ir.Constant(lanes, keep_high))
        vectors = swapped
        bit *= 2
    return vectors


def _relu(builder, x, zero):
    """``x if not x <= 0 else 0`` per lane: NaN kept, -0 made +0 (as the reference's ``relu``)."""
    return builder.select(builder.fcmp_ordered("<=", x, zero), zero, x)


def _head_sums_weighted(dots, totals, weights, divisor) -> bool | None:
    """Whether a head-sum epilogue's ``weights`` are given (a float32 C matrix) or not (``None``), for float32 C
    matrices ``dots`` and ``totals`` and a float32 ``divisor``; ``None`` for arguments it does not take."""
    weighted = not isinstance(weights, (types.NoneType, types.Omitted))
    if not (_is_c_matrix(dots, types.float32) and _is_c_matrix(totals, types.float32)
            and (not weighted or _is_c_matrix(weights, types.float32)) and divisor == types.float32):
        return None
    return weighted


@intrinsic(prefer_literal=True)
def relu_head_sums_block(typingctx, dots, totals, key0, lane0, heads, weights, divisor, column0):
    """The score epilogue of one tile, in registers, for a head count ``heads`` (a literal dividing 16 or a
    multiple of 16): ``totals[lane0 // heads + i, column0 + key0 + k] = (sum_h w_h * relu(dots[key0 + k,
    lane0 + i*heads + h])) / divisor`` for ``k < 8``, ``i < max(1, 16 // heads)``, each sum in head order
    ``h = 0 .. heads-1``: the same operations in the same order as :func:`._score_tasks.relu_sums`, whose
    bits it reproduces.

    ``weights`` ``None`` (every weight 1: neither the multiplies nor the leading ``0 +`` change a bit of
    a ReLU's result, so neither is emitted) or float32 ``[rows, heads]`` C (row ``lane0 // heads + i``);
    ``dots`` and ``totals`` float32 2-d C; ``divisor`` float32. The lanes from ``lane0`` hold whole rows:
    ``16 // heads`` rows in one tile, or one row over ``heads // 16`` tiles (its running sums stay in
    registers from one tile to the next). Unweighted 2, 4 or 8 heads: each group of ``heads`` keys is
    transposed within each row's lanes (:func:`_segment_transpose`), so the sums run on whole 16-lane
    vectors (``16 // heads`` rows x ``heads`` keys) and each row's keys are stored at once. Otherwise
    the 8 x 16 transpose (:func:`_block_columns`) of each tile makes each (row, head) an 8-key vector.
    The caller keeps every index in bounds.
    """
    if not (isinstance(heads, types.IntegerLiteral) and heads.literal_value > 0
            and (VECTOR % heads.literal_value == 0 or heads.literal_value % VECTOR == 0)):
        return None
    weighted = _head_sums_weighted(dots, totals, weights, divisor)
    if weighted is None:
        return None
    row_heads = heads.literal_value

    def codegen(context, builder, sig, args):
        dots_arr, totals_arr = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2]))
        key0, lane0, divisor_value, column0 = args[2], args[3], args[6], args[7]
        index = ir.IntType(64)
        totals_cols = builder.extract_value(totals_arr.shape, 1)
        dots_cols = builder.extract_value(dots_arr.shape, 1)
        first_row = builder.sdiv(lane0, ir.Constant(index, row_heads))

        def store(values, row, key):  # a vector of consecutive keys of one row of totals
            start = builder.add(builder.mul(builder.add(first_row, ir.Constant(index, row)), totals_cols),
                                builder.add(builder.add(column0, key0), ir.Constant(index, key)))
            builder.store(values, _vector_at(builder, totals_arr.data, start, values.type), align=4)

        if not weighted and row_heads in (2, 4, 8):
            vector = ir.VectorType(ir.FloatType(), VECTOR)
            zero = ir.Constant(vector, [0.0] * VECTOR)
            spread_divisor = _splat(builder, divisor_value, vector)
            keys = [builder.load(_vector_at(builder, dots_arr.data, builder.add(
                builder.mul(builder.add(key0, ir.Constant(index, k)), dots_cols), lane0), vector), align=4)
                for k in range(KEYS_PER_TILE)]
            for group in range(0, KEYS_PER_TILE, row_heads):
                by_head = _segment_transpose(builder, keys[group : group + row_heads], row_heads)
                total = _relu(builder, by_head[0], zero)
                for h in range(1, row_heads):
                    total = builder.fadd(total, _relu(builder, by_head[h], zero))
                total = builder.fdiv(total, spread_divisor)
                for i in range(VECTOR // row_heads):
                    row_keys = builder.shuffle_vector(total, ir.Constant(vector, ir.Undefined), ir.Constant(
                        ir.VectorType(ir.IntType(32), row_heads), list(range(i * row_heads, (i + 1) * row_heads))))
                    store(row_keys, i, group)
            return context.get_dummy_value()

        octet = ir.VectorType(ir.FloatType(), KEYS_PER_TILE)
        zero = ir.Constant(octet, [0.0] * KEYS_PER_TILE)
        spread_divisor = _splat(builder, divisor_value, octet)
        if weighted:
            weights_arr = context.make_array(sig.args[5])(context, builder, args[5])
            weight_cols = builder.extract_value(weights_arr.shape, 1)
        tiles = {}

        def column(lane):  # lane - lane0's 8 keys; each tile transposed once, when first needed
            tile = lane // VECTOR
            if tile not in tiles:
                tiles[tile] = _block_columns(builder, dots_arr.data, dots_cols, key0,
                                             builder.add(lane0, ir.Constant(index, tile * VECTOR)))
            return tiles[tile][lane % VECTOR]

        for i in range(max(1, VECTOR // row_heads)):
            total = None
            for h in range(row_heads):
                term = _relu(builder, column(i * row_heads + h), zero)
                if weighted:
                    row = builder.add(first_row, ir.Constant(index, i))
                    weight = builder.load(builder.gep(weights_arr.data, [
                        builder.add(builder.mul(row, weight_cols), ir.Constant(index, h))]))
                    term = builder.fmul(_splat(builder, weight, octet), term)
                    total = builder.fadd(zero if total is None else total, term)
                else:
                    total = term if total is None else builder.fadd(total, term)
            store(builder.fdiv(total, spread_divisor), i, 0)
        return context.get_dummy_value()

    return types.void(dots, totals, types.intp, types.intp, heads, weights, divisor, types.intp), codegen


def _octet_transpose(builder, rows):
    """The 8 x 8 transpose of eight 8-float vectors: ``out[j][k] = rows[k][j]``, in 24 shuffles of the kinds
    x86 does within 128-bit halves or on whole halves (``unpcklps``/``unpckhps``, ``shufps``, ``vperm2f128``),
    cheaper than the lane-crossing two-source permutes of :func:`_block_columns`' 16-float rows."""
    def shuffle(a, b, indices):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), indices))

    pairs = []  # pairs[2p]: rows 2p, 2p+1 interleaved, columns 0, 1, 4, 5; pairs[2p+1]: columns 2, 3, 6, 7
    for p in range(4):
        pairs += [shuffle(rows[2 * p], rows[2 * p + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
                  shuffle(rows[2 * p], rows[2 * p + 1], [2, 10, 3, 11, 6, 14, 7, 15])]
    quads = []  # quads[4h + c]: rows 4h .. 4h+3 of columns c and c + 4
    for first in (0, 4):
        for low in (0, 1):
            for keep in ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]):
                quads.append(shuffle(pairs[first + low], pairs[first + 2 + low], keep))
    return ([shuffle(quads[c], quads[4 + c], [0, 1, 2, 3, 8, 9, 10, 11]) for c in range(4)]
            + [shuffle(quads[c], quads[4 + c], [4, 5, 6, 7, 12, 13, 14, 15]) for c in range(4)])


@intrinsic(prefer_literal=True)
def relu_head_sums_pair(typingctx, dots, totals, key0, lane0, heads, weights, divisor, column0):
    """:func:`relu_head_sums_block`'s sums for two tiles at once, keys ``key0 .. key0 + 15``, where one row's
    ``heads`` (a literal multiple of 16) fill whole tiles: ``totals[lane0 // heads, column0 + key0 + k]`` for
    ``k < 16``, the same operations in the same order (same bits). Each 8-key half's columns come from 8 x 8
    transposes (:func:`_octet_transpose`), and the halves' two chains of ``heads`` sums are interleaved: with
    the cheaper shuffles one chain's adds become the limit. Alone in a loop, 32 weighted heads: 20.8-27.0 ns
    per 8 keys against 31.2-35.5 for two :func:`relu_head_sums_block` calls. The caller keeps every index in
    bounds."""
    if not (isinstance(heads, types.IntegerLiteral) and heads.literal_value > 0
            and heads.literal_value % VECTOR == 0):
        return None
    weighted = _head_sums_weighted(dots, totals, weights, divisor)
    if weighted is None:
        return None
    row_heads = heads.literal_value

    def codegen(context, builder, sig, args):
        dots_arr, totals_arr = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:2], args[:2]))
        key0, lane0, divisor_value, column0 = args[2], args[3], args[6], args[7]
        index = ir.IntType(64)
        octet = ir.VectorType(ir.FloatType(), KEYS_PER_TILE)
        zero = ir.Constant(octet, [0.0] * KEYS_PER_TILE)
        dots_cols = builder.extract_value(dots_arr.shape, 1)
        row = builder.sdiv(lane0, ir.Constant(index, row_heads))
        if weighted:
            weights_arr = context.make_array(sig.args[5])(context, builder, args[5])
            weight_row = builder.mul(row, builder.extract_value(weights_arr.shape, 1))

        def octet_at(key, lane):
            start = builder.add(builder.mul(key, dots_cols), lane)
            return builder.load(_vector_at(builder, dots_arr.data, start, octet), align=4)

        totals = [None, None]
        for group in range(0, row_heads, KEYS_PER_TILE):  # 8 heads at a time, in head order
            lane = builder.add(lane0, ir.Constant(index, group))
            columns = [_octet_transpose(builder, [octet_at(builder.add(key0, ir.Constant(index, 8 * half + k)), lane)
                                                  for k in range(KEYS_PER_TILE)]) for half in range(2)]
            for h in range(KEYS_PER_TILE):
                if weighted:
                    weight = _splat(builder, builder.load(builder.gep(weights_arr.data, [
                        builder.add(weight_row, ir.Constant(index, group + h))])), octet)
                for half in range(2):
                    term = _relu(builder, columns[half][h], zero)
                    if weighted:
                        totals[half] = builder.fadd(zero if totals[half] is None else totals[half],
                                                    builder.fmul(weight, term))
                    else:
                        totals[half] = term if totals[half] is None else builder.fadd(totals[half], term)
        spread_divisor = _splat(builder, divisor_value, octet)
        totals_cols = builder.extract_value(totals_arr.shape, 1)
        for half in range(2):
            start = builder.add(builder.mul(row, totals_cols),
                                builder.add(builder.add(column0, key0), ir.Constant(index, 8 * half)))
            builder.store(builder.fdiv(totals[half], spread_divisor),
                          _vector_at(builder, totals_arr.data, start, octet), align=4)
        return context.get_dummy_value()

    return types.void(dots, totals, types.intp, types.intp, heads, weights, divisor, types.intp), codegen


SQUARE_SUM_ROWS = 2 * KEYS_PER_TILE
"""Rows whose squares :func:`add_block_squares` sums at once (two independent chains of 8)."""


@intrinsic
def add_block_squares(typingctx, rows, sums, col0):
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


def _prefetch_element_typing(array, index, locality: int):
    """Signature and codegen of a prefetch of the cache line of ``array[index]`` with ``locality``."""
    if not (isinstance(array, types.Array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        _prefetch(builder, builder.gep(data, [args[1]]), write=False, locality=locality)
        return context.get_dummy_value()

    return types.void(array, index), codegen


@intrinsic
def prefetch_element(typingctx, array, index):
    """Ask for the cache line of ``array[index]`` (into every cache level); never faults."""
    return _prefetch_element_typing(array, index, PREFETCH_KEEP_EVERYWHERE)
