"""Public MLA k-pool ops (SPEC 3): compress, the cross-call ring, pool score, top-k expansion.

One layer step of the GLM-5-Next indexer, for a ragged batch whose sequence
``b`` has ``c = cache_lengths[b]`` cached tokens and ``n`` new rows::

    closed, closed_ids = mla_kpool_ring_close(ring, slot_ids, k, gate, ape, offsets, cache_lengths, kpool=4)
    pool_offsets = kpool_pool_row_offsets(offsets, cache_lengths, kpool=4)
    pooled = mla_kpool_compress(k, gate, ape, offsets, pool_offsets, cache_lengths, kpool=4)
    mla_kpool_seed_tail(ring, slot_ids, k, gate, offsets, cache_lengths, kpool=4)
    # store closed + pooled into the pooled-key cache (sparsekv.ops.kpool_step.store_pooled_keys), then:
    scores = mla_kpool_score(q, head_weights, pooled_cache, layer, query_positions, offsets, kpool=4)
    indices, counts = mla_kpool_expand_topk(scores, query_positions, kpool=4, topk=2048)

``sparsekv.ops.kpool_step.kpool_indexer_step`` runs the first four and the store
in one call. Every op here is a torch custom op ``sparsekv::<name>`` (out-style,
fake impl returns ``None``) behind a Python function that validates its
arguments: bad input raises ``ValueError`` (``TypeError`` for a non-tensor, a
non-int or a wrong dtype) naming the argument.

Choices where SPEC 3 is silent:

* a dtype mismatch between ``k`` and ``gate`` (or ``ape`` not float32) is a
  ``TypeError``, as a wrong dtype is everywhere else;
* ``cache_lengths`` must be ``>= 0`` in every op that takes them
  (:func:`kpool_pool_row_offsets` included);
* ``closed`` rows of sequences that close no pool are zeros;
* ``mla_kpool_score`` sizes its output to the largest visible pool count of
  the batch when ``out_cols`` is ``None``; a smaller ``out_cols`` is an error
  (it would drop visible pools);
* ``slot_ids`` must be distinct within a batch (two sequences sharing a ring
  slot would overwrite each other's open pool).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch

from .._checks import (KEY_DTYPES, as_index_tensor, check_bool, check_instance, check_int, check_nonnegative,
                       check_offsets, check_tensor, host_array, largest)
from .._env import host_checks
from ..cache.layout import PagedKVCacheCollection
from ..kernels.reference.kpool import MODES, check_score_pages, pool_counts
from ._registry import kernel, out_op
from ._score_plan import PagedScorePlanBase

FAMILY = "kpool"


class KPoolClosed(NamedTuple):
    """Result of :func:`mla_kpool_ring_close`."""

    closed: torch.Tensor  # [B, D], k's dtype; zeros where no pool closed
    closed_ids: torch.Tensor  # [B] int32, pool id or -1


class KPoolSelection(NamedTuple):
    """Result of :func:`mla_kpool_expand_topk`."""

    indices: torch.Tensor  # [total_q, topk + kpool - 1] int32, -1 padded
    counts: torch.Tensor  # [total_q] int32


# ---------------------------------------------------------------------------
# custom ops (out-style; the body picks the backend). NOTE: the pool mode is
# called ``pool_mode`` in the schemas: an argument named ``mode`` collides with
# torch's own ``mode`` parameter when the op is dispatched under a torch mode
# (FakeTensorMode, AOT dispatch).
# ---------------------------------------------------------------------------
@out_op("mla_kpool_compress", mutates_args=("pooled",))
def _compress_op(pooled: torch.Tensor, k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
                 input_row_offsets: torch.Tensor, pool_row_offsets: torch.Tensor, cache_lengths: torch.Tensor,
                 kpool: int, pool_mode: str) -> None:
    kernel(FAMILY, "mla_kpool_compress", k.device)(
        pooled, k, gate, ape, input_row_offsets, pool_row_offsets, cache_lengths, kpool, pool_mode)



@out_op("mla_kpool_ring_close", mutates_args=("closed", "closed_ids"))
def _ring_close_op(closed: torch.Tensor, closed_ids: torch.Tensor, ring: torch.Tensor, slot_ids: torch.Tensor,
                   k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, input_row_offsets: torch.Tensor,
                   cache_lengths: torch.Tensor, kpool: int, pool_mode: str) -> None:
    kernel(FAMILY, "mla_kpool_ring_close", k.device)(
        closed, closed_ids, ring, slot_ids, k, gate, ape, input_row_offsets, cache_lengths, kpool, pool_mode)



@out_op("mla_kpool_seed_tail", mutates_args=("ring",))
def _seed_tail_op(ring: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                  input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, kpool: int) -> None:
    kernel(FAMILY, "mla_kpool_seed_tail", k.device)(ring, slot_ids, k, gate, input_row_offsets, cache_lengths, kpool)



@out_op("mla_kpool_score", mutates_args=("scores",))
def _score_op(scores: torch.Tensor, q: torch.Tensor, head_weights: torch.Tensor, pooled_blocks: torch.Tensor,
              lookup_table: torch.Tensor, query_positions: torch.Tensor, input_row_offsets: torch.Tensor,
              kpool: int, layer: int) -> None:
    kernel(FAMILY, "mla_kpool_score", q.device)(
        scores, q, head_weights, pooled_blocks, lookup_table, query_positions, input_row_offsets, kpool, layer)



# ---------------------------------------------------------------------------
# argument checks shared by the ops below
# ---------------------------------------------------------------------------
def _check_kpool(kpool: int) -> int:
    return check_int("kpool", kpool, minimum=1)


def _check_mode(mode: str) -> str:
    if not isinstance(mode, str):
        raise TypeError(f"mode: expected a str, got {type(mode).__name__} {mode!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _check_keys(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor | None, kpool: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``gate`` ``[T, D]`` of one key dtype, ``ape`` ``[kpool, D]`` float32; returns them contiguous."""
    check_tensor("k", k, ndim=2, dtypes=KEY_DTYPES)
    check_tensor("gate", gate, device=k.device)
    if gate.dim() != 2 or gate.shape != k.shape:
        raise ValueError(f"gate: expected the shape of k {tuple(k.shape)}, got {tuple(gate.shape)}")
    if gate.dtype != k.dtype:
        raise TypeError(f"gate: expected k's dtype {k.dtype}, got {gate.dtype}")
    if ape is not None:
        check_tensor("ape", ape, device=k.device)
        if tuple(ape.shape) != (kpool, k.shape[1]):
            raise ValueError(f"ape: expected shape [kpool, D] = ({kpool}, {k.shape[1]}), got {tuple(ape.shape)}")
        if ape.dtype != torch.float32:
            raise TypeError(f"ape: expected dtype float32, got {ape.dtype}")
    return k.contiguous(), gate.contiguous()


def _check_batch(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, device: torch.device,
                 rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets ``[B+1]`` (ending at ``rows`` when given, the rows of ``k``) and cache lengths ``[B]``
    (``>= 0``), both int32 on ``device``. The one rule for every op that takes them."""
    cache_lengths = check_nonnegative("cache_lengths", cache_lengths, device=device)
    batch = cache_lengths.shape[0]
    check_tensor("input_row_offsets", input_row_offsets, ndim=1)
    if input_row_offsets.shape[0] != batch + 1:
        raise ValueError(f"input_row_offsets: expected shape ({batch + 1},) = batch + 1 (batch from "
                         f"cache_lengths), got {tuple(input_row_offsets.shape)}")
    offsets = check_offsets("input_row_offsets", input_row_offsets, batch=batch, total=rows, total_of="rows of k",
                            device=device)
    return offsets.contiguous(), cache_lengths.contiguous()


def _check_ring(ring: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor, kpool: int, batch: int
                ) -> torch.Tensor:
    """``ring [max_slots, 2, kpool, D]`` contiguous in k's dtype; returns ``slot_ids`` as int32."""
    check_tensor("ring", ring, device=k.device)
    want = (None, 2, kpool, k.shape[1])
    if ring.dim() != 4 or any(w is not None and w != g for w, g in zip(want, ring.shape)):
        raise ValueError(f"ring: expected shape [max_slots, 2, kpool, D] = (*, 2, {kpool}, {k.shape[1]}), "
                         f"got {tuple(ring.shape)}")
    if ring.dtype != k.dtype:
        raise TypeError(f"ring: expected k's dtype {k.dtype}, got {ring.dtype}")
    if not ring.is_contiguous():
        raise ValueError("ring: expected a contiguous tensor (it is updated in place)")
    slot_ids = as_index_tensor("slot_ids", slot_ids, ndim=1, device=k.device)
    if slot_ids.shape[0] != batch:
        raise ValueError(f"slot_ids: expected shape ({batch},) = batch, got {tuple(slot_ids.shape)}")
    if host_checks(k.device) and batch:
        problem = _slot_problem(host_array(slot_ids), ring.shape[0])
        if problem == _SLOT_OUTSIDE:
            raise ValueError(f"slot_ids: expected values in [0, {ring.shape[0]}) (ring slots), "
                             f"got {slot_ids.tolist()}")
        if problem == _SLOT_REPEATED:
            raise ValueError(f"slot_ids: expected distinct slots within a batch, got {slot_ids.tolist()}")
    return slot_ids.contiguous()


_SLOT_OUTSIDE, _SLOT_REPEATED = 1, 2


@numba.njit(cache=True, nogil=True)
def _slot_problem(slots, max_slots):
    """``_SLOT_OUTSIDE`` if a slot lies outside ``[0, max_slots)``, else ``_SLOT_REPEATED`` if one repeats, else
    0 (one scan, 0.9 us; the torch comparisons and ``torch.unique`` it replaces took 11 us)."""
    for slot in slots:
        if slot < 0 or slot >= max_slots:
            return _SLOT_OUTSIDE
    seen = np.zeros(max_slots, np.bool_)
    for slot in slots:
        if seen[slot]:
            return _SLOT_REPEATED
        seen[slot] = True
    return 0


# ---------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------
def kpool_pool_row_offsets(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, *,
                           kpool: int) -> torch.Tensor:
    """Where each sequence's emitted pools start in :func:`mla_kpool_compress`'s output.

    Args:
        input_row_offsets: ``[B+1]`` int, this call's rows per sequence.
        cache_lengths: ``[B]`` int, tokens cached before this call.
        kpool: tokens per pool (>= 1).

    Returns ``[B+1]`` int32: the exclusive prefix sum of
    ``P = max(0, floor((c+n)/kpool) - ceil(c/kpool))`` (SPEC 3.1). The
    arguments are checked as :func:`mla_kpool_compress` checks them
    (``cache_lengths >= 0``, offsets from 0, non-decreasing).

    Example, kpool 4, cache lengths ``[6, 0, 3]``, offsets ``[0, 7, 10, 15]``
    (``n = 7, 3, 5``): ``P = [3-2, 0-0, 2-1] = [1, 0, 1]``, result ``[0, 1, 1, 2]``.
    """
    _check_kpool(kpool)
    device = cache_lengths.device if isinstance(cache_lengths, torch.Tensor) else None
    offsets, cache_lengths = _check_batch(input_row_offsets, cache_lengths, device)
    counts = pool_counts(offsets, cache_lengths, kpool)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def mla_kpool_compress(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, input_row_offsets: torch.Tensor,
                       pool_row_offsets: torch.Tensor | None, cache_lengths: torch.Tensor, *, kpool: int,
                       mode: str = "softmax", out: torch.Tensor | None = None) -> torch.Tensor:
    """Compress every pool completed inside this call's rows into one key (SPEC 3.1).

    Args:
        k: ``[T, D]`` bf16/fp16/fp32, layer-normed indexer keys of a ragged batch.
        gate: ``[T, D]``, k's dtype, per-channel gate logits.
        ape: ``[kpool, D]`` float32, within-pool position embedding (added to the gate).
        input_row_offsets: ``[B+1]`` int; sequence ``b`` owns rows ``offsets[b] .. offsets[b+1]-1``.
        pool_row_offsets: ``[B+1]`` int from :func:`kpool_pool_row_offsets` (checked
            against that rule; ``None`` computes it).
        cache_lengths: ``[B]`` int, ``c``: row ``i`` of sequence ``b`` is at position ``c + i``.
        kpool: tokens per pool (>= 1); ``kpool == 1`` returns ``k`` exactly.
        mode: ``"softmax"`` (per-channel softmax of gate + ape weighting the keys),
            ``"mean"`` or ``"last"``.
        out: optional ``[pool_row_offsets[B], D]`` tensor in k's dtype to write into.

    Returns ``pooled [pool_row_offsets[B], D]`` in k's dtype: row
    ``pool_row_offsets[b] + j`` is sequence ``b``'s pool ``ceil(c/kpool) + j``.
    A pool opened in an earlier call is skipped here (see :func:`mla_kpool_ring_close`).

    Example, kpool 4, cache lengths ``[6, 0]``, offsets ``[0, 7, 10]``: sequence 0
    (positions 6..12) emits pool 2 from rows 2..5 (positions 8..11); sequence 1
    (positions 0..2) emits none; ``pool_row_offsets == [0, 1, 1]``, one output row.
    """
    _check_kpool(kpool)
    _check_mode(mode)
    k, gate = _check_keys(k, gate, ape, kpool)
    offsets, cache_lengths = _check_batch(input_row_offsets, cache_lengths, k.device, k.shape[0])
    expected = kpool_pool_row_offsets(offsets, cache_lengths, kpool=kpool)
    if pool_row_offsets is None:
        pool_offsets = expected
    else:
        check_tensor("pool_row_offsets", pool_row_offsets, shape=(cache_lengths.shape[0] + 1,))
        pool_offsets = as_index_tensor("pool_row_offsets", pool_row_offsets, ndim=1, device=k.device)
        if host_checks(k.device) and not torch.equal(pool_offsets, expected):
            raise ValueError(
                f"pool_row_offsets: expected {expected.tolist()} (exclusive prefix sum of "
                f"max(0, floor((c+n)/kpool) - ceil(c/kpool)) per sequence), got {pool_offsets.tolist()}")
    pool_offsets = pool_offsets.contiguous()
    total_pools = int(pool_offsets[-1])
    if out is None:
        out = torch.empty(total_pools, k.shape[1], dtype=k.dtype, device=k.device)
    else:
        check_tensor("out", out, shape=(total_pools, k.shape[1]), dtypes=(k.dtype,), device=k.device)
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    _compress_op(target, k, gate, ape.contiguous(), offsets, pool_offsets, cache_lengths, kpool, mode)
    if target is not out:
        out.copy_(target)
    return out


def mla_kpool_ring_close(ring: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                         ape: torch.Tensor, input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, *,
                         kpool: int, mode: str = "softmax") -> KPoolClosed:
    """Close each sequence's pool left open by an earlier call (SPEC 3.2). Runs before the others.

    Args:
        ring: ``[max_slots, 2, kpool, D]`` in k's dtype, contiguous: plane 0 keys,
            plane 1 gates of open-pool members at ``position % kpool`` (read only here).
        slot_ids: ``[B]`` int, distinct, in ``[0, max_slots)``: each sequence's ring slot.
        k, gate, ape, input_row_offsets, cache_lengths, kpool, mode: as in :func:`mla_kpool_compress`.

    Returns ``(closed [B, D] in k's dtype, closed_ids [B] int32)``. Sequence
    ``b`` closes pool ``floor(c/kpool)`` iff ``c % kpool != 0`` and ``n >= align``
    (``align = kpool - c % kpool``); its members before position ``c`` come
    from the ring, the rest from its first ``align`` rows. Otherwise
    ``closed_ids[b] == -1`` and ``closed[b]`` is zeros.

    Example, kpool 4, cache lengths ``[6, 5]``, offsets ``[0, 2, 3]``: sequence 0
    closes pool 1 (ring members 0, 1 + rows 0, 1); sequence 1 (one new token,
    position 5, needs 3) closes none: ``closed_ids == [1, -1]``.
    """
    _check_kpool(kpool)
    _check_mode(mode)
    k, gate = _check_keys(k, gate, ape, kpool)
    offsets, cache_lengths = _check_batch(input_row_offsets, cache_lengths, k.device, k.shape[0])
    batch = cache_lengths.shape[0]
    slot_ids = _check_ring(ring, slot_ids, k, kpool, batch)
    closed = torch.empty(batch, k.shape[1], dtype=k.dtype, device=k.device)
    closed_ids = torch.empty(batch, dtype=torch.int32, device=k.device)
    _ring_close_op(closed, closed_ids, ring, slot_ids, k, gate, ape.contiguous(), offsets, cache_lengths,
                   kpool, mode)
    return KPoolClosed(closed, closed_ids)


def mla_kpool_seed_tail(ring: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor, gate: torch.Tensor,
                        input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, *, kpool: int) -> None:
    """Store this call's members of each sequence's still-open pool into ``ring`` (SPEC 3.2). Runs last.

    Rows at positions ``max(floor((c+n)/kpool)*kpool, c) .. c+n-1`` are written
    to ``ring[slot_ids[b], 0 / 1, position % kpool]`` (key / gate); nothing
    else in ``ring`` changes. Arguments as in :func:`mla_kpool_ring_close`.

    Example, kpool 4, ``c = 6``, ``n = 7`` (positions 6..12): only position 12
    is kept, at ring member 0; with ``n = 1`` position 6 goes to member 2.
    """
    _check_kpool(kpool)
    k, gate = _check_keys(k, gate, None, kpool)
    offsets, cache_lengths = _check_batch(input_row_offsets, cache_lengths, k.device, k.shape[0])
    slot_ids = _check_ring(ring, slot_ids, k, kpool, cache_lengths.shape[0])
    _seed_tail_op(ring, slot_ids, k, gate, offsets, cache_lengths, kpool)


class KPoolScorePlan(PagedScorePlanBase):
    """The pool scores of one batch of query rows, set up once for every indexer layer that scores them.

    :func:`plan_kpool_score` validates what the layers share (positions, row
    offsets, the pooled cache) once; :meth:`run` then scores one layer,
    checking only that layer's arguments: on the CPU a public call spends
    tens of microseconds on checks and views around a kernel of a few hundred
    (FlashInfer's wrappers split plan and run for the same reason). The plan
    keeps its own copies of the positions and offsets, and each run checks
    every page its rows need as the lookup table holds them then (a missing
    one raises ``ValueError``, nothing written; :mod:`._score_plan`).

    Example, a step of three indexer layers::

        plan = plan_kpool_score(pooled_cache, positions, offsets, kpool=4)
        for layer in range(3):
            scores = plan.run(q[layer], head_weights[layer], layer)
    """

    __slots__ = ("kpool",)

    def __init__(self, pooled_collection: PagedKVCacheCollection, query_positions: torch.Tensor,
                 input_row_offsets: torch.Tensor, kpool: int, out_cols: int) -> None:
        """Use :func:`plan_kpool_score`, which validates the arguments."""
        self.kpool = kpool
        super().__init__(pooled_collection, query_positions, input_row_offsets, out_cols, FAMILY, "ScorePlan",
                         (kpool, out_cols))

    def run(self, q: torch.Tensor, head_weights: torch.Tensor, layer_idx: int, *,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Score every visible pool of layer ``layer_idx`` for every planned query row (SPEC 3.3).

        Args:
            q: ``[total_q, H, D]`` index queries in the pooled cache's dtype (``total_q`` planned rows).
            head_weights: ``[total_q, H]`` float (computed in float32), already scaled.
            layer_idx: the pooled cache's layer whose plane 0 holds this layer's pooled keys.
            out: optional ``[total_q, out_cols]`` float32 tensor to write into.

        Returns ``scores [total_q, out_cols]`` float32, as :func:`mla_kpool_score`.
        """
        self.check_layer(layer_idx, "pooled_collection")
        pc, device, total_q = self.collection, self.blocks.device, self.total_q
        check_tensor("q", q, ndim=3, dtypes=KEY_DTYPES, device=device)
        self.check_rows(q)
        if q.shape[2] != pc.head_size:
            raise ValueError(f"q: expected head dim {pc.head_size} (the pooled cache's), got {q.shape[2]}")
        if q.dtype != pc.dtype:
            raise TypeError(f"q: expected the pooled cache's dtype {pc.dtype}, got {q.dtype}")
        check_tensor("head_weights", head_weights, shape=(total_q, q.shape[1]), dtypes=KEY_DTYPES, device=device)
        if out is None:
            out = torch.empty(total_q, self.out_cols, dtype=torch.float32, device=device)
        else:
            check_tensor("out", out, shape=(total_q, self.out_cols), dtypes=(torch.float32,), device=device)
        if head_weights.dtype != torch.float32:  # ``.to`` costs ~0.8 us even when it has nothing to do
            head_weights = head_weights.to(torch.float32)
        q, head_weights = q.contiguous(), head_weights.contiguous()
        return self.run_into(
            out, (q, head_weights), lambda target: self.backend_plan.run(target, q, head_weights, layer_idx),
            lambda target: _score_op(target, q, head_weights, self.blocks, self.lookup_table, self.query_positions,
                                     self.input_row_offsets, self.kpool, layer_idx))


def plan_kpool_score(pooled_collection: PagedKVCacheCollection, query_positions: torch.Tensor,
                     input_row_offsets: torch.Tensor, *, kpool: int, out_cols: int | None = None) -> KPoolScorePlan:
    """Validate what every layer's pool score shares and set it up once (:class:`KPoolScorePlan`).

    Args:
        pooled_collection: the pooled-key cache (``num_heads == 1``, ``head_size == D``,
            one row per pool, see ``sparsekv.cache.pooled``).
        query_positions: ``[total_q]`` int, each row's position ``t`` in its sequence.
        input_row_offsets: ``[B+1]`` int, query rows per sequence (``B`` = the cache's batch).
        kpool: tokens per pool.
        out_cols: output width, at least the largest visible pool count
            ``max((t+1)//kpool)``, which is the default.

    A visible pool on a missing page raises ``ValueError`` here (CPU) as in every :meth:`~KPoolScorePlan.run`.
    """
    _check_kpool(kpool)
    pc = check_instance("pooled_collection", pooled_collection, PagedKVCacheCollection)
    if pc.num_heads != 1:
        raise ValueError(f"pooled_collection: expected one head (one pooled key per pool), got {pc.num_heads}")
    positions = check_nonnegative("query_positions", query_positions, device=pc.device)
    total_q = positions.shape[0]
    offsets = check_offsets("input_row_offsets", input_row_offsets, batch=pc.batch_size, total=total_q,
                            total_of="q rows", device=pc.device)
    host = host_checks(pc.device)
    if out_cols is None or host:
        needed = (int(largest(host_array(positions))) + 1) // kpool if total_q else 0
        if host and needed > pc.max_pages_per_seq * pc.page_size:
            # a row sees a pool past the lookup table: refuse before sizing anything by its position
            check_score_pages(pc.lookup_table, pc.num_pages, pc.page_size, positions, offsets, kpool, needed)
        if out_cols is None:
            out_cols = needed
        elif check_int("out_cols", out_cols, minimum=0) < needed:
            raise ValueError(f"out_cols: expected >= {needed} (the most pools a query row sees), got {out_cols}")
    check_int("out_cols", out_cols, minimum=0)
    # the plan's own copies: the caller may change its tensors between runs
    return KPoolScorePlan(pc, positions.clone(memory_format=torch.contiguous_format),
                          offsets.clone(memory_format=torch.contiguous_format), kpool, out_cols)


def mla_kpool_score(q: torch.Tensor, head_weights: torch.Tensor, pooled_collection: PagedKVCacheCollection,
                    layer_idx: int, query_positions: torch.Tensor, input_row_offsets: torch.Tensor, *,
                    kpool: int, out_cols: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Score every visible pool for every query row (SPEC 3.3).

    Args:
        q: ``[total_q, H, D]`` index queries in the pooled cache's dtype.
        head_weights: ``[total_q, H]`` float (computed in float32), already scaled.
        pooled_collection: the pooled-key cache (``num_heads == 1``, ``head_size == D``,
            one row per pool, see ``sparsekv.cache.pooled``); plane 0 of ``layer_idx`` is read.
        query_positions: ``[total_q]`` int, each row's position ``t`` in its sequence.
        input_row_offsets: ``[B+1]`` int, query rows per sequence (``B`` = the cache's batch).
        kpool: tokens per pool.
        out_cols: output width, at least the largest visible pool count
            ``max((t+1)//kpool)``, which is the default.
        out: optional ``[total_q, out_cols]`` float32 tensor to write into.

    Returns ``scores [total_q, out_cols]`` float32:
    ``sum_h head_weights[r,h] * relu(q[r,h] . K_p)`` for pools ``p`` with
    ``(p+1)*kpool - 1 <= t``, ``-inf`` elsewhere. A visible pool on a missing
    page raises ``ValueError`` (CPU). Several layers scoring the same rows:
    :func:`plan_kpool_score` once, then :meth:`KPoolScorePlan.run` per layer.

    Example, kpool 4, two decode rows at ``t = [9, 3]``: row 0 sees pools 0, 1
    (``10 // 4 = 2``), row 1 sees pool 0; ``out_cols`` defaults to 2 and
    ``scores[1, 1] == -inf``.
    """
    plan = plan_kpool_score(pooled_collection, query_positions, input_row_offsets, kpool=kpool, out_cols=out_cols)
    return plan.run(q, head_weights, layer_idx, out=out)


def mla_kpool_expand_topk(scores: torch.Tensor, query_positions: torch.Tensor, *, kpool: int, topk: int,
                          always_select_tail: bool = True) -> KPoolSelection:
    """Pick each row's best pools and expand them to token positions (SPEC 3.3).

    Args:
        scores: ``[total_q, out_cols]`` float32 from :func:`mla_kpool_score`.
        query_positions: ``[total_q]`` int, each row's position ``t``.
        kpool: tokens per pool; topk: token budget (``topk // kpool`` pools).
        always_select_tail: also select the open tail ``[v - v % kpool, v)``, ``v = t + 1``.

    Returns ``(indices [total_q, topk + kpool - 1] int32, counts [total_q] int32)``:
    the top ``min(topk // kpool, visible)`` pools (ties to the lower pool id),
    each expanded to its ``kpool`` positions in ascending pool order, then the
    tail, then ``-1``. This is the shared block selection
    (``sparsekv.ops.select.select_blocks_expand``) with ``ratio = kpool``.

    Example, kpool 4, topk 8, ``t = 13``: 3 visible pools, the best 2 (say 0
    and 2) give ``[0..3, 8..11]``, then the tail ``[12, 13]``, then ``-1``:
    ``counts == 10``.
    """
    from .select import select_blocks_expand

    _check_kpool(kpool)
    check_int("topk", topk, minimum=0)
    check_bool("always_select_tail", always_select_tail)
    indices, counts = select_blocks_expand(scores, query_positions, ratio=kpool, budget=topk,
                                           include_tail=always_select_tail)
    return KPoolSelection(indices, counts)
