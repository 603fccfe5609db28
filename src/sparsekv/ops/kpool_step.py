"""The k-pool indexer's per-layer step on a pooled-key cache: ring close -> compress -> seed tail -> store.

The pooled-key cache's layout (one entry per ``kpool`` tokens, co-indexed with
the token cache) is described in :mod:`sparsekv.cache.pooled`, which builds
it (:func:`~sparsekv.cache.pooled.make_pooled_collection`); this module writes
it with the public ops of :mod:`sparsekv.ops.kpool` and
:func:`sparsekv.ops.cache.paged_store`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import as_index_tensor, check_int, check_nonnegative, check_tensor
from .._env import host_checks
from ..cache.layout import PagedKVCacheCollection, page_problem, ragged_rows, resolve_pages
from .cache import paged_store
from .kpool import kpool_pool_row_offsets, mla_kpool_compress, mla_kpool_ring_close, mla_kpool_seed_tail

__all__ = ["KPoolStep", "kpool_indexer_step", "store_pooled_keys"]


class _PooledStore(NamedTuple):
    """A validated pooled store: ``values`` go to ``view`` (pool lengths as cache lengths) in entry order."""

    view: PagedKVCacheCollection
    values: torch.Tensor  # [entries, 1, D]
    entry_offsets: torch.Tensor  # [B+1] int32


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

    Every destination page is validated before the first write; a missing
    one raises :func:`pooled_page_error`.

    Example, kpool 4, ``c = 6``, ``n = 7``: pool 1 (closed) then pool 2 go to
    pool ids 1 and 2 (``floor(6/4) = 1``; ``floor(13/4) - 1 = 2``).
    """
    plan = _plan_pooled_store(pooled_collection, layer_idx, closed, closed_ids, pooled, pool_row_offsets,
                              cache_lengths, kpool)
    if plan is not None:
        paged_store(plan.view, plan.values, plan.entry_offsets, layer_idx=layer_idx, plane=0)


def _plan_pooled_store(pooled_collection: PagedKVCacheCollection, layer_idx: int, closed: torch.Tensor,
                       closed_ids: torch.Tensor, pooled: torch.Tensor, pool_row_offsets: torch.Tensor,
                       cache_lengths: torch.Tensor, kpool: int) -> _PooledStore | None:
    """Validate a :func:`store_pooled_keys` call, destination pages included, and return what it writes
    (``None`` when no pool closes or completes: most decode steps)."""
    check_int("kpool", kpool, minimum=1)
    if not isinstance(pooled_collection, PagedKVCacheCollection):
        raise TypeError(f"pooled_collection: expected a PagedKVCacheCollection, got "
                        f"{type(pooled_collection).__name__}")
    pc = pooled_collection
    if pc.num_heads != 1:
        raise ValueError(f"pooled_collection: expected one head, got {pc.num_heads}")
    pc._check_layer(layer_idx)  # here too: a call that stores nothing returns before the store's checks
    dim = pc.head_size
    cache_lengths = check_nonnegative("cache_lengths", cache_lengths, device=pc.device)
    batch = cache_lengths.shape[0]
    if batch != pc.batch_size:
        raise ValueError(f"cache_lengths: expected {pc.batch_size} entries (the pooled cache's batch), got {batch}")
    check_tensor("closed", closed, shape=(batch, dim), dtypes=(pc.dtype,), device=pc.device)
    closed_ids = as_index_tensor("closed_ids", closed_ids, ndim=1, device=pc.device)
    if closed_ids.shape[0] != batch:
        raise ValueError(f"closed_ids: expected shape ({batch},), got {tuple(closed_ids.shape)}")
    pool_row_offsets = as_index_tensor("pool_row_offsets", pool_row_offsets, ndim=1, device=pc.device)
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
    if pooled.shape[0] == 0 and not bool(has_closed.any()):
        return None

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
    host = host_checks(pc.device)
    offsets = view.check_store(values, entry_offsets, layer_idx=layer_idx, plane=0, check_values=host)
    if host:
        resolve_pages(view.lookup_table, view.num_pages, view.page_size, seq_of_entry,
                      pool_lengths.to(torch.int64)[seq_of_entry] + local,
                      error=lambda seq, pool: pooled_page_error(view.lookup_table, view.num_pages, view.page_size,
                                                                cache_lengths, kpool, seq, pool))
    return _PooledStore(view, values, offsets)


def pooled_page_error(lookup_table: torch.Tensor, num_pages: int, pools_per_page: int, cache_lengths: torch.Tensor,
                      kpool: int, seq: int, pool: int) -> ValueError:
    """The ``ValueError`` for pool ``pool`` of sequence ``seq`` that a store finds without a valid page.

    Names what the caller passed, token positions: the sequence's cache
    length and the positions the pool holds, then why it has no page.
    """
    first = pool * kpool
    return ValueError(
        f"pooled cache: sequence {seq} (cache_lengths[{seq}] = {int(cache_lengths[seq])}) stores pool {pool} "
        f"(positions {first}..{first + kpool - 1}), which has no page: "
        f"{page_problem(lookup_table, num_pages, pools_per_page, seq, pool)}")


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
    closed, closed_ids = mla_kpool_ring_close(ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths,
                                              kpool=kpool, mode=mode)
    pool_row_offsets = kpool_pool_row_offsets(input_row_offsets, cache_lengths, kpool=kpool)
    pooled = mla_kpool_compress(k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths,
                                kpool=kpool, mode=mode)
    store = _plan_pooled_store(pooled_collection, layer_idx, closed, closed_ids, pooled, pool_row_offsets,
                               cache_lengths, kpool)
    # Past this point nothing raises: ring close checked the seed tail's arguments, the plan the store's.
    mla_kpool_seed_tail(ring, slot_ids, k, gate, input_row_offsets, cache_lengths, kpool=kpool)
    if store is not None:
        paged_store(store.view, store.values, store.entry_offsets, layer_idx=layer_idx, plane=0)
    return KPoolStep(closed, closed_ids, pooled, pool_row_offsets)
