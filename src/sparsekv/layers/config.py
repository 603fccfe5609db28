"""Model configs read from a Hugging Face style ``config.json``.

Two families, told apart by ``model_type``:

* ``qwen4_exp`` (:class:`Qwen4ExpConfig`): the full-attention layers of the
  Qwen4Exp family with their QSA indexer (SPEC 2).
* ``glm5_next`` (:class:`Glm5NextConfig`): the k-pool indexer of the
  GLM-5-Next family (SPEC 3).

Every key is either one the layers use (a dataclass field), or one on the
short list of keys a real checkpoint carries for parts this library does not
build (MLP / MoE, linear-attention layers, the MLA main attention,
tokenizer ids): those are accepted and ignored. Any other key is a
``ValueError`` naming it, so that a typo (``indexer_budjet``) never silently
falls back to a default.

Example::

    cfg = load_config({"model_type": "qwen4_exp", "hidden_size": 256, "num_hidden_layers": 2,
                       "qsa_layers": [0, 1]})
    cfg.rotary_dim  # 64 = head_dim 256 * partial_rotary_factor 0.25
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

# Keys of any Hugging Face config that say nothing about the layers built here.
_GENERIC_KEYS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "initializer_range", "use_cache", "vocab_size",
    "max_position_embeddings", "hidden_act", "intermediate_size", "attention_dropout", "auto_map",
    "_name_or_path", "quantization_config", "rope_scaling", "output_router_logits", "router_aux_loss_coef",
})

# Parts of a Qwen4Exp checkpoint other than its full-attention layers (MoE MLP, Gated DeltaNet layers).
_QWEN4_EXP_OTHER_KEYS = frozenset({
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
})

# Hugging Face spellings of the QSA layer choice (Qwen3-Next style), mapped onto our keys.
_QWEN4_EXP_ALIASES = {"full_attention_interval": "qsa_layer_interval", "layer_types": "qsa_layers"}

# Parts of a GLM-5-Next checkpoint other than the indexer (MLA main attention, MoE).
_GLM5_NEXT_OTHER_KEYS = frozenset({
    "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "rope_theta", "rope_interleave", "attention_bias", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "scoring_func", "topk_method", "moe_layer_freq",
    "num_nextn_predict_layers", "head_dim",
})


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config key {name!r}: expected a positive integer, got {value!r}")


def _check_positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config key {name!r}: expected a positive number, got {value!r}")


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


@dataclass(frozen=True)
class Qwen4ExpConfig:
    """Config of the Qwen4Exp full-attention (QSA) layers. Defaults are the real model's (SPEC 2).

    ``qsa_layers`` (explicit ids) or ``qsa_layer_interval`` (every n-th layer,
    ``n-1, 2n-1, ...``) pick the QSA layers; neither means interval 4. The
    Qwen3-Next spellings ``full_attention_interval`` and ``layer_types``
    (``"full_attention"`` entries) are read as these two.
    The indexer's RoPE uses the main attention's table (``rotary_dim =
    head_dim * partial_rotary_factor``, ``rope_theta``), NeoX half-split.
    """

    model_type: ClassVar[str] = "qwen4_exp"

    hidden_size: int = 2560
    num_hidden_layers: int = 48
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    indexer_n_heads: int = 4
    indexer_head_dim: int = 128
    indexer_compress_ratio: int = 4
    indexer_budget: int = 2048
    qsa_layers: tuple[int, ...] | None = None
    qsa_layer_interval: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "indexer_n_heads", "indexer_head_dim", "indexer_compress_ratio",
                     "indexer_budget"):
            _check_positive_int(name, getattr(self, name))
        for name in ("rope_theta", "rms_norm_eps"):
            _check_positive_float(name, getattr(self, name))
        if not isinstance(self.attention_bias, bool):
            raise ValueError(f"config key 'attention_bias': expected true/false, got {self.attention_bias!r}")
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
                f"config: the rotary dim {int(rotary)} is shared with the indexer and must be "
                f"<= indexer_head_dim ({self.indexer_head_dim})"
            )
        if self.indexer_budget < self.indexer_compress_ratio:
            raise ValueError(
                f"config: indexer_budget ({self.indexer_budget}) must be >= indexer_compress_ratio "
                f"({self.indexer_compress_ratio})"
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
class Glm5NextConfig:
    """Config of the GLM-5-Next k-pool indexer (SPEC 3). Defaults follow the real model.

    ``q_lora_rank``: width of the MLA query latent the indexer's ``wq_b``
    reads (DeepSeek-V3.2 style). ``index_layers`` / ``index_layer_interval``
    pick the layers with an indexer (neither means interval 4: 3, 7, ..., 43).
    ``index_kpool_mode`` is the pooling rule of SPEC 3.1 (``softmax``,
    ``mean`` or ``last``). The indexer is NoPE (no rotary).
    """

    model_type: ClassVar[str] = "glm5_next"

    hidden_size: int = 6144
    num_hidden_layers: int = 45
    q_lora_rank: int = 2048
    rms_norm_eps: float = 1e-5
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    index_kpool_mode: str = "softmax"
    index_norm_eps: float = 1e-6
    index_layers: tuple[int, ...] | None = None
    index_layer_interval: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "q_lora_rank", "index_n_heads", "index_head_dim",
                     "index_topk", "index_kpool"):
            _check_positive_int(name, getattr(self, name))
        for name in ("rms_norm_eps", "index_norm_eps"):
            _check_positive_float(name, getattr(self, name))
        if self.index_kpool_mode not in ("softmax", "mean", "last"):
            raise ValueError(
                f"config key 'index_kpool_mode': expected 'softmax', 'mean' or 'last', got {self.index_kpool_mode!r}"
            )
        if self.index_topk < self.index_kpool:
            raise ValueError(f"config: index_topk ({self.index_topk}) must be >= index_kpool ({self.index_kpool})")
        interval = self.index_layer_interval
        if self.index_layers is None and interval is None:
            interval = 4
        layers = _resolve_layers("index_layer", None if self.index_layers is None else list(self.index_layers),
                                 interval, self.num_hidden_layers)
        if not layers:
            raise ValueError("config: no indexer layer (index_layer_interval larger than num_hidden_layers)")
        object.__setattr__(self, "index_layers", layers)
        object.__setattr__(self, "index_layer_interval", None)  # resolved into index_layers

    @property
    def topk_pools(self) -> int:
        """Pools each query selects at most: ``index_topk // index_kpool``."""
        return self.index_topk // self.index_kpool

    def to_dict(self) -> dict[str, Any]:
        data = {"model_type": self.model_type, **dataclasses.asdict(self)}
        data["index_layers"] = list(self.index_layers)
        data.pop("index_layer_interval")
        return data


ModelConfig = Qwen4ExpConfig | Glm5NextConfig

_FAMILIES: dict[str, tuple[type, frozenset[str]]] = {
    Qwen4ExpConfig.model_type: (Qwen4ExpConfig, _QWEN4_EXP_OTHER_KEYS),
    Glm5NextConfig.model_type: (Glm5NextConfig, _GLM5_NEXT_OTHER_KEYS),
}


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Build the config named by ``data["model_type"]``; unknown keys raise ``ValueError``.

    ``rope_scaling`` must be absent or null (no scaled RoPE is implemented).
    """
    if not isinstance(data, dict):
        raise TypeError(f"config: expected a JSON object (dict), got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"config key 'model_type': expected one of {sorted(_FAMILIES)}, got {model_type!r}")
    cls, other_keys = _FAMILIES[model_type]
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "model_type":
            continue
        if model_type == Qwen4ExpConfig.model_type and key in _QWEN4_EXP_ALIASES:
            if key == "layer_types":
                if not isinstance(value, list):
                    raise ValueError(f"config key 'layer_types': expected a list of strings, got {value!r}")
                value = [i for i, kind in enumerate(value) if kind == "full_attention"]
            target = _QWEN4_EXP_ALIASES[key]
            if target in kwargs or target in data:
                raise ValueError(f"config: give either {key!r} or {target!r}, not both")
            kwargs[target] = value
        elif key in fields:
            kwargs[key] = value
        elif key == "rope_scaling" and value is not None:
            raise ValueError(f"config key 'rope_scaling': scaled RoPE is not supported, got {value!r}")
        elif key not in _GENERIC_KEYS and key not in other_keys:
            raise ValueError(
                f"config key {key!r} is not a known {model_type} key (known: {', '.join(sorted(fields))})"
            )
    for list_key in ("qsa_layers", "index_layers"):
        if isinstance(kwargs.get(list_key), list):
            kwargs[list_key] = tuple(kwargs[list_key])
    return cls(**kwargs)


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
    """Write ``config`` as a ``config.json`` that :func:`load_config` reads back."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config.to_dict(), handle, indent=2)
        handle.write("\n")


__all__ = ["Glm5NextConfig", "ModelConfig", "Qwen4ExpConfig", "config_from_dict", "load_config", "save_config"]
