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

The indexer step that fills it (ring close -> compress -> seed tail -> store)
runs ops, so it lives with them: :mod:`sparsekv.ops.kpool_step`.
"""

from __future__ import annotations

import torch

from .._checks import as_index_tensor, check_int, check_tensor
from .layout import PagedKVCacheCollection


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
