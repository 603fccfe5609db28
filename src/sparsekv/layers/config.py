"""Model configs read from the ``config.json`` that Hugging Face's ``save_pretrained`` writes.

Four families, told apart by ``model_type``:

* ``qwen4_exp`` (:class:`Qwen4ExpConfig`): the full-attention (QSA) layers of
  the Qwen4Exp family (SPEC 2). HF writes ``qwen4_exp_text``, or ``qwen4_exp``
  with the text part nested under ``text_config``.
* ``glm5_next`` (:class:`Glm5NextConfig`): GLM-5-Next (GLM-5.3-Flash), MLA
  attention with the k-pool DSA indexer (SPEC 3). HF writes ``glm5_next_text``,
  or ``glm5_next`` nested (``text_config``) or flat.
* ``glm_moe_dsa`` (:class:`GlmMoeDsaConfig`, GLM-5) and ``deepseek_v32``
  (:class:`DeepseekV32Config`, DeepSeek-V3.2): MLA attention with the DSA
  indexer, which is the k-pool indexer with ``kpool = 1`` and RoPE on the first
  ``qk_rope_head_dim`` indexer channels (GLM-5 interleaved, DeepSeek half-split).

A key HF leaves out takes **HF's default** (the field defaults of the
``transformers`` 5.23 config classes, repeated in the dataclasses below; a
test checks them against those classes): an absent ``index_kpool`` is 16, an
absent ``partial_rotary_factor`` 1.0, an absent ``rope_theta`` 10000.

Every key is either one the layers use, one HF writes for parts this library
does not build (MLP / MoE, linear-attention layers, hyper-connections,
tokenizer ids: accepted and ignored), or a ``ValueError`` naming it, so that a
typo (``indexer_budjet``) never silently falls back to a default. The vision
half of a multimodal config (``vision_config``, image / video token ids) is
ignored and named once in a ``warnings.warn``.

The sparsekv spellings of earlier versions stay accepted: ``qsa_layers`` /
``qsa_layer_interval``, ``index_layers`` / ``index_layer_interval``, top-level
``rope_theta`` / ``partial_rotary_factor``, ``index_kpool_mode``,
``index_norm_eps``; :func:`save_config` writes that flat form.

Example::

    cfg = load_config({"model_type": "qwen4_exp_text", "hidden_size": 256, "num_hidden_layers": 4,
                       "head_dim": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                       "partial_rotary_factor": 0.25}, "indexer_n_heads": 4, "indexer_kv_heads": 1,
                       "indexer_head_dim": 128, "indexer_compress_ratio": 4, "indexer_budget": 2048})
    cfg.qsa_layers, cfg.rotary_dim  # (3,), 64
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

# Keys of any Hugging Face config that say nothing about the layers built here.
_GENERIC_KEYS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "initializer_range", "use_cache", "vocab_size",
    "max_position_embeddings", "hidden_act", "intermediate_size", "attention_dropout", "auto_map",
    "_name_or_path", "quantization_config", "output_router_logits", "router_aux_loss_coef",
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_hidden_states",
    "output_attentions", "problem_type", "return_dict", "tokenizer_class",
})

# The vision half of a multimodal config: ignored, and named in one warning.
_VISION_KEYS = frozenset({
    "vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    "image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id",
})

# Qwen4ExpTextConfig fields of parts other than the full-attention layers (MoE MLP, Gated DeltaNet layers,
# hyper-connections, per-layer n-gram embeddings) and keys HF derives from others.
_QWEN4_EXP_OTHER_KEYS = frozenset({
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "hc_count", "hc_lowrank", "ple_layer_ids", "ple_embed_dim", "ple_conv_kernel_size", "ngram_size",
    "heads_per_ngram", "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "seed",
    "split_ngram_parts", "output_gate_type", "number_of_conv_states",
})

# Fields shared by the three MLA + DSA configs for parts other than the attention layers.
_MLA_OTHER_KEYS = frozenset({
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
    "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func", "topk_method", "moe_layer_freq",
    "num_nextn_predict_layers", "first_k_dense_replace", "mlp_layer_types", "mlp_bias", "ep_size",
    "head_dim", "qk_head_dim", "num_experts",
})
_GLM5_NEXT_OTHER_KEYS = _MLA_OTHER_KEYS | frozenset({
    "swiglu_limit", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound",
    "linear_attn_config", "hc_mult", "hc_eps", "hc_sinkhorn_iters",
    # NoPE: a rope entry changes nothing in the attention layers
    "rope_parameters", "rope_theta", "rope_scaling",
})

# HF's layer_types values: these layers carry the sparse attention built here.
_INDEXED_LAYER_TYPES = ("indexed_attention", "full_attention")
_OTHER_LAYER_TYPES = ("linear_attention",)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config key {name!r}: expected a positive integer, got {value!r}")


def _check_non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config key {name!r}: expected an integer >= 0, got {value!r}")


def _check_positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config key {name!r}: expected a positive number, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"config key {name!r}: expected true/false, got {value!r}")


def _resolve_layers(name: str, explicit: list[int] | None, interval: int | None, num_layers: int) -> tuple[int, ...]:
    """Layer ids from an explicit list, or every ``interval``-th layer (``interval-1, 2*interval-1, ...``)."""
    if explicit is not None and interval is not None:
        raise ValueError(f"config: give either {name}s or {name}_interval, not both")
    if explicit is None:
        step = interval if interval is not None else 1
        _check_positive_int(f"{name}_interval", step)
        return tuple(range(step - 1, num_layers, step))
    if not isinstance(explicit, (list, tuple)) or not explicit:
        raise ValueError(f"config key '{name}s': expected a non-empty list of layer ids, got {explicit!r}")
    for layer in explicit:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(
                f"config key '{name}s': expected layer ids in [0, num_hidden_layers={num_layers}), got {layer!r}"
            )
    if len(set(explicit)) != len(explicit) or list(explicit) != sorted(explicit):
        raise ValueError(f"config key '{name}s': expected strictly increasing layer ids, got {list(explicit)}")
    return tuple(explicit)


def _indexed_layers_from_types(layer_types: Any, num_layers: int) -> list[int]:
    """Ids of the ``"indexed_attention"`` (or ``"full_attention"``) entries of HF's ``layer_types``."""
    if not isinstance(layer_types, (list, tuple)) or not all(isinstance(k, str) for k in layer_types):
        raise ValueError(f"config key 'layer_types': expected a list of strings, got {layer_types!r}")
    if len(layer_types) != num_layers:
        raise ValueError(f"config key 'layer_types': expected {num_layers} entries (num_hidden_layers), "
                         f"got {len(layer_types)}")
    for kind in layer_types:
        if kind not in _INDEXED_LAYER_TYPES + _OTHER_LAYER_TYPES:
            raise ValueError(f"config key 'layer_types': unknown layer type {kind!r} (expected one of "
                             f"{', '.join(_INDEXED_LAYER_TYPES + _OTHER_LAYER_TYPES)})")
    return [i for i, kind in enumerate(layer_types) if kind in _INDEXED_LAYER_TYPES]


# YaRN entries of HF's rope_parameters (glm_moe_dsa / deepseek_v32 only).
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def _rope_from_parameters(params: Any, *, key: str = "rope_parameters", yarn: bool = False) -> dict[str, Any]:
    """``rope_theta`` / ``partial_rotary_factor`` (and ``rope_yarn``) out of HF's ``rope_parameters``.

    The default RoPE everywhere; YaRN where ``yarn`` (the MLA families with RoPE).
    """
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ValueError(f"config key {key!r}: expected an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    supported = ("default", "yarn") if yarn else ("default",)
    if rope_type not in supported:
        raise ValueError(f"config key {key!r}: rope_type {rope_type!r} is not supported (only "
                         f"{' or '.join(repr(t) for t in supported)})")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
    if rope_type == "yarn":
        known |= set(_YARN_KEYS)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"config key {key!r}: unknown entries {unknown}")
    # mrope sections differ only for image/video positions; text positions are equal in every section.
    found = {name: params[name] for name in ("rope_theta", "partial_rotary_factor") if name in params}
    if rope_type == "yarn":
        found["rope_yarn"] = tuple(sorted((name, params[name]) for name in _YARN_KEYS if name in params))
    return found


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _indexer_types_from_schedule(pattern: Any, freq: Any, offset: Any, num_layers: int) -> list[str]:
    """HF's default ``indexer_types``: a ``"FSSF..."`` pattern, else the ``index_topk_freq`` / offset rule."""
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            if any(c not in letters for c in pattern):
                raise ValueError(f"config key 'index_topk_pattern': expected letters F and S, got {pattern!r}")
            return [letters[c] for c in pattern]
        return list(pattern)
    freq = max(1 if freq is None else freq, 1)
    offset = 2 if offset is None else offset
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """Config of the Qwen4Exp full-attention (QSA) layers (SPEC 2); defaults are HF's ``Qwen4ExpTextConfig``'s.

    ``qsa_layers`` (explicit ids) or ``qsa_layer_interval`` (every n-th layer,
    ``n-1, 2n-1, ...``) pick the QSA layers; neither means interval 4. HF's
    ``layer_types`` (``"indexed_attention"`` / ``"full_attention"`` entries)
    and ``full_attention_interval`` are read as these two. The ``indexer_*``
    keys have no default in HF (absent, QSA is off); sparsekv builds only QSA
    layers, so they are required (``indexer_kv_heads`` may be left out: 1, the
    only value HF accepts). The indexer's RoPE uses the main attention's table
    (``rotary_dim = head_dim * partial_rotary_factor``, ``rope_theta``), NeoX
    half-split.
    """

    model_type: ClassVar[str] = "qwen4_exp"

    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_compress_ratio: int | None = None
    indexer_budget: int | None = None
    qsa_layers: tuple[int, ...] | None = None
    qsa_layer_interval: int | None = None

    def __post_init__(self) -> None:
        missing = [name for name in ("indexer_n_heads", "indexer_head_dim", "indexer_compress_ratio",
                                     "indexer_budget") if getattr(self, name) is None]
        if missing:
            raise ValueError(f"config: {', '.join(missing)} unset: not a QSA model (Hugging Face leaves QSA off "
                             "without the indexer_* keys; sparsekv builds only QSA layers)")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "indexer_n_heads", "indexer_head_dim", "indexer_compress_ratio",
                     "indexer_budget"):
            _check_positive_int(name, getattr(self, name))
        if self.indexer_kv_heads is None:
            object.__setattr__(self, "indexer_kv_heads", 1)
        if self.indexer_kv_heads != 1:
            raise ValueError(f"config key 'indexer_kv_heads': QSA has one indexer key head, got "
                             f"{self.indexer_kv_heads!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            _check_positive_float(name, getattr(self, name))
        _check_bool("attention_bias", self.attention_bias)
        factor = self.partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"config key 'partial_rotary_factor': expected a number in (0, 1], got {factor!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rotary = self.head_dim * factor
        if rotary != int(rotary) or int(rotary) % 2 or int(rotary) < 2:
            raise ValueError(
                f"config: head_dim * partial_rotary_factor = {rotary} must be an even integer >= 2"
            )
        if int(rotary) > self.indexer_head_dim:
            raise ValueError(
                f"config: the rotary dim {int(rotary)} (head_dim * partial_rotary_factor) is shared with the "
                f"indexer and must be <= indexer_head_dim ({self.indexer_head_dim})"
            )
        if self.indexer_budget < self.indexer_compress_ratio or self.indexer_budget % self.indexer_compress_ratio:
            raise ValueError(
                f"config: indexer_budget ({self.indexer_budget}) must be a positive multiple of "
                f"indexer_compress_ratio ({self.indexer_compress_ratio})"
            )
        interval = self.qsa_layer_interval
        if self.qsa_layers is None and interval is None:
            interval = 4
        layers = _resolve_layers("qsa_layer", None if self.qsa_layers is None else list(self.qsa_layers),
                                 interval, self.num_hidden_layers)
        if not layers:
            raise ValueError("config: no QSA layer (qsa_layer_interval larger than num_hidden_layers)")
        object.__setattr__(self, "qsa_layers", layers)
        object.__setattr__(self, "qsa_layer_interval", None)  # resolved into qsa_layers

    @property
    def rotary_dim(self) -> int:
        """Channels RoPE rotates in both the main attention and the indexer (64 for the real model)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def budget_blocks(self) -> int:
        """Blocks each query selects at most: ``indexer_budget // indexer_compress_ratio``."""
        return self.indexer_budget // self.indexer_compress_ratio

    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": self.model_type, **dataclasses.asdict(self)}
        data["qsa_layers"] = list(self.qsa_layers)
        data.pop("qsa_layer_interval")
        return data


@dataclass(frozen=True)
class _MlaConfig:
    """Fields shared by the MLA + DSA families (HF names); see the subclasses for defaults and meaning.

    ``index_layers`` are the layers with MLA sparse attention (HF's
    ``layer_types`` entries ``"indexed_attention"``); ``indexer_types`` has one
    entry per model layer: ``"full"`` runs the layer's own indexer,
    ``"shared"`` has none and reuses the selection of the previous full
    indexed layer.
    """

    model_type: ClassVar[str] = ""
    #: RoPE of the indexer's first ``qk_rope_head_dim`` channels: ``"none"``, ``"interleave"`` or ``"half"``.
    indexer_rope: ClassVar[str] = "none"
    #: The family's checkpoints carry the k-pool weights ``index_kpool_compress_{ape,gate}``.
    has_kpool_weights: ClassVar[bool] = False
    #: eps of ``q_a_layernorm`` / ``kv_a_layernorm`` (``None``: ``rms_norm_eps``).
    latent_norm_eps: ClassVar[float | None] = 1e-6
    #: Layer interval of ``index_layers`` when neither it nor ``layer_types`` is given.
    default_index_interval: ClassVar[int] = 1

    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 10000.0
    #: YaRN entries of ``rope_parameters`` as sorted ``(name, value)`` pairs; ``None``: the default RoPE
    rope_yarn: tuple[tuple[str, Any], ...] | None = None
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    index_norm_eps: float = 1e-6
    index_layers: tuple[int, ...] | None = None
    index_layer_interval: int | None = None
    indexer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
                     "index_head_dim", "index_topk"):
            _check_positive_int(name, getattr(self, name))
        _check_non_negative_int("qk_rope_head_dim", self.qk_rope_head_dim)
        for name in ("rms_norm_eps", "index_norm_eps", "rope_theta"):
            _check_positive_float(name, getattr(self, name))
        _check_bool("attention_bias", self.attention_bias)
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"config: MLA reads one latent for all heads, so num_key_value_heads "
                             f"({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config key 'qk_rope_head_dim': expected an even number, got {self.qk_rope_head_dim}")
        if self.rope_yarn is not None:
            if self.indexer_rope == "none":
                raise ValueError(f"config key 'rope_parameters': {self.model_type} is NoPE, YaRN does not apply")
            yarn = dict(self.rope_yarn)
            unknown = sorted(set(yarn) - set(_YARN_KEYS))
            if unknown:
                raise ValueError(f"config key 'rope_parameters': unknown YaRN entries {unknown}")
            for name in ("factor", "original_max_position_embeddings"):
                if yarn.get(name) is None:
                    raise ValueError(f"config key 'rope_parameters': YaRN needs {name!r}")
                _check_positive_float(f"rope_parameters.{name}", yarn[name])
            object.__setattr__(self, "rope_yarn", tuple(sorted(yarn.items())))
        if self.indexer_rope != "none" and self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"config: qk_rope_head_dim ({self.qk_rope_head_dim}) must be <= index_head_dim "
                             f"({self.index_head_dim}): the indexer rotates its first qk_rope_head_dim channels")
        interval = self.index_layer_interval
        if self.index_layers is None and interval is None:
            interval = self.default_index_interval
        layers = _resolve_layers("index_layer", None if self.index_layers is None else list(self.index_layers),
                                 interval, self.num_hidden_layers)
        if not layers:
            raise ValueError("config: no indexed attention layer (index_layer_interval larger than "
                             "num_hidden_layers)")
        object.__setattr__(self, "index_layers", layers)
        object.__setattr__(self, "index_layer_interval", None)  # resolved into index_layers
        kinds = self.indexer_types
        if kinds is None:
            kinds = ("full",) * self.num_hidden_layers
        if not isinstance(kinds, (list, tuple)) or len(kinds) != self.num_hidden_layers:
            raise ValueError(f"config key 'indexer_types': expected {self.num_hidden_layers} entries "
                             f"(num_hidden_layers), got {kinds!r}")
        for kind in kinds:
            if kind not in ("full", "shared"):
                raise ValueError(f"config key 'indexer_types': expected 'full' or 'shared' entries, got {kind!r}")
        if kinds[layers[0]] != "full":
            raise ValueError(f"config key 'indexer_types': the first indexed layer ({layers[0]}) is 'shared', "
                             "but a shared layer reuses the selection of an earlier full layer")
        object.__setattr__(self, "indexer_types", tuple(kinds))

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head of the expanded form: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Channels of one latent cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention's ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        scale = self.qk_head_dim ** -0.5
        yarn = dict(self.rope_yarn or ())
        if yarn.get("mscale_all_dim"):
            scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        return scale

    @property
    def latent_eps(self) -> float:
        """eps of ``q_a_layernorm`` and ``kv_a_layernorm``."""
        return self.rms_norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

    @property
    def full_index_layers(self) -> tuple[int, ...]:
        """The indexed layers that run their own indexer (``indexer_types`` ``"full"``)."""
        return tuple(n for n in self.index_layers if self.indexer_types[n] == "full")

    @property
    def topk_pools(self) -> int:
        """Pools each query selects at most: ``index_topk // index_kpool``."""
        return self.index_topk // self.index_kpool

    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": self.model_type, **dataclasses.asdict(self)}
        data["index_layers"] = list(self.index_layers)
        data["indexer_types"] = list(self.indexer_types)
        data.pop("index_layer_interval")
        return data


@dataclass(frozen=True)
class Glm5NextConfig(_MlaConfig):
    """GLM-5-Next (GLM-5.3-Flash): MLA sparse attention with the k-pool indexer (SPEC 3).

    Defaults are HF's ``Glm5NextTextConfig``'s: ``index_kpool`` 16, NoPE
    (``qk_rope_head_dim`` must be 0), indexed layers 3, 7, ... (the others are
    linear attention), ``q_a_layernorm`` / ``kv_a_layernorm`` with
    ``rms_norm_eps``. ``index_kpool_always_select_tail`` appends the open tail
    to each selection. ``index_kpool_mode`` (sparsekv) is the pooling rule of
    SPEC 3.1 (``softmax``, HF's, or ``mean`` / ``last``).
    """

    model_type: ClassVar[str] = "glm5_next"
    indexer_rope: ClassVar[str] = "none"
    has_kpool_weights: ClassVar[bool] = True
    latent_norm_eps: ClassVar[float | None] = None
    default_index_interval: ClassVar[int] = 4

    hidden_size: int = 4096
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    index_kpool_mode: str = "softmax"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("index_kpool", self.index_kpool)
        _check_bool("index_kpool_always_select_tail", self.index_kpool_always_select_tail)
        if self.qk_rope_head_dim:
            raise ValueError(f"config key 'qk_rope_head_dim': GLM-5-Next attention is NoPE (0), got "
                             f"{self.qk_rope_head_dim}")
        if self.index_kpool_mode not in ("softmax", "mean", "last"):
            raise ValueError(
                f"config key 'index_kpool_mode': expected 'softmax', 'mean' or 'last', got {self.index_kpool_mode!r}"
            )
        if self.index_topk < self.index_kpool or self.index_topk % self.index_kpool:
            raise ValueError(f"config: index_topk ({self.index_topk}) must be a positive multiple of index_kpool "
                             f"({self.index_kpool})")


@dataclass(frozen=True)
class _DsaConfig(_MlaConfig):
    """The MLA families with the DSA indexer: the k-pool indexer with ``kpool = 1`` (every token its own pool)."""

    index_kpool: ClassVar[int] = 1
    index_kpool_always_select_tail: ClassVar[bool] = False
    index_kpool_mode: ClassVar[str] = "softmax"


@dataclass(frozen=True)
class GlmMoeDsaConfig(_DsaConfig):
    """GLM-5: MLA sparse attention with the DSA indexer (``kpool = 1``); defaults are HF's ``GlmMoeDsaConfig``'s.

    The indexer rotates its first ``qk_rope_head_dim`` channels with
    interleaved RoPE (as the main attention does); ``indexer_types`` may mark
    layers ``"shared"``.
    """

    model_type: ClassVar[str] = "glm_moe_dsa"
    indexer_rope: ClassVar[str] = "interleave"

    hidden_size: int = 6144
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32


@dataclass(frozen=True)
class DeepseekV32Config(_DsaConfig):
    """DeepSeek-V3.2: MLA sparse attention with the DSA indexer (``kpool = 1``); HF's ``DeepseekV32Config`` defaults.

    The indexer rotates its first ``qk_rope_head_dim`` channels with the
    half-split (NeoX) RoPE; the main attention uses interleaved RoPE. Every
    layer runs its own indexer.
    """

    model_type: ClassVar[str] = "deepseek_v32"
    indexer_rope: ClassVar[str] = "half"

    hidden_size: int = 7168
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    index_n_heads: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if "shared" in self.indexer_types:
            raise ValueError("config key 'indexer_types': DeepSeek-V3.2 runs the indexer in every layer "
                             "(HF's deepseek_v32 has no shared layers)")


MlaConfig = Glm5NextConfig | GlmMoeDsaConfig | DeepseekV32Config
ModelConfig = Qwen4ExpConfig | MlaConfig

_FAMILIES: dict[str, tuple[type, frozenset[str]]] = {
    Qwen4ExpConfig.model_type: (Qwen4ExpConfig, _QWEN4_EXP_OTHER_KEYS),
    Glm5NextConfig.model_type: (Glm5NextConfig, _GLM5_NEXT_OTHER_KEYS),
    GlmMoeDsaConfig.model_type: (GlmMoeDsaConfig, _MLA_OTHER_KEYS),
    DeepseekV32Config.model_type: (DeepseekV32Config, _MLA_OTHER_KEYS),
}
# HF's model_type of the text part -> family
_TEXT_MODEL_TYPES = {"qwen4_exp_text": "qwen4_exp", "glm5_next_text": "glm5_next"}
# Keys HF reads only as constructor arguments to derive indexer_types (GLM families).
_INDEXER_SCHEDULE_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")


def _text_part(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(family, text keys)`` of a config dict: unwraps ``text_config``, warns once about vision keys."""
    model_type = data.get("model_type")
    family = _TEXT_MODEL_TYPES.get(model_type, model_type)
    if family not in _FAMILIES:
        known = sorted(set(_FAMILIES) | set(_TEXT_MODEL_TYPES))
        raise ValueError(f"config key 'model_type': expected one of {known}, got {model_type!r}")
    ignored = sorted(key for key in data if key in _VISION_KEYS)
    text = data
    if "text_config" in data:
        if model_type in _TEXT_MODEL_TYPES or family not in ("qwen4_exp", "glm5_next"):
            raise ValueError(f"config key 'text_config': a {model_type} config has no nested text part")
        nested = data["text_config"] or {}
        if not isinstance(nested, dict):
            raise ValueError(f"config key 'text_config': expected an object, got {nested!r}")
        inner_type = nested.get("model_type", f"{family}_text")
        if _TEXT_MODEL_TYPES.get(inner_type, inner_type) != family:
            raise ValueError(f"config key 'text_config.model_type': expected {family}_text, got {inner_type!r}")
        outer = set(data) - {"text_config", "model_type"} - _GENERIC_KEYS - _VISION_KEYS
        if outer:
            raise ValueError(f"config: unknown keys {sorted(outer)} next to 'text_config' in a {model_type} config")
        text = nested
    if ignored:
        warnings.warn(f"config: {family} is built from the text part only; ignoring the vision keys "
                      f"{', '.join(ignored)}", stacklevel=3)
    return family, {k: v for k, v in text.items() if k not in _VISION_KEYS}


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Build the config named by ``data["model_type"]``; unknown keys raise ``ValueError``.

    Takes HF's ``config.json`` of the four families (text part of a
    multimodal config) and sparsekv's own flat form. Only the default RoPE is
    implemented: another ``rope_type`` is an error.
    """
    if not isinstance(data, dict):
        raise TypeError(f"config: expected a JSON object (dict), got {type(data).__name__}")
    family, text = _text_part(data)
    cls, other_keys = _FAMILIES[family]
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    schedule: dict[str, Any] = {}
    layer_types = None

    sources: dict[str, str] = {}

    def put(target: str, value: Any, source: str) -> None:
        if target in kwargs:
            raise ValueError(f"config: give either {sources[target]!r} or {source!r}, not both (both set {target})")
        kwargs[target] = value
        sources[target] = source

    for key, value in text.items():
        if key == "model_type":
            continue
        if key == "layer_types" and value is not None:
            layer_types = value
        elif key in ("rope_parameters", "rope_scaling") and family != "glm5_next":
            yarn = family in ("glm_moe_dsa", "deepseek_v32")
            for name, entry in _rope_from_parameters(value, key=key, yarn=yarn).items():
                put(name, entry, key)
        elif family == "qwen4_exp" and key == "full_attention_interval":
            put("qsa_layer_interval", value, key)
        elif family in ("glm5_next", "glm_moe_dsa") and key in _INDEXER_SCHEDULE_KEYS:
            schedule[key] = value
        elif key in fields:
            if value is not None or key != "indexer_types":
                put(key, value, key)
        elif key not in _GENERIC_KEYS and key not in other_keys:
            raise ValueError(
                f"config key {key!r} is not a known {family} key (known: {', '.join(sorted(fields))})"
            )
    layer_key = "qsa_layers" if family == "qwen4_exp" else "index_layers"
    if layer_types is not None:
        num_layers = kwargs.get("num_hidden_layers", _default_of(cls, "num_hidden_layers"))
        if isinstance(num_layers, bool) or not isinstance(num_layers, int):
            _check_positive_int("num_hidden_layers", num_layers)
        put(layer_key, _indexed_layers_from_types(layer_types, num_layers), "layer_types")
    interval_key = f"{layer_key[:-1]}_interval"
    if layer_key in kwargs and interval_key in kwargs:
        raise ValueError(f"config: give either {sources[layer_key]!r} or {sources[interval_key]!r}, not both")
    if schedule and "indexer_types" not in kwargs:  # as in HF, an explicit indexer_types wins
        num_layers = kwargs.get("num_hidden_layers", _default_of(cls, "num_hidden_layers"))
        kwargs["indexer_types"] = _indexer_types_from_schedule(
            schedule.get("index_topk_pattern"), schedule.get("index_topk_freq"),
            schedule.get("index_skip_topk_offset"), num_layers)
    for list_key in ("qsa_layers", "index_layers", "indexer_types"):
        if isinstance(kwargs.get(list_key), list):
            kwargs[list_key] = tuple(kwargs[list_key])
    return cls(**kwargs)


def _default_of(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def load_config(source: str | os.PathLike | dict[str, Any]) -> ModelConfig:
    """A config from a dict, a ``config.json`` path, or a checkpoint folder holding one."""
    if isinstance(source, dict):
        return config_from_dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config: no such file {path!r}")
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as err:
            raise ValueError(f"config: {path!r} is not valid JSON ({err})") from None
    return config_from_dict(data)


def save_config(config: ModelConfig, path: str | os.PathLike) -> None:
    """Write ``config`` as a ``config.json`` (sparsekv's flat form) that :func:`load_config` reads back."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config.to_dict(), handle, indent=2)
        handle.write("\n")


__all__ = ["DeepseekV32Config", "Glm5NextConfig", "GlmMoeDsaConfig", "MlaConfig", "ModelConfig", "Qwen4ExpConfig",
           "config_from_dict", "load_config", "save_config"]
