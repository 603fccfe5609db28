"""Page-table checks shared by the CPU kernels of several families (numba, on host arrays)."""

from __future__ import annotations

import numba
import numpy as np

from ..._address import array_at
from ..reference.qsa import counted_entry_error


@numba.njit(cache=True, nogil=True, inline="always")
def _page_missing(table, b, logical, num_pages):
    """Whether sequence ``b``'s logical page ``logical >= 0`` has no page: past the table's columns, or an
    id that is negative (the sentinel) or ``>= num_pages``."""
    return logical >= table.shape[1] or table[b, logical] < 0 or table[b, logical] >= num_pages


@numba.njit(cache=True, nogil=True)
def first_missing_page(table, num_pages, page_size, entry_counts):
    """First page that entries ``0 .. entry_counts[b]-1`` of each sequence need and ``table`` lacks.

    Args:
        table: ``[B, max_pages]`` integer array (page ids; negative or ``>= num_pages`` is missing).
        num_pages: pages in the cache.
        page_size: entries per page (tokens in a token cache, pools in a pooled one).
        entry_counts: ``[B]`` integer array.

    Returns ``(sequence, first entry of that page)``, or ``(-1, -1)`` when every
    needed page is there. Example: page size 4, counts ``[9]``, table
    ``[[3, -1, 0]]``: entries 4..7 have no page, result ``(0, 4)``.
    """
    for b in range(entry_counts.shape[0]):
        for logical in range((entry_counts[b] + page_size - 1) // page_size):
            if _page_missing(table, b, logical, num_pages):
                return b, logical * page_size
    return -1, -1


@numba.njit(cache=True, nogil=True)
def _scan_counted_entries(table, num_pages, page_size, indices, counts, offsets):
    """One pass over every row's counted entries: ``(seq_of_row, bad_row, bad_entry, counted, most_rows,
    longest)``.

    ``seq_of_row [total_q]`` int64 is each row's sequence; ``(bad_row, bad_entry)`` the first counted
    position (row by row) that is negative or has no valid page, ``(-1, -1)`` if none; ``counted`` the
    entries counted in all (``counts`` clipped to ``[0, W]``); ``most_rows`` the most rows of one sequence;
    ``longest`` the most entries one row counts.
    """
    batch = offsets.shape[0] - 1
    seq_of_row = np.empty(offsets[batch], np.int64)
    counted = longest = 0
    most_rows = 0
    for b in range(batch):
        most_rows = max(most_rows, offsets[b + 1] - offsets[b])
        for r in range(offsets[b], offsets[b + 1]):
            seq_of_row[r] = b
            count = max(min(counts[r], indices.shape[1]), 0)
            counted += count
            longest = max(longest, count)
            for i in range(count):
                position = indices[r, i]
                if position < 0 or _page_missing(table, b, position // page_size, num_pages):
                    return seq_of_row, r, i, counted, most_rows, longest
    return seq_of_row, -1, -1, counted, most_rows, longest


@numba.njit(cache=True, nogil=True)
def _scan_counted_entries_at(table_at, batch, max_pages, num_pages, page_size, indices_at, total_q, width, counts_at,
                             offsets_at):
    """:func:`_scan_counted_entries` over int32 tensors given by address (:func:`sparsekv._address.array_at`;
    each C-contiguous): ``table [batch, max_pages]``, ``indices [total_q, width]``, ``counts [total_q]``,
    ``offsets [batch + 1]``."""
    return _scan_counted_entries(array_at(table_at, (batch, max_pages), np.int32), num_pages, page_size,
                                 array_at(indices_at, (total_q, width), np.int32),
                                 array_at(counts_at, (total_q,), np.int32),
                                 array_at(offsets_at, (batch + 1,), np.int32))


def plan_counted_rows(lookup_table, num_pages, page_size, indices, counts, input_row_offsets):
    """``(seq_of_row, counted, most_rows, longest)`` of :func:`_scan_counted_entries`, after checking every counted
    entry in the same pass: the first (row by row) that is negative or has no valid page raises the
    reference's :func:`counted_entry_error`. All int32 C-contiguous CPU tensors: ``lookup_table [B,
    max_pages]``, ``indices [total_q, W]``, ``counts [total_q]``, ``input_row_offsets [B+1]`` (read by
    address: no numpy views to make, whose code is cold after a kernel).
    """
    seq_of_row, r, i, counted, most_rows, longest = _scan_counted_entries_at(
        lookup_table.data_ptr(), lookup_table.shape[0], lookup_table.shape[1], num_pages, page_size,
        indices.data_ptr(), indices.shape[0], indices.shape[1], counts.data_ptr(), input_row_offsets.data_ptr())
    if r >= 0:
        raise counted_entry_error(lookup_table, num_pages, page_size, indices, counts, r, i, int(seq_of_row[r]))
    return seq_of_row, counted, most_rows, longest
