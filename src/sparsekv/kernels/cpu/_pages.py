"""Page-table checks shared by the CPU kernels of several families (numba, on host arrays)."""

from __future__ import annotations

import numba


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
