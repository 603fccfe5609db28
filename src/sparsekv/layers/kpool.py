"""The DSA indexer of the MLA families on a paged pooled-key cache (SPEC 3): GLM-5-Next's k-pool, and ``kpool = 1``.

Weight names are Hugging Face's (checkpoint prefix ``model.layers.N.self_attn.``)::

    q_a_proj.weight              [q_lora_rank, hidden]     MLA query down-projection (shared with
    q_a_layernorm.weight         [q_lora_rank]             the main attention in the full model)
    indexer.wq_b.weight          [index_n_heads * index_head_dim, q_lora_rank]
    indexer.wk.weight            [index_head_dim, hidden]
    indexer.k_norm.weight        [index_head_dim]          LayerNorm (eps 1e-6, as HF)
    indexer.k_norm.bias          [index_head_dim]
    indexer.weights_proj.weight  [index_n_heads, hidden]   per-head query weights
    indexer.index_kpool_compress_gate  [index_head_dim, hidden]  per-channel pooling gate logits  (glm5_next)
    indexer.index_kpool_compress_ape   [index_kpool, index_head_dim] within-pool position embedding (glm5_next)

The three families, each as HF's modeling code orders its operations:

* ``glm5_next``: NoPE; ``index_kpool`` tokens pooled per key (softmax over
  ``gate + ape`` per channel, SPEC 3.1); the open tail is appended to each
  selection only when ``index_kpool_always_select_tail`` is set.
* ``glm_moe_dsa`` / ``deepseek_v32``: ``kpool = 1`` (every token is a pool;
  no gate or ape weights, the pooled key is the key itself), RoPE on the
  first ``qk_rope_head_dim`` channels of queries and keys after ``wq_b`` and
  ``k_norm``: interleaved for GLM-5, half-split for DeepSeek-V3.2
  (``sparsekv.layers.dsa``). ``weights_proj`` stays float32 in a float16
  model, as HF keeps it (``_keep_in_fp32_modules``, which HF applies to
  float16 only).

Score of pool ``p`` for query ``t``: HF computes ``sum_h w[t,h] * H**-0.5 *
relu(D**-0.5 * q[t,h] . K_p)``; sparsekv folds both constants into the head
weights (``relu`` commutes with a positive scale), ``weights_proj(x) *
(H**-0.5 * D**-0.5)`` in float32, and the score op sums ``w * relu(q . K)``:
equal up to float32 rounding of the products (docs/spec-notes.md).
``index_kpool_compress_ape`` is kept in float32 whatever the model dtype (the
compress op requires it; a 16-bit checkpoint value converts exactly).

One call: project -> ring close / compress / seed tail -> store the finished
pools in the pooled cache -> score the visible pools -> top-k pools expanded
to token positions (then the open tail when asked).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..cache.layout import PagedKVCacheCollection
from ..ops.kpool import KPoolScorePlan, mla_kpool_expand_topk, mla_kpool_score, plan_kpool_score
from ..ops.kpool_step import kpool_indexer_step
from ._common import StageTimerLike, batch_positions, frozen_linear, no_timer
from .config import Glm5NextConfig, MlaConfig
from .dsa import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """``y = weight * cast(x * rsqrt(mean(x^2) + eps))`` over the last dim; weight starts at 1.

    The normalisation runs in float32 and is cast to ``x``'s dtype before the
    weight multiplies it (in that dtype), as HF's MLA families do.
    """

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)


class KPoolResult(NamedTuple):
    """One indexer call."""

    indices: torch.Tensor  # [T, index_topk (+ kpool - 1 with the tail)] int32 token positions, -1 padded
    counts: torch.Tensor  # [T] int32
    keys: torch.Tensor  # [T, D] normed (and rotated) keys of this call, before pooling
    gates: torch.Tensor  # [T, D] gate logits of this call (zeros for kpool = 1)
    q: torch.Tensor  # [T, H, D]
    head_weights: torch.Tensor  # [T, H] float32, scaled
    scores: torch.Tensor  # [T, visible pools] float32
    positions: torch.Tensor  # [T] int32


class KPoolIndexer(nn.Module):
    """The DSA indexer of an MLA layer: one pooled key per ``index_kpool`` tokens (1 for GLM-5 / DeepSeek-V3.2).

    Args:
        config: a ``glm5_next``, ``glm_moe_dsa`` or ``deepseek_v32`` config.
        dtype, device: of the weights and of the pooled cache it writes
            (``index_kpool_compress_ape`` is float32, and so is ``weights_proj``
            of the two ``kpool = 1`` families in a float16 model).

    Call with the layer input ``hidden_states [T, hidden]``, the MLA query
    latent ``q_latent [T, q_lora_rank]``, a ragged batch (``input_row_offsets``,
    token ``cache_lengths``), the request ring ``ring [max_slots, 2, kpool, D]``
    with each sequence's ``slot_ids`` (both may be ``None`` when ``kpool == 1``),
    and the pooled cache (see ``sparsekv.cache.pooled``; ``pooled_cache.cache_lengths``
    count pools).
    """

    def __init__(self, config: MlaConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.kpool = config.index_kpool
        self.topk = config.index_topk
        self.mode = config.index_kpool_mode
        self.always_select_tail = bool(config.index_kpool_always_select_tail)
        self.rope_layout = config.indexer_rope
        self.rope_dim = config.qk_rope_head_dim if self.rope_layout != "none" else 0
        inv_freq, self.rope_attention_factor = rope_inv_freq(max(self.rope_dim, 2), config.rope_theta,
                                                             dict(config.rope_yarn or ()), device)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        hidden = config.hidden_size
        self.wq_b = frozen_linear(config.q_lora_rank, self.n_heads * self.head_dim, False, dtype, device)
        self.wk = frozen_linear(hidden, self.head_dim, False, dtype, device)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=config.index_norm_eps, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        # HF keeps weights_proj float32 in a float16 model of the kpool = 1 families (not in bf16, not GLM-5-Next)
        fp16 = dtype == torch.float16 and not isinstance(config, Glm5NextConfig)
        weights_dtype = torch.float32 if fp16 else dtype
        self.weights_proj = frozen_linear(hidden, self.n_heads, False, weights_dtype, device)
        if config.has_kpool_weights:
            self.index_kpool_compress_gate = nn.Parameter(
                torch.zeros(self.head_dim, hidden, dtype=dtype, device=device), requires_grad=False)
            self.index_kpool_compress_ape = nn.Parameter(
                torch.zeros(self.kpool, self.head_dim, dtype=torch.float32, device=device), requires_grad=False)
        else:  # kpool = 1: a softmax over one member returns the key whatever gate and ape hold
            self.index_kpool_compress_gate = None
            self.register_buffer("index_kpool_compress_ape",
                                 torch.zeros(self.kpool, self.head_dim, dtype=torch.float32, device=device),
                                 persistent=False)
        self.head_weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    @property
    def ape(self) -> torch.Tensor:
        """``index_kpool_compress_ape`` (``[kpool, D]`` float32), the ``ape`` argument of the k-pool ops."""
        return self.index_kpool_compress_ape

    def new_ring(self, max_slots: int) -> torch.Tensor:
        """A zeroed ring ``[max_slots, 2, kpool, D]`` for requests' open pools."""
        return torch.zeros(max_slots, 2, self.kpool, self.head_dim, dtype=self.wk.weight.dtype,
                           device=self.wk.weight.device)

    def project(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H, D], keys [T, D], gates [T, D], head_weights [T, H] float32)``.

        ``positions [T]`` (each row's position) is needed when the family rotates.
        """
        q = self.wq_b(q_latent).reshape(-1, self.n_heads, self.head_dim)
        keys = self.k_norm(self.wk(hidden_states))
        if self.rope_dim:
            if positions is None:
                raise ValueError("positions: required by an indexer with RoPE")
            cos, sin = rope_cos_sin(positions, self.rope_inv_freq, self.rope_attention_factor, q.dtype)
            r = self.rope_dim
            q = torch.cat([apply_rope(q[..., :r], cos, sin, self.rope_layout), q[..., r:]], dim=-1)
            keys = torch.cat([apply_rope(keys[:, :r], cos, sin, self.rope_layout), keys[:, r:]], dim=-1)
        if self.index_kpool_compress_gate is not None:
            gates = nn.functional.linear(hidden_states, self.index_kpool_compress_gate)
        else:
            gates = torch.zeros_like(keys)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
        return q, keys, gates, weights * self.head_weight_scale

    def forward(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, *, input_row_offsets: torch.Tensor,
                cache_lengths: torch.Tensor, ring: torch.Tensor | None, slot_ids: torch.Tensor | None,
                pooled_cache: PagedKVCacheCollection, cache_layer: int,
                score_plan: KPoolScorePlan | None = None, timer: StageTimerLike = no_timer) -> KPoolResult:
        """One layer's indexer step; ``score_plan``: the step's pool-score plan over ``pooled_cache`` for
        these rows (:func:`step_score_plan`), shared by every indexer layer of the step, else the score
        plans for this layer alone."""
        offsets = input_row_offsets.to(hidden_states.device)
        positions = batch_positions(offsets, cache_lengths.to(hidden_states.device))
        if score_plan is not None:
            score_plan.check_for(pooled_cache, "pooled_cache", positions, offsets)
            if score_plan.kpool != self.kpool:
                raise ValueError(f"score_plan: expected kpool {self.kpool} (the indexer's), got {score_plan.kpool}")
        with timer("kpool.project"):
            q, keys, gates, head_weights = self.project(hidden_states, q_latent, positions)
        if ring is None or slot_ids is None:
            if self.kpool != 1:
                raise ValueError(f"ring, slot_ids: required for index_kpool {self.kpool} (open pools span calls)")
            ring = self.new_ring(cache_lengths.shape[0])
            slot_ids = torch.arange(cache_lengths.shape[0], device=ring.device)
        with timer("kpool.pool_store"):
            kpool_indexer_step(ring, slot_ids, keys, gates, self.index_kpool_compress_ape, offsets, cache_lengths,
                               pooled_cache, cache_layer, kpool=self.kpool, mode=self.mode)
        with timer("kpool.score"):
            if score_plan is None:
                scores = mla_kpool_score(q, head_weights, pooled_cache, cache_layer, positions, offsets,
                                         kpool=self.kpool)
            else:
                scores = score_plan.run(q, head_weights, cache_layer)
        with timer("kpool.select"):
            indices, counts = mla_kpool_expand_topk(scores, positions, kpool=self.kpool, topk=self.topk,
                                                    always_select_tail=self.always_select_tail)
        return KPoolResult(indices, counts, keys, gates, q, head_weights, scores, positions)


def step_score_plan(pooled_cache: PagedKVCacheCollection, input_row_offsets: torch.Tensor,
                    cache_lengths: torch.Tensor, kpool: int) -> KPoolScorePlan:
    """The pool-score plan of one step's rows (``input_row_offsets``, ``cache_lengths`` before the step)
    over ``pooled_cache``: made once, run by every indexer layer of the step (``score_plan``)."""
    offsets = input_row_offsets.to(pooled_cache.device)
    positions = batch_positions(offsets, cache_lengths.to(pooled_cache.device))
    return plan_kpool_score(pooled_cache, positions, offsets, kpool=kpool)


class KPoolIndexerLayer(nn.Module):
    """What a GLM-5-Next attention layer's indexer needs: the query latent and the indexer.

    ``q_latent = q_a_layernorm(q_a_proj(x))`` (the MLA query latent, shared with
    the main attention in the full model), then :class:`KPoolIndexer`.
    Checkpoint prefix ``model.layers.N.self_attn.``.
    """

    def __init__(self, config: MlaConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.q_a_proj = frozen_linear(config.hidden_size, config.q_lora_rank, config.attention_bias, dtype, device)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.latent_eps, dtype=dtype, device=device)
        self.indexer = KPoolIndexer(config, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> KPoolResult:
        timer = kwargs.get("timer", no_timer)
        with timer("kpool.project"):
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))
        return self.indexer(hidden_states, q_latent, **kwargs)


class Glm5NextIndexerSlice(nn.Module):
    """The k-pool indexers of a GLM-5-Next model over a token embedding.

    ``model.embed_tokens.weight`` then, for each layer ``N`` of
    ``config.full_index_layers`` (the layers that run their own indexer),
    ``model.layers.N.input_layernorm.weight`` (RMSNorm)
    and :class:`KPoolIndexerLayer`. The slice has no main attention, so every
    indexer reads the normed embedding. Cache layer ``i`` and ring ``i`` belong
    to the slice's ``i``-th indexer.
    """

    def __init__(self, config: MlaConfig, vocab_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.input_layernorms = nn.ModuleList(
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
            for _ in config.full_index_layers)
        self.layers = nn.ModuleList(KPoolIndexerLayer(config, dtype=dtype, device=device)
                                    for _ in config.full_index_layers)

    def checkpoint_modules(self) -> list[tuple[nn.Module, str]]:
        pairs: list[tuple[nn.Module, str]] = [(self.embed_tokens, "model.embed_tokens.")]
        for layer_id, norm, layer in zip(self.config.full_index_layers, self.input_layernorms, self.layers):
            pairs.append((norm, f"model.layers.{layer_id}.input_layernorm."))
            pairs.append((layer, f"model.layers.{layer_id}.self_attn."))
        return pairs

    def new_rings(self, max_slots: int) -> list[torch.Tensor]:
        """One zeroed ring per indexer layer."""
        return [layer.indexer.new_ring(max_slots) for layer in self.layers]

    def forward(self, token_ids: torch.Tensor, *, input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor,
                rings: list[torch.Tensor], slot_ids: torch.Tensor, pooled_cache: PagedKVCacheCollection,
                timer: StageTimerLike = no_timer) -> list[KPoolResult]:
        with timer("embed"):
            hidden = self.embed_tokens(token_ids)
        with timer("kpool.score"):
            plan = step_score_plan(pooled_cache, input_row_offsets, cache_lengths, self.config.index_kpool)
        return [layer(norm(hidden), input_row_offsets=input_row_offsets, cache_lengths=cache_lengths, ring=ring,
                      slot_ids=slot_ids, pooled_cache=pooled_cache, cache_layer=i, score_plan=plan, timer=timer)
                for i, (norm, layer, ring) in enumerate(zip(self.input_layernorms, self.layers, rings))]


__all__ = ["Glm5NextIndexerSlice", "KPoolIndexer", "KPoolIndexerLayer", "KPoolResult", "RMSNorm", "step_score_plan"]
