"""sparsekv: paged KV cache and sparse-attention indexer kernels for PyTorch.

Storage: :class:`PagedKVCacheCollection`, :class:`PagedKVCache`; management:
:class:`PagedKVCacheManager`. Ops: QSA (``qsa_*``) and MLA k-pool
(``mla_kpool_*``), each a torch custom op with a reference, a CPU and a
Triton backend.
"""

from .cache.layout import SENTINEL, UINT32_SENTINEL, PagedKVCache, PagedKVCacheCollection
from .cache.manager import BatchInputs, CacheGroupSpec, PagedKVCacheManager
from .cache.page_pool import InsufficientPagesError
from .cache.pooled import make_pooled_collection
from .numerics import rope_freqs_cis
from .ops.cache import paged_store
from .ops.kpool import (
    KPoolScorePlan,
    kpool_pool_row_offsets,
    mla_kpool_compress,
    mla_kpool_expand_topk,
    mla_kpool_ring_close,
    mla_kpool_score,
    mla_kpool_seed_tail,
    plan_kpool_score,
)
from .ops.kpool_step import kpool_indexer_step, store_pooled_keys
from .ops.mla import mla_sparse_attention_paged
from .ops.qsa import (QSABlockScorePlan, plan_qsa_block_score_paged, qsa_block_score, qsa_block_score_paged,
                      qsa_compress_keys_paged, qsa_load_block_keys_paged, qsa_select_tokens,
                      qsa_sparse_attention_paged, qsa_store_block_keys_paged)
from .ops.select import SelectedTokens, select_blocks_expand

__version__ = "0.1.0"

__all__ = [
    "SENTINEL",
    "UINT32_SENTINEL",
    "PagedKVCache",
    "PagedKVCacheCollection",
    "PagedKVCacheManager",
    "QSABlockScorePlan",
    "BatchInputs",
    "CacheGroupSpec",
    "InsufficientPagesError",
    "KPoolScorePlan",
    "SelectedTokens",
    "kpool_indexer_step",
    "kpool_pool_row_offsets",
    "make_pooled_collection",
    "mla_kpool_compress",
    "mla_kpool_expand_topk",
    "mla_kpool_ring_close",
    "mla_kpool_score",
    "mla_kpool_seed_tail",
    "mla_sparse_attention_paged",
    "paged_store",
    "plan_kpool_score",
    "plan_qsa_block_score_paged",
    "qsa_block_score",
    "qsa_block_score_paged",
    "qsa_compress_keys_paged",
    "qsa_load_block_keys_paged",
    "qsa_select_tokens",
    "qsa_sparse_attention_paged",
    "qsa_store_block_keys_paged",
    "rope_freqs_cis",
    "select_blocks_expand",
    "store_pooled_keys",
]
