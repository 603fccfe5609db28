"""Public cache ops: the ragged paged store, registered as a torch custom op."""

from __future__ import annotations

import torch

from .._checks import check_int, check_offsets, check_tensor, host_array, host_checks
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
    """
    c = collection
    check_int("plane", plane, minimum=0)
    if plane >= c.kv_planes:
        raise ValueError(f"plane: expected < KV = {c.kv_planes}, got {plane}")
    c._check_layer(layer_idx)
    check_tensor("values", values, shape=(None, c.num_heads, c.head_size), dtypes=(c.dtype,), device=c.device)
    check_tensor("input_row_offsets", input_row_offsets, shape=(c.batch_size + 1,))
    offsets = check_offsets("input_row_offsets", input_row_offsets.to(c.device), batch=c.batch_size,
                            total=values.shape[0], total_of="rows of values")
    if host_checks(c.device) and c.batch_size:
        rows = host_array(offsets)
        longest = int((rows[1:] - rows[:-1]).max())
        if longest > c.max_seq_length:
            b = int((rows[1:] - rows[:-1]).argmax())
            raise ValueError(f"input_row_offsets: sequence {b} stores {longest} rows, more than the collection's "
                             f"max_seq_length = {c.max_seq_length}")
    _paged_store_op(c.blocks, values, c.lookup_table, c.cache_lengths, offsets, plane, layer_idx)
