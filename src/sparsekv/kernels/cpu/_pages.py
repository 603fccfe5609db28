"""Page-table checks shared by the CPU kernels of several families (numba, on host arrays)."""

from __future__ import annotations

import numba

from ..reference.qsa import counted_entry_error


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
            if logical >= table.shape[1] or table[b, logical] < 0 or table[b, logical] >= num_pages:
                return b, logical * page_size
    return -1, -1


@numba.njit(cache=True, nogil=True)
def _first_bad_entry(table, num_pages, page_size, indices, counts, seq_of_row):
    """(row, entry) of the first counted position that is negative or has no valid page; (-1, -1) if none."""
    for r in range(indices.shape[0]):
        b = seq_of_row[r]
        for i in range(min(counts[r], indices.shape[1])):
            position = indices[r, i]
            if position < 0 or position // page_size >= table.shape[1]:
                return r, i
            page = table[b, position // page_size]
            if page < 0 or page >= num_pages:
                return r, i
    return -1, -1


def check_counted_entries(lookup_table, num_pages, page_size, indices, counts, seq_of_row):
    """Raise the reference's :func:`counted_entry_error` for the first counted entry (row by row) that is
    negative or has no valid page, in one pass without temporaries.

    ``lookup_table [B, max_pages]``, ``indices [total_q, W]``, ``counts [total_q]``: int32 CPU tensors;
    ``seq_of_row [total_q]`` int64 array (:func:`._paged_rows.sequence_of_rows`).
    """
    r, i = _first_bad_entry(lookup_table.numpy(), num_pages, page_size, indices.numpy(), counts.numpy(), seq_of_row)
    if r >= 0:
        raise counted_entry_error(lookup_table, num_pages, page_size, indices, counts, r, i, int(seq_of_row[r]))
