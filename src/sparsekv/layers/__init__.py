"""Model layers with the checkpoints' weight names, and their config/checkpoint loading.

* :class:`QSAAttention` / :class:`QSAIndexer` (Qwen4Exp full-attention layers, SPEC 2),
  stacked by :class:`Qwen4ExpSlice`; :func:`qsa_cache_groups` (K/V, indexer and block-key cache groups);
* :class:`KPoolIndexer` (the DSA indexer: GLM-5-Next's k-pool, ``kpool = 1`` for
  GLM-5 / DeepSeek-V3.2, SPEC 3), with :class:`KPoolIndexerLayer` and :class:`Glm5NextIndexerSlice`;
* :class:`MlaSparseAttention` (MLA attention over the indexer's selection, SPEC 3.4),
  stacked by :class:`MlaSlice`; :func:`mla_cache_groups` (latent + indexer cache groups);
* :func:`load_config` (``config.json``), :class:`CheckpointReader` and
  :func:`load_module_weights` / :func:`load_slice_weights` (safetensors by weight name).
"""

from ._common import batch_positions
from .checkpoint import (
    CheckpointReader,
    load_module_weights,
    load_slice_weights,
    module_state,
    open_checkpoint,
    save_checkpoint,
    slice_state,
)
from .config import (DeepseekV32Config, Glm5NextConfig, GlmMoeDsaConfig, MlaConfig, ModelConfig, Qwen4ExpConfig,
                     config_from_dict, load_config, save_config)
from .dsa import mla_cache_groups
from .kpool import Glm5NextIndexerSlice, KPoolIndexer, KPoolIndexerLayer, KPoolResult, RMSNorm
from .mla import MlaResult, MlaSlice, MlaSparseAttention
from .qsa import (
    QSAAttention,
    QSAIndexer,
    QSAResult,
    Qwen4ExpSlice,
    RotaryTable,
    ZeroCentredRMSNorm,
    dense_causal_attention,
    qsa_cache_groups,
)

__all__ = [
    "CheckpointReader",
    "DeepseekV32Config",
    "Glm5NextConfig",
    "Glm5NextIndexerSlice",
    "GlmMoeDsaConfig",
    "KPoolIndexer",
    "KPoolIndexerLayer",
    "KPoolResult",
    "MlaConfig",
    "MlaResult",
    "MlaSlice",
    "MlaSparseAttention",
    "ModelConfig",
    "QSAAttention",
    "QSAIndexer",
    "QSAResult",
    "Qwen4ExpConfig",
    "Qwen4ExpSlice",
    "RMSNorm",
    "RotaryTable",
    "ZeroCentredRMSNorm",
    "batch_positions",
    "config_from_dict",
    "dense_causal_attention",
    "load_config",
    "load_module_weights",
    "load_slice_weights",
    "mla_cache_groups",
    "module_state",
    "open_checkpoint",
    "qsa_cache_groups",
    "save_checkpoint",
    "save_config",
    "slice_state",
]
