"""Argument checks shared by the sparse attention ops (QSA, SPEC 2.5; MLA, SPEC 3.4).

Both ops take the same ``indices [total_q, W]``, ``counts [total_q]`` and
``input_row_offsets [B+1]``; these checks give both the same errors.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .._address import array_at
from .._checks import check_offsets, host_int32


def check_row_offsets(offsets: torch.Tensor, batch: int, total_rows: int, device: torch.device) -> torch.Tensor:
    """``input_row_offsets``: ``[batch + 1]`` non-decreasing from 0 to ``total_rows`` (the q rows), as int32
    on ``device``; ``ValueError``/``TypeError`` naming it otherwise."""
    return check_offsets("input_row_offsets", offsets, batch=batch, total=total_rows, total_of="q rows",
                         device=device)


@numba.njit(cache=True, nogil=True)
def _first_bad_counted_entry(indices_at, total_q, width, counts_at, offsets_at, batch, cached_at):
    """(row, entry, tokens held) of the first counted entry outside ``[0, tokens held)``, or (row, -1, 0) for
    the first count above ``indices``' width; (-1, -1, 0) when every row is fine. The int32 ``indices
    [total_q, width]``, ``counts [total_q]``, ``offsets [batch + 1]`` and ``cached [batch]`` by address
    (:func:`sparsekv._address.array_at`). One pass, no temporaries: the ten numpy ops over the whole index
    matrix that it replaces took ~30 us themselves but made the decode step that followed them 0.05-0.14 ms
    slower (measured; the cause was not pinned down)."""
    indices = array_at(indices_at, (total_q, width), np.int32)
    counts = array_at(counts_at, (total_q,), np.int32)
    offsets = array_at(offsets_at, (batch + 1,), np.int32)
    cached = array_at(cached_at, (batch,), np.int32)
    for b in range(batch):
        rows = offsets[b + 1] - offsets[b]
        held = np.int64(cached[b]) + rows
        for r in range(offsets[b], offsets[b + 1]):
            if counts[r] > width:
                return r, -1, 0
            for i in range(counts[r]):
                if indices[r, i] < 0 or indices[r, i] >= held:
                    return r, i, held
    return -1, -1, 0


def check_counted_positions(indices: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                            cache_lengths: torch.Tensor) -> None:
    """Counts within ``[.., W]`` and counted positions in ``[0, tokens held)``, else ``ValueError`` (int32
    tensors: ``indices [total_q, W]``, ``counts [total_q]``, ``offsets [B+1]``, ``cache_lengths [B]``)."""
    indices, counts, offsets, cached = (host_int32(t) for t in (indices, counts, offsets, cache_lengths))
    r, i, held = _first_bad_counted_entry(indices.data_ptr(), indices.shape[0], indices.shape[1], counts.data_ptr(),
                                          offsets.data_ptr(), cached.shape[0], cached.data_ptr())
    if r < 0:
        return
    if i < 0:
        raise ValueError(f"counts: row {r} counts {int(counts[r])} entries but indices has {indices.shape[1]} columns")
    b = int(np.searchsorted(offsets.numpy(), r, side="right")) - 1
    raise ValueError(
        f"indices: row {r}, entry {i} holds position {int(indices[r, i])}, outside [0, {held}) "
        f"(the tokens sequence {b} holds) inside the counted region (counts[{r}] = {int(counts[r])})"
    )
