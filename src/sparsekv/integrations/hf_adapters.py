"""One adapter per Hugging Face model family: its indexed-attention layers as sparsekv layers.

An adapter knows a family's attention class (by name), builds one sparsekv
layer per Hugging Face attention
module with the module's own weights (the same ``nn.Module`` objects, never
copies), declares the cache groups those layers read and write, and runs one
layer on a ragged batch of real (non-padding) token rows. It may also
replace the masks Hugging Face would build (:meth:`AttentionAdapter.mask_mapping`).
Everything else (sessions, padding, HF cache objects, ``generate``) is
family-independent and lives in :mod:`sparsekv.integrations.transformers`,
the only importer of this module.

Families: ``qwen4_exp`` (:class:`Qwen4ExpAdapter`, QSA indexer + gated
attention); the MLA + DSA families (:class:`MlaAdapter`): ``glm5_next``
(:class:`Glm5NextAdapter`, k-pool indexer and shared-selection layers),
``glm_moe_dsa`` (:class:`GlmMoeDsaAdapter`) and ``deepseek_v32``
(:class:`DeepseekV32Adapter`). Every adapter is listed in :data:`ADAPTERS`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_recurrent_attention_mask

from ..cache.groups import BatchInputs, CacheGroupSpec
from ..layers.config import MlaConfig, Qwen4ExpConfig, load_config
from ..layers.dsa import mla_cache_groups, rope_inv_freq
from ..layers.mla import MlaSparseAttention
from ..layers.qsa import QSAAttention, RotaryTable, qsa_cache_groups


class HFRotaryTable(RotaryTable):
    """A ``freqs_cis`` table (SPEC 2.2) whose cos/sin come from the model's own rotary module.

    Row ``p`` holds the cos/sin the Hugging Face rotary module computes for
    position ``p`` (float32, including its ``attention_scaling``), interleaved
    ``[cos_0, sin_0, cos_1, sin_1, ...]``, so that RoPE applied through
    sparsekv uses exactly the model's angles. Grown on demand by doubling
    (:class:`sparsekv.layers.RotaryTable` with these rows instead of a theta).

    Args:
        rotary_module: the text model's ``rotary_emb``; called as
            ``rotary_module(x, position_ids [1, n])`` and returning ``(cos, sin)``
            of shape ``[1, n, rotary_dim]`` whose two halves are equal (NeoX).
        rotary_dim: channels it rotates.
    """

    def __init__(self, rotary_module: nn.Module, rotary_dim: int, device: torch.device) -> None:
        super().__init__(rotary_dim, device=device, rows=self._module_rows)
        self.rotary_module = rotary_module

    def _module_rows(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, device=self.device)[None, :]
        probe = torch.empty(0, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            cos, sin = self.rotary_module(probe, positions)
        half = self.rotary_dim // 2
        if cos.shape[-1] != self.rotary_dim:
            raise ValueError(f"rotary module: expected {self.rotary_dim} rotary channels, got {cos.shape[-1]}")
        pairs = torch.stack([cos[0, :, :half].float(), sin[0, :, :half].float()], dim=-1)
        return pairs.reshape(num_positions, self.rotary_dim).contiguous()


class AttentionAdapter:
    """Base of the per-family adapters.

    Subclasses set ``family`` and ``attention_class_names`` and implement
    :meth:`cache_groups` and :meth:`forward`. ``layers[i]`` is the sparsekv
    layer of the ``i``-th patched attention module (its cache layer ``i``).
    ``main_group`` names the cache group whose pages every token uses (the
    one reported as "pages used"); ``output_arity`` is how many values the
    Hugging Face attention module returns (the output, then ``None`` for the
    rest: attention weights, top-k indices).
    ``forward`` adds to ``tokens_read`` (cached tokens the sparse attention
    read, summed over query rows and layers) and ``tokens_causal`` (what dense
    causal attention would have read): int64 scalars on the layers' device,
    so counting never waits for the device.
    """

    family: str = ""
    attention_class_names: tuple[str, ...] = ()
    #: Hugging Face cache-layer classes of the patched layers that a fresh cache may hold (replaced on adoption).
    cache_layer_class_names: tuple[str, ...] = ("DynamicIndexedLayer",)
    main_group: str = "main"
    output_arity: int = 2

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return type(module).__name__ in cls.attention_class_names

    @classmethod
    def weight_of(cls, module: nn.Module) -> torch.Tensor:
        """A weight of ``module`` whose dtype and device the patched layer computes in."""
        return module.q_proj.weight

    def __init__(self, text_model: nn.Module, attentions: list[nn.Module]) -> None:
        self.text_model = text_model
        self.attentions = attentions
        self.reset_read_counts()

    def reset_read_counts(self) -> None:
        device = self.weight_of(self.attentions[0]).device
        with torch.inference_mode(False):  # plain tensors, so calls in and out of inference mode may add to them
            self.tokens_read = torch.zeros((), dtype=torch.int64, device=device)
            self.tokens_causal = torch.zeros((), dtype=torch.int64, device=device)

    def cache_groups(self, dtype: torch.dtype, page_size: int) -> list[CacheGroupSpec]:
        """The cache groups the patched layers need, for pages of ``page_size`` tokens."""
        raise NotImplementedError

    def mask_mapping(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None) -> dict | None:
        """The text model's per-layer-type masks for one call, or ``None`` to let Hugging Face build them.

        ``inputs``: the call's ``input_ids [B, T]`` or ``inputs_embeds [B, T, hidden]``;
        ``attention_mask``: its 2-d padding mask (or ``None``).
        """
        return None

    def forward(self, ordinal: int, rows: torch.Tensor, batch: BatchInputs, scratch: dict) -> torch.Tensor:
        """Run patched layer ``ordinal`` on ``rows [N, hidden]`` (the batch's real tokens); ``[N, hidden]``.

        ``scratch``: the generation's own state between layers and calls
        (emptied when its pages are released).
        """
        raise NotImplementedError


def _refuse_split_weights(module: nn.Module, names: tuple[str, ...]) -> None:
    """Raise ``NotImplementedError`` when a tensor-parallel plan split any of ``module``'s ``names`` over ranks.

    Hugging Face's ``tp_plan`` turns a sharded weight into a ``DTensor``; the
    patched layers compute with whole projections (every head), so they
    cannot run on a rank's shard.
    """
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor, Replicate

    split = [name for name in names if isinstance(weight := getattr(module, name).weight, DTensor)
             and not all(isinstance(placement, Replicate) for placement in weight.placements)]
    if split:
        raise NotImplementedError(
            f"model: layer {module.layer_idx}'s {', '.join(split)} are split over ranks by a tensor-parallel plan "
            "(tp_plan); the patched attention runs on whole projections and does not take Hugging Face's shards "
            "(docs/scale-out.md, section 8). Load the model without tp_plan, or with a plan that leaves the "
            "attention projections whole")


def _config_value(config: object, name: str) -> object:
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"model config: {name!r} is not set; the indexed attention needs it")
    return value


class Qwen4ExpAdapter(AttentionAdapter):
    """Qwen4Exp (``qwen4_exp_text``): QSA indexer + gated attention as :class:`sparsekv.layers.QSAAttention`.

    Cache groups (co-indexed, one layer per patched module): ``"main"``
    (keys and values, ``num_key_value_heads`` heads of ``head_dim``) and
    ``"indexer"`` (raw indexer keys, one head of ``indexer_head_dim``), plus
    ``"index_blocks"`` (the indexer's block keys, one per ``indexer_compress_ratio``
    tokens) when that ratio divides the page size.
    RoPE uses the model's own rotary module (:class:`HFRotaryTable`), at each
    request's own positions ``0, 1, 2, ...`` (real tokens only).
    """

    family = "qwen4_exp"
    attention_class_names = ("Qwen4ExpTextAttention",)

    def __init__(self, text_model: nn.Module, attentions: list[nn.Module]) -> None:
        super().__init__(text_model, attentions)
        hf = text_model.config
        if _config_value(hf, "indexer_kv_heads") != 1:
            raise ValueError(f"model config: indexer_kv_heads must be 1 for QSA, got {hf.indexer_kv_heads}")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rotary = getattr(text_model, "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise ValueError("model: the text model has no rotary_emb module with inv_freq")
        rope_type = getattr(rotary, "rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            raise NotImplementedError(f"RoPE type {rope_type!r} changes its frequencies with the sequence "
                                      "length; the patched attention supports position-independent RoPE only")
        self.config = Qwen4ExpConfig(
            hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            rope_theta=float(rope.get("rope_theta", 1e7)),
            rms_norm_eps=float(hf.rms_norm_eps),
            attention_bias=bool(hf.attention_bias),
            indexer_n_heads=_config_value(hf, "indexer_n_heads"),
            indexer_head_dim=_config_value(hf, "indexer_head_dim"),
            indexer_compress_ratio=_config_value(hf, "indexer_compress_ratio"),
            indexer_budget=_config_value(hf, "indexer_budget"),
            qsa_layers=tuple(module.layer_idx for module in attentions),
        )
        rotary_dim = 2 * rotary.inv_freq.numel()
        if rotary_dim != self.config.rotary_dim:
            raise ValueError(f"model: the rotary module rotates {rotary_dim} channels but head_dim * "
                             f"partial_rotary_factor is {self.config.rotary_dim}")
        self.device = attentions[0].q_proj.weight.device
        self.rotary = HFRotaryTable(rotary, rotary_dim, self.device)
        self.layers = [self._build(module) for module in attentions]

    def _build(self, module: nn.Module) -> QSAAttention:
        """A :class:`QSAAttention` whose submodules are ``module``'s own (weights shared, nothing copied)."""
        _refuse_split_weights(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
        layer = QSAAttention(self.config, dtype=module.q_proj.weight.dtype, device="meta")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            setattr(layer, name, getattr(module, name))
        for name in ("index_qk_proj", "q_layernorm", "k_layernorm"):
            setattr(layer.indexer, name, getattr(module.indexer, name))
        layer.rotary = self.rotary
        left = [name for name, tensor in layer.state_dict().items() if tensor.is_meta]
        if left:
            raise RuntimeError(f"adapter: the QSA layer still has unshared weights {left}")
        return layer

    def cache_groups(self, dtype: torch.dtype, page_size: int) -> list[CacheGroupSpec]:
        """``"main"``, ``"indexer"``, and where ``indexer_compress_ratio`` divides the page size the
        indexer's block-key cache ``"index_blocks"`` (each block pooled once, in the call that completes it)."""
        return qsa_cache_groups(self.config, dtype, page_size)

    def mask_mapping(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
        """Hugging Face's masks without the dense ``[B, 1, T, past + T]`` one of the indexed layers.

        The patched layers read no mask (the 2-d padding mask is checked and
        applied when the call is planned), so building it would only cost
        ``O(T * (past + T))`` memory per call; the linear-attention layers get
        Hugging Face's own recurrent mask.
        """
        return {"indexed_attention": None,
                "linear_attention": create_recurrent_attention_mask(self.text_model.config, inputs, attention_mask)}

    def forward(self, ordinal: int, rows: torch.Tensor, batch: BatchInputs, scratch: dict) -> torch.Tensor:
        block_cache = batch.collection("index_blocks") if "index_blocks" in batch.groups else None
        result = self.layers[ordinal](rows, input_row_offsets=batch.input_row_offsets,
                                      kv_cache=batch.collection("main"), index_cache=batch.collection("indexer"),
                                      cache_layer=ordinal, block_cache=block_cache)
        self.tokens_read += result.counts.sum(dtype=torch.int64)
        self.tokens_causal += result.positions.sum(dtype=torch.int64) + result.positions.numel()
        return result.output


_MLA_PROJECTIONS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                    "o_proj")
_INDEXER_MODULES = ("wq_b", "wk", "k_norm", "weights_proj")


class MlaAdapter(AttentionAdapter):
    """The MLA + DSA families: each attention module as a :class:`sparsekv.layers.MlaSparseAttention`.

    The sparsekv config comes from the text model's Hugging Face config
    (:func:`sparsekv.layers.load_config`). Cache groups
    (:func:`sparsekv.layers.mla_cache_groups`, co-indexed): ``"latent"`` (one
    latent row of ``kv_lora_rank + qk_rope_head_dim`` channels per token and
    indexed layer) and ``"indexer"`` (one pooled indexer key per
    ``index_kpool`` tokens, per layer that runs its own indexer). A
    ``"shared"`` layer reads the selection of the last full layer of the same
    forward call. RoPE (GLM-5, DeepSeek-V3.2) is the layers' own, at each
    request's positions ``0, 1, 2, ...``; the open k-pools of GLM-5-Next live in
    one ring per full layer and generation. The attention runs in the
    absorbed form (``mla_sparse_attention_paged``).

    Weights are the Hugging Face modules themselves, except
    ``index_kpool_compress_ape`` (``[index_kpool, index_head_dim]``) of a
    16-bit GLM-5-Next, which the k-pool ops read in float32: a float32 copy.
    """

    main_group = "latent"
    output_arity = 3

    @classmethod
    def weight_of(cls, module: nn.Module) -> torch.Tensor:
        return module.q_a_proj.weight

    def __init__(self, text_model: nn.Module, attentions: list[nn.Module]) -> None:
        super().__init__(text_model, attentions)
        config = load_config(text_model.config.to_dict())
        if not isinstance(config, MlaConfig) or config.model_type != self.family:
            raise ValueError(f"model config: expected a {self.family} config, got {type(config).__name__}")
        patched = tuple(module.layer_idx for module in attentions)
        if patched != config.index_layers:
            raise ValueError(f"model: the indexed-attention modules sit at layers {patched}, the config says "
                             f"{config.index_layers}")
        self.config = config
        self.device = self.weight_of(attentions[0]).device
        self.layers = [self._build(module) for module in attentions]
        self.full_ordinals = [i for i, layer in enumerate(self.layers) if layer.indexer is not None]
        self.index_layer_of = {ordinal: j for j, ordinal in enumerate(self.full_ordinals)}

    def _rope(self, rotary_dim: int) -> tuple[torch.Tensor, float]:
        return rope_inv_freq(max(rotary_dim, 2), self.config.rope_theta, dict(self.config.rope_yarn or ()),
                             self.device)

    def _build(self, module: nn.Module) -> MlaSparseAttention:
        """A :class:`MlaSparseAttention` whose submodules are ``module``'s own (weights shared, nothing copied)."""
        _refuse_split_weights(module, ("q_b_proj", "kv_b_proj", "o_proj"))
        dtype = self.weight_of(module).dtype
        layer = MlaSparseAttention(self.config, module.layer_idx, dtype=dtype, device="meta")
        for name in _MLA_PROJECTIONS:
            setattr(layer, name, getattr(module, name))
        layer.rope_inv_freq, layer.rope_attention_factor = self._rope(layer.rope_dim)
        ours, theirs = layer.indexer, getattr(module, "indexer", None)
        if (ours is None) != (theirs is None):
            raise ValueError(f"model: layer {module.layer_idx} {'has' if theirs is not None else 'lacks'} an "
                             "indexer, but its config indexer_types entry says otherwise")
        if ours is not None:
            for name in _INDEXER_MODULES:
                setattr(ours, name, getattr(theirs, name))
            if ours.index_kpool_compress_gate is not None:
                ours.index_kpool_compress_gate = theirs.index_kpool_compress_gate
                ape = theirs.index_kpool_compress_ape
                if ape.dtype != torch.float32:
                    ape = nn.Parameter(ape.detach().float(), requires_grad=False)
                ours.index_kpool_compress_ape = ape
            else:
                ours.index_kpool_compress_ape = torch.zeros(ours.kpool, ours.head_dim, dtype=torch.float32,
                                                            device=self.device)
            ours.rope_inv_freq, ours.rope_attention_factor = self._rope(ours.rope_dim)
        left = [name for name, tensor in [*layer.named_parameters(), *layer.named_buffers()] if tensor.is_meta]
        if left:
            raise RuntimeError(f"adapter: the MLA layer still has unshared weights {left}")
        return layer

    def cache_groups(self, dtype: torch.dtype, page_size: int) -> list[CacheGroupSpec]:
        return mla_cache_groups(self.config, dtype)

    def forward(self, ordinal: int, rows: torch.Tensor, batch: BatchInputs, scratch: dict) -> torch.Tensor:
        layer = self.layers[ordinal]
        common = dict(input_row_offsets=batch.input_row_offsets, latent_cache=batch.collection("latent"),
                      cache_layer=ordinal)
        if layer.indexer is None:
            selection = scratch.get("selection")
            if selection is None:
                raise RuntimeError(f"layer {layer.layer_id} shares the selection of an earlier full layer, which "
                                   "did not run in this forward call")
            result = layer(rows, selection=selection, **common)
        else:
            index_layer = self.index_layer_of[ordinal]
            ring = slot_ids = None
            if layer.indexer.kpool > 1:  # open pools span calls: one ring row per sequence of the generation
                rings = scratch.get("rings")
                if rings is None:
                    rings = scratch["rings"] = [self.layers[i].indexer.new_ring(batch.batch_size)
                                                for i in self.full_ordinals]
                ring = rings[index_layer]
                slot_ids = torch.arange(batch.batch_size, device=ring.device)
            result = layer(rows, index_cache=batch.collection("indexer"), index_layer=index_layer, ring=ring,
                           slot_ids=slot_ids, **common)
            scratch["selection"] = (result.indices, result.counts)
        self.tokens_read += result.counts.sum(dtype=torch.int64)
        self.tokens_causal += result.positions.sum(dtype=torch.int64) + result.positions.numel()
        return result.output


class Glm5NextAdapter(MlaAdapter):
    """GLM-5-Next (``glm5_next_text``): NoPE MLA with the k-pool indexer and shared-selection layers.

    Hugging Face's padding mask of these layers is the 2-d one (cheap), so
    its masks are left as they are.
    """

    family = "glm5_next"
    attention_class_names = ("Glm5NextTextAttention",)


class GlmMoeDsaAdapter(MlaAdapter):
    """GLM-5 (``glm_moe_dsa``): MLA with the DSA indexer (``kpool = 1``, interleaved RoPE), shared layers allowed."""

    family = "glm_moe_dsa"
    attention_class_names = ("GlmMoeDsaAttention",)

    def mask_mapping(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
        """No dense ``[B, 1, T, past + T]`` causal mask: the patched layers read none (every layer is indexed)."""
        return {"indexed_attention": None}


class DeepseekV32Adapter(GlmMoeDsaAdapter):
    """DeepSeek-V3.2 (``deepseek_v32``): MLA with the DSA indexer (``kpool = 1``, half-split indexer RoPE)."""

    family = "deepseek_v32"
    attention_class_names = ("DeepseekV32Attention",)
    output_arity = 2


#: Every family adapter, tried in order on each module of a model.
ADAPTERS: tuple[type[AttentionAdapter], ...] = (Qwen4ExpAdapter, Glm5NextAdapter, GlmMoeDsaAdapter,
                                                DeepseekV32Adapter)

__all__ = ["ADAPTERS", "AttentionAdapter", "DeepseekV32Adapter", "Glm5NextAdapter", "GlmMoeDsaAdapter",
           "HFRotaryTable", "MlaAdapter", "Qwen4ExpAdapter"]
