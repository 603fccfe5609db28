"""Public cache ops: the ragged paged store, registered as a torch custom op."""

from __future__ import annotations

import torch

from .._env import host_checks
from ..cache.layout import PagedKVCacheCollection
from ._registry import kernel, out_op


@out_op("paged_store", mutates_args=("blocks",))
def _paged_store_op(
    blocks: torch.Tensor,
    values: torch.Tensor,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    plane: int,
    layer: int,
) -> None:
    kernel("cache", "paged_store", blocks.device)(
        blocks, values, lookup_table, cache_lengths, input_row_offsets, plane, layer
    )



def paged_store(
    collection: PagedKVCacheCollection,
    values: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    layer_idx: int,
    plane: int,
) -> None:
    """Store a ragged batch of new rows into one plane of one layer.

    Args:
        collection: the paged cache; ``cache_lengths[b]`` is where sequence
            ``b``'s first new row goes.
        values: ``[T, num_heads, head_size]``, the cache's dtype and device.
        input_row_offsets: ``[B+1]`` int32/int64, ``T == input_row_offsets[-1]``.
        layer_idx, plane: which layer, 0 for keys and 1 for values.

    Raises ``ValueError`` when one sequence has more rows than the
    collection's ``max_seq_length`` (the largest number of new tokens of one
    sequence in this call, which sizes launches and the tables read after
    the store), or on a missing page, before writing anything.

    Example: cache lengths ``[5, 0]``, offsets ``[0, 2, 3]`` write sequence 0
    positions 5 and 6 and sequence 1 position 0.

    The storage-level :meth:`~sparsekv.cache.layout.PagedKVCache.store` writes
    the same rows without a backend (always validating on the host).
    """
    c = collection
    offsets = c.check_store(values, input_row_offsets, layer_idx=layer_idx, plane=plane,
                            check_values=host_checks(c.device))
    _paged_store_op(c.blocks, values, c.lookup_table, c.cache_lengths, offsets, plane, layer_idx)
