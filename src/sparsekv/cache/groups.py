"""Cache group shapes, per-batch kernel inputs and usage metrics of the manager.

Split from ``manager.py`` so that the manager module holds only the request
lifecycle; see its docstring for the co-indexed group design.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .._checks import KEY_DTYPES, check_int
from .layout import PagedKVCacheCollection, packed_page_elements


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """Shape of one cache group; its pages share page ids with every other group.

    Args:
        name: unique group name (``"main"``, ``"indexer"``, ``"kpool"``).
        kv_planes: 2 (keys and values) or 1 (keys only).
        num_layers, num_heads, head_size: the blocks' layer, head and channel dims.
        dtype: bfloat16, float16 or float32.
        tokens_per_entry: tokens per stored entry (4 for a k-pool of 4, else 1);
            must divide the manager's page size.
    """

    name: str
    kv_planes: int
    num_layers: int
    num_heads: int
    head_size: int
    dtype: torch.dtype
    tokens_per_entry: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"CacheGroupSpec.name: expected a str, got {type(self.name).__name__} {self.name!r}")
        if not self.name:
            raise ValueError("CacheGroupSpec.name: expected a non-empty str, got ''")
        check_int("CacheGroupSpec.kv_planes", self.kv_planes)
        if self.kv_planes not in (1, 2):
            raise ValueError(f"CacheGroupSpec.kv_planes: expected 1 or 2, got {self.kv_planes}")
        for attr in ("num_layers", "num_heads", "head_size", "tokens_per_entry"):
            check_int(f"CacheGroupSpec.{attr}", getattr(self, attr), minimum=1)
        if self.dtype not in KEY_DTYPES:
            raise TypeError(f"CacheGroupSpec.dtype: expected bfloat16, float16 or float32, got {self.dtype}")

    def entries_per_page(self, page_size: int) -> int:
        return page_size // self.tokens_per_entry

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of this group."""
        elements = packed_page_elements(self.kv_planes, self.num_layers, self.entries_per_page(page_size),
                                        self.num_heads, self.head_size)
        return elements * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """Page counts and bytes of one cache group (page counts are shared by all groups)."""

    pages_used: int
    pages_free: int
    pages_evictable: int
    page_bytes: int

    @property
    def bytes_used(self) -> int:
        return self.pages_used * self.page_bytes

    @property
    def bytes_evictable(self) -> int:
        return self.pages_evictable * self.page_bytes

    @property
    def bytes_total(self) -> int:
        return (self.pages_used + self.pages_free + self.pages_evictable) * self.page_bytes


@dataclass(frozen=True, slots=True)
class CacheMetrics:
    """A snapshot of the manager: pool usage per group and prefix-cache counters."""

    num_pages: int
    num_requests: int
    groups: dict[str, GroupUsage]
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_query_requests: int
    prefix_hit_requests: int

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens / queried prompt tokens (0 before any query)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(slots=True, eq=False)
class BatchInputs:
    """Kernel inputs for one batch, built by :meth:`PagedKVCacheManager.prepare`.

    ``input_row_offsets [B+1]``, ``cache_lengths [B]`` and ``lookup_table
    [B, max_pages]`` are int32 on the manager's device (table padded with
    ``SENTINEL`` -1); ``max_seq_length`` / ``max_cache_length`` are Python ints.
    The lookup table serves every cache group (co-indexed page ids);
    :meth:`collection` wraps one group's blocks with it (each group owns a
    packed tensor, so its ``page_stride`` is the packed page size).
    """

    request_ids: tuple
    input_row_offsets: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    max_seq_length: int
    max_cache_length: int
    host_cache_lengths: np.ndarray = field(repr=False)
    host_new_tokens: np.ndarray = field(repr=False)
    groups: dict[str, CacheGroupSpec] = field(repr=False)
    blocks: dict[str, torch.Tensor] = field(repr=False)
    _collections: dict[str, PagedKVCacheCollection] = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def _spec(self, group_name: str) -> CacheGroupSpec:
        try:
            return self.groups[group_name]
        except (KeyError, TypeError):
            raise ValueError(f"group_name: unknown cache group {group_name!r}; "
                             f"groups are {list(self.groups)}") from None

    def _entry_counts(self, spec: CacheGroupSpec) -> tuple[np.ndarray, np.ndarray]:
        """Per request: entries cached before this call, entries this call completes."""
        per = spec.tokens_per_entry
        before = self.host_cache_lengths // per
        return before, (self.host_cache_lengths + self.host_new_tokens) // per - before

    def entry_row_offsets(self, group_name: str) -> torch.Tensor:
        """``[B+1]`` int32 offsets of the entries this call completes in one group.

        Equal to ``input_row_offsets`` for ``tokens_per_entry == 1``. Example
        (R = 4): cache lengths ``[6, 0]``, new ``[3, 5]`` complete ``[1, 1]``
        entries (``9 // 4 - 6 // 4 = 1``, ``5 // 4 - 0 = 1``): offsets ``[0, 1, 2]``.
        """
        spec = self._spec(group_name)
        if spec.tokens_per_entry == 1:
            return self.input_row_offsets
        _, new_entries = self._entry_counts(spec)
        offsets = np.zeros(len(new_entries) + 1, dtype=np.int32)
        np.cumsum(new_entries, out=offsets[1:], dtype=np.int32)
        return torch.from_numpy(offsets).to(self.lookup_table.device)

    def collection(self, group_name: str) -> PagedKVCacheCollection:
        """One group's :class:`PagedKVCacheCollection` for this batch (built once, then reused).

        For ``tokens_per_entry = R > 1`` lengths count entries:
        ``cache_lengths // R`` and ``max_seq_length`` = most entries completed
        by one request (see :meth:`entry_row_offsets`).
        """
        spec = self._spec(group_name)
        built = self._collections.get(group_name)
        if built is None:
            if spec.tokens_per_entry == 1:
                lengths, max_new, max_cached = self.cache_lengths, self.max_seq_length, self.max_cache_length
            else:
                before, new_entries = self._entry_counts(spec)
                lengths = torch.from_numpy(before.astype(np.int32)).to(self.lookup_table.device)
                max_new, max_cached = int(new_entries.max()), int(before.max())
            built = PagedKVCacheCollection(self.blocks[group_name], lengths, self.lookup_table,
                                           max_seq_length=max_new, max_cache_length=max_cached)
            self._collections[group_name] = built
        return built
