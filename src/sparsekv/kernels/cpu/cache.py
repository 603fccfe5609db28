"""CPU paged store (SPEC 1.1): every destination resolved and validated in one numba pass, then the rows copied.

The reference store (vectorised torch, a dozen ops of several microseconds
each) costs about 50 us per call whatever its size, 0.17 ms inside a model's
decode step, three stores per layer. Here a decode-sized store is one numba
call; a large one copies its rows on every thread.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ...cache.layout import page_error
from ._bits import as_numba, copy_row
from . import _parallel
from ._paged_rows import flat_plane
from ._parallel import PARALLEL_JIT, worker_tasks


@numba.njit(cache=True, nogil=True)
def _place_rows(starts, table, cache_lengths, offsets, num_pages, page_size, page_stride, flat, base, values, copy):
    """``starts[r]``: where row ``r`` of ``values [T, W]`` goes (sequence ``b``'s position ``cache_lengths[b]
    + r - offsets[b]``), in elements from ``base``, for every row in order; then, with ``copy``, the rows
    written there (``flat[base + starts[r] :][:W] = values[r]``, on this thread). Returns ``(-1, -1)``, or,
    having written nothing, ``(b, position)`` of the first row whose page is past the table, a sentinel or
    outside ``[0, num_pages)``."""
    width = values.shape[1]
    max_pages = table.shape[1]
    for b in range(offsets.shape[0] - 1):
        for r in range(offsets[b], offsets[b + 1]):
            position = np.int64(cache_lengths[b]) + r - offsets[b]
            logical = position // page_size
            page = table[b, logical] if logical < max_pages else -1
            if page < 0 or page >= num_pages:
                return b, position
            starts[r] = page * page_stride + (position - logical * page_size) * width
    if copy:
        for r in range(values.shape[0]):
            copy_row(flat[base + starts[r] : base + starts[r] + width], values[r])
    return -1, -1


@numba.njit(**PARALLEL_JIT)
def _copy_rows(flat, base, starts, values, threads):
    """``flat[base + starts[r] : ... + W] = values[r]`` for every row ``r`` of ``values [T, W]``."""
    rows, width = values.shape
    workers = max(1, min(threads, rows))
    for worker in prange(workers):
        first, end = worker_tasks(worker, workers, rows)
        for r in range(first, end):
            copy_row(flat[base + starts[r] : base + starts[r] + width], values[r])


def paged_store(blocks, values, lookup_table, cache_lengths, input_row_offsets, plane, layer):
    """Same contract as :func:`sparsekv.kernels.reference.cache.paged_store`: nothing is written when a
    destination page is missing. A store below ``PARALLEL_MIN_WORK`` elements (a decode step's) is one
    numba call on this thread; a larger one copies its rows on every thread once all are placed."""
    rows = values.shape[0]
    if rows == 0:
        return
    num_pages, _, _, page_size, heads, dim = blocks.shape
    source = as_numba(values.contiguous()).reshape(rows, heads * dim)
    flat, _, base = flat_plane(blocks, plane, layer) if num_pages else (source.reshape(-1)[:0], 0, 0)
    starts = np.empty(rows, np.int64)
    small = source.size < _parallel.PARALLEL_MIN_WORK
    b, position = _place_rows(starts, lookup_table.numpy(), cache_lengths.numpy(), input_row_offsets.numpy(),
                              num_pages, page_size, blocks.stride(0), flat, base, source, small)
    if b >= 0:
        raise page_error(lookup_table, num_pages, page_size, b, position)
    if not small:
        with _parallel.threads_for(source.size) as threads:
            _copy_rows(flat, base, starts, source, threads)


__all__ = ["paged_store"]
