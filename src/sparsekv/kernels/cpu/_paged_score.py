"""The score kernel over keys that live in a paged cache: k-pool pool scores (SPEC 3.3) and QSA block scores
read from a block-key cache (SPEC 2.3), one numba pass for both.

For query row ``r`` at position ``t`` and key ``g`` (row ``g % per_page`` of
page ``table[b, g // per_page]``)::

    score[r, g] = (sum_h w[r, h] * relu(q[r, h] . K_g)) / divisor

for the keys each row sees, ``g < min((t+1) // ratio, out_cols)``
(:func:`visible_keys`), ``-inf`` elsewhere; without weights each term is
``relu(...)`` alone (the QSA block score, divided by its ``score_scale``).
One task per (sequence, chunk of 128 keys): the chunk's keys are read in
place, page by page, through the page table (bf16 as bits, no copy; each
tile asks for the keys a page or more on), by each group of the sequence's
rows in register tiles (:mod:`._tile_ops`: every dot product the same chain
in a fixed channel order; bf16 pairs through ``VDPBF16PS``), then relu and
the sum over heads in head order, on the tiles in registers
(:func:`._score_tasks.write_group_scores`; for GLM's 32 heads 0.51 -> 0.36
us per 128 pools against summing over the transposed dots). So a row's scores do not depend on the rows that share the
call (BLAS does not promise that), nothing is gathered into a copy first, and
a QSA block score from the pages equals the one over contiguous block keys
bit for bit (the same tiles and epilogue, the same keys).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch
from numba.extending import overload

from ..._address import array_at
from ._bits import as_numba
from ._pages import first_missing_page
from ._paged_rows import flat_plane
from ._parallel import next_task, threads_for
from ._score_tasks import plan_score_tasks, row_group, score_task, write_group_scores
from ._tile_ir import KEYS_PER_TILE
from ._tile_ops import KEYS_AHEAD, KEYS_PER_TASK, dots_of_rows, new_scratch, prefetch_span


@numba.njit(cache=True, nogil=True)
def visible_keys(positions, offsets, ratio, out_cols):
    """``(visible [total_q], needed [B], total)``: the keys each row sees (``(t+1)//ratio`` capped at
    ``out_cols``), each sequence's most (the keys whose pages it needs) and their sum over the rows (the
    work to split)."""
    batch = offsets.shape[0] - 1
    visible = np.empty(positions.shape[0], np.int64)
    needed = np.zeros(batch, np.int64)
    total = 0
    for b in range(batch):
        for r in range(offsets[b], offsets[b + 1]):
            visible[r] = min(max((np.int64(positions[r]) + 1) // ratio, 0), out_cols)
            needed[b] = max(needed[b], visible[r])
            total += visible[r]
    return visible, needed, total


def prefetch_pages_ahead(per_page: int) -> int:
    """How many pages on from the one it scores the paged score asks for keys: at least ``KEYS_AHEAD`` keys
    and one page further.

    Pages lie anywhere, so the hardware prefetcher cannot run ahead from one page to the next; each tile
    of a page asks for the same slots of that later page while it computes, one cache line per channel
    step (:func:`._tile_ops.dots_of_rows`). That measured better than whole pages asked for in a burst as
    each page began (a core keeps a few dozen misses in flight, and the products waited behind the rest),
    against the kernel alone's same-run peak, two threads (docs/performance-notes.md): keys from memory, 16
    layers in turn, the QSA block score's 8 KB pages bf16 0.57-0.60 -> 0.69-0.72 of the peak, fp32
    0.50-0.58 -> 0.69-0.74, 32768 blocks x 8 layers 0.53-0.56 -> 0.62-0.67, the k-pool score's 4 KB pages
    bf16 0.66-0.68 -> 0.75-0.76; keys in the L3 the same within 2% (QSA) or better (k-pool 0.75-0.77 ->
    0.77-0.80). 1 to 4 pages of 32 keys ahead measured alike; 64 keys ahead of 16-key pages 1-3% slower
    than 16 or 32.
    """
    return max(1, -(-KEYS_AHEAD // per_page))


@numba.njit(cache=True, nogil=True, inline="always")
def _rows_to_page_ahead(cache, table, b, key, run, num_keys, page, start, page_stride, per_page, dim, pages_ahead):
    """How many key rows from ``start`` (key ``key`` of sequence ``b``, in page ``page``) to the same slot
    ``pages_ahead`` pages on, for the tiles to ask for (``KEYS_PER_TILE``, the next tile, where that key is
    past the ``num_keys`` whose pages are validated). The keys of the run's partial tile, which the tiles
    do not read in place, are asked for here. Rounded down to whole rows (a page stride that is not whole
    keys asks for lines up to a key early)."""
    far_key = key + pages_ahead * per_page
    if far_key >= num_keys or dim == 0:
        return KEYS_PER_TILE
    ahead_rows = (table[b, far_key // per_page] - page) * page_stride // dim
    partial = run % KEYS_PER_TILE
    if partial:
        prefetch_span(cache, start + (ahead_rows + run - partial) * dim, partial * dim)
    return ahead_rows


@numba.njit(parallel=True, cache=True, nogil=True)
def _paged_score_kernel(scores, q, head_weights, cache, page_stride, base, per_page, num_pages, table, visible,
                        seq_keys, offsets, divisor, pages_ahead, threads):
    """``scores [total_q, out_cols]``; ``q [total_q, heads, D]``; ``head_weights [total_q, heads]`` float32 or
    ``None``; ``cache`` the paged keys as one flat array: key slot ``s`` of page ``n`` (this layer) starts at
    ``cache[n*page_stride + base + s*D]``, ``num_pages`` pages; ``divisor`` float32; ``visible`` and
    ``seq_keys`` (its ``needed``) from :func:`visible_keys`.

    Returns ``(-1, -1)`` having written the scores, or, having written nothing, the first page that a
    sequence's ``seq_keys`` keys need and ``table`` lacks (:func:`._pages.first_missing_page`): the check
    runs in the same call as the scores (a numba call from Python costs ~1.5 us, more with the caches
    cold after a layer's other work).

    Each group of a task's rows runs over the chunk's keys it sees (none: the group is skipped), page by
    page, while its tiles ask for the keys ``pages_ahead`` pages on (:func:`prefetch_pages_ahead`).
    ``q_t[group]`` holds a row group's queries transposed, ``[D, lanes]``, zero padding lanes. ``threads``
    workers take the tasks in runs as they go (:func:`._parallel.claim_tasks`), each with one set of scratch.
    """
    seq, key = first_missing_page(table, num_pages, per_page, seq_keys)
    if seq >= 0:
        return seq, key
    total_q, heads, dim = q.shape
    batch = offsets.shape[0] - 1
    num_keys, task_starts, group_starts, q_t, group_rows = plan_score_tasks(scores, q, offsets, visible)
    group_lanes = q_t.shape[2]
    tasks = task_starts[batch]
    workers = max(1, min(threads, tasks))
    claimed = np.zeros(1, np.int64)
    for worker in numba.prange(workers):
        scratch = new_scratch(cache, dim)
        dots = np.empty((KEYS_PER_TASK + KEYS_PER_TILE, group_lanes), np.float32)
        work = np.empty((group_lanes, KEYS_PER_TASK + KEYS_PER_TILE), np.float32)
        # a group's rows (at most group_rows) first; the register epilogue reads up to lanes // heads rows
        group_weights = np.zeros((max(group_rows, group_lanes), heads), np.float32)
        own_run = np.zeros(2, np.int64)  # this worker's claimed run: [next task, end]
        while True:
            task = next_task(claimed, own_run, tasks, workers)
            if task < 0:
                break
            b, first_row, end_row, key0, chunk = score_task(task, task_starts, group_starts, num_keys, offsets)
            for r0 in range(first_row, end_row, group_rows):
                r1, needed, lanes = row_group(r0, end_row, group_rows, visible, key0, chunk, heads)
                if needed <= 0:
                    continue
                group_q = q_t[group_starts[b] + (r0 - first_row) // group_rows]
                column = 0
                while column < needed:  # page by page: a page's keys are consecutive rows
                    key = key0 + column
                    slot = key % per_page
                    run = min(per_page - slot, needed - column)
                    page = table[b, key // per_page]
                    start = page * page_stride + base + slot * dim
                    ahead_rows = _rows_to_page_ahead(cache, table, b, key, run, num_keys[b], page, start,
                                                     page_stride, per_page, dim, pages_ahead)
                    dots_of_rows(dots[column:], group_q, cache[start : start + run * dim].reshape((run, dim)),
                                 lanes, scratch, ahead_rows)
                    column += run
                if head_weights is None:
                    write_group_scores(scores, dots, work, r0, r1, key0, chunk, needed, visible, lanes, heads,
                                       None, divisor)
                else:
                    group_weights[: r1 - r0] = head_weights[r0:r1]
                    write_group_scores(scores, dots, work, r0, r1, key0, chunk, needed, visible, lanes, heads,
                                       group_weights, divisor)
    return np.int64(-1), np.int64(-1)


def _weights_at(address, rows, heads):
    """``None`` for ``address`` ``None``, else :func:`sparsekv._address.array_at` float32 ``[rows, heads]``
    (numba only)."""
    raise NotImplementedError


@overload(_weights_at, inline="always")
def _weights_at_overload(address, rows, heads):
    if isinstance(address, (numba.types.NoneType, numba.types.Omitted)):
        return lambda address, rows, heads: None
    return lambda address, rows, heads: array_at(address, (rows, heads), np.float32)


@numba.njit(cache=True, nogil=True)
def _paged_scores_at(scores_at, q_at, weights_at, total_q, heads, dim, out_cols, cache, page_stride, base, per_page,
                     num_pages, table, visible, seq_keys, offsets, divisor, pages_ahead, threads):
    """:func:`_paged_score_kernel` over tensors given by address (:func:`sparsekv._address.array_at`; each
    C-contiguous): ``scores_at`` float32 ``[total_q, out_cols]``, ``q_at`` ``[total_q, heads, dim]`` of
    ``cache``'s element type, ``weights_at`` float32 ``[total_q, heads]`` or ``None``."""
    return _paged_score_kernel(array_at(scores_at, (total_q, out_cols), np.float32),
                               array_at(q_at, (total_q, heads, dim), cache),
                               _weights_at(weights_at, total_q, heads), cache, page_stride, base, per_page, num_pages,
                               table, visible, seq_keys, offsets, divisor, pages_ahead, threads)


class PagedKeys(NamedTuple):
    """A paged key cache as :func:`_paged_score_kernel` reads it: plane 0 of layer ``layer`` starts at
    ``cache[n*page_stride + base + layer*layer_span]`` in page ``n``, ``per_page`` keys a page."""

    cache: np.ndarray
    page_stride: int
    base: int
    layer_span: int
    per_page: int
    num_pages: int


def paged_keys(blocks: torch.Tensor) -> PagedKeys:
    """:class:`PagedKeys` over ``blocks [num_pages, KV, layers, per_page, 1, D]`` (pages may be strided,
    not their insides: a copy is made otherwise)."""
    num_pages, _, _, per_page, heads, dim = blocks.shape
    if num_pages == 0:  # validated by the caller: no row sees a key
        return PagedKeys(as_numba(blocks).reshape(-1), 0, 0, 0, per_page, 0)
    # the whole tensor is asked first: indexing a page costs ~1 us
    if not (blocks.is_contiguous() or blocks[0].is_contiguous()):
        blocks = blocks.contiguous()
    cache, page_stride, base = flat_plane(blocks, 0, 0)
    return PagedKeys(cache, page_stride, base, per_page * heads * dim, per_page, num_pages)


class PagedScorePlan:
    """A paged score's query rows over one key cache, set up once and run for any of its layers: the keys each
    row sees (:func:`visible_keys` of the rows' positions and offsets, ``ratio`` tokens per key, at most
    ``out_cols``), the keys as the kernel reads them (:func:`paged_keys`), ``divisor``, and how many pages ahead
    the kernel asks for keys (:func:`prefetch_pages_ahead`).

    Pages are checked when the plan is made (an early error) and again by each run, in the kernel's own
    call, against the lookup table's values as they are then (the table may change between runs: a plan
    never reads a page it has not checked, and a run that finds one missing writes nothing). A family names
    a missing page its own way (:meth:`page_error`); the k-pool score and the QSA block score each subclass
    it.
    """

    __slots__ = ("lookup_table", "table", "positions", "offsets", "ratio", "divisor", "keys", "key_dtype", "visible",
                 "seq_keys", "total_visible", "pages_ahead")

    def __init__(self, blocks: torch.Tensor, lookup_table: torch.Tensor, query_positions: torch.Tensor,
                 input_row_offsets: torch.Tensor, ratio: int, out_cols: int, divisor: float) -> None:
        self.lookup_table, self.table = lookup_table, lookup_table.numpy()
        self.positions, self.offsets = query_positions.numpy(), input_row_offsets.numpy()
        self.ratio, self.divisor = ratio, np.float32(divisor)  # as the kernel takes it, made once (~0.4 us)
        self.keys, self.key_dtype = paged_keys(blocks), blocks.dtype
        self.visible, self.seq_keys, self.total_visible = visible_keys(self.positions, self.offsets, ratio, out_cols)
        self.pages_ahead = prefetch_pages_ahead(self.keys.per_page)
        seq, key = first_missing_page(self.table, self.keys.num_pages, self.keys.per_page, self.seq_keys)
        if seq >= 0:
            raise self.page_error(seq, key)

    def page_error(self, seq: int, key: int) -> ValueError:
        """The error for key ``key`` of sequence ``seq``, which a row sees, without a valid page."""
        raise NotImplementedError

    def run_scores(self, scores: torch.Tensor, q: torch.Tensor, head_weights: torch.Tensor | None, layer: int) -> None:
        """The scores of ``layer`` into ``scores [total_q, out_cols]`` float32 (the rows' pages checked first,
        nothing written when one is missing); ``q [total_q, heads, D]`` in the keys' dtype, ``head_weights``
        float32 ``[total_q, heads]`` or ``None``."""
        if scores.shape[0] == 0:
            return
        if q.dtype != self.key_dtype:  # the kernel reads q's memory as the keys' elements
            raise TypeError(f"q: expected the keys' dtype {self.key_dtype}, got {q.dtype}")
        if scores.dtype != torch.float32:  # the kernel writes float32 at its address
            raise TypeError(f"scores: expected float32, got {scores.dtype}")
        keys = self.keys
        target = scores if scores.is_contiguous() else torch.empty_like(scores, memory_format=torch.contiguous_format)
        q = q.contiguous()
        total_q, heads, dim = q.shape
        weights_at = None
        if head_weights is not None:
            if head_weights.dtype != torch.float32 or head_weights.shape != (total_q, heads):
                raise ValueError(f"head_weights: expected float32 [{total_q}, {heads}], got {head_weights.dtype} "
                                 f"{list(head_weights.shape)}")
            weights_at = head_weights.contiguous().data_ptr()
        with threads_for(self.total_visible * heads * dim) as threads:
            seq, key = _paged_scores_at(target.data_ptr(), q.data_ptr(), weights_at, total_q, heads, dim,
                                        target.shape[1], keys.cache, keys.page_stride,
                                        keys.base + layer * keys.layer_span, keys.per_page, keys.num_pages,
                                        self.table, self.visible, self.seq_keys, self.offsets,
                                        self.divisor, self.pages_ahead, threads)
        if seq >= 0:
            raise self.page_error(seq, key)
        if target is not scores:
            scores.copy_(target)
