"""Reference paged store: vectorised PyTorch over the SPEC 1.1 address math."""

from __future__ import annotations

import torch

from ...cache.layout import ragged_rows, resolve_pages


def paged_store(
    blocks: torch.Tensor,
    values: torch.Tensor,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    plane: int,
    layer: int,
) -> None:
    """Write ``values [T, H, D]``: row ``i`` of sequence ``b`` to position ``cache_lengths[b] + i``.

    Every destination is validated before the first write (nothing is written
    when one page is missing).
    """
    seq_ids, local = ragged_rows(input_row_offsets)
    positions = cache_lengths.to(torch.int64)[seq_ids] + local
    pages, rows = resolve_pages(lookup_table, blocks.shape[0], blocks.shape[3], seq_ids, positions)
    blocks[pages, plane, layer, rows] = values
