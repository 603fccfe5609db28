"""Fast CPU block selection (SPEC 2.4, 3.3): numba, same signature and outputs as the reference.

One ``prange`` task per row. Instead of sorting the row (the reference's
stable sort, ``O(v log v)``), it finds the ``K``-th largest score with
``np.partition`` (``O(v)``), then walks the blocks in ascending order taking
every score above that threshold and, of the scores equal to it, the lowest
block ids until ``K`` are taken. That is exactly "the ``K`` highest, ties to
the lower id", and it writes the tokens in ascending block order without a
second sort. NaN ranks as ``-inf`` and ``-0.0 == 0.0``, as in the reference.
"""

from __future__ import annotations

import numba
import numpy as np

from ._parallel import PARALLEL_JIT, threads_for


@numba.njit(**PARALLEL_JIT)
def _select_kernel(indices, counts, scores, positions, ratio, budget, include_tail):
    total_q, width = indices.shape
    num_cols = scores.shape[1]
    max_selected = budget // ratio
    for r in numba.prange(total_q):
        t = positions[r]
        visible = min(max((t + 1) // ratio, 0), num_cols)
        n = 0
        if visible <= max_selected:
            for g in range(visible):
                for i in range(ratio):
                    indices[r, n] = g * ratio + i
                    n += 1
        elif max_selected > 0:
            ranked = np.empty(visible, np.float32)
            for g in range(visible):
                s = scores[r, g]
                ranked[g] = -np.inf if np.isnan(s) else s
            threshold = np.partition(ranked, visible - max_selected)[visible - max_selected]
            above = 0
            for g in range(visible):
                if ranked[g] > threshold:
                    above += 1
            ties_left = max_selected - above
            for g in range(visible):
                s = ranked[g]
                take = s > threshold
                if not take and s == threshold and ties_left > 0:
                    take = True
                    ties_left -= 1
                if take:
                    for i in range(ratio):
                        indices[r, n] = g * ratio + i
                        n += 1
        if include_tail and t >= 0:
            for position in range(ratio * ((t + 1) // ratio), t + 1):
                indices[r, n] = position
                n += 1
        counts[r] = n
        for i in range(n, width):
            indices[r, i] = -1


def select_blocks_expand(indices, counts, scores, query_positions, ratio, budget, include_tail):
    """Same contract as :func:`sparsekv.kernels.reference.select.select_blocks_expand`."""
    if indices.shape[0] == 0:
        return
    with threads_for(scores.numel()):
        _select_kernel(indices.numpy(), counts.numpy(), scores.float().contiguous().numpy(),
                       query_positions.numpy(), ratio, budget, bool(include_tail))
