"""Public QSA ops (SPEC 2.2 - 2.5): compress, block score, token selection, sparse attention, and the
block-key cache (store the blocks a call completes, score them in place or load them).

Each public function validates its arguments (``ValueError``/``TypeError``
naming the argument), normalises index tensors to int32, allocates its outputs
and calls an out-style torch custom op ``sparsekv::<name>`` whose body runs the
backend chosen by ``sparsekv.ops._registry``. Checks that need the values of
device tensors (page tables, counts) run on CPU tensors always and on GPU
tensors only with ``SPARSEKV_DEBUG=1``.

One layer step (SPEC 2.6)::

    block_keys = qsa_compress_keys_paged(gamma, freqs_cis, key_counts, index_cache, layer,
                                         ratio=4, eps=1e-6, max_blocks=max_blocks)
    scores = qsa_block_score(index_q, block_keys, positions, offsets, ratio=4, score_scale=128 ** 0.5)
    indices, counts = qsa_select_tokens(scores, positions, offsets, ratio=4, budget=2048)
    out = qsa_sparse_attention_paged(q, main_cache, layer, indices, counts, offsets, scale=256 ** -0.5)

With a block-key cache (pages co-indexed with the indexer cache, ``page_size // 4`` rows each), a
step pools only the blocks it completes and scores them where they lie (the same scores)::

    qsa_store_block_keys_paged(gamma, freqs_cis, key_counts, index_cache, block_cache, layer, ratio=4, eps=1e-6)
    scores = qsa_block_score_paged(index_q, block_cache, layer, positions, offsets, ratio=4,
                                   score_scale=128 ** 0.5, out_cols=max_blocks)
"""

from __future__ import annotations

import numpy as np
import torch

from .._checks import (KEY_DTYPES, as_index_tensor, check_bool, check_float, check_freqs_cis_rows, check_instance,
                       check_int, check_nonnegative, check_same_dtype, check_tensor, host_array)
from .._env import host_checks
from ..cache.layout import PagedKVCacheCollection, check_needed_pages
from ._attention_checks import check_counted_positions, check_row_offsets
from ._registry import kernel, out_op
from ._score_plan import PagedScorePlanBase
from .select import SelectedTokens, select_blocks_expand

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---- custom ops (out-style) ------------------------------------------------

@out_op("qsa_compress_keys_paged", mutates_args=("block_keys",))
def _compress_op(
    block_keys: torch.Tensor,
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
    eps: float,
) -> None:
    kernel("qsa", "qsa_compress_keys_paged", block_keys.device)(
        block_keys, gamma, freqs_cis, key_counts, blocks, lookup_table, layer, ratio, eps
    )



@out_op("qsa_store_block_keys_paged", mutates_args=("block_blocks",))
def _store_block_keys_op(
    block_blocks: torch.Tensor,
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    first_blocks: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
    eps: float,
    max_new_blocks: int,
) -> None:
    kernel("qsa", "qsa_store_block_keys_paged", block_blocks.device)(
        block_blocks, gamma, freqs_cis, key_counts, first_blocks, blocks, lookup_table, layer, ratio, eps,
        max_new_blocks
    )


@out_op("qsa_load_block_keys_paged", mutates_args=("block_keys",))
def _load_block_keys_op(
    block_keys: torch.Tensor,
    key_counts: torch.Tensor,
    block_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
) -> None:
    kernel("qsa", "qsa_load_block_keys_paged", block_keys.device)(
        block_keys, key_counts, block_blocks, lookup_table, layer, ratio
    )


@out_op("qsa_block_score", mutates_args=("scores",))
def _block_score_op(
    scores: torch.Tensor,
    q: torch.Tensor,
    block_keys: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    ratio: int,
    score_scale: float,
) -> None:
    kernel("qsa", "qsa_block_score", scores.device)(
        scores, q, block_keys, query_positions, input_row_offsets, ratio, score_scale
    )



@out_op("qsa_block_score_paged", mutates_args=("scores",))
def _block_score_paged_op(
    scores: torch.Tensor,
    q: torch.Tensor,
    block_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    ratio: int,
    score_scale: float,
) -> None:
    kernel("qsa", "qsa_block_score_paged", scores.device)(
        scores, q, block_blocks, lookup_table, query_positions, input_row_offsets, layer, ratio, score_scale
    )


@out_op("qsa_sparse_attention_paged", mutates_args=("out", "lse"))
def _sparse_attention_op(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    scale: float,
    gate: torch.Tensor | None,
) -> None:
    kernel("qsa", "qsa_sparse_attention_paged", out.device)(
        out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale, gate
    )



# ---- public ops --------------------------------------------------------------

def qsa_compress_keys_paged(
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    kv_collection: PagedKVCacheCollection,
    layer_idx: int,
    *,
    ratio: int,
    eps: float,
    max_blocks: int | None = None,
    rotary_dim: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool each sequence's complete ``ratio``-token blocks of raw indexer keys (SPEC 2.2).

    Block ``j`` of sequence ``b``: fp32 mean of raw keys ``j*R .. j*R+R-1``,
    zero-centred RMSNorm with ``gamma``, NeoX RoPE at position ``j*R`` over the
    first ``rotary_dim`` channels, each step cast to the cache dtype.

    Args:
        gamma: ``[D]`` float (``k_layernorm`` weight); ``D`` is the head dim.
        freqs_cis: ``[positions, rotary_dim]`` float cos/sin pairs
            (``sparsekv.rope_freqs_cis``); needs a row for every block start.
        key_counts: ``[B]`` int32/int64/uint32, raw keys per sequence
            *including* this call's tokens (``cache_lengths + rows of this call``).
        kv_collection: the indexer cache, ``[num_pages, KV, num_layers, page_size, 1, D]``;
            plane 0 of ``layer_idx`` is read. Its ``cache_lengths`` do not change the output.
        layer_idx: layer of the indexer cache.
        ratio: tokens per block ``R >= 1``.
        eps: RMSNorm epsilon (``>= 0``).
        max_blocks: blocks per sequence in the output; required unless ``out`` is given.
        rotary_dim: optional; when given, ``freqs_cis.shape[1]`` must equal it.
        out: optional ``[B * max_blocks, D]`` contiguous tensor of the cache dtype.

    Returns ``block_keys [B * max_blocks, D]`` in the cache dtype: sequence
    ``b``'s block ``j < min(key_counts[b] // R, max_blocks)`` at row
    ``b * max_blocks + j``; every other row is zero.

    Raises ``ValueError`` for an empty batch, batch-size mismatches, widths
    other than ``D``, a multi-head cache, a bad ``rotary_dim``, a
    ``freqs_cis`` too short, or a missing page (naming sequence and position).

    Example: ``key_counts = [9, 3]``, ``R = 4``, ``max_blocks = 3``: rows 0-1
    pool tokens 0..3 and 4..7 of sequence 0, rows 2-5 are zero (9 // 4 = 2
    blocks; 3 // 4 = 0 blocks).
    """
    c = check_instance("kv_collection", kv_collection, PagedKVCacheCollection)
    key_counts, eps = _check_compress_inputs(gamma, freqs_cis, key_counts, c, "kv_collection", layer_idx, ratio,
                                             eps, rotary_dim)
    out, max_blocks = _block_keys_out(out, max_blocks, key_counts.shape[0], gamma.shape[0], c)
    if host_checks(c.device):
        num_blocks = np.minimum(host_array(key_counts).astype(np.int64) // ratio, max_blocks)
        check_freqs_cis_rows(freqs_cis.shape[0], num_blocks, ratio)
        if c.device.type != "cpu":  # CPU kernels check pages themselves before reading
            check_needed_pages(c.lookup_table, c.num_pages, c.page_size, torch.from_numpy(num_blocks * ratio))
    _compress_op(out, gamma, freqs_cis, key_counts, c.blocks, c.lookup_table, layer_idx, ratio, eps)
    return out


def _check_compress_inputs(gamma: torch.Tensor, freqs_cis: torch.Tensor, key_counts: torch.Tensor,
                           c: PagedKVCacheCollection, cache_name: str, layer_idx: int, ratio: int, eps: float,
                           rotary_dim: int | None) -> tuple[torch.Tensor, float]:
    """The argument checks of the ops that pool raw indexer keys (compress, store block keys) against the
    indexer cache ``c`` (named ``cache_name``); returns ``(key_counts`` as int32 on ``c``'s device, ``eps)``."""
    c._check_layer(layer_idx)
    check_int("ratio", ratio, minimum=1)
    eps = check_float("eps", eps, minimum=0.0)
    check_tensor("gamma", gamma, ndim=1, dtypes=FLOAT_DTYPES, device=c.device)
    check_tensor("freqs_cis", freqs_cis, ndim=2, dtypes=FLOAT_DTYPES, device=c.device)
    key_counts = check_nonnegative("key_counts", key_counts, device=c.device)
    batch = key_counts.shape[0]
    if batch == 0:
        raise ValueError("key_counts: empty batch (0 sequences); expected at least one")
    if c.batch_size != batch:
        raise ValueError(f"{cache_name}.cache_lengths: expected {batch} entries (len(key_counts)), got {c.batch_size}")
    if c.lookup_table.shape[0] != batch:
        raise ValueError(
            f"{cache_name}.lookup_table: expected {batch} rows (len(key_counts)), got {c.lookup_table.shape[0]}"
        )
    head_dim = gamma.shape[0]
    if c.num_heads != 1:
        raise ValueError(f"{cache_name}: expected an indexer cache with one key head, got {c.num_heads} heads")
    if c.head_size != head_dim:
        raise ValueError(f"{cache_name}: head width {c.head_size} differs from D = len(gamma) = {head_dim}")
    freq_width = freqs_cis.shape[1]
    if rotary_dim is not None:
        check_int("rotary_dim", rotary_dim, minimum=0)
        if freq_width != rotary_dim:
            raise ValueError(f"freqs_cis: width {freq_width} differs from rotary_dim = {rotary_dim}")
    if freq_width == 0 or freq_width % 2 or freq_width > head_dim:
        raise ValueError(f"freqs_cis: rotary_dim (its width) must be even, > 0 and <= D = {head_dim}, got {freq_width}")
    return key_counts, eps


def _block_keys_out(out: torch.Tensor | None, max_blocks: int | None, batch: int, head_dim: int,
                    c: PagedKVCacheCollection) -> tuple[torch.Tensor, int]:
    """``(block_keys, max_blocks)``: ``out`` checked against ``max_blocks`` and the batch, or a new
    ``[batch * max_blocks, head_dim]`` tensor of ``c``'s dtype when ``out`` is ``None``."""
    if out is None:
        if max_blocks is None:
            raise ValueError("max_blocks: required when out is not given")
        check_int("max_blocks", max_blocks, minimum=0)
        return torch.empty(batch * max_blocks, head_dim, dtype=c.dtype, device=c.device), max_blocks
    check_tensor("out (block_keys)", out, ndim=2, dtypes=(c.dtype,), device=c.device)
    if out.shape[1] != head_dim:
        raise ValueError(f"out (block_keys): width {out.shape[1]} differs from D = {head_dim}")
    if out.shape[0] % batch:
        raise ValueError(f"out (block_keys): {out.shape[0]} rows is not a multiple of the batch size {batch}")
    if max_blocks is not None and max_blocks != out.shape[0] // batch:
        raise ValueError(f"max_blocks: {max_blocks} disagrees with out rows {out.shape[0]} // batch {batch}")
    if not out.is_contiguous():
        raise ValueError("out (block_keys): expected a contiguous tensor")
    return out, out.shape[0] // batch


def _check_block_cache(block_cache: PagedKVCacheCollection, index_cache: PagedKVCacheCollection, ratio: int,
                       layer_idx: int) -> PagedKVCacheCollection:
    """Check that ``block_cache`` can hold ``index_cache``'s block keys: a collection with one key head of
    the same width and dtype, ``index_cache.page_size // ratio`` rows per page, the same pages, lookup
    table and layers, and ``index_cache.cache_lengths // ratio`` blocks cached (the blocks complete before
    this call). The table and lengths are compared where :func:`host_checks` reads values."""
    bc = check_instance("block_cache", block_cache, PagedKVCacheCollection)
    bc._check_layer(layer_idx)
    if bc.device != index_cache.device:
        raise ValueError(f"block_cache: on {bc.device}, expected index_cache's device {index_cache.device}")
    if bc.dtype != index_cache.dtype:
        raise TypeError(f"block_cache: expected dtype {index_cache.dtype} (same as index_cache), got {bc.dtype}")
    if bc.num_heads != 1 or bc.head_size != index_cache.head_size:
        raise ValueError(f"block_cache: expected one head of {index_cache.head_size} channels (as index_cache), "
                         f"got {bc.num_heads} x {bc.head_size}")
    if bc.page_size * ratio != index_cache.page_size:
        raise ValueError(f"block_cache: {bc.page_size} rows per page x ratio {ratio} differs from index_cache's "
                         f"page size {index_cache.page_size}")
    if bc.num_pages != index_cache.num_pages:
        raise ValueError(f"block_cache: {bc.num_pages} pages, expected index_cache's {index_cache.num_pages} "
                         "(the two share page ids)")
    if bc.lookup_table.shape != index_cache.lookup_table.shape:
        raise ValueError(f"block_cache.lookup_table: shape {tuple(bc.lookup_table.shape)} differs from "
                         f"index_cache's {tuple(index_cache.lookup_table.shape)} (the two share page ids)")
    if host_checks(bc.device):
        if bc.lookup_table is not index_cache.lookup_table and not np.array_equal(
                host_array(bc.lookup_table), host_array(index_cache.lookup_table)):
            raise ValueError("block_cache.lookup_table: differs from index_cache's (the two share page ids)")
        expected = host_array(index_cache.cache_lengths).astype(np.int64) // ratio
        found = host_array(bc.cache_lengths).astype(np.int64)
        if not np.array_equal(found, expected):
            b = int(np.flatnonzero(found != expected)[0])
            raise ValueError(f"block_cache.cache_lengths: sequence {b} has {int(found[b])} blocks cached, expected "
                             f"{int(expected[b])} (index_cache.cache_lengths[{b}] // ratio)")
    return bc


def qsa_store_block_keys_paged(
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    index_cache: PagedKVCacheCollection,
    block_cache: PagedKVCacheCollection,
    layer_idx: int,
    *,
    ratio: int,
    eps: float,
    rotary_dim: int | None = None,
) -> None:
    """Compress the blocks that complete in this call and keep them in a block-key cache (SPEC 2.2, cached).

    Block ``j`` of a sequence never changes once its ``R`` raw keys are stored,
    so a decode step need not pool it again: this op pools blocks
    ``block_cache.cache_lengths[b] .. key_counts[b] // R - 1`` of each sequence
    (those completed since the last call; bit for bit what
    :func:`qsa_compress_keys_paged` computes for them) and stores block ``j``
    in row ``j % P`` of logical page ``j // P`` (``P = page_size // R``),
    the page that holds its tokens in ``index_cache``. Read them back with
    :func:`qsa_load_block_keys_paged`.

    Args:
        gamma, freqs_cis, key_counts, ratio, eps, rotary_dim: as for :func:`qsa_compress_keys_paged`.
        index_cache: the indexer cache holding the raw keys (this call's already stored).
        block_cache: ``[num_pages, KV, num_layers, page_size // R, 1, D]``, the same page ids, lookup
            table and layers as ``index_cache``, its ``cache_lengths`` the blocks complete before this call
            (``index_cache.cache_lengths // R``), its ``max_seq_length`` at least the blocks one sequence
            completes in this call: e.g. a cache manager's group with ``tokens_per_entry = R``.
        layer_idx: layer of both caches.

    Every call that stores raw keys must be followed by this op before the
    blocks are read: a block is stored once, in the call that completes it.

    Raises ``ValueError`` for caches that do not match (page geometry, table,
    lengths), a missing page or a ``freqs_cis`` too short, before writing anything.

    Example: ``R = 4``, page size 8 (``P = 2``), 6 tokens cached, 3 new
    (``key_counts = [9]``, ``block_cache.cache_lengths = [1]``): block 1
    (tokens 4..7) goes to row 1 of logical page 0; token 8 waits for its block.
    """
    c = check_instance("index_cache", index_cache, PagedKVCacheCollection)
    key_counts, eps = _check_compress_inputs(gamma, freqs_cis, key_counts, c, "index_cache", layer_idx, ratio, eps,
                                             rotary_dim)
    bc = _check_block_cache(block_cache, c, ratio, layer_idx)
    if host_checks(c.device):
        num_blocks = host_array(key_counts).astype(np.int64) // ratio
        cached = host_array(bc.cache_lengths)
        short = np.flatnonzero(num_blocks < cached)
        if short.size:
            b = int(short[0])
            raise ValueError(f"key_counts: sequence {b} has {int(num_blocks[b])} complete blocks, fewer than the "
                             f"{int(cached[b])} block_cache holds")
        new_blocks = num_blocks - cached
        if new_blocks.max() > bc.max_seq_length:  # it sizes the GPU kernels' grids
            b = int(new_blocks.argmax())
            raise ValueError(f"block_cache.max_seq_length: {bc.max_seq_length}, but sequence {b} completes "
                             f"{int(new_blocks[b])} blocks in this call (key_counts[{b}] // ratio - its cached blocks)")
        if not new_blocks.any():  # no block completes (a decode step inside a block): nothing to do
            return
        check_freqs_cis_rows(freqs_cis.shape[0], num_blocks, ratio)
        if c.device.type != "cpu":  # CPU kernels check pages themselves before reading
            check_needed_pages(c.lookup_table, c.num_pages, c.page_size, torch.from_numpy(num_blocks * ratio))
    _store_block_keys_op(bc.blocks, gamma, freqs_cis, key_counts, bc.cache_lengths, c.blocks, c.lookup_table,
                         layer_idx, ratio, eps, bc.max_seq_length)


def qsa_load_block_keys_paged(
    key_counts: torch.Tensor,
    block_cache: PagedKVCacheCollection,
    layer_idx: int,
    *,
    ratio: int,
    max_blocks: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`qsa_compress_keys_paged`'s output, read from a block-key cache instead of pooled again.

    Args:
        key_counts: ``[B]`` int, raw keys per sequence including this call's tokens.
        block_cache: the cache :func:`qsa_store_block_keys_paged` filled up to ``key_counts``.
        layer_idx: its layer.
        ratio: tokens per block ``R``.
        max_blocks, out: as for :func:`qsa_compress_keys_paged`.

    Returns ``block_keys [B * max_blocks, D]`` in the cache dtype: block ``j
    < min(key_counts[b] // R, max_blocks)`` of sequence ``b`` at row ``b *
    max_blocks + j``, every other row zero. The blocks must have been
    stored (the op cannot tell a stored block from stale memory).

    Raises ``ValueError`` for a missing page (naming sequence and block).
    """
    bc = check_instance("block_cache", block_cache, PagedKVCacheCollection)
    bc._check_layer(layer_idx)
    check_int("ratio", ratio, minimum=1)
    if bc.batch_size == 0:
        raise ValueError("block_cache: empty batch (0 sequences); expected at least one")
    key_counts = check_nonnegative("key_counts", key_counts, batch=bc.batch_size, device=bc.device)
    if bc.num_heads != 1:
        raise ValueError(f"block_cache: expected one key head, got {bc.num_heads} heads")
    out, max_blocks = _block_keys_out(out, max_blocks, bc.batch_size, bc.head_size, bc)
    if host_checks(bc.device) and bc.device.type != "cpu":  # CPU kernels check pages themselves
        num_blocks = np.minimum(host_array(key_counts).astype(np.int64) // ratio, max_blocks)
        check_needed_pages(bc.lookup_table, bc.num_pages, bc.page_size, torch.from_numpy(num_blocks))
    _load_block_keys_op(out, key_counts, bc.blocks, bc.lookup_table, layer_idx, ratio)
    return out


def _scores_width(out: torch.Tensor | None, out_cols: int | None, device: torch.device, *,
                  max_blocks: int | None = None) -> int:
    """A block score's output width: ``out``'s columns when given (``out_cols``, if also given, must agree),
    else ``out_cols``, which defaults to ``max_blocks`` (required without one) and may not be below it."""
    if out is not None:
        check_tensor("out (scores)", out, ndim=2, dtypes=(torch.float32,), device=device)
        if out_cols is not None and out.shape[1] != out_cols:
            raise ValueError(f"out_cols: {out_cols} disagrees with out's {out.shape[1]} columns")
        out_cols = out.shape[1]
    elif out_cols is None:
        if max_blocks is None:
            raise ValueError("out_cols: required when out is not given")
        out_cols = max_blocks
    check_int("out_cols", out_cols, minimum=0)
    if max_blocks is not None and out_cols < max_blocks:
        raise ValueError(f"out_cols: expected >= max_blocks = {max_blocks}, got {out_cols}")
    return out_cols


def _scores_tensor(out: torch.Tensor | None, out_cols: int, total_q: int, device: torch.device) -> torch.Tensor:
    """A block score's output: ``out`` checked (``[total_q, out_cols]`` contiguous float32 on ``device``), or a
    new one."""
    if out is None:
        return torch.empty(total_q, out_cols, dtype=torch.float32, device=device)
    check_tensor("out (scores)", out, shape=(total_q, out_cols), dtypes=(torch.float32,), device=device)
    if not out.is_contiguous():
        raise ValueError("out (scores): expected a contiguous tensor")
    return out


def _scores_out(out: torch.Tensor | None, out_cols: int | None, total_q: int, device: torch.device, *,
                max_blocks: int | None = None) -> torch.Tensor:
    """:func:`_scores_width` then :func:`_scores_tensor`."""
    return _scores_tensor(out, _scores_width(out, out_cols, device, max_blocks=max_blocks), total_q, device)


def qsa_block_score(
    q: torch.Tensor,
    block_keys: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    ratio: int,
    score_scale: float,
    out_cols: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score each query row against its sequence's block keys (SPEC 2.3).

    ``scores[r, g] = sum_h relu(q[r, h] . block_keys[b*max_blocks + g]) / score_scale``
    (fp32) for visible blocks ``g < min((t+1) // ratio, max_blocks)``, ``-inf``
    elsewhere; ``b`` is row ``r``'s sequence, ``t = query_positions[r]``.

    Args:
        q: ``[total_q, n_heads, D]`` bf16/fp16/fp32, normed and rotated.
        block_keys: ``[B * max_blocks, D]``, q's dtype (``qsa_compress_keys_paged``'s output).
        query_positions: ``[total_q]`` int, ``t >= 0`` of each row in its sequence.
        input_row_offsets: ``[B+1]`` int, ``input_row_offsets[-1] == total_q``.
        ratio: tokens per block.
        score_scale: the divisor, ``> 0`` (``sqrt(D)`` in the model).
        out_cols: columns of the output, ``>= max_blocks`` (default ``max_blocks``).
        out: optional ``[total_q, out_cols]`` contiguous float32.

    Returns ``scores [total_q, out_cols]`` float32.

    Example: 2 sequences, ``max_blocks = 8`` (16 block-key rows), offsets
    ``[0, 1, 3]``, positions ``[9, 2, 3]``, ``R = 4``: row 0 sees blocks
    0-1 of sequence 0 (rows 0-1), row 1 none, row 2 block 0 of sequence 1 (row 8).
    """
    check_int("ratio", ratio, minimum=1)
    score_scale = check_float("score_scale", score_scale, positive=True)
    check_tensor("q", q, ndim=3, dtypes=KEY_DTYPES)
    check_tensor("block_keys", block_keys, ndim=2, dtypes=KEY_DTYPES, device=q.device)
    check_same_dtype(("q", "block_keys"), q, block_keys)
    total_q, _, head_dim = q.shape
    if block_keys.shape[1] != head_dim:
        raise ValueError(f"block_keys: width {block_keys.shape[1]} differs from q's head dim {head_dim}")
    check_tensor("input_row_offsets", input_row_offsets, ndim=1)
    batch = input_row_offsets.shape[0] - 1
    if batch < 1:
        raise ValueError("input_row_offsets: empty batch; expected shape (B+1,) with B >= 1")
    if block_keys.shape[0] % batch:
        raise ValueError(f"block_keys: {block_keys.shape[0]} rows is not a multiple of the batch size {batch}")
    max_blocks = block_keys.shape[0] // batch
    offsets = check_row_offsets(input_row_offsets, batch, total_q, q.device)
    positions = check_nonnegative("query_positions", query_positions, device=q.device)
    if positions.shape[0] != total_q:
        raise ValueError(f"query_positions: expected shape ({total_q},) = q rows, got {tuple(positions.shape)}")
    out = _scores_out(out, out_cols, total_q, q.device, max_blocks=max_blocks)
    _block_score_op(out, q, block_keys, positions, offsets, ratio, score_scale)
    return out


class QSABlockScorePlan(PagedScorePlanBase):
    """:func:`qsa_block_score_paged`'s query rows over one block-key cache, set up once for every layer
    (:func:`plan_qsa_block_score_paged`; the plan and run split of :class:`sparsekv.ops.kpool.KPoolScorePlan`,
    :mod:`._score_plan`).

    Example, the layers of one step::

        plan = plan_qsa_block_score_paged(block_cache, positions, offsets, ratio=4, score_scale=16.0,
                                          out_cols=max_blocks)
        scores = [plan.run(index_q[layer], layer) for layer in range(layers)]
    """

    __slots__ = ("ratio", "score_scale")

    def __init__(self, block_cache: PagedKVCacheCollection, query_positions: torch.Tensor,
                 input_row_offsets: torch.Tensor, ratio: int, score_scale: float, out_cols: int) -> None:
        """Use :func:`plan_qsa_block_score_paged`, which validates the arguments."""
        self.ratio, self.score_scale = ratio, score_scale
        super().__init__(block_cache, query_positions, input_row_offsets, out_cols, "qsa", "BlockScorePlan",
                         (ratio, score_scale, out_cols))

    def run(self, q: torch.Tensor, layer_idx: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The block scores of layer ``layer_idx`` for every planned query row.

        Args:
            q: ``[total_q, n_heads, D]``, the cache's dtype, normed and rotated (``total_q`` planned rows).
            layer_idx: the block-key cache's layer.
            out: optional ``[total_q, out_cols]`` contiguous float32.

        Returns ``scores [total_q, out_cols]`` float32, as :func:`qsa_block_score_paged`.
        """
        self.check_layer(layer_idx, "block_cache")
        bc, device = self.collection, self.blocks.device
        check_tensor("q", q, ndim=3, dtypes=KEY_DTYPES, device=device)
        if q.dtype != bc.dtype:
            raise TypeError(f"q: expected dtype {bc.dtype} (same as block_cache), got {q.dtype}")
        if bc.head_size != q.shape[2]:
            raise ValueError(f"block_cache: head width {bc.head_size} differs from q's head dim {q.shape[2]}")
        self.check_rows(q)
        out = _scores_tensor(out, self.out_cols, self.total_q, device)
        q = q.contiguous()
        return self.run_into(
            out, (q,), lambda target: self.backend_plan.run(target, q, layer_idx),
            lambda target: _block_score_paged_op(target, q, self.blocks, self.lookup_table, self.query_positions,
                                                 self.input_row_offsets, layer_idx, self.ratio, self.score_scale))


def plan_qsa_block_score_paged(block_cache: PagedKVCacheCollection, query_positions: torch.Tensor,
                               input_row_offsets: torch.Tensor, *, ratio: int, score_scale: float,
                               out_cols: int) -> QSABlockScorePlan:
    """Validate what every layer's paged block score shares and set it up once (:class:`QSABlockScorePlan`).

    Args:
        block_cache: the cache :func:`qsa_store_block_keys_paged` fills (one key head).
        query_positions: ``[total_q]`` int, ``t >= 0`` of each row in its sequence.
        input_row_offsets: ``[B+1]`` int, ``B`` the cache's batch size, ``input_row_offsets[-1] == total_q``.
        ratio, score_scale: as for :func:`qsa_block_score`.
        out_cols: columns of the output.

    Raises ``ValueError`` for a missing page (CPU; naming the sequence and block), as every run does.
    """
    bc = check_instance("block_cache", block_cache, PagedKVCacheCollection)
    check_int("ratio", ratio, minimum=1)
    score_scale = check_float("score_scale", score_scale, positive=True)
    if bc.num_heads != 1:
        raise ValueError(f"block_cache: expected one key head, got {bc.num_heads} heads")
    positions = check_nonnegative("query_positions", query_positions, device=bc.device)
    offsets = check_row_offsets(input_row_offsets, bc.batch_size, positions.shape[0], bc.device)
    check_int("out_cols", out_cols, minimum=0)
    # the plan's own copies: the caller may change its tensors between runs
    return QSABlockScorePlan(bc, positions.clone(memory_format=torch.contiguous_format),
                             offsets.clone(memory_format=torch.contiguous_format), ratio, score_scale, out_cols)


def qsa_block_score_paged(
    q: torch.Tensor,
    block_cache: PagedKVCacheCollection,
    layer_idx: int,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    ratio: int,
    score_scale: float,
    out_cols: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`qsa_block_score` over the block keys of a block-key cache, read where they lie in its pages.

    The same scores, bit for bit, as :func:`qsa_block_score` on
    :func:`qsa_load_block_keys_paged`'s output with ``max_blocks = out_cols``,
    without that copy of every block key: row ``r`` of sequence ``b`` sees
    blocks ``g < min((t+1) // ratio, out_cols)``, block ``g`` in row ``g % P``
    of logical page ``g // P`` (``P`` the cache's rows per page). Several
    layers scoring the same rows: :func:`plan_qsa_block_score_paged` once,
    then :meth:`QSABlockScorePlan.run` per layer (this call is both).

    Args:
        q: ``[total_q, n_heads, D]``, the cache's dtype, normed and rotated.
        block_cache: the cache :func:`qsa_store_block_keys_paged` filled, this call's blocks included.
        layer_idx: its layer.
        query_positions: ``[total_q]`` int, ``t >= 0`` of each row in its sequence.
        input_row_offsets: ``[B+1]`` int, ``B`` the cache's batch size, ``input_row_offsets[-1] == total_q``.
        ratio, score_scale: as for :func:`qsa_block_score`.
        out_cols: columns of the output (required unless ``out`` is given).
        out: optional ``[total_q, out_cols]`` contiguous float32.

    Returns ``scores [total_q, out_cols]`` float32. Raises ``ValueError`` for
    a missing page (naming the sequence and block).
    """
    bc = check_instance("block_cache", block_cache, PagedKVCacheCollection)
    plan = plan_qsa_block_score_paged(bc, query_positions, input_row_offsets, ratio=ratio, score_scale=score_scale,
                                      out_cols=_scores_width(out, out_cols, bc.device))
    return plan.run(q, layer_idx, out=out)


def qsa_select_tokens(
    scores: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    ratio: int,
    budget: int,
) -> SelectedTokens:
    """Top ``budget // ratio`` blocks of each row expanded to tokens, plus the open tail (SPEC 2.4).

    Args:
        scores: ``[total_q, num_cols]`` float32 from ``qsa_block_score``.
        query_positions: ``[total_q]`` int, ``t >= 0``.
        input_row_offsets: ``[B+1]`` int, ``input_row_offsets[-1] == total_q``
            (checked; the selection itself is per row).
        ratio: tokens per block; budget: tokens (``2048`` in the model).

    Returns ``SelectedTokens(indices [total_q, budget + ratio - 1] int32, counts [total_q] int32)``;
    see ``sparsekv.select_blocks_expand`` for the rules (ties to the lower
    block id; visibility by position).

    Example: ``R = 4``, ``budget = 8``, ``t = 6``: 1 visible block, so
    indices ``[0, 1, 2, 3, 4, 5, 6, -1, -1, -1, -1]``, counts ``7``
    (every causal token, as ``t + 1 = 7 <= 8 + 4 - 1``).
    """
    check_tensor("scores", scores, ndim=2)
    check_tensor("input_row_offsets", input_row_offsets, ndim=1)
    batch = input_row_offsets.shape[0] - 1
    if batch < 1:
        raise ValueError("input_row_offsets: empty batch; expected shape (B+1,) with B >= 1")
    check_row_offsets(input_row_offsets, batch, scores.shape[0], scores.device)
    return select_blocks_expand(scores, query_positions, ratio=ratio, budget=budget, include_tail=True)


def qsa_sparse_attention_paged(
    q: torch.Tensor,
    kv_collection: PagedKVCacheCollection,
    layer_idx: int,
    indices: torch.Tensor,
    counts: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    scale: float,
    gate: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query row over the cached tokens it selected (SPEC 2.5).

    Args:
        q: ``[total_q, q_heads, head_size]`` in the cache dtype; ``q_heads`` a
            multiple of the cache's ``kv_heads`` (GQA: head ``h`` reads KV head
            ``h // (q_heads // kv_heads)``).
        kv_collection: the main cache (``KV == 2``), this call's K/V already stored.
        layer_idx: the layer to read.
        indices: ``[total_q, W]`` int, request-relative positions; only the
            first ``counts[r]`` of row ``r`` are read (duplicates count twice).
        counts: ``[total_q]`` int, ``<= W``; ``<= 0`` gives a zero row.
        input_row_offsets: ``[B+1]`` int, rows of each sequence.
        scale: multiplies ``q . k``.
        gate: optional ``[total_q, q_heads, head_size]`` in q's dtype; the
            output is multiplied by ``sigmoid(gate)`` (fp32, before the cast).
        return_lse: also return the ``[total_q, q_heads]`` float32 log-sum-exp
            (natural log of the scaled logits; ``-inf`` for empty rows).

    Returns ``out`` in q's dtype, or ``(out, lse)``.

    Raises ``ValueError`` when a counted entry is ``-1``, negative, at or past
    the tokens the sequence holds (``cache_lengths[b] + its rows in this
    call``), or on a missing page, naming row and entry.

    Example: cache lengths ``[5]``, offsets ``[0, 1]`` (one new token at
    position 5, already stored), ``indices = [[0, 1, 5, -1]]``, ``counts = [3]``:
    the row attends over tokens 0, 1 and 5.
    """
    c = check_instance("kv_collection", kv_collection, PagedKVCacheCollection)
    c._check_layer(layer_idx)
    if c.kv_planes != 2:
        raise ValueError(f"kv_collection: expected a K/V cache (KV == 2), got KV == {c.kv_planes}")
    scale = check_float("scale", scale)
    check_bool("return_lse", return_lse)
    check_tensor("q", q, ndim=3, dtypes=(c.dtype,), device=c.device)
    total_q, q_heads, head_dim = q.shape
    if head_dim != c.head_size:
        raise ValueError(f"q: head dim {head_dim} differs from the cache's head_size {c.head_size}")
    if q_heads % c.num_heads:
        raise ValueError(f"q: {q_heads} heads is not a multiple of the cache's {c.num_heads} KV heads")
    if gate is not None:
        check_tensor("gate", gate, shape=tuple(q.shape), dtypes=(q.dtype,), device=c.device)
    indices = as_index_tensor("indices", indices, ndim=2, device=c.device)
    counts = as_index_tensor("counts", counts, ndim=1, device=c.device)
    if indices.shape[0] != total_q:
        raise ValueError(f"indices: expected {total_q} rows (q rows), got {indices.shape[0]}")
    if counts.shape[0] != total_q:
        raise ValueError(f"counts: expected shape ({total_q},) = q rows, got {tuple(counts.shape)}")
    offsets = check_row_offsets(input_row_offsets, c.batch_size, total_q, c.device)
    if host_checks(c.device) and total_q:
        check_counted_positions(indices, counts, offsets, c.cache_lengths)
    out = torch.empty_like(q)
    lse = torch.empty(total_q, q_heads, dtype=torch.float32, device=c.device)
    _sparse_attention_op(out, lse, q, c.blocks, c.lookup_table, indices, counts, offsets, layer_idx, scale, gate)
    return (out, lse) if return_lse else out
