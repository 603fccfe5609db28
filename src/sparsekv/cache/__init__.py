"""Paged KV storage (layout, views) and its manager (page pool, prefix cache)."""

from .layout import SENTINEL, UINT32_SENTINEL, PagedKVCache, PagedKVCacheCollection, ragged_rows, resolve_pages

__all__ = ["SENTINEL", "UINT32_SENTINEL", "PagedKVCache", "PagedKVCacheCollection", "ragged_rows", "resolve_pages"]
