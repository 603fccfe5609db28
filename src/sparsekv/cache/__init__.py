"""Paged KV storage (layout, views) and its manager (page pool, prefix cache)."""

from .hashing import page_hash, prefix_page_hashes
from .layout import (
    SENTINEL,
    UINT32_SENTINEL,
    PagedKVCache,
    PagedKVCacheCollection,
    ragged_rows,
    resolve_pages,
)
from .manager import (
    BatchInputs,
    CacheGroupSpec,
    CacheMetrics,
    GroupUsage,
    PagedKVCacheManager,
)
from .memory import allocate_pages
from .page_pool import InsufficientPagesError, PagePool, PageRecord

__all__ = [
    "SENTINEL",
    "UINT32_SENTINEL",
    "BatchInputs",
    "CacheGroupSpec",
    "CacheMetrics",
    "GroupUsage",
    "InsufficientPagesError",
    "PagePool",
    "PageRecord",
    "PagedKVCache",
    "PagedKVCacheCollection",
    "PagedKVCacheManager",
    "allocate_pages",
    "page_hash",
    "prefix_page_hashes",
    "ragged_rows",
    "resolve_pages",
]
