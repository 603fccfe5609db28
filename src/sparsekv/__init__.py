"""sparsekv: paged KV cache and sparse-attention indexer kernels for PyTorch.

Storage: :class:`PagedKVCacheCollection`, :class:`PagedKVCache`; management:
:class:`PagedKVCacheManager`. Ops: QSA (``qsa_*``) and MLA k-pool
(``mla_kpool_*``), each a torch custom op with a reference, a CPU and a
Triton backend.
"""

from .cache.layout import SENTINEL, UINT32_SENTINEL, PagedKVCache, PagedKVCacheCollection
from .numerics import rope_freqs_cis
from .ops.cache import paged_store

__version__ = "0.1.0"

__all__ = [
    "SENTINEL",
    "UINT32_SENTINEL",
    "PagedKVCache",
    "PagedKVCacheCollection",
    "paged_store",
    "rope_freqs_cis",
]
