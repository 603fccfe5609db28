"""Pooled-key cache of the k-pool indexer: one stored key per ``kpool`` tokens.

The cache manager indexes every cache group with the same page ids: logical
page ``i`` of a request covers tokens ``[i*page_size, (i+1)*page_size)`` in
every group, and one lookup table serves them all. A pooled group holds one
entry per ``kpool`` tokens, so its pages have ``page_size // kpool`` rows::

    blocks [num_pages, 1, num_layers, page_size // kpool, 1, D]

and pool ``p`` of a request lives in row ``p % (page_size // kpool)`` of
logical page ``p // (page_size // kpool)``, which is the page that holds the
pool's tokens in the token cache. A pooled cache is therefore a plain
:class:`~sparsekv.cache.layout.PagedKVCacheCollection` (one head, keys only)
that shares the token cache's lookup table and counts its length in pools:
``floor(c / kpool)`` for ``c`` cached tokens.

Example, page size 64, kpool 4: 16 pools per page; pool 37 (tokens
148..151) is row ``37 % 16 = 5`` of logical page ``37 // 16 = 2``, the page
holding tokens 128..191.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import as_index_tensor, check_int, check_tensor
from .layout import PagedKVCacheCollection, ragged_rows


def make_pooled_collection(blocks: torch.Tensor, cache_lengths: torch.Tensor, lookup_table: torch.Tensor, *,
                           kpool: int, max_seq_length: int | None = None,
                           page_stride: int = -1) -> PagedKVCacheCollection:
    """A pooled-key cache over ``blocks`` for a batch whose *token* cache lengths are ``cache_lengths``.

    Args:
        blocks: ``[num_pages, KV, num_layers, pools_per_page, 1, D]`` (``KV`` is 1 for a pooled group).
        cache_lengths: ``[B]`` int, tokens cached per sequence (the collection stores
            ``floor(c / kpool)`` pools).
        lookup_table: ``[B, max_pages]`` int, the token cache's table (co-indexed pages).
        kpool: tokens per pool.
        max_seq_length: most pools one sequence adds in this call (default: the
            table's capacity in pools).
        page_stride: as for :class:`PagedKVCacheCollection`.
    """
    check_int("kpool", kpool, minimum=1)
    check_tensor("blocks", blocks, ndim=6)
    if blocks.shape[4] != 1:
        raise ValueError(f"blocks: expected one head (axis 4) in a pooled cache, got {blocks.shape[4]}")
    cache_lengths = as_index_tensor("cache_lengths", cache_lengths, ndim=1)
    pool_lengths = torch.div(cache_lengths.to(torch.int64), kpool, rounding_mode="floor").to(torch.int32)
    if max_seq_length is None:
        max_seq_length = lookup_table.shape[1] * blocks.shape[3] if lookup_table.dim() == 2 else 0
    max_cache = int(pool_lengths.max()) if pool_lengths.numel() else 0
    return PagedKVCacheCollection(blocks, pool_lengths, lookup_table, max_seq_length=max_seq_length,
                                  max_cache_length=max_cache, page_stride=page_stride)


def store_pooled_keys(pooled_collection: PagedKVCacheCollection, layer_idx: int, closed: torch.Tensor,
                      closed_ids: torch.Tensor, pooled: torch.Tensor, pool_row_offsets: torch.Tensor,
                      cache_lengths: torch.Tensor, *, kpool: int) -> None:
    """Write this call's finished pools into the pooled-key cache, in pool order.

    Sequence ``b`` (``c = cache_lengths[b]`` tokens cached) gets its ring-closed
    pool ``closed[b]`` (when ``closed_ids[b] >= 0``; it must be ``floor(c/kpool)``)
    followed by its compressed pools ``pooled[pool_row_offsets[b]:pool_row_offsets[b+1]]``,
    at pool ids ``floor(c/kpool) .. floor((c+n)/kpool) - 1``.

    Args:
        pooled_collection: the pooled cache (one head, ``head_size == D``); its own
            ``cache_lengths`` are not read: ``cache_lengths`` (tokens) decides.
        layer_idx: layer to write (plane 0).
        closed, closed_ids: from ``mla_kpool_ring_close`` (``[B, D]``, ``[B]``).
        pooled, pool_row_offsets: from ``mla_kpool_compress`` / ``kpool_pool_row_offsets``.
        cache_lengths: ``[B]`` int, tokens cached before this call.

    Every destination page is validated before the first write.

    Example, kpool 4, ``c = 6``, ``n = 7``: pool 1 (closed) then pool 2 go to
    pool ids 1 and 2 (``floor(6/4) = 1``; ``floor(13/4) - 1 = 2``).
    """
    from ..ops.cache import paged_store

    check_int("kpool", kpool, minimum=1)
    if not isinstance(pooled_collection, PagedKVCacheCollection):
        raise TypeError(f"pooled_collection: expected a PagedKVCacheCollection, got "
                        f"{type(pooled_collection).__name__}")
    pc = pooled_collection
    if pc.num_heads != 1:
        raise ValueError(f"pooled_collection: expected one head, got {pc.num_heads}")
    dim = pc.head_size
    cache_lengths = as_index_tensor("cache_lengths", cache_lengths, ndim=1).to(pc.device)
    batch = cache_lengths.shape[0]
    if batch != pc.batch_size:
        raise ValueError(f"cache_lengths: expected {pc.batch_size} entries (the pooled cache's batch), got {batch}")
    check_tensor("closed", closed, shape=(batch, dim), dtypes=(pc.dtype,), device=pc.device)
    closed_ids = as_index_tensor("closed_ids", closed_ids, ndim=1).to(pc.device)
    if closed_ids.shape[0] != batch:
        raise ValueError(f"closed_ids: expected shape ({batch},), got {tuple(closed_ids.shape)}")
    pool_row_offsets = as_index_tensor("pool_row_offsets", pool_row_offsets, ndim=1).to(pc.device)
    if pool_row_offsets.shape[0] != batch + 1:
        raise ValueError(f"pool_row_offsets: expected shape ({batch + 1},), got {tuple(pool_row_offsets.shape)}")
    check_tensor("pooled", pooled, shape=(None, dim), dtypes=(pc.dtype,), device=pc.device)
    if pooled.shape[0] != int(pool_row_offsets[-1]):
        raise ValueError(f"pooled: expected {int(pool_row_offsets[-1])} rows (pool_row_offsets[-1]), "
                         f"got {pooled.shape[0]}")
    first_pool = torch.div(cache_lengths.to(torch.int64), kpool, rounding_mode="floor")
    has_closed = closed_ids >= 0
    if bool((has_closed & (closed_ids.to(torch.int64) != first_pool)).any()):
        raise ValueError(f"closed_ids: expected floor(cache_lengths / kpool) = {first_pool.tolist()} "
                         f"or -1, got {closed_ids.tolist()}")

    # Entries per sequence: the closed pool (0 or 1), then its compressed pools.
    compressed = (pool_row_offsets[1:] - pool_row_offsets[:-1]).to(torch.int64)
    entries = has_closed.to(torch.int64) + compressed
    entry_offsets = torch.cat([entries.new_zeros(1), entries.cumsum(0)])
    seq_of_entry, local = ragged_rows(entry_offsets)
    # Source row in cat([closed, pooled]): closed[b] is row b, pooled row j is B + j.
    shift = has_closed.to(torch.int64)[seq_of_entry]
    source = torch.where(local < shift, seq_of_entry,
                         batch + pool_row_offsets.to(torch.int64)[seq_of_entry] + local - shift)
    values = torch.cat([closed, pooled])[source][:, None, :]
    pool_lengths = first_pool.to(torch.int32)
    view = PagedKVCacheCollection(pc.blocks, pool_lengths, pc.lookup_table,
                                  max_seq_length=int(entries.max()) if batch else 0,
                                  max_cache_length=int(pool_lengths.max()) if batch else 0,
                                  page_stride=pc.page_stride)
    paged_store(view, values, entry_offsets.to(torch.int32), layer_idx=layer_idx, plane=0)


class KPoolStep(NamedTuple):
    """What :func:`kpool_indexer_step` computed (already stored in the pooled cache)."""

    closed: torch.Tensor  # [B, D]
    closed_ids: torch.Tensor  # [B] int32, -1 for none
    pooled: torch.Tensor  # [pool_row_offsets[B], D]
    pool_row_offsets: torch.Tensor  # [B+1] int32


def kpool_indexer_step(ring: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                       ape: torch.Tensor, input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor,
                       pooled_collection: PagedKVCacheCollection, layer_idx: int, *, kpool: int,
                       mode: str = "softmax") -> KPoolStep:
    """One layer step of pooled-key upkeep: ring close -> compress -> seed tail -> store.

    After it returns, every pool completed by this call's tokens is in the
    pooled cache and ``ring`` holds the open pools' members; the pooled keys
    are bit-identical whatever the schedule (SPEC 3.2). Arguments as in
    ``sparsekv.ops.kpool`` and :func:`store_pooled_keys`.

    Example, kpool 4, a request decoding token by token from ``c = 0``: calls
    at ``c = 0, 1, 2`` only fill the ring; the call at ``c = 3`` closes pool 0
    and stores it at pool id 0.
    """
    from ..ops.kpool import (
        kpool_pool_row_offsets,
        mla_kpool_compress,
        mla_kpool_ring_close,
        mla_kpool_seed_tail,
    )

    closed, closed_ids = mla_kpool_ring_close(ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths,
                                              kpool=kpool, mode=mode)
    pool_row_offsets = kpool_pool_row_offsets(input_row_offsets, cache_lengths, kpool=kpool)
    pooled = mla_kpool_compress(k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths,
                                kpool=kpool, mode=mode)
    mla_kpool_seed_tail(ring, slot_ids, k, gate, input_row_offsets, cache_lengths, kpool=kpool)
    store_pooled_keys(pooled_collection, layer_idx, closed, closed_ids, pooled, pool_row_offsets, cache_lengths,
                      kpool=kpool)
    return KPoolStep(closed, closed_ids, pooled, pool_row_offsets)
