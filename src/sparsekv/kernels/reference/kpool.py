"""Reference MLA k-pool kernels (SPEC 3): readable PyTorch, the oracle for every backend.

Every backend of family ``kpool`` exports these four functions with these
signatures (outputs first). They trust their arguments: the public ops in
``sparsekv.ops.kpool`` validate, normalise index tensors to int32 on the data's
device and allocate the outputs. Reading a paged cache through a missing page
still raises ``ValueError`` here (SPEC 1.1), before anything is written.

Common arguments
----------------
k, gate:
    ``[T, D]`` bf16/fp16/fp32 (the same dtype), this call's layer-normed
    indexer keys and their per-channel gate logits; sequence ``b`` owns rows
    ``input_row_offsets[b] .. input_row_offsets[b+1]-1``, at absolute
    positions ``cache_lengths[b] + i``.
ape:
    ``[kpool, D]`` float32, the within-pool position embedding added to the gate.
input_row_offsets:
    ``[B+1]`` int32, non-decreasing from 0, last entry ``T``.
cache_lengths:
    ``[B]`` int32, tokens of each sequence cached before this call (``c``).
kpool:
    tokens per pool (>= 1). Pool ``p`` covers positions ``[p*kpool, (p+1)*kpool)``.
mode:
    ``"softmax"`` | ``"mean"`` | ``"last"`` (see :func:`pool_members`).

Pool math (all in float32, one cast to ``k``'s dtype at the end), per channel:

* softmax: ``l_m = gate_m + ape_m``; ``e_m = exp(l_m - max_m l_m)`` (the float32
  rounding of a float64 exp: a correctly rounded exp, so that no backend's
  result depends on which exp approximation it has);
  ``s = e_0 + e_1 + ...`` (in member order); ``w_m = e_m / s``;
  ``pooled = w_0*k_0 + w_1*k_1 + ...`` (in member order, starting from the
  first product, so ``kpool == 1`` returns ``k`` bit for bit, signed zeros included).
* mean: ``(k_0 + k_1 + ...) / kpool`` (in member order).
* last: ``k_{kpool-1}`` unchanged (no arithmetic).

Every product, quotient and sum is rounded to float32 on its own (no fused
multiply-add). These rounding points are the contract: a backend that follows
them in this order agrees with this module bit for bit (Triton); one that uses
a float32 ``exp`` (the CPU fast path) agrees within SPEC 4 instead.

The score kernel takes no per-sequence pool count: a row sees the pools its
position completes (``(t+1) // kpool``, capped by ``scores.shape[1]``), and
those pools must be in the pooled cache.
"""

from __future__ import annotations

import torch

from ...cache.layout import first_missing_page, page_problem, ragged_rows
from ...numerics import div_rn
from .qsa import keys_seen

MODES = ("softmax", "mean", "last")


# ---------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------
def pool_members(members_k: torch.Tensor, members_gate: torch.Tensor, ape: torch.Tensor, mode: str) -> torch.Tensor:
    """Combine ``kpool`` members into one key per pool, per channel (SPEC 3.1).

    Args:
        members_k, members_gate: ``[N, kpool, D]`` in the key dtype, member ``m``
            at position ``p*kpool + m`` of its pool.
        ape: ``[kpool, D]`` float32.
        mode: ``"softmax"``, ``"mean"`` or ``"last"``.

    Returns ``[N, D]`` in the key dtype.
    """
    kpool = members_k.shape[1]
    if mode == "last":
        return members_k[:, kpool - 1].clone()
    keys = members_k.float()
    if mode == "mean":
        total = keys[:, 0]
        for m in range(1, kpool):
            total = total + keys[:, m]
        return div_rn(total, kpool).to(members_k.dtype)
    if mode != "softmax":
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    logits = members_gate.float() + ape[None]  # [N, kpool, D]: one weight per channel, not per token
    peak = logits.amax(dim=1, keepdim=True)
    # exp evaluated in float64 and rounded once: the correctly rounded float32 exp (but for
    # double-rounding cases of probability ~1e-9), so every backend and batch layout agrees bit for bit.
    exps = torch.exp((logits - peak).double()).float()
    denom = exps[:, 0]
    for m in range(1, kpool):
        denom = denom + exps[:, m]
    pooled = (exps[:, 0] / denom) * keys[:, 0]
    for m in range(1, kpool):
        pooled = pooled + (exps[:, m] / denom) * keys[:, m]
    return pooled.to(members_k.dtype)


def pool_counts(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, kpool: int) -> torch.Tensor:
    """Pools that :func:`mla_kpool_compress` emits per sequence (SPEC 3.1), int64 ``[B]``.

    ``P = max(0, floor((c+n)/kpool) - ceil(c/kpool))``. Example, kpool 4:
    ``c = 6, n = 7`` covers positions 6..12; pool 1 (4..7) is left to the ring,
    pool 2 (8..11) is emitted, 12 waits: ``P = floor(13/4) - ceil(6/4) = 3 - 2 = 1``.
    """
    offsets = input_row_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    cached = cache_lengths.to(torch.int64)
    end_pool = torch.div(cached + lengths, kpool, rounding_mode="floor")
    first_pool = torch.div(cached + kpool - 1, kpool, rounding_mode="floor")
    return (end_pool - first_pool).clamp_min(0)


def visible_pools(query_positions: torch.Tensor, kpool: int, out_cols: int) -> torch.Tensor:
    """Pools each query row sees, int64 ``[total_q]``: ``(t+1) // kpool`` capped to ``[0, out_cols]``."""
    visible = torch.div(query_positions.to(torch.int64) + 1, kpool, rounding_mode="floor")
    return visible.clamp(0, out_cols)


def score_page_error(lookup_table: torch.Tensor, num_pages: int, pools_per_page: int,
                     query_positions: torch.Tensor, input_row_offsets: torch.Tensor, kpool: int,
                     seq: int, pool: int) -> ValueError:
    """The ``ValueError`` for pool ``pool`` of sequence ``seq`` without a valid page in the pooled cache.

    Names what the caller passed: the first query row of the sequence that
    sees that pool and its position, then why the pool has no page.
    """
    start, end = int(input_row_offsets[seq]), int(input_row_offsets[seq + 1])
    positions = query_positions[start:end].to(torch.int64)
    row = start + int(torch.nonzero(torch.div(positions + 1, kpool, rounding_mode="floor") > pool)[0])
    first = pool * kpool
    return ValueError(
        f"query_positions: row {row} (sequence {seq}) at position {int(query_positions[row])} sees pool {pool} "
        f"(positions {first}..{first + kpool - 1}), which has no page in the pooled cache: "
        f"{page_problem(lookup_table, num_pages, pools_per_page, seq, pool)}")


def check_score_pages(lookup_table: torch.Tensor, num_pages: int, pools_per_page: int,
                      query_positions: torch.Tensor, input_row_offsets: torch.Tensor, kpool: int,
                      out_cols: int) -> None:
    """Raise :func:`score_page_error` unless every pool a query row sees has a valid page.

    Memory and time in proportion to the rows and the lookup table, whatever
    the positions: the pools a sequence needs are counted, never listed.
    """
    if query_positions.shape[0] == 0:
        return
    missing = first_missing_page(lookup_table, num_pages, pools_per_page,
                                 keys_seen(query_positions, input_row_offsets, kpool, out_cols))
    if missing is not None:
        raise score_page_error(lookup_table, num_pages, pools_per_page, query_positions, input_row_offsets, kpool,
                               *missing)


def compress_member_rows(
    input_row_offsets: torch.Tensor, pool_row_offsets: torch.Tensor, cache_lengths: torch.Tensor, kpool: int
) -> torch.Tensor:
    """Input rows of every emitted pool's members: int64 ``[pool_row_offsets[B], kpool]``.

    Output row ``pool_row_offsets[b] + j`` uses input rows ``r0 + m`` with
    ``r0 = input_row_offsets[b] + align + j*kpool``, ``align = (kpool - c % kpool) % kpool``.
    """
    seq_of_pool, local_pool = ragged_rows(pool_row_offsets)
    cached = cache_lengths.to(torch.int64)
    align = (kpool - cached % kpool) % kpool
    first_row = input_row_offsets.to(torch.int64)[:-1] + align
    r0 = first_row[seq_of_pool] + local_pool * kpool
    return r0[:, None] + torch.arange(kpool, device=r0.device)[None, :]


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------
def mla_kpool_compress(
    pooled: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    input_row_offsets: torch.Tensor,
    pool_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    kpool: int,
    mode: str,
) -> None:
    """Write every pool completed inside this call's rows (SPEC 3.1).

    Args:
        pooled: output ``[pool_row_offsets[B], D]`` in ``k``'s dtype; row
            ``pool_row_offsets[b] + j`` receives sequence ``b``'s ``j``-th
            emitted pool, pool id ``ceil(c/kpool) + j``.
        pool_row_offsets: ``[B+1]`` int32, the exclusive prefix sum of
            :func:`pool_counts` (the caller has checked it).

    A pool opened in an earlier call (the first ``align`` rows) is not
    written here; :func:`mla_kpool_ring_close` closes it.

    Example, kpool 4, cache lengths ``[6, 0]``, offsets ``[0, 7, 10]``: sequence 0
    holds positions 6..12 and emits pool 2 from rows 2..5 (8..11); sequence 1
    holds positions 0..2 and emits nothing; ``pool_row_offsets = [0, 1, 1]``.
    """
    if pooled.shape[0] == 0:
        return
    rows = compress_member_rows(input_row_offsets, pool_row_offsets, cache_lengths, kpool)
    pooled.copy_(pool_members(k[rows], gate[rows], ape, mode))


def mla_kpool_ring_close(
    closed: torch.Tensor,
    closed_ids: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    kpool: int,
    mode: str,
) -> None:
    """Close the pool each sequence left open in an earlier call (SPEC 3.2).

    Args:
        closed: output ``[B, D]`` in ``k``'s dtype; row ``b`` gets the closed
            pool, or zeros when sequence ``b`` closes none.
        closed_ids: output ``[B]`` int32, the closed pool id ``floor(c/kpool)``
            or ``-1``.
        ring: ``[max_slots, 2, kpool, D]`` in ``k``'s dtype; plane 0 keys,
            plane 1 gates of the open pool's members at slot ``position % kpool``.
            Read only.
        slot_ids: ``[B]`` int32 in ``[0, max_slots)``, each sequence's ring slot.

    Sequence ``b`` closes pool ``floor(c/kpool)`` iff ``c % kpool != 0`` and
    ``n >= align``: members at positions ``< c`` come from the ring, the rest
    from this call's first ``align`` rows.

    Example, kpool 4, ``c = 6``, ``n = 3``: pool 1 (positions 4..7) takes
    members 0, 1 from ``ring[slot, :, 0:2]`` and members 2, 3 from rows 0, 1.
    """
    closed.zero_()
    closed_ids.fill_(-1)
    batch = cache_lengths.shape[0]
    if batch == 0 or kpool == 1:
        return
    offsets = input_row_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    cached = cache_lengths.to(torch.int64)
    align = (kpool - cached % kpool) % kpool
    closing = (align > 0) & (lengths >= align)
    seqs = torch.nonzero(closing).flatten()
    if seqs.numel() == 0:
        return
    member = torch.arange(kpool, device=k.device)
    cached_members = cached[seqs] % kpool  # members 0..cached_members-1 come from the ring
    from_ring = member[None, :] < cached_members[:, None]  # [S, kpool]
    rows = offsets[seqs][:, None] + member[None, :] - cached_members[:, None]
    rows = torch.where(from_ring, torch.zeros_like(rows), rows)
    slots = slot_ids.to(torch.int64)[seqs]
    ring_k, ring_gate = ring[slots, 0], ring[slots, 1]  # [S, kpool, D]
    mask = from_ring[:, :, None]
    members_k = torch.where(mask, ring_k, k[rows])
    members_gate = torch.where(mask, ring_gate, gate[rows])
    closed[seqs] = pool_members(members_k, members_gate, ape, mode)
    closed_ids[seqs] = torch.div(cached[seqs], kpool, rounding_mode="floor").to(closed_ids.dtype)


def mla_kpool_seed_tail(
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    kpool: int,
) -> None:
    """Store this call's members of each sequence's still-open pool into the ring (SPEC 3.2).

    Rows at positions ``max(floor((c+n)/kpool)*kpool, c) .. c+n-1`` go to
    ``ring[slot_ids[b], 0, position % kpool]`` (key) and ``ring[..., 1, ...]``
    (gate). Runs after :func:`mla_kpool_ring_close`, which may read the same
    slots. Other ring entries are left as they are.

    Example, kpool 4, ``c = 6``, ``n = 7`` (positions 6..12): position 12 goes to
    slot member 0; ``c = 5``, ``n = 1``: position 5 goes to member 1.
    """
    if kpool == 1 or k.shape[0] == 0:
        return
    seq_ids, local = ragged_rows(input_row_offsets)
    cached = cache_lengths.to(torch.int64)
    lengths = input_row_offsets.to(torch.int64).diff()
    positions = cached[seq_ids] + local
    open_from = torch.maximum(
        torch.div(cached + lengths, kpool, rounding_mode="floor") * kpool, cached
    )[seq_ids]
    keep = positions >= open_from
    rows = torch.nonzero(keep).flatten()
    slots = slot_ids.to(torch.int64)[seq_ids[rows]]
    members = positions[rows] % kpool
    ring[slots, 0, members] = k[rows]
    ring[slots, 1, members] = gate[rows]


def mla_kpool_score(
    scores: torch.Tensor,
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    kpool: int,
    layer: int,
) -> None:
    """Score every visible pool for every query row (SPEC 3.3).

    Args:
        scores: output ``[total_q, out_cols]`` float32.
        q: ``[total_q, H, D]`` index queries, the pooled cache's dtype.
        head_weights: ``[total_q, H]`` float32, already scaled.
        pooled_blocks: ``[num_pages, KV, num_layers, pools_per_page, 1, D]``,
            the pooled-key cache (plane 0 is read); pool ``p`` of sequence
            ``b`` is row ``p % pools_per_page`` of page
            ``lookup_table[b, p // pools_per_page]``.
        lookup_table: ``[B, max_pages]`` int32, ``-1`` for no page.
        query_positions: ``[total_q]`` int32, each row's position ``t`` in its sequence.
        input_row_offsets: ``[B+1]`` int32, the rows of each sequence; ``total_q`` last.
        layer: which layer of ``pooled_blocks``.

    ``scores[r, p] = sum_h head_weights[r, h] * relu(q[r, h] . K_p)`` (fp32)
    for the ``v = min((t+1) // kpool, out_cols)`` visible pools ``p < v``;
    every other column is ``-inf``. A missing page among the visible pools
    raises ``ValueError`` (:func:`score_page_error`: the query row and
    position that needed it) before anything is written.

    Example, kpool 4, pools_per_page 2: a row at ``t = 10`` sees pools 0, 1
    (positions 0..7; pool 2 ends at 11 > 10), both in logical page 0.
    """
    total_q = scores.shape[0]
    if total_q == 0:
        return
    # Every page is validated first, in bounded memory, before anything is listed or written.
    check_score_pages(lookup_table, pooled_blocks.shape[0], pooled_blocks.shape[3], query_positions,
                      input_row_offsets, kpool, scores.shape[1])
    seq_of_row, _ = ragged_rows(input_row_offsets)
    visible = visible_pools(query_positions, kpool, scores.shape[1])
    pair_rows, pair_pools = ragged_rows(torch.cat([visible.new_zeros(1), visible.cumsum(0)]))
    per_page = pooled_blocks.shape[3]
    pages = lookup_table[seq_of_row[pair_rows], torch.div(pair_pools, per_page, rounding_mode="floor")].long()
    keys = pooled_blocks[pages, 0, layer, pair_pools % per_page, 0].float()  # [pairs, D]
    scores.fill_(float("-inf"))
    starts = torch.cat([visible.new_zeros(1), visible.cumsum(0)]).tolist()
    for r in range(total_q):
        row_keys = keys[starts[r]: starts[r + 1]]  # [v, D]
        dots = q[r].float() @ row_keys.T  # [H, v]
        scores[r, : row_keys.shape[0]] = (head_weights[r].float()[:, None] * dots.clamp_min(0)).sum(dim=0)
