"""The register tiles of :mod:`._tile_ir` over whole arrays, and the numba overloads that lay data out for them.

:func:`tile_dots` fills ``dots [keys, lanes]`` with ``keys[i] . q_t[:, lane]``
for float32 ``q_t [D, lanes]`` (``lanes`` a multiple of ``VECTOR``) and
``keys [rows, D]``, or the bf16 pair layout (int32 ``q_t [P, lanes]``, uint16
keys); :func:`new_scratch`, :func:`put_key_row`, :func:`new_query_tiles` and
:func:`put_queries` build those layouts from the dtypes.

:func:`dots_of_rows` runs the tiles on keys read in place (a page's
consecutive pooled keys, a sequence's block keys): whole tiles straight from
memory, the last ``n % 8`` keys from a zero-padded copy, and each tile
prefetches keys ahead (the next tile's, or those a given number of rows on).
:func:`dots_of_gathered_rows` does the same for keys anywhere (attention's
selected tokens): the tile reads each key from its own start
(``row_starts``), and :func:`gather_rows` copies rows with a prefetch ahead
where a copy is needed. :func:`transpose_dots` turns
``dots [keys, lanes]`` into ``[lanes, keys]`` so that the score epilogues run
over each lane's keys contiguously; :func:`square_sums_in_order` sums the
squares of 16 rows at once in channel order (compress's RMSNorm).
:func:`weighted_rows` is the other half of attention, ``acc[h] += sum_n p[n,
h] * v[n]``.

Example: ``q_t`` ``[128, 16]`` (4 rows x 4 heads), ``keys`` ``[128, 128]``:
``tile_dots(dots, q_t, keys, 16, 100)`` runs 13 tiles and writes
``dots[:104]``; rows 100..103 come from ``keys``' rows 100..103 (keep them
finite, e.g. zeros) and are to be ignored.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from numba import types
from numba.extending import overload

from ._bits import widen
from ._tile_ir import (CACHE_LINE, KEYS_PER_TILE, SQUARE_SUM_ROWS, VECTOR, WEIGHTED_CHANNELS, add_block_squares,
                       dot_tile, prefetch_element, transpose_block, weighted_rows_tile_4,
                       weighted_rows_tile_8, weighted_rows_tile_12)

KEYS_PER_TASK = 128
"""Keys (block keys or pooled keys) per score task and per scratch chunk: enough work per task, little scratch;
a multiple of KEYS_PER_TILE."""
KEYS_AHEAD = 32
"""The fewest rows ahead of those it scores that a score kernel asks for while its tiles compute: the
contiguous block score reads its keys ``KEYS_AHEAD`` rows on, the paged scores the same slots a page or
more on (:func:`._paged_score.prefetch_pages_ahead`). For the contiguous QSA block score (4 x 4 rows, 4
heads, two threads, the kernel against the tile's same-run peak, three runs), 32 rows against the next
tile's 8: bf16 keys from memory 0.70-0.81 -> 0.76-0.85 (32768 blocks, 34 MB) and 0.56-0.66 -> 0.62-0.70
(8192 blocks after a 96 MB write), in the L3 0.81-0.85 -> 0.82-0.84; fp32 from -3% to +5% (16 rows
alike)."""
VALUE_ROWS = 64
"""Value rows attention gathers at a time, prefetching the next ones during P.V (:func:`new_value_scratch`'s
rows): 64 measured 3-4% faster than 128."""


@numba.njit(cache=True, nogil=True)
def weighted_rows(acc, weights, rows, heads, num_rows, ahead=None, ahead_starts=None):
    """``acc[h, :] += sum_n weights[n, h] * rows[n, :]`` for ``h < heads`` (rounded up to a multiple of 4),
    ``n < num_rows``: per (head, channel) one fused multiply-add per row, rows in order. Heads run 12 at a
    time while 12 are left (24 accumulators: a GQA group of 12 reads each value row once per 32
    channels; bf16 values 10% faster than 8 + 4), then 8 or 4.

    ``acc [>= heads rounded up to 8, C]``, ``weights [>= num_rows, >= heads rounded up to 8]``,
    ``rows [>= num_rows, C]`` float32 or bf16 bits (``uint16``, widened in registers); all
    C-contiguous, ``C`` a multiple of ``WEIGHTED_CHANNELS`` (32). With ``ahead`` (1-d) and
    ``ahead_starts`` (int64, 1-d), the first pass over the rows also prefetches the ``C`` elements from
    ``ahead[ahead_starts[n]]`` for ``n < min(num_rows, len(ahead_starts))``, a cache line per row per 32
    channels: rows the caller reads next then arrive while these multiply-adds run.
    """
    ahead_rows = 0
    if ahead_starts is not None:
        ahead_rows = min(num_rows, ahead_starts.shape[0])
    head0 = 0
    while head0 < heads:
        left = heads - head0
        step = 12 if left >= 12 else (8 if left > 4 else 4)  # e.g. 12 heads in one pass over the rows
        for chan0 in range(0, acc.shape[1], WEIGHTED_CHANNELS):
            if step == 12:
                weighted_rows_tile_12(acc, weights, rows, head0, chan0, num_rows, ahead, ahead_starts, ahead_rows)
            elif step == 8:
                weighted_rows_tile_8(acc, weights, rows, head0, chan0, num_rows, ahead, ahead_starts, ahead_rows)
            else:
                weighted_rows_tile_4(acc, weights, rows, head0, chan0, num_rows, ahead, ahead_starts, ahead_rows)
        head0 += step
        ahead_rows = 0  # the rows' first pass has asked for them


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
        add_block_squares(rows, sums, col0)
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
            transpose_block(dots, dots_t, key0, lane0)


@numba.njit(cache=True, nogil=True, inline="always")
def tile_dots(dots, q_t, keys, lanes, num_keys, row_starts=None, ahead_rows=KEYS_PER_TILE):
    """``dots[i, l] = key_i . q_t[:, l]`` for ``l < lanes``, ``i < num_keys`` rounded up to ``KEYS_PER_TILE``.

    ``q_t [D, >= lanes]`` float32 with float32 keys, or the bf16 pair layout
    (``q_t`` int32 ``[P, >= lanes]``, uint16 keys of ``2P`` channels);
    ``dots [>= rounded keys, >= lanes]`` float32; all C-contiguous; ``lanes``
    a multiple of ``VECTOR``. ``key_i`` is row ``i`` of ``keys [>= rounded
    keys, D]``, or, given ``row_starts`` (int64, ``>= rounded keys +
    KEYS_PER_TILE`` entries, all pointing at whole keys), the ``D`` elements
    of the 1-d ``keys`` from ``row_starts[i]``: keys gathered from anywhere
    (e.g. cached tokens through a page table) without copying them first.
    Each tile asks for the keys ``ahead_rows`` rows after its own while it
    computes (:func:`._tile_ir.dot_tile`; keep ``KEYS_PER_TILE`` with
    ``row_starts``).

    Inlined where it is called: the paged score calls it once per page (32 keys of the QSA block-key cache),
    and as a call it had cost that kernel 1-3% with the keys in the L3 and 2-6% with them in memory (the
    contiguous block score and the k-pool score 0.5-2%; compiling took 1-2 s longer).
    """
    if q_t.shape[0] == 0:  # the tile's channel loop runs at least once
        dots[: (num_keys + KEYS_PER_TILE - 1) // KEYS_PER_TILE * KEYS_PER_TILE, :lanes] = 0.0
        return
    for key0 in range(0, num_keys, KEYS_PER_TILE):
        for lane0 in range(0, lanes, VECTOR):
            dot_tile(dots, q_t, keys, lane0, key0, row_starts, ahead_rows)


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


@numba.njit(cache=True, nogil=True, inline="always")
def dots_of_rows(dots, q_t, rows, lanes, scratch, ahead_rows=KEYS_PER_TILE):
    """``dots[i, l] = rows[i] . q_t[:, l]`` for ``i < n``, ``l < lanes``; may write up to
    ``KEYS_PER_TILE - 1`` more rows of ``dots``, never reads past ``rows``.

    ``rows [n, D]`` (``n <= KEYS_PER_TASK``) as stored: float32, bf16 bits
    (``uint16``) or fp16 bits (``int16``), C-contiguous, e.g. consecutive
    pooled keys of one page. float32 and even-``D`` bf16 rows are read in
    place; whole tiles of 8 rows run on them directly and the last ``n % 8``
    rows from a zero-padded copy in ``scratch`` (:func:`new_scratch`). So the
    keys stream from memory while the tile computes, instead of being copied
    first (the copy had cost as much as the products). Each whole tile asks
    for ``rows``' keys ``ahead_rows`` rows after its own while it computes
    (:func:`tile_dots`; read in place only, a copy's tiles the next tile's).
    """
    n = rows.shape[0]
    keys = _in_tile_layout(rows, scratch)
    full = n - n % KEYS_PER_TILE
    if full > 0:
        in_place = keys.ctypes.data == rows.ctypes.data
        tile_dots(dots, q_t, keys, lanes, full, None, ahead_rows if in_place else KEYS_PER_TILE)
    if n > full:
        tail = scratch[KEYS_PER_TASK:]
        tail[: n - full] = keys[full:n]
        tail[n - full :] = 0
        tile_dots(dots[full:], q_t, tail, lanes, n - full)


GATHER_AHEAD = 8
"""Rows :func:`gather_rows` asks for ahead of the one it copies (scattered rows defeat the hardware prefetcher)."""


@numba.njit(cache=True, nogil=True, inline="always")
def prefetch_span(flat, start, count):
    """Ask for the cache lines of ``flat[start : start + count]`` (1-d; never faults), into every cache level."""
    step = max(1, CACHE_LINE // flat.itemsize)
    for offset in range(0, count, step):
        prefetch_element(flat, start + offset)


@numba.njit(cache=True, nogil=True)
def gather_rows(target, flat, row_starts, n, dim):
    """``target[i, :dim]`` = ``flat[row_starts[i] : row_starts[i] + dim]`` in ``target``'s layout
    (:func:`put_key_row`) for ``i < n``, while prefetching row ``i + GATHER_AHEAD`` (while
    ``row_starts`` has it: pass the rows after ``n`` too). ``row_starts`` int64, 1-d."""
    for i in range(n):
        if i + GATHER_AHEAD < row_starts.shape[0]:
            prefetch_span(flat, row_starts[i + GATHER_AHEAD], dim)
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
    """Scratch for ``VALUE_ROWS`` value rows of ``channels >= dim`` in :func:`weighted_rows`' layout for
    values like ``values`` (numba only): bf16 bits (``uint16``) stay bits, other floats float32. Only the
    padding channels ``dim ..`` are zeroed (the rows are written before they are read)."""
    raise NotImplementedError


@overload(new_value_scratch, inline="always")
def _new_value_scratch_overload(values, dim, channels):
    dtype = np.uint16 if values.dtype == types.uint16 else np.float32

    def value_scratch(values, dim, channels):
        scratch = np.empty((VALUE_ROWS, channels), dtype)
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


@numba.njit(cache=True, nogil=True, inline="always")
def pack_pairs(tile, lane0, q_rows):
    """Columns ``lane0 ..`` of an int32 pair tile = bf16 bits ``q_rows [n, D]``, each pair packed from its two
    channels (any layout, an odd ``D``'s last channel alone). Channel outer, row inner: each pass stores along
    a tile row (4 rows of GLM's 32 heads took 3.0-5.5 us, row by row 4.8, or-ing each half of a pair into a
    zeroed tile 7.3)."""
    n, dim = q_rows.shape
    for p in range(dim // 2):
        for i in range(n):
            tile[p, lane0 + i] = np.int32(np.int64(q_rows[i, 2 * p]) | (np.int64(q_rows[i, 2 * p + 1]) << 16))
    if dim % 2:
        for i in range(n):
            tile[dim // 2, lane0 + i] = np.int32(q_rows[i, dim - 1])


def put_queries(tile, lane0, q_rows):
    """Columns ``lane0 .. lane0 + n - 1`` of one group's query tile = ``q_rows [n, D]`` (e.g. one row's
    heads) in the tile's layout (numba only)."""
    raise NotImplementedError


@overload(put_queries, inline="always")
def put_queries_overload(tile, lane0, q_rows):
    if tile.dtype == types.int32 and q_rows.layout == "C" and sys.byteorder == "little":
        # an even D's channel pairs are int32 words as stored (channel 2p the low half), copied row by
        # row: 16 rows x 4 heads 3.6 -> 1.5 us, 4 rows x 32 heads 3.6 -> 2.2 against packing each pair
        def copy_pairs(tile, lane0, q_rows):
            n, dim = q_rows.shape
            if dim % 2:
                pack_pairs(tile, lane0, q_rows)
                return
            words = q_rows.view(np.int32)
            for i in range(n):
                for p in range(dim // 2):
                    tile[p, lane0 + i] = words[i, p]
        return copy_pairs
    if tile.dtype == types.int32:
        return lambda tile, lane0, q_rows: pack_pairs(tile, lane0, q_rows)

    def widen_columns(tile, lane0, q_rows):
        n, dim = q_rows.shape
        for d in range(dim):
            for i in range(n):
                tile[d, lane0 + i] = widen(q_rows[i, d])
    return widen_columns
