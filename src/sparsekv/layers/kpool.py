"""GLM-5-Next k-pool indexer on a paged pooled-key cache (SPEC 3).

Weight names (checkpoint prefix ``model.layers.N.self_attn.``), modelled on
the DeepSeek-V3.2 indexer that GLM's follows, plus the k-pool parts::

    q_a_proj.weight              [q_lora_rank, hidden]     MLA query down-projection (shared with
    q_a_layernorm.weight         [q_lora_rank]             the main attention in the full model)
    indexer.wq_b.weight          [index_n_heads * index_head_dim, q_lora_rank]
    indexer.wk.weight            [index_head_dim, hidden]
    indexer.k_norm.weight        [index_head_dim]          LayerNorm (eps ``index_norm_eps`` = 1e-6)
    indexer.k_norm.bias          [index_head_dim]
    indexer.weights_proj.weight  [index_n_heads, hidden]   per-head query weights
    indexer.gate_proj.weight     [index_head_dim, hidden]  per-channel pooling gate logits
    indexer.ape                  [index_kpool, index_head_dim] float32, within-pool position embedding

Choices where the SPEC is silent:

* Head weights are ``weights_proj(x)`` computed in fp32 and scaled by
  ``index_n_heads ** -0.5 * index_head_dim ** -0.5`` (the DeepSeek-V3.2
  indexer's ``n_heads**-0.5`` times its softmax scale); the score op takes
  them "already scaled".
* NoPE: neither queries nor keys are rotated; no Hadamard rotation or fp8
  quantisation of the keys (those are storage optimisations of other engines).
* ``q_a_layernorm`` is a plain RMSNorm (``x * rsqrt(mean x^2 + eps) * w``,
  fp32 math, ``rms_norm_eps``) as in DeepSeek/GLM MLA.
* ``ape`` stays float32 whatever the model dtype (the compress op requires it).

One call: project -> ring close / compress / seed tail -> store the finished
pools in the pooled cache -> score the visible pools -> top-k pools expanded
to token positions (with the open tail).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..cache.layout import PagedKVCacheCollection
from ..ops.kpool import mla_kpool_expand_topk, mla_kpool_score
from ..ops.kpool_step import kpool_indexer_step
from ._common import StageTimerLike, batch_positions, frozen_linear, no_timer
from .config import Glm5NextConfig


class RMSNorm(nn.Module):
    """``y = x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (fp32 math, cast); weight starts at 1."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class KPoolResult(NamedTuple):
    """One indexer call."""

    indices: torch.Tensor  # [T, index_topk + kpool - 1] int32 token positions, -1 padded
    counts: torch.Tensor  # [T] int32
    keys: torch.Tensor  # [T, D] layer-normed keys of this call (pooled)
    gates: torch.Tensor  # [T, D] gate logits of this call
    q: torch.Tensor  # [T, H, D]
    head_weights: torch.Tensor  # [T, H] float32, scaled
    scores: torch.Tensor  # [T, visible pools] float32
    positions: torch.Tensor  # [T] int32


class KPoolIndexer(nn.Module):
    """The GLM-5-Next sparse-attention indexer: one pooled key per ``index_kpool`` tokens.

    Args:
        config: the GLM-5-Next config.
        dtype, device: of the weights and of the pooled cache it writes (``ape`` is float32).

    Call with the layer input ``hidden_states [T, hidden]``, the MLA query
    latent ``q_latent [T, q_lora_rank]``, a ragged batch (``input_row_offsets``,
    token ``cache_lengths``), the request ring ``ring [max_slots, 2, kpool, D]``
    with each sequence's ``slot_ids``, and the pooled cache (see
    ``sparsekv.cache.pooled``; ``pooled_cache.cache_lengths`` count pools).
    """

    def __init__(self, config: Glm5NextConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.kpool = config.index_kpool
        self.topk = config.index_topk
        self.mode = config.index_kpool_mode
        hidden = config.hidden_size
        self.wq_b = frozen_linear(config.q_lora_rank, self.n_heads * self.head_dim, False, dtype, device)
        self.wk = frozen_linear(hidden, self.head_dim, False, dtype, device)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=config.index_norm_eps, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        self.weights_proj = frozen_linear(hidden, self.n_heads, False, dtype, device)
        self.gate_proj = frozen_linear(hidden, self.head_dim, False, dtype, device)
        self.ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim, dtype=torch.float32, device=device),
                                requires_grad=False)
        self.head_weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    def new_ring(self, max_slots: int) -> torch.Tensor:
        """A zeroed ring ``[max_slots, 2, kpool, D]`` for requests' open pools."""
        return torch.zeros(max_slots, 2, self.kpool, self.head_dim, dtype=self.wk.weight.dtype,
                           device=self.wk.weight.device)

    def project(self, hidden_states: torch.Tensor, q_latent: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H, D], keys [T, D], gates [T, D], head_weights [T, H] float32)``."""
        q = self.wq_b(q_latent).reshape(-1, self.n_heads, self.head_dim)
        keys_raw = self.wk(hidden_states)
        keys = nn.functional.layer_norm(keys_raw.float(), (self.head_dim,), self.k_norm.weight.float(),
                                        self.k_norm.bias.float(), self.k_norm.eps).to(keys_raw.dtype)
        gates = self.gate_proj(hidden_states)
        head_weights = nn.functional.linear(hidden_states.float(), self.weights_proj.weight.float())
        return q, keys, gates, head_weights * self.head_weight_scale

    def forward(self, hidden_states: torch.Tensor, q_latent: torch.Tensor, *, input_row_offsets: torch.Tensor,
                cache_lengths: torch.Tensor, ring: torch.Tensor, slot_ids: torch.Tensor,
                pooled_cache: PagedKVCacheCollection, cache_layer: int,
                timer: StageTimerLike = no_timer) -> KPoolResult:
        with timer("kpool.project"):
            q, keys, gates, head_weights = self.project(hidden_states, q_latent)
        offsets = input_row_offsets.to(keys.device)
        positions = batch_positions(offsets, cache_lengths.to(keys.device))
        with timer("kpool.pool_store"):
            kpool_indexer_step(ring, slot_ids, keys, gates, self.ape, offsets, cache_lengths, pooled_cache,
                               cache_layer, kpool=self.kpool, mode=self.mode)
        with timer("kpool.score"):
            scores = mla_kpool_score(q, head_weights, pooled_cache, cache_layer, positions, offsets,
                                     kpool=self.kpool)
        with timer("kpool.select"):
            indices, counts = mla_kpool_expand_topk(scores, positions, kpool=self.kpool, topk=self.topk)
        return KPoolResult(indices, counts, keys, gates, q, head_weights, scores, positions)


class KPoolIndexerLayer(nn.Module):
    """What a GLM-5-Next attention layer's indexer needs: the query latent and the indexer.

    ``q_latent = q_a_layernorm(q_a_proj(x))`` (the MLA query latent, shared with
    the main attention in the full model), then :class:`KPoolIndexer`.
    Checkpoint prefix ``model.layers.N.self_attn.``.
    """

    def __init__(self, config: Glm5NextConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.q_a_proj = frozen_linear(config.hidden_size, config.q_lora_rank, False, dtype, device)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=dtype, device=device)
        self.indexer = KPoolIndexer(config, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> KPoolResult:
        timer = kwargs.get("timer", no_timer)
        with timer("kpool.project"):
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))
        return self.indexer(hidden_states, q_latent, **kwargs)


class Glm5NextIndexerSlice(nn.Module):
    """The k-pool indexers of a GLM-5-Next model over a token embedding.

    ``model.embed_tokens.weight`` then, for each indexer layer ``N`` of
    ``config.index_layers``, ``model.layers.N.input_layernorm.weight`` (RMSNorm)
    and :class:`KPoolIndexerLayer`. The slice has no main attention, so every
    indexer reads the normed embedding. Cache layer ``i`` and ring ``i`` belong
    to the slice's ``i``-th indexer.
    """

    def __init__(self, config: Glm5NextConfig, vocab_size: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.input_layernorms = nn.ModuleList(
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device) for _ in config.index_layers)
        self.layers = nn.ModuleList(KPoolIndexerLayer(config, dtype=dtype, device=device)
                                    for _ in config.index_layers)

    def checkpoint_modules(self) -> list[tuple[nn.Module, str]]:
        pairs: list[tuple[nn.Module, str]] = [(self.embed_tokens, "model.embed_tokens.")]
        for layer_id, norm, layer in zip(self.config.index_layers, self.input_layernorms, self.layers):
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
        return [layer(norm(hidden), input_row_offsets=input_row_offsets, cache_lengths=cache_lengths, ring=ring,
                      slot_ids=slot_ids, pooled_cache=pooled_cache, cache_layer=i, timer=timer)
                for i, (norm, layer, ring) in enumerate(zip(self.input_layernorms, self.layers, rings))]


__all__ = ["Glm5NextIndexerSlice", "KPoolIndexer", "KPoolIndexerLayer", "KPoolResult", "RMSNorm"]
