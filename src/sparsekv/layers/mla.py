"""MLA sparse attention of GLM-5-Next, GLM-5 and DeepSeek-V3.2 on a paged latent cache (SPEC 3.4).

Weight names are Hugging Face's (checkpoint prefix ``model.layers.N.self_attn.``)::

    q_a_proj.weight            [q_lora_rank, hidden]          (+ .bias with attention_bias)
    q_a_layernorm.weight       [q_lora_rank]                  RMSNorm
    q_b_proj.weight            [heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank]
    kv_a_proj_with_mqa.weight  [kv_lora_rank + qk_rope_head_dim, hidden]   (+ .bias)
    kv_a_layernorm.weight      [kv_lora_rank]                 RMSNorm
    kv_b_proj.weight           [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    o_proj.weight              [hidden, heads * v_head_dim]   (+ .bias)
    indexer.*                  (layers whose indexer_types entry is "full"; see ``layers/kpool.py``)

One call, for a ragged batch (the order of HF's modeling code):

1. ``q_latent = q_a_layernorm(q_a_proj(x))``; ``q = q_b_proj(q_latent)`` split per
   head into ``q_nope`` (first ``qk_nope_head_dim``) and ``q_rope``;
2. ``kv_a_proj_with_mqa(x)`` split into ``kv_pass`` (``kv_lora_rank``) and the
   rope key; ``c = kv_a_layernorm(kv_pass)``;
3. interleaved RoPE on ``q_rope`` and the rope key at each row's position
   (``sparsekv.layers.dsa``; GLM-5-Next is NoPE);
4. the latent row ``[c, rope key]`` of every new token goes into the latent
   cache (one head of ``kv_lora_rank + qk_rope_head_dim`` channels, ``KV = 1``);
5. the selection: this layer's indexer, or (a ``"shared"`` layer) the
   selection of the previous full layer, passed in;
6. attention over the selected latent rows, softmax scale ``qk_head_dim**-0.5``
   (times YaRN's ``mscale_all_dim`` correction squared, as HF), in one of two
   forms of the same math:

   * ``"absorbed"``: ``q_lat = [q_nope @ W_uk, q_rope]`` per head (W_uk = the
     key half of ``kv_b_proj``, float32 math, cast), then
     ``sparsekv.mla_sparse_attention_paged`` gives ``o_lat`` (``kv_lora_rank``
     channels per head), then ``o = o_lat @ W_uv^T`` (float32 math, cast):
     ``kv_lora_rank * 2 + qk_rope_head_dim`` multiply-adds per selected key
     and head, and nothing per cached row;
   * ``"expanded"`` (HF's form): ``kv_b_proj`` applied to every cached latent
     row of the sequence (float32 math, cast) gives per-head keys ``[k_nope,
     rope key]`` and values in a temporary paged cache, then
     ``sparsekv.qsa_sparse_attention_paged`` with one query head per KV head
     over the selection: ``qk_head_dim + v_head_dim`` multiply-adds per
     selected key and head, plus ``kv_b_proj`` over the history;
   * ``"auto"`` (the default) takes the form with fewer multiply-adds for the
     call (:meth:`MlaSparseAttention.attention_form`): expanded for a prefill
     whose rows select much of a short history, absorbed for decode steps and
     long histories, and absorbed whenever the expanded keys and values would
     pass ``EXPANDED_MAX_BYTES``;

7. ``o_proj``.

Tensor parallel (``process_group``, ``layers/tensor_parallel.py``): a rank
holds its heads' rows of ``q_b_proj`` and ``kv_b_proj`` (column-parallel) and
columns of ``o_proj`` (row-parallel, one all-reduce). ``q_a_proj``,
``kv_a_proj_with_mqa``, their norms and the indexer are replicated, and so is
the latent cache: a latent row belongs to a token, not to a head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..cache.layout import PagedKVCacheCollection
from ..ops.cache import paged_store
from ..ops.kpool import KPoolScorePlan
from ..ops.mla import mla_sparse_attention_paged
from ..ops.qsa import qsa_sparse_attention_paged
from .config import MlaConfig
from .dsa import apply_rope, rope_cos_sin, rope_inv_freq
from .kpool import KPoolIndexer, KPoolResult, RMSNorm, step_score_plan
from ._common import StageTimerLike, batch_positions, frozen_linear, no_timer
from .tensor_parallel import TensorParallelGroup, WeightSlice, head_slice

MODES = ("auto", "absorbed", "expanded")
EXPANDED_MAX_BYTES = 1 << 30  # the expanded form's temporary keys and values of one call, at most
EXPANDED_PAGE_SIZE = 64  # tokens per page of that temporary cache
EXPANDED_ROWS_PER_TILE = 32  # rows of one head the CPU sparse attention kernel packs into one query tile
SPREAD_SAMPLES = 8  # row groups whose union selection_spread measures


def selection_spread(indices: torch.Tensor, counts: torch.Tensor, input_row_offsets: torch.Tensor,
                     rows_per_group: int, samples: int = SPREAD_SAMPLES) -> float:
    """How many distinct keys ``rows_per_group`` consecutive rows of one sequence select together, over the
    keys one of them selects (mean over up to ``samples`` groups spread over the call; 1.0 when no sequence
    has that many rows). ``indices [T, W]``, ``counts [T]``, ``input_row_offsets [B+1]`` (host)."""
    starts = [first for b in range(input_row_offsets.shape[0] - 1)
              for first in range(int(input_row_offsets[b]), int(input_row_offsets[b + 1]) - rows_per_group + 1,
                                 rows_per_group)]
    if not starts:
        return 1.0
    chosen = [starts[i * len(starts) // samples] for i in range(min(samples, len(starts)))]
    union = selected = 0
    width = torch.arange(indices.shape[1], device=indices.device)
    for first in chosen:
        group_counts = counts[first:first + rows_per_group].clamp(min=0)
        counted = width[None, :] < group_counts[:, None]
        union += int(torch.unique(indices[first:first + rows_per_group][counted]).numel())
        selected += int(group_counts.sum())
    return union * rows_per_group / selected if selected else 1.0


def _expanded_pages(input_row_offsets: torch.Tensor,
                    cache_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, held, pages)`` per sequence, host int64 ``[B]``: its rows in the call, the tokens it holds
    with them, and the ``EXPANDED_PAGE_SIZE``-token pages its expanded keys and values take (0 for a
    sequence without rows in the call)."""
    rows = input_row_offsets.to(torch.int64).cpu().diff()
    held = cache_lengths.to(torch.int64).cpu() + rows
    pages = (held + EXPANDED_PAGE_SIZE - 1).div(EXPANDED_PAGE_SIZE, rounding_mode="floor") * (rows > 0)
    return rows, held, pages


def _put_rows(pages: torch.Tensor, rows: torch.Tensor, channel0: int) -> None:
    """Write ``rows [n, heads, c]`` into the first ``n`` token rows of ``pages [count, page_size, heads,
    width]`` (a strided view of a paged cache), channels ``channel0 .. channel0 + c``: the whole pages in
    one copy, then the rows of the last one."""
    page_size, n, width = pages.shape[1], rows.shape[0], rows.shape[2]
    whole = n // page_size
    if whole:
        pages[:whole, ..., channel0:channel0 + width] = rows[:whole * page_size].unflatten(0, (whole, page_size))
    if n > whole * page_size:
        pages[whole, :n - whole * page_size, :, channel0:channel0 + width] = rows[whole * page_size:]


class MlaResult(NamedTuple):
    """One layer call."""

    output: torch.Tensor  # [T, hidden]
    attention: torch.Tensor  # [T, heads, v_head_dim]: per-head attention output, before o_proj
    indices: torch.Tensor  # [T, width] int32 selected positions, -1 padded
    counts: torch.Tensor  # [T] int32
    latent: torch.Tensor  # [T, kv_lora_rank + qk_rope_head_dim]: the rows this call stored
    positions: torch.Tensor  # [T] int32
    indexer: KPoolResult | None  # the layer's own indexer call (None on a shared layer)


class MlaSparseAttention(nn.Module):
    """One MLA attention layer of an MLA + DSA model, reading only the tokens its selection names.

    Args:
        config: a ``glm5_next``, ``glm_moe_dsa`` or ``deepseek_v32`` config.
        layer_id: the model layer (one of ``config.index_layers``): it has an
            indexer unless ``config.indexer_types[layer_id] == "shared"``.
        dtype, device: of the weights; the caches must share the dtype.
        process_group: shard the heads over this ``torch.distributed`` group
            (``None``: one process); ``num_heads`` is then this rank's.

    Call with a ragged batch ``hidden_states [T, hidden]``, ``input_row_offsets
    [B+1]``, the latent cache (``latent_cache``, layer ``cache_layer``) holding
    each sequence's ``cache_lengths`` tokens, and either the indexer's caches
    (``index_cache`` / ``index_layer``, ``ring`` / ``slot_ids`` as for
    :class:`KPoolIndexer`) or, on a shared layer, ``selection = (indices,
    counts)`` of the previous full layer.

    Example (GLM-5 shapes, one sequence with 5 cached tokens decoding one)::

        result = layer(hidden[None, 0], input_row_offsets=torch.tensor([0, 1]), latent_cache=latent,
                       cache_layer=0, index_cache=pooled, index_layer=0)
        result.output.shape  # (1, hidden); result.counts == [6]: every causal token (6 <= index_topk)
    """

    def __init__(self, config: MlaConfig, layer_id: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if layer_id not in config.index_layers:
            raise ValueError(f"layer_id: {layer_id} is not an indexed attention layer ({config.index_layers})")
        self.config = config
        self.layer_id = layer_id
        self.tensor_parallel = TensorParallelGroup(process_group)
        self.heads = self.tensor_parallel.heads(config.num_attention_heads)
        self.num_heads = len(self.heads)
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.scale = config.softmax_scale
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_a_proj = frozen_linear(hidden, config.q_lora_rank, bias, dtype, device)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.latent_eps, dtype=dtype, device=device)
        self.q_b_proj = frozen_linear(config.q_lora_rank, self.num_heads * config.qk_head_dim, False, dtype, device)
        self.kv_a_proj_with_mqa = frozen_linear(hidden, config.latent_dim, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.latent_eps, dtype=dtype, device=device)
        self.kv_b_proj = frozen_linear(config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), False,
                                 dtype, device)
        self.o_proj = frozen_linear(self.num_heads * self.v_head_dim, hidden, bias, dtype, device)
        inv_freq, self.rope_attention_factor = rope_inv_freq(max(self.rope_dim, 2), config.rope_theta,
                                                             dict(config.rope_yarn or ()), device)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        shared = config.indexer_types[layer_id] == "shared"
        self.indexer = None if shared else KPoolIndexer(config, dtype=dtype, device=device)

    def _kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_uk [H, nope, r], W_uv [H, v, r])`` float32 views of ``kv_b_proj``."""
        weight = self.kv_b_proj.weight.float().reshape(self.num_heads, self.nope_dim + self.v_head_dim,
                                                       self.kv_lora_rank)
        return weight[:, :self.nope_dim], weight[:, self.nope_dim:]

    def forward(self, hidden_states: torch.Tensor, *, input_row_offsets: torch.Tensor,
                latent_cache: PagedKVCacheCollection, cache_layer: int,
                index_cache: PagedKVCacheCollection | None = None, index_layer: int | None = None,
                ring: torch.Tensor | None = None, slot_ids: torch.Tensor | None = None,
                selection: tuple[torch.Tensor, torch.Tensor] | None = None, mode: str = "auto",
                score_plan: KPoolScorePlan | None = None, timer: StageTimerLike = no_timer) -> MlaResult:
        """Run the layer (module docstring); ``mode`` is ``"auto"``, ``"absorbed"`` or ``"expanded"``;
        ``score_plan``: the step's pool-score plan over ``index_cache`` (:func:`.kpool.step_score_plan`)."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if self.indexer is None and selection is None:
            raise ValueError(f"selection: layer {self.layer_id} is a shared indexer layer; pass the (indices, counts) "
                             "of the previous full layer")
        if self.indexer is not None and (index_cache is None or index_layer is None):
            raise ValueError(f"index_cache, index_layer: layer {self.layer_id} runs its own indexer and needs them")
        tokens = hidden_states.shape[0]
        offsets = input_row_offsets.to(hidden_states.device)
        cache_lengths = latent_cache.cache_lengths
        positions = batch_positions(offsets, cache_lengths.to(hidden_states.device))
        with timer("mla.project"):
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_latent).reshape(tokens, self.num_heads, self.nope_dim + self.rope_dim)
            q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
            compressed = self.kv_a_proj_with_mqa(hidden_states)
            kv_pass, k_rope = compressed[:, :self.kv_lora_rank], compressed[:, self.kv_lora_rank:]
            latent_c = self.kv_a_layernorm(kv_pass)
            if self.rope_dim:
                cos, sin = rope_cos_sin(positions, self.rope_inv_freq, self.rope_attention_factor, q.dtype)
                q_rope = apply_rope(q_rope, cos, sin, "interleave")
                k_rope = apply_rope(k_rope, cos, sin, "interleave")
            latent = torch.cat([latent_c, k_rope], dim=-1)
        with timer("cache.store"):
            paged_store(latent_cache, latent[:, None, :], offsets, layer_idx=cache_layer, plane=0)
        indexed = None
        if self.indexer is not None:
            indexed = self.indexer(hidden_states, q_latent, input_row_offsets=offsets, cache_lengths=cache_lengths,
                                   ring=ring, slot_ids=slot_ids, pooled_cache=index_cache, cache_layer=index_layer,
                                   score_plan=score_plan, timer=timer)
            indices, counts = indexed.indices, indexed.counts
        else:
            indices, counts = selection
        with timer("mla.attention"):
            if mode == "auto":
                mode = self.attention_form(indices, counts, offsets, cache_lengths)
            if mode == "absorbed":
                w_uk, w_uv = self._kv_b_halves()
                q_absorbed = torch.einsum("thn,hnr->thr", q_nope.float(), w_uk).to(q.dtype)
                q_lat = torch.cat([q_absorbed, q_rope], dim=-1)
                o_lat = mla_sparse_attention_paged(q_lat, latent_cache, cache_layer, indices, counts, offsets,
                                                   scale=self.scale, v_head_dim=self.kv_lora_rank)
                attended = torch.einsum("thr,hvr->thv", o_lat.float(), w_uv).to(q.dtype)
            else:
                attended = self._expanded(q_nope, q_rope, latent_cache, cache_layer, indices, counts, offsets)
        with timer("mla.o_proj"):
            output = self.tensor_parallel.partial_linear(self.o_proj,
                                                         attended.reshape(tokens, self.num_heads * self.v_head_dim))
        output = self.tensor_parallel.all_reduce_sum(output, self.o_proj.bias, timer)
        return MlaResult(output, attended, indices, counts, latent, positions, indexed)

    def tensor_parallel_slices(self) -> dict[str, WeightSlice]:
        """The checkpoint slices this rank holds (names relative to the layer); the rest is replicated."""
        heads, total = self.heads, self.config.num_attention_heads
        return {"q_b_proj.weight": head_slice(heads, self.nope_dim + self.rope_dim, total),
                "kv_b_proj.weight": head_slice(heads, self.nope_dim + self.v_head_dim, total),
                "o_proj.weight": head_slice(heads, self.v_head_dim, total, dim=1)}

    def _expanded_width(self) -> int:
        """Channels of the expanded keys and values (the wider of ``qk_head_dim`` and ``v_head_dim``)."""
        return max(self.nope_dim + self.rope_dim, self.v_head_dim)

    def attention_form(self, indices: torch.Tensor, counts: torch.Tensor, input_row_offsets: torch.Tensor,
                       cache_lengths: torch.Tensor) -> str:
        """``"expanded"`` or ``"absorbed"``: the form with fewer multiply-adds for a call whose rows select
        ``indices[r, :counts[r]]``, absorbed when the expanded keys and values would pass
        ``EXPANDED_MAX_BYTES``.

        Per head, absorbed costs ``(2 * kv_lora_rank + rope) * selected + (nope + v) * kv_lora_rank * rows``
        (the kernel, then ``W_uk`` and ``W_uv`` per row); expanded ``(nope + v) * kv_lora_rank * held +
        2 * width * selected * spread`` (``kv_b_proj`` over the ``held`` cached rows of the sequences in the
        call, then the kernel on keys and values ``width = max(qk_head_dim, v_head_dim)`` wide). With one
        query head per KV head the CPU kernel runs ``EXPANDED_ROWS_PER_TILE`` consecutive rows of a sequence
        in one tile over the union of their selections: ``spread`` is that union over one row's selection,
        measured on a few such groups (:func:`selection_spread`); 1 for a causal prefill under the top-k,
        larger where neighbouring rows pick different keys.
        """
        offsets = input_row_offsets.to(torch.int64).cpu()
        rows, held, pages = _expanded_pages(offsets, cache_lengths)
        selected = int(counts.clamp(min=0).sum())
        rank, expanded_dim, width = self.kv_lora_rank, self.nope_dim + self.v_head_dim, self._expanded_width()
        element = torch.finfo(self.kv_b_proj.weight.dtype).bits // 8
        if int(pages.sum()) * EXPANDED_PAGE_SIZE * self.num_heads * 2 * width * element > EXPANDED_MAX_BYTES:
            return "absorbed"
        absorbed = (2 * rank + self.rope_dim) * selected + expanded_dim * rank * int(rows.sum())
        expanded = expanded_dim * rank * int(held[rows > 0].sum())
        if expanded >= absorbed:
            return "absorbed"
        spread = selection_spread(indices, counts, offsets, EXPANDED_ROWS_PER_TILE)
        return "expanded" if expanded + 2 * width * selected * spread < absorbed else "absorbed"

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: PagedKVCacheCollection,
                  cache_layer: int, indices: torch.Tensor, counts: torch.Tensor,
                  offsets: torch.Tensor) -> torch.Tensor:
        """HF's expanded form over the selection: ``kv_b_proj`` on every cached latent row of each sequence in
        the call gives per-head keys ``[k_nope, rope key]`` and values (zero-padded to one width), stored in
        a temporary paged cache of ``EXPANDED_PAGE_SIZE``-token pages; ``qsa_sparse_attention_paged`` with one
        query head per KV head attends over the selection. Returns ``[T, heads, v_head_dim]`` in q's dtype."""
        lengths, held, pages = _expanded_pages(offsets, latent_cache.cache_lengths)
        qk_dim = self.nope_dim + self.rope_dim
        width, page_size = self._expanded_width(), EXPANDED_PAGE_SIZE
        first_page = torch.cumsum(pages, 0) - pages
        blocks = q_nope.new_empty(int(pages.sum()), 2, 1, page_size, self.num_heads, width)
        table = torch.full((len(held), max(int(pages.max()), 1)), -1, dtype=torch.int32)
        rows = latent_cache.get_key_cache(cache_layer)
        kv_b = self.kv_b_proj.weight.float()
        for b in torch.nonzero(lengths > 0).flatten().tolist():
            n, first, count = int(held[b]), int(first_page[b]), int(pages[b])
            table[b, :count] = torch.arange(first, first + count, dtype=torch.int32)
            history = rows.load(b, torch.arange(n, device=q_nope.device))[:, 0].float()  # [n, rank + rope]
            kv = (history[:, :self.kv_lora_rank] @ kv_b.T).reshape(n, self.num_heads, -1)
            pages_of_b = blocks[first:first + count, :, 0]  # [count, 2, page_size, heads, width]
            keys, values = pages_of_b[:, 0], pages_of_b[:, 1]
            _put_rows(keys, kv[..., :self.nope_dim], 0)
            _put_rows(keys, history[:, None, self.kv_lora_rank:].expand(n, self.num_heads, self.rope_dim),
                      self.nope_dim)
            _put_rows(values, kv[..., self.nope_dim:], 0)
            keys[..., qk_dim:] = 0  # channels past a key's or value's width meet zero query channels or
            values[..., self.v_head_dim:] = 0  # are cut off the output: zeros keep them from being NaN
            tail = n - (count - 1) * page_size  # rows of the last page in use
            pages_of_b[-1, :, tail:] = 0
        expanded = PagedKVCacheCollection(blocks, latent_cache.cache_lengths, table.to(blocks.device),
                                          max_seq_length=int(lengths.max()),
                                          max_cache_length=latent_cache.max_cache_length)
        query = q_nope.new_zeros(q_nope.shape[0], self.num_heads, width)
        query[..., :self.nope_dim], query[..., self.nope_dim:qk_dim] = q_nope, q_rope
        out = qsa_sparse_attention_paged(query, expanded, 0, indices, counts, offsets, scale=self.scale)
        return out[..., :self.v_head_dim]


class MlaSlice(nn.Module):
    """The MLA attention layers of an MLA + DSA model over a token embedding, with input norms and residuals.

    ``model.embed_tokens.weight`` feeds a residual stream through each layer
    ``N`` of ``config.index_layers``: ``h = h + attn(input_layernorm(h))``
    (``model.layers.N.input_layernorm.weight``, RMSNorm with ``rms_norm_eps``).
    The other parts of the real model (MLPs, linear attention, hyper-connections)
    are not in the slice. Latent cache layer ``i`` belongs to the ``i``-th
    indexed layer, indexer cache layer and ring ``j`` to the ``j``-th layer that
    runs its own indexer (``sparsekv.layers.dsa.mla_cache_groups``); a shared
    layer reuses the selection of the last full layer before it.
    """

    def __init__(self, config: MlaConfig, vocab_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.input_layernorms = nn.ModuleList(
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device) for _ in config.index_layers)
        self.attentions = nn.ModuleList(MlaSparseAttention(config, n, dtype=dtype, device=device,
                                                           process_group=process_group)
                                        for n in config.index_layers)

    def checkpoint_modules(self) -> list[tuple[nn.Module, str]]:
        """``(module, checkpoint prefix)`` pairs covering every weight of the slice."""
        pairs: list[tuple[nn.Module, str]] = [(self.embed_tokens, "model.embed_tokens.")]
        for layer_id, norm, attention in zip(self.config.index_layers, self.input_layernorms, self.attentions):
            pairs.append((norm, f"model.layers.{layer_id}.input_layernorm."))
            pairs.append((attention, f"model.layers.{layer_id}.self_attn."))
        return pairs

    def new_rings(self, max_slots: int) -> list[torch.Tensor]:
        """One zeroed ring per layer that runs its own indexer."""
        return [a.indexer.new_ring(max_slots) for a in self.attentions if a.indexer is not None]

    def forward(self, token_ids: torch.Tensor, *, input_row_offsets: torch.Tensor,
                latent_cache: PagedKVCacheCollection, index_cache: PagedKVCacheCollection,
                rings: list[torch.Tensor] | None = None, slot_ids: torch.Tensor | None = None,
                mode: str = "absorbed", timer: StageTimerLike = no_timer) -> tuple[torch.Tensor, list[MlaResult]]:
        """``token_ids [T]`` of a ragged batch -> (final hidden ``[T, hidden]``, one result per layer)."""
        with timer("embed"):
            hidden = self.embed_tokens(token_ids)
        results: list[MlaResult] = []
        selection = None
        index_layer = 0
        with timer("kpool.score"):
            plan = step_score_plan(index_cache, input_row_offsets, latent_cache.cache_lengths, self.config.index_kpool)
        for cache_layer, (norm, attention) in enumerate(zip(self.input_layernorms, self.attentions)):
            own = attention.indexer is not None
            ring = rings[index_layer] if own and rings is not None else None
            result = attention(norm(hidden), input_row_offsets=input_row_offsets, latent_cache=latent_cache,
                               cache_layer=cache_layer, index_cache=index_cache if own else None,
                               index_layer=index_layer if own else None, ring=ring, slot_ids=slot_ids,
                               selection=None if own else selection, mode=mode,
                               score_plan=plan if own else None, timer=timer)
            if own:
                selection = (result.indices, result.counts)
                index_layer += 1
            hidden = hidden + result.output
            results.append(result)
        return hidden, results


__all__ = ["MODES", "MlaResult", "MlaSlice", "MlaSparseAttention", "selection_spread"]
