"""Qwen4Exp full-attention layer with its QSA indexer, on paged caches (SPEC 2).

Weight names (checkpoint prefix ``model.layers.N.self_attn.``)::

    q_proj.weight        [num_heads * 2 * head_dim, hidden]   query and output gate
    k_proj.weight        [kv_heads * head_dim, hidden]
    v_proj.weight        [kv_heads * head_dim, hidden]
    o_proj.weight        [hidden, num_heads * head_dim]
    q_norm.weight        [head_dim]     zero-centred RMSNorm, per head
    k_norm.weight        [head_dim]
    indexer.index_qk_proj.weight  [(indexer_n_heads + 1) * indexer_head_dim, hidden]
    indexer.q_layernorm.weight    [indexer_head_dim]
    indexer.k_layernorm.weight    [indexer_head_dim]   (the ``gamma`` of the compress op)

(``*_proj.bias`` too when ``attention_bias`` is true.)

Choices where the SPEC is silent:

* Gated attention as in Qwen3-Next: ``q_proj`` yields ``[T, heads, 2*head_dim]``
  per head, split into the query (first ``head_dim`` channels) and an
  element-wise output gate (last ``head_dim``); the attention output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``.
* Main-attention q/k norms are zero-centred RMSNorm (``x * rsqrt(mean x^2 + eps) * (1 + w)``)
  with ``rms_norm_eps``, applied per head before RoPE; RoPE is NeoX over the
  first ``rotary_dim = head_dim * partial_rotary_factor`` channels.
* The indexer uses the same RoPE table (``rotary_dim``, ``rope_theta``) for its
  queries (at position ``t``) and its block keys (at the block's first token).
* Softmax scale ``head_dim ** -0.5``; block-score divisor ``sqrt(indexer_head_dim)``.

One call (SPEC 2.6): project -> store raw indexer keys and main K/V ->
compress every complete block -> score -> select -> sparse attention -> o_proj.
With a block-key cache, the compress step pools only the blocks the call
completes into the cache, and the score reads the blocks where they lie there.

Tensor parallel (``process_group``, see ``layers/tensor_parallel.py``): a rank
holds its slice of the query/gate and KV heads (column-parallel ``q_proj``,
``k_proj``, ``v_proj``), stores and attends over those heads only, and sums
the row-parallel ``o_proj`` with one all-reduce; the indexer is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..cache.groups import CacheGroupSpec
from ..cache.layout import PagedKVCacheCollection
from ..numerics import apply_rope_neox, rms_norm_zero_centred, rope_freqs_cis
from ..ops.cache import paged_store
from ..ops.qsa import (QSABlockScorePlan, plan_qsa_block_score_paged, qsa_block_score, qsa_block_score_paged,
                       qsa_compress_keys_paged, qsa_select_tokens, qsa_sparse_attention_paged,
                       qsa_store_block_keys_paged)
from ._common import StageTimerLike, batch_positions, frozen_linear, no_timer
from .config import Qwen4ExpConfig
from .tensor_parallel import TensorParallelGroup, WeightSlice, head_slice


class RotaryTable:
    """A ``freqs_cis`` table (``sparsekv.rope_freqs_cis``) grown on demand by doubling.

    It grows to the first power of two (at least 1024) *above* the positions
    asked for, so the decode step after a prompt of exactly ``2**n`` tokens
    does not rebuild it. Its rows come from ``theta`` (``rope_freqs_cis``) or,
    given instead, from ``rows(num_positions)`` (e.g. a model's own rotary
    module: ``sparsekv.integrations.hf_adapters.HFRotaryTable``).
    """

    def __init__(self, rotary_dim: int, theta: float | None = None, device: torch.device | str | None = None, *,
                 rows: Callable[[int], torch.Tensor] | None = None) -> None:
        if (theta is None) == (rows is None):
            raise ValueError(f"RotaryTable: pass exactly one of theta and rows, got theta={theta!r}, rows={rows!r}")
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._rows = rows
        self._table = torch.empty(0, rotary_dim, dtype=torch.float32, device=self.device)

    def rows(self, num_positions: int) -> torch.Tensor:
        """``[num_positions, rotary_dim]`` float32: interleaved ``[cos_0, sin_0, cos_1, ...]`` per position."""
        if self._rows is not None:
            return self._rows(num_positions)
        return rope_freqs_cis(num_positions, self.rotary_dim, self.theta, device=self.device)

    def table(self, num_positions: int) -> torch.Tensor:
        """``[>= num_positions, rotary_dim]`` float32 rows."""
        if self._table.shape[0] < num_positions:
            size = max(1024, self._table.shape[0])
            while size <= num_positions:
                size *= 2
            self._table = self.rows(size)
        return self._table


def _rope_in_place(x: torch.Tensor, freqs: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``apply_rope_neox`` over ``x [T, heads, D]``, rotating only the first ``rotary_dim`` channels in place.

    The channels past ``rotary_dim`` pass through unchanged either way; touching
    only the rotated ones saves copying the whole head (256 channels, 64 rotated).
    """
    x[..., :rotary_dim] = apply_rope_neox(x[..., :rotary_dim], freqs[:, None, :], rotary_dim)
    return x


class ZeroCentredRMSNorm(nn.Module):
    """``y = x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim (fp32 math, cast); weight starts at 0."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_zero_centred(x, self.weight, self.eps)


class QSAIndexer(nn.Module):
    """The weight-light indexer of a QSA layer: picks, per query, the blocks the attention reads.

    Args:
        config: the model config (``indexer_*`` keys, ``rms_norm_eps``, RoPE).
        dtype, device: of the weights (and of the indexer cache it writes).
    """

    def __init__(self, config: Qwen4ExpConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads = config.indexer_n_heads
        self.head_dim = config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.budget = config.indexer_budget
        self.eps = config.rms_norm_eps
        self.rotary_dim = config.rotary_dim
        self.index_qk_proj = frozen_linear(config.hidden_size, (self.n_heads + 1) * self.head_dim, False, dtype,
                                           device)
        self.q_layernorm = ZeroCentredRMSNorm(self.head_dim, self.eps, dtype=dtype, device=device)
        self.k_layernorm = ZeroCentredRMSNorm(self.head_dim, self.eps, dtype=dtype, device=device)

    def project(self, hidden_states: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SPEC 2.1: ``(index_q [T, n_heads, D]`` normed and rotated, ``raw_keys [T, 1, D])``.

        ``freqs``: ``[T, rotary_dim]`` rows of the RoPE table at each row's position.
        """
        fused = self.index_qk_proj(hidden_states)
        split = self.n_heads * self.head_dim
        q = fused[:, :split].reshape(-1, self.n_heads, self.head_dim)
        raw_keys = fused[:, split:].reshape(-1, 1, self.head_dim).contiguous()
        q = apply_rope_neox(self.q_layernorm(q), freqs[:, None, :], self.rotary_dim)
        return q, raw_keys

    def scores_all_tokens(self, index_cache: PagedKVCacheCollection) -> bool:
        """Whether no row of this call can see more than ``budget + R - 1`` tokens (from the collection's
        ``max_cache_length + max_seq_length``, no device read): SPEC 2.4 then selects every causal token."""
        return index_cache.max_cache_length + index_cache.max_seq_length <= self.budget + self.ratio - 1

    def step_score_plan(self, index_cache: PagedKVCacheCollection, block_cache: PagedKVCacheCollection,
                        positions: torch.Tensor, input_row_offsets: torch.Tensor) -> QSABlockScorePlan | None:
        """The block-score plan of one step's rows over ``block_cache``, for every QSA layer of the step
        (:meth:`select`'s ``score_plan``); ``None`` when the step scores nothing (:meth:`scores_all_tokens`)."""
        if self.scores_all_tokens(index_cache):
            return None
        return plan_qsa_block_score_paged(block_cache, positions, input_row_offsets, ratio=self.ratio,
                                          score_scale=math.sqrt(self.head_dim), out_cols=self._max_blocks(index_cache))

    def _max_blocks(self, index_cache: PagedKVCacheCollection) -> int:
        return (index_cache.max_cache_length + index_cache.max_seq_length) // self.ratio

    def select(self, index_q: torch.Tensor, index_cache: PagedKVCacheCollection, cache_layer: int,
               positions: torch.Tensor, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor,
               timer: StageTimerLike = no_timer, block_cache: PagedKVCacheCollection | None = None,
               score_plan: QSABlockScorePlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compress -> score -> select (SPEC 2.2-2.4); this call's raw keys must be stored already.

        Returns ``(indices [T, budget + R - 1] int32, counts [T] int32)``.
        ``max_blocks`` is sized from the collection's ``max_cache_length +
        max_seq_length`` (no device read). While no row can see more than
        ``budget + R - 1`` tokens (known from those two, again without a device
        read), SPEC 2.4 selects every causal token: the selection is then
        written directly, the same indices in the same order, without
        compressing or scoring. With a ``block_cache`` that :meth:`store_blocks`
        has brought up to this call, the blocks are scored where they lie in it
        instead of pooled again (the same bits), through ``score_plan`` when given
        (:meth:`step_score_plan` of this step's rows over ``block_cache``; one of other rows, another cache,
        ratio or scale raises ``ValueError``).
        """
        if self.scores_all_tokens(index_cache):
            with timer("qsa.select"):
                return every_causal_token(positions, self.budget + self.ratio - 1)
        if score_plan is not None:
            score_plan.check_for(block_cache, "block_cache", positions, input_row_offsets)
            if (score_plan.ratio, score_plan.score_scale) != (self.ratio, math.sqrt(self.head_dim)):
                raise ValueError(f"score_plan: expected ratio {self.ratio} and score_scale {math.sqrt(self.head_dim)} "
                                 f"(the indexer's), got {score_plan.ratio} and {score_plan.score_scale}")
            with timer("qsa.score"):
                scores = score_plan.run(index_q, cache_layer)
        elif block_cache is None:
            max_blocks = self._max_blocks(index_cache)
            with timer("qsa.compress"):
                block_keys = qsa_compress_keys_paged(
                    self.k_layernorm.weight, freqs_cis, key_counts_after_call(index_cache, input_row_offsets),
                    index_cache, cache_layer, ratio=self.ratio, eps=self.eps, max_blocks=max_blocks)
            with timer("qsa.score"):
                scores = qsa_block_score(index_q, block_keys, positions, input_row_offsets, ratio=self.ratio,
                                         score_scale=math.sqrt(self.head_dim))
        else:
            with timer("qsa.score"):
                scores = qsa_block_score_paged(index_q, block_cache, cache_layer, positions, input_row_offsets,
                                               ratio=self.ratio, score_scale=math.sqrt(self.head_dim),
                                               out_cols=self._max_blocks(index_cache))
        with timer("qsa.select"):
            indices, counts = qsa_select_tokens(scores, positions, input_row_offsets, ratio=self.ratio,
                                                budget=self.budget)
        return indices, counts

    def store_blocks(self, index_cache: PagedKVCacheCollection, block_cache: PagedKVCacheCollection,
                     cache_layer: int, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor) -> None:
        """Pool the blocks this call completes into ``block_cache`` (:func:`qsa_store_block_keys_paged`);
        this call's raw keys must be stored already. Run on every call that stores raw keys."""
        qsa_store_block_keys_paged(self.k_layernorm.weight, freqs_cis,
                                   key_counts_after_call(index_cache, input_row_offsets), index_cache, block_cache,
                                   cache_layer, ratio=self.ratio, eps=self.eps)


def key_counts_after_call(index_cache: PagedKVCacheCollection, input_row_offsets: torch.Tensor) -> torch.Tensor:
    """``[B]`` int32: raw keys per sequence once this call's rows are stored (cached + new; a collection's
    lengths are int32, and int32 index tensors pass the ops' checks without a conversion)."""
    offsets = input_row_offsets.to(torch.int32)
    return index_cache.cache_lengths.to(torch.int32) + (offsets[1:] - offsets[:-1])


def qsa_cache_groups(config: Qwen4ExpConfig, dtype: torch.dtype, page_size: int, *, num_kv_heads: int | None = None,
                     main: str = "main", indexer: str = "indexer",
                     blocks: str = "index_blocks") -> list[CacheGroupSpec]:
    """The co-indexed cache groups of the QSA layers (``config.qsa_layers``, one cache layer each): ``main``
    (keys and values, ``num_kv_heads`` heads of ``head_dim``; default all of the config's KV heads, a
    tensor-parallel rank passes its own), ``indexer`` (raw indexer keys, one head of ``indexer_head_dim``),
    and, where ``indexer_compress_ratio`` divides ``page_size``, ``blocks``: the indexer's block-key cache
    (one entry per ``indexer_compress_ratio`` tokens; pass it to :class:`QSAAttention` as ``block_cache``).
    """
    layers = len(config.qsa_layers)
    kv_heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    groups = [CacheGroupSpec(main, 2, layers, kv_heads, config.head_dim, dtype),
              CacheGroupSpec(indexer, 1, layers, 1, config.indexer_head_dim, dtype)]
    if page_size % config.indexer_compress_ratio == 0:
        groups.append(CacheGroupSpec(blocks, 1, layers, 1, config.indexer_head_dim, dtype,
                                     tokens_per_entry=config.indexer_compress_ratio))
    return groups


def every_causal_token(positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of rows that see at most ``width`` tokens: ``indices [T, width]`` int32 holding
    ``0 .. t`` then ``-1``, and ``counts = t + 1`` (``positions [T]`` int32, every ``t < width``)."""
    columns = torch.arange(width, dtype=torch.int32, device=positions.device)
    indices = torch.where(columns[None, :] <= positions[:, None], columns[None, :], -1).to(torch.int32)
    return indices, (positions + 1).to(torch.int32)


class QSAResult(NamedTuple):
    """One layer call. ``indices``/``counts`` are the selection (``None``/all causal tokens in dense mode)."""

    output: torch.Tensor  # [T, hidden]
    attention: torch.Tensor  # [T, heads, head_dim]: gated attention output, before o_proj (this rank's heads)
    query: torch.Tensor  # [T, heads, head_dim]: normed, rotated queries (this rank's heads)
    gate: torch.Tensor  # [T, heads, head_dim]: output gate logits (this rank's heads)
    indices: torch.Tensor | None  # [T, budget + R - 1] int32
    counts: torch.Tensor  # [T] int32: tokens the attention read per row
    index_q: torch.Tensor  # [T, indexer_n_heads, indexer_head_dim]
    positions: torch.Tensor  # [T] int32


class QSAAttention(nn.Module):
    """Qwen4Exp gated full attention whose reads are chosen by a :class:`QSAIndexer`.

    Args:
        config: the model config.
        dtype, device: of the weights; the caches must share the dtype.
        process_group: shard the heads over this ``torch.distributed`` group
            (``None``: one process). ``num_heads`` / ``num_kv_heads`` are then
            this rank's heads.

    Call with a ragged batch: ``hidden_states [T, hidden]``, ``input_row_offsets
    [B+1]``, the main cache ``kv_cache`` (``KV == 2``, ``num_kv_heads``
    heads of ``head_dim``) and the indexer cache ``index_cache`` (one head of
    ``indexer_head_dim``), both already holding each sequence's
    ``cache_lengths`` tokens; ``cache_layer`` is this layer's index in both.

    Example (2 sequences: 5 cached + 2 new tokens, and a fresh 3-token prompt)::

        offsets = torch.tensor([0, 2, 5])     # rows 0-1 at positions 5, 6; rows 2-4 at 0, 1, 2
        result = layer(hidden[:5], input_row_offsets=offsets, kv_cache=main, index_cache=index,
                       cache_layer=0)
        result.output.shape  # (5, hidden)
    """

    def __init__(self, config: Qwen4ExpConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tensor_parallel = TensorParallelGroup(process_group)
        self.heads = self.tensor_parallel.heads(config.num_attention_heads)
        self.kv_heads = self.tensor_parallel.kv_heads(config.num_key_value_heads, config.num_attention_heads)
        self.num_heads, self.num_kv_heads = len(self.heads), len(self.kv_heads)
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.scale = config.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = frozen_linear(hidden, self.num_heads * 2 * self.head_dim, bias, dtype, device)
        self.k_proj = frozen_linear(hidden, self.num_kv_heads * self.head_dim, bias, dtype, device)
        self.v_proj = frozen_linear(hidden, self.num_kv_heads * self.head_dim, bias, dtype, device)
        self.o_proj = frozen_linear(self.num_heads * self.head_dim, hidden, bias, dtype, device)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.indexer = QSAIndexer(config, dtype=dtype, device=device)
        self.rotary = RotaryTable(self.rotary_dim, config.rope_theta, device=device)

    def forward(self, hidden_states: torch.Tensor, *, input_row_offsets: torch.Tensor,
                kv_cache: PagedKVCacheCollection, index_cache: PagedKVCacheCollection, cache_layer: int,
                mode: str = "sparse", timer: StageTimerLike = no_timer,
                block_cache: PagedKVCacheCollection | None = None,
                score_plan: QSABlockScorePlan | None = None) -> QSAResult:
        """Run the layer on a ragged batch; ``mode`` is ``"sparse"`` (QSA) or ``"dense"`` (all causal tokens).

        Both modes store this call's keys/values and raw indexer keys, so they
        can be mixed across calls. ``block_cache`` (optional): the indexer's
        block-key cache (``index_cache``'s pages, ``page_size // R`` rows each,
        ``cache_lengths // R`` blocks cached; a cache manager's group with
        ``tokens_per_entry = R``): each call pools only the blocks it completes
        and keeps them there, and the indexer scores the blocks there instead
        of pooling every block again (same bits). Pass it on every call of the
        sequences it serves, or on none. ``score_plan``: the step's block-score plan over ``block_cache``
        (:meth:`QSAIndexer.step_score_plan`), shared by every QSA layer of the step. Returns a
        :class:`QSAResult`.
        """
        if mode not in ("sparse", "dense"):
            raise ValueError(f"mode: expected 'sparse' or 'dense', got {mode!r}")
        tokens = hidden_states.shape[0]
        positions = batch_positions(input_row_offsets.to(kv_cache.device), kv_cache.cache_lengths)
        freqs_cis = self.rotary.table(kv_cache.max_cache_length + kv_cache.max_seq_length)
        freqs = freqs_cis[positions.long()]
        with timer("qsa.project"):
            q_and_gate = self.q_proj(hidden_states).reshape(tokens, self.num_heads, 2 * self.head_dim)
            query, gate = q_and_gate[..., :self.head_dim], q_and_gate[..., self.head_dim:].contiguous()
            key = self.k_proj(hidden_states).reshape(tokens, self.num_kv_heads, self.head_dim)
            value = self.v_proj(hidden_states).reshape(tokens, self.num_kv_heads, self.head_dim)
            index_q, raw_keys = self.indexer.project(hidden_states, freqs)
        with timer("qsa.norm_rope"):
            query = _rope_in_place(self.q_norm(query), freqs, self.rotary_dim)
            key = _rope_in_place(self.k_norm(key), freqs, self.rotary_dim)
        with timer("cache.store"):
            paged_store(index_cache, raw_keys, input_row_offsets, layer_idx=cache_layer, plane=0)
            paged_store(kv_cache, key, input_row_offsets, layer_idx=cache_layer, plane=0)
            paged_store(kv_cache, value.contiguous(), input_row_offsets, layer_idx=cache_layer, plane=1)
        if block_cache is not None:
            with timer("qsa.store_blocks"):
                self.indexer.store_blocks(index_cache, block_cache, cache_layer, input_row_offsets, freqs_cis)
        if mode == "sparse":
            indices, counts = self.indexer.select(index_q, index_cache, cache_layer, positions,
                                                  input_row_offsets, freqs_cis, timer, block_cache, score_plan)
            with timer("qsa.attention"):
                attended = qsa_sparse_attention_paged(query, kv_cache, cache_layer, indices, counts,
                                                      input_row_offsets, scale=self.scale, gate=gate)
        else:
            indices, counts = None, positions + 1
            with timer("dense.attention"):
                attended = dense_causal_attention(query, kv_cache, cache_layer, input_row_offsets,
                                                  scale=self.scale, gate=gate)
        with timer("qsa.o_proj"):
            output = self.tensor_parallel.partial_linear(self.o_proj,
                                                         attended.reshape(tokens, self.num_heads * self.head_dim))
        output = self.tensor_parallel.all_reduce_sum(output, self.o_proj.bias, timer)
        return QSAResult(output, attended, query, gate, indices, counts, index_q, positions)

    def tensor_parallel_slices(self) -> dict[str, WeightSlice]:
        """The checkpoint slices this rank holds (names relative to the layer); the rest is replicated."""
        total_heads, total_kv = self.config.num_attention_heads, self.config.num_key_value_heads
        slices = {"q_proj.weight": head_slice(self.heads, 2 * self.head_dim, total_heads),
                  "k_proj.weight": head_slice(self.kv_heads, self.head_dim, total_kv),
                  "v_proj.weight": head_slice(self.kv_heads, self.head_dim, total_kv),
                  "o_proj.weight": head_slice(self.heads, self.head_dim, total_heads, dim=1)}
        if self.config.attention_bias:
            slices.update({name.replace("weight", "bias"): slices[name]
                           for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight")})
        return slices


def dense_causal_attention(q: torch.Tensor, kv_cache: PagedKVCacheCollection, cache_layer: int,
                           input_row_offsets: torch.Tensor, *, scale: float, gate: torch.Tensor | None = None,
                           rows: torch.Tensor | None = None, row_chunk: int = 256) -> torch.Tensor:
    """Plain causal attention over every cached token, read back from the paged cache.

    Written independently of the sparse kernels (gather whole histories,
    masked softmax in fp32, ``* sigmoid(gate)``, one cast), it is the "dense"
    side of the sparse-versus-dense checks.

    Args:
        q: ``[T, q_heads, D]``; row ``i`` of sequence ``b`` sits at position
            ``cache_lengths[b] + i`` and attends to positions ``0..t``.
        kv_cache: main cache (``KV == 2``) already holding this call's K/V.
        gate: optional ``[T, q_heads, D]``.
        rows: optional int tensor of row ids to compute (others are zero).

    Returns ``[T, q_heads, D]`` in q's dtype.
    """
    offsets = input_row_offsets.to(torch.int64).cpu()
    lengths = kv_cache.cache_lengths.to(torch.int64).cpu()
    total, q_heads, head_dim = q.shape
    kv_heads = kv_cache.num_heads
    group = q_heads // kv_heads  # query head h reads KV head h // group
    out = torch.zeros_like(q)
    wanted = None if rows is None else torch.zeros(total, dtype=torch.bool).index_fill_(0, rows.cpu(), True)
    keys_view, values_view = kv_cache.get_key_cache(cache_layer), kv_cache.get_value_cache(cache_layer)
    for b in range(offsets.shape[0] - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        row_ids = torch.arange(start, end)
        if wanted is not None:
            row_ids = row_ids[wanted[start:end]]
        if row_ids.numel() == 0:
            continue
        held = int(lengths[b]) + end - start
        history = torch.arange(held, device=q.device)
        keys = keys_view.load(b, history).float()  # [n, kv_heads, D]
        values = values_view.load(b, history).float()
        for chunk in row_ids.split(row_chunk):
            chunk_dev = chunk.to(q.device)
            positions = (lengths[b] + chunk - start).to(q.device)
            grouped = q[chunk_dev].float().reshape(-1, kv_heads, group, head_dim)
            logits = torch.einsum("rkgd,nkd->rkgn", grouped, keys) * scale
            visible = history[None, :] <= positions[:, None]  # [rows, n]
            logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
            result = torch.einsum("rkgn,nkd->rkgd", torch.softmax(logits, dim=-1), values)
            result = result.reshape(-1, q_heads, head_dim)
            if gate is not None:
                result = result * torch.sigmoid(gate[chunk_dev].float())
            out[chunk_dev] = result.to(q.dtype)
    return out


class Qwen4ExpSlice(nn.Module):
    """The QSA layers of a Qwen4Exp model, stacked with their input norms and residuals.

    ``model.embed_tokens.weight [vocab, hidden]`` feeds a residual stream through
    each QSA layer ``N`` of ``config.qsa_layers``: ``h = h + attn(input_layernorm(h))``
    (``model.layers.N.input_layernorm.weight``, zero-centred RMSNorm). The other
    layers of the real model (linear attention, MLPs) are not part of the slice.
    Cache layer ``i`` belongs to the slice's ``i``-th QSA layer. With a
    ``process_group`` the attentions shard their heads (:class:`QSAAttention`);
    load them with ``layers.tensor_parallel.load_tensor_parallel_weights``.
    """

    def __init__(self, config: Qwen4ExpConfig, vocab_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.input_layernorms = nn.ModuleList(
            ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
            for _ in config.qsa_layers)
        self.attentions = nn.ModuleList(QSAAttention(config, dtype=dtype, device=device, process_group=process_group)
                                        for _ in config.qsa_layers)

    def checkpoint_modules(self) -> list[tuple[nn.Module, str]]:
        """``(module, checkpoint prefix)`` pairs covering every weight of the slice."""
        pairs: list[tuple[nn.Module, str]] = [(self.embed_tokens, "model.embed_tokens.")]
        for layer_id, norm, attention in zip(self.config.qsa_layers, self.input_layernorms, self.attentions):
            pairs.append((norm, f"model.layers.{layer_id}.input_layernorm."))
            pairs.append((attention, f"model.layers.{layer_id}.self_attn."))
        return pairs

    def forward(self, token_ids: torch.Tensor, *, input_row_offsets: torch.Tensor, kv_cache: PagedKVCacheCollection,
                index_cache: PagedKVCacheCollection, mode: str = "sparse", timer: StageTimerLike = no_timer,
                block_cache: PagedKVCacheCollection | None = None) -> tuple[torch.Tensor, list[QSAResult]]:
        """``token_ids [T]`` of a ragged batch -> (final hidden ``[T, hidden]``, one result per QSA layer).
        ``block_cache``: the indexers' block-key cache (see :meth:`QSAAttention.forward`), or ``None``."""
        with timer("embed"):
            hidden = self.embed_tokens(token_ids)
        plan = None
        if block_cache is not None and mode == "sparse" and self.attentions:
            with timer("qsa.score"):
                offsets = input_row_offsets.to(kv_cache.device)
                plan = self.attentions[0].indexer.step_score_plan(
                    index_cache, block_cache, batch_positions(offsets, kv_cache.cache_lengths), offsets)
        results = []
        for cache_layer, (norm, attention) in enumerate(zip(self.input_layernorms, self.attentions)):
            result = attention(norm(hidden), input_row_offsets=input_row_offsets, kv_cache=kv_cache,
                               index_cache=index_cache, cache_layer=cache_layer, mode=mode, timer=timer,
                               block_cache=block_cache, score_plan=plan)
            hidden = hidden + result.output
            results.append(result)
        return hidden, results


__all__ = ["QSAAttention", "QSAIndexer", "QSAResult", "Qwen4ExpSlice", "RotaryTable", "ZeroCentredRMSNorm",
           "dense_causal_attention", "every_causal_token", "key_counts_after_call", "qsa_cache_groups"]
