"""Reference paged store: vectorised PyTorch over the SPEC 1.1 address math."""

from __future__ import annotations

import torch

from ...cache.layout import store_rows


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
    when one page is missing): the storage's own address math,
    :func:`sparsekv.cache.layout.store_rows`.
    """
    store_rows(blocks, values, lookup_table, cache_lengths, input_row_offsets, plane, layer)
