"""Paged KV storage: the block tensor, its address math and per-layer views.

Layout (SPEC 1.1)::

    blocks [num_pages, KV, num_layers, page_size, num_heads, head_size]

``KV == 2`` holds keys (plane 0) and values (plane 1); ``KV == 1`` holds keys
only (latent / indexer caches). Sequence ``b``'s logical page ``i`` (tokens
``i*page_size .. i*page_size + page_size - 1``) lives in physical page
``lookup_table[b, i]``. Element address of (b, t, plane c, layer l, head h,
channel d)::

    p*page_stride + ((c*num_layers + l)*page_size + r)*num_heads*head_size + h*head_size + d
    with p = lookup_table[b, t // page_size], r = t % page_size

``page_stride`` is ``blocks.stride(0)``: packed blocks have stride
``KV*num_layers*page_size*num_heads*head_size``; a larger stride arises when
``blocks`` is a view of pages interleaved with other cache groups.

Unassigned lookup entries hold a sentinel (``-1`` in an int32 table, the same
bits as ``0xFFFFFFFF`` in a uint32 one). Every CPU path that would read or
write through a sentinel or any entry outside ``[0, num_pages)`` raises a
``ValueError`` naming the sequence and position, and touches nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._checks import (KEY_DTYPES, as_index_tensor, check_int, check_nonnegative, check_offsets, check_tensor,
                       host_array, most_rows)
from .._env import host_checks

#: Sentinel for an unassigned page in an int32 lookup table.
SENTINEL = -1
#: The same sentinel as a uint32 table spells it.
UINT32_SENTINEL = 0xFFFFFFFF


def ragged_rows(input_row_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand ``[B+1]`` row offsets into per-row (sequence id, index inside the sequence).

    Example: offsets ``[0, 3, 3, 5]`` give seq ids ``[0, 0, 0, 2, 2]`` and
    local indices ``[0, 1, 2, 0, 1]``. Both returned as int64 ``[T]``.
    """
    offsets = input_row_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    batch = lengths.shape[0]
    seq_ids = torch.repeat_interleave(torch.arange(batch, device=offsets.device), lengths)
    local = torch.arange(seq_ids.shape[0], device=offsets.device) - offsets[:-1][seq_ids]
    return seq_ids, local


def page_problem(lookup_table: torch.Tensor, num_pages: int, page_size: int, b: int, t: int) -> str | None:
    """Why position ``t`` of sequence ``b`` has no valid page, in the words every page error uses;
    ``None`` when it has one. ``lookup_table``: ``[B, max_pages]`` int32 (sentinel ``-1``)."""
    if t < 0:
        return f"position {t} is negative"
    logical = t // page_size
    if logical >= lookup_table.shape[1]:
        return f"logical page {logical} is beyond the lookup table's {lookup_table.shape[1]} columns"
    page = int(lookup_table[b, logical])
    if page == SENTINEL:
        return f"its page (lookup_table[{b}, {logical}]) is the sentinel (unassigned)"
    if not 0 <= page < num_pages:
        return f"its page (lookup_table[{b}, {logical}]) is {page}, outside [0, {num_pages})"
    return None


def page_error(lookup_table: torch.Tensor, num_pages: int, page_size: int, b: int, t: int) -> ValueError:
    """The ``ValueError`` for a missing page: ``paged cache: sequence b, position t: <page_problem>``."""
    return ValueError(f"paged cache: sequence {b}, position {t}: "
                      f"{page_problem(lookup_table, num_pages, page_size, b, t)}")


def first_missing_page(lookup_table: torch.Tensor, num_pages: int, page_size: int,
                       token_counts: torch.Tensor) -> tuple[int, int] | None:
    """``(sequence, first position of the page)`` of the first page that tokens ``0 .. token_counts[b]-1``
    of some sequence need and the table does not validly hold, or ``None``.

    Memory and time in proportion to the lookup table, whatever the counts
    (a count past the table's end is found without expanding it).
    """
    counts = token_counts.to(torch.int64).cpu().clamp_min(0)
    table = lookup_table.cpu()
    columns = table.shape[1]
    pages_needed = (counts + page_size - 1) // page_size
    needed = torch.arange(columns)[None, :] < pages_needed[:, None]  # [B, columns]
    bad = needed & ((table < 0) | (table >= num_pages))
    first_bad = torch.where(bad.any(dim=1), bad.to(torch.int8).argmax(dim=1), torch.where(
        pages_needed > columns, columns, -1))
    seqs = torch.nonzero(first_bad >= 0).flatten()
    if seqs.numel() == 0:
        return None
    b = int(seqs[0])
    return b, int(first_bad[b]) * page_size


def check_needed_pages(lookup_table: torch.Tensor, num_pages: int, page_size: int,
                       token_counts: torch.Tensor) -> None:
    """Raise :func:`page_error` unless tokens ``0 .. token_counts[b]-1`` of every sequence have a valid page.

    Bounded like :func:`first_missing_page`; names the sequence and the first
    position of the first missing page.
    """
    missing = first_missing_page(lookup_table, num_pages, page_size, token_counts)
    if missing is not None:
        raise page_error(lookup_table, num_pages, page_size, *missing)


def resolve_pages(
    lookup_table: torch.Tensor,
    num_pages: int,
    page_size: int,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    error: Callable[[int, int], Exception] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map (sequence, position) pairs to (physical page, row in page), validated.

    Args:
        lookup_table: ``[B, max_pages]`` int32 (sentinel ``-1``).
        seq_ids, positions: int tensors of the same shape.
        error: ``error(seq, position)`` builds the exception for a pair
            without a valid page, for a caller whose positions mean something
            else to its user (e.g. pool ids); default :func:`page_error`.

    Returns int64 ``pages`` and ``rows`` of that shape. Raises ``error`` for
    the first (sequence, position) whose page is negative, beyond the table,
    a sentinel or outside ``[0, num_pages)``.
    """
    seq_ids = seq_ids.to(torch.int64)
    positions = positions.to(torch.int64)
    max_pages = lookup_table.shape[1]
    logical = torch.div(positions, page_size, rounding_mode="floor")
    in_table = (positions >= 0) & (logical < max_pages)
    safe_logical = torch.where(in_table, logical, torch.zeros_like(logical))
    pages = lookup_table[seq_ids, safe_logical].to(torch.int64)
    valid = in_table & (pages >= 0) & (pages < num_pages)
    if not bool(valid.all()):
        bad = int(torch.nonzero(~valid.reshape(-1))[0])
        seq, position = int(seq_ids.reshape(-1)[bad]), int(positions.reshape(-1)[bad])
        if error is not None:
            raise error(seq, position)
        raise page_error(lookup_table, num_pages, page_size, seq, position)
    return pages, positions % page_size


def store_rows(
    blocks: torch.Tensor,
    values: torch.Tensor,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    plane: int,
    layer: int,
) -> None:
    """Write ``values [T, H, D]``: row ``i`` of sequence ``b`` to position ``cache_lengths[b] + i``.

    The raw-tensor store under :meth:`PagedKVCache.store` and the reference
    ``paged_store`` kernel. Arguments as that kernel takes them: ``blocks``
    ``[num_pages, KV, num_layers, page_size, H, D]``, ``lookup_table`` ``[B, max_pages]``
    int32, ``cache_lengths`` ``[B]`` int, ``input_row_offsets`` ``[B+1]`` int
    (already checked: non-decreasing from 0, last entry ``T``), ``plane`` and
    ``layer`` in range. Every destination page is resolved by
    :func:`resolve_pages` before the first write, so a missing page raises
    ``ValueError`` and nothing is written.

    Example: cache lengths ``[5, 0]``, offsets ``[0, 2, 3]``, page size 4 write
    sequence 0's positions 5, 6 (rows 1, 2 of its logical page 1) and sequence
    1's position 0.
    """
    seq_ids, local = ragged_rows(input_row_offsets)
    positions = cache_lengths.to(torch.int64)[seq_ids] + local
    pages, rows = resolve_pages(lookup_table, blocks.shape[0], blocks.shape[3], seq_ids, positions)
    blocks[pages, plane, layer, rows] = values


class PagedKVCacheCollection:
    """Paged K/V storage of all layers for one batch of sequences (SPEC 1.1).

    Args:
        blocks: ``[num_pages, KV, num_layers, page_size, num_heads, head_size]``,
            bf16/fp16/fp32, ``KV`` in {1, 2}; dims after the first contiguous.
        cache_lengths: ``[B]`` int32/uint32/int64, tokens cached *before* this call.
        lookup_table: ``[B, max_pages]`` int32/uint32/int64 page ids, sentinel for none.
        max_seq_length: largest number of new tokens of one sequence in this call (an int):
            storing more rows than that for one sequence is an error.
        max_cache_length: largest ``cache_lengths`` entry.
        page_stride: elements between consecutive pages, ``-1`` for packed.
            Must equal ``blocks.stride(0)`` (a padded stride is expressed by
            passing a strided view of a larger allocation).

    Index tensors are kept as int32 on ``blocks.device`` (uint32 reinterpreted).

    Example (2 sequences, page size 4, 3 and 6 cached tokens)::

        blocks = torch.zeros(5, 2, 1, 4, 1, 8)
        coll = PagedKVCacheCollection(blocks, torch.tensor([3, 6], dtype=torch.int32),
                                      torch.tensor([[0, -1], [3, 1]], dtype=torch.int32),
                                      max_seq_length=1, max_cache_length=6)
        coll.get_key_cache(0).load(1, torch.tensor([5]))  # page 1, row 1 (5 = 1*4 + 1)
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        cache_lengths: torch.Tensor,
        lookup_table: torch.Tensor,
        max_seq_length: int,
        max_cache_length: int,
        page_stride: int = -1,
    ) -> None:
        check_tensor("blocks", blocks, ndim=6, dtypes=KEY_DTYPES)
        num_pages, kv, num_layers, page_size, num_heads, head_size = blocks.shape
        if kv not in (1, 2):
            raise ValueError(f"blocks: expected KV (axis 1) in {{1, 2}}, got {kv}")
        if min(num_layers, page_size, num_heads, head_size) < 1:
            raise ValueError(f"blocks: expected non-empty layer/page/head dims, got {tuple(blocks.shape)}")
        packed = kv * num_layers * page_size * num_heads * head_size
        inner_strides = (num_layers * page_size * num_heads * head_size,
                         page_size * num_heads * head_size, num_heads * head_size, head_size, 1)
        if tuple(blocks.stride()[1:]) != inner_strides:
            raise ValueError(
                f"blocks: dims after the page axis must be contiguous (strides {inner_strides}), "
                f"got strides {tuple(blocks.stride()[1:])}"
            )
        check_int("page_stride", page_stride)
        actual_stride = blocks.stride(0) if num_pages > 1 else (packed if page_stride == -1 else page_stride)
        if page_stride == -1:
            if actual_stride != packed:
                raise ValueError(
                    f"page_stride: -1 means packed pages ({packed} elements) but blocks.stride(0) is "
                    f"{actual_stride}; pass page_stride={actual_stride}"
                )
        elif page_stride < packed:
            raise ValueError(f"page_stride: expected -1 or >= {packed} (one packed page), got {page_stride}")
        elif page_stride != actual_stride:
            raise ValueError(
                f"page_stride: expected blocks.stride(0) = {actual_stride}, got {page_stride}; "
                "view the shared allocation with that page stride"
            )
        self.blocks = blocks
        self.page_stride = actual_stride
        self.cache_lengths = check_nonnegative("cache_lengths", cache_lengths, device=blocks.device)
        self.lookup_table = as_index_tensor("lookup_table", lookup_table, ndim=2, device=blocks.device)
        if self.lookup_table.shape[0] != self.batch_size:
            raise ValueError(f"lookup_table: expected {self.batch_size} rows (batch size from cache_lengths), "
                             f"got {self.lookup_table.shape[0]}")
        self.max_seq_length = check_int("max_seq_length", max_seq_length, minimum=0)
        self.max_cache_length = check_int("max_cache_length", max_cache_length, minimum=0)
        if host_checks(blocks.device) and self.batch_size > 0:
            longest = int(host_array(self.cache_lengths).max())
            if longest > self.max_cache_length:
                raise ValueError(f"max_cache_length: expected >= max(cache_lengths) = {longest}, "
                                 f"got {self.max_cache_length}")

    # ---- shape facts -----------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.blocks.shape[0]

    @property
    def kv_planes(self) -> int:
        return self.blocks.shape[1]

    @property
    def num_layers(self) -> int:
        return self.blocks.shape[2]

    @property
    def page_size(self) -> int:
        return self.blocks.shape[3]

    @property
    def num_heads(self) -> int:
        return self.blocks.shape[4]

    @property
    def head_size(self) -> int:
        return self.blocks.shape[5]

    @property
    def batch_size(self) -> int:
        return self.cache_lengths.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.lookup_table.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    # ---- views -----------------------------------------------------------
    def _check_layer(self, layer_idx: int) -> int:
        check_int("layer_idx", layer_idx, minimum=0)
        if layer_idx >= self.num_layers:
            raise ValueError(f"layer_idx: expected < num_layers = {self.num_layers}, got {layer_idx}")
        return layer_idx

    def get_key_cache(self, layer_idx: int) -> PagedKVCache:
        """Plane 0 (keys) of one layer."""
        return PagedKVCache(self, self._check_layer(layer_idx), plane=0)

    def get_value_cache(self, layer_idx: int) -> PagedKVCache:
        """Plane 1 (values) of one layer; a ``ValueError`` for a keys-only (``KV == 1``) cache."""
        if self.kv_planes == 1:
            raise ValueError("get_value_cache: this collection has KV == 1 (keys only); it holds no values")
        return PagedKVCache(self, self._check_layer(layer_idx), plane=1)

    def check_store(self, values: torch.Tensor, input_row_offsets: torch.Tensor, *, layer_idx: int, plane: int,
                    check_values: bool) -> torch.Tensor:
        """Check the arguments of a store into ``plane`` of layer ``layer_idx``; returns the offsets as int32.

        Args:
            values: ``[T, num_heads, head_size]`` in the cache's dtype, on its device.
            input_row_offsets: ``[B+1]`` int32/int64, ``T == input_row_offsets[-1]``.
            layer_idx, plane: which layer, 0 for keys and 1 for values.
            check_values: also check the offsets' values (non-decreasing from 0,
                last one ``T``, no sequence longer than ``max_seq_length``); this
                reads them on the host.
        """
        check_int("plane", plane, minimum=0)
        if plane >= self.kv_planes:
            raise ValueError(f"plane: expected < KV = {self.kv_planes}, got {plane}")
        self._check_layer(layer_idx)
        check_tensor("values", values, shape=(None, self.num_heads, self.head_size), dtypes=(self.dtype,),
                     device=self.device)
        check_tensor("input_row_offsets", input_row_offsets, shape=(self.batch_size + 1,))
        if not check_values:
            return input_row_offsets.to(self.device).to(torch.int32)
        offsets = check_offsets("input_row_offsets", input_row_offsets, batch=self.batch_size, total=values.shape[0],
                                total_of="rows of values", device=self.device)
        b, rows = most_rows(host_array(offsets))
        if rows > self.max_seq_length:
            raise ValueError(f"input_row_offsets: sequence {b} stores {rows} rows, more than the "
                             f"collection's max_seq_length = {self.max_seq_length}")
        return offsets

    def cache_length(self, batch_idx: int) -> int:
        """Tokens cached for sequence ``batch_idx`` before this call."""
        check_int("batch_idx", batch_idx, minimum=0)
        if batch_idx >= self.batch_size:
            raise ValueError(f"batch_idx: expected < batch size {self.batch_size}, got {batch_idx}")
        return int(self.cache_lengths[batch_idx])

    def element_offset(self, batch_idx: int, token: int, plane: int, layer: int, head: int, channel: int) -> int:
        """Element address (SPEC 1.1) relative to ``blocks.data_ptr()``, validated."""
        pages, rows = resolve_pages(
            self.lookup_table, self.num_pages, self.page_size,
            torch.tensor([batch_idx]), torch.tensor([token]),
        )
        p, r = int(pages[0]), int(rows[0])
        return (p * self.page_stride
                + ((plane * self.num_layers + layer) * self.page_size + r) * self.num_heads * self.head_size
                + head * self.head_size + channel)

    def __repr__(self) -> str:
        return (f"PagedKVCacheCollection(pages={self.num_pages}, KV={self.kv_planes}, layers={self.num_layers}, "
                f"page_size={self.page_size}, heads={self.num_heads}, head_size={self.head_size}, "
                f"batch={self.batch_size}, page_stride={self.page_stride}, dtype={self.dtype})")


class PagedKVCache:
    """One plane (keys or values) of one layer of a :class:`PagedKVCacheCollection`."""

    def __init__(self, collection: PagedKVCacheCollection, layer_idx: int, plane: int) -> None:
        self.collection = collection
        self.layer_idx = layer_idx
        self.plane = plane

    @property
    def page_size(self) -> int:
        return self.collection.page_size

    @property
    def num_heads(self) -> int:
        return self.collection.num_heads

    @property
    def head_size(self) -> int:
        return self.collection.head_size

    def cache_length(self, batch_idx: int) -> int:
        return self.collection.cache_length(batch_idx)

    def store(self, values: torch.Tensor, input_row_offsets: torch.Tensor) -> None:
        """Write this call's rows: row ``i`` of sequence ``b`` goes to position ``cache_lengths[b] + i``.

        Args:
            values: ``[T, num_heads, head_size]`` in the cache's dtype, ``T = input_row_offsets[-1]``.
            input_row_offsets: ``[B+1]`` int, non-decreasing, starting at 0.

        Validates the arguments and every destination page first (reading them
        on the host, also for GPU tensors); on a sentinel or out-of-range page
        it raises ``ValueError`` and writes nothing. The op
        ``sparsekv.paged_store`` does the same through the chosen backend (on a
        GPU without host syncs, and under ``torch.compile``).
        """
        c = self.collection
        offsets = c.check_store(values, input_row_offsets, layer_idx=self.layer_idx, plane=self.plane,
                                check_values=True)
        store_rows(c.blocks, values, c.lookup_table, c.cache_lengths, offsets, self.plane, self.layer_idx)

    def load(self, batch_idx: int, positions: torch.Tensor) -> torch.Tensor:
        """Read tokens ``positions`` (``[n]`` int) of sequence ``batch_idx``: ``[n, num_heads, head_size]``."""
        check_int("batch_idx", batch_idx, minimum=0)
        if batch_idx >= self.collection.batch_size:
            raise ValueError(f"batch_idx: expected < batch size {self.collection.batch_size}, got {batch_idx}")
        check_tensor("positions", positions, ndim=1)
        if positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise TypeError(f"positions: expected an integer tensor, got {positions.dtype}")
        positions = positions.to(self.collection.device)
        seq_ids = torch.full_like(positions, batch_idx, dtype=torch.int64)
        return self.gather(seq_ids, positions)

    def gather(self, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Read any (sequence, position) pairs at once: shape ``[*, num_heads, head_size]``."""
        c = self.collection
        pages, rows = resolve_pages(c.lookup_table, c.num_pages, c.page_size, seq_ids, positions)
        return c.blocks[pages, self.plane, self.layer_idx, rows]


def packed_page_elements(kv: int, num_layers: int, page_size: int, num_heads: int, head_size: int) -> int:
    """Elements in one packed page (the ``page_stride`` that ``-1`` stands for)."""
    return math.prod((kv, num_layers, page_size, num_heads, head_size))
