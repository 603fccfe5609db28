"""Fast CPU QSA kernels (SPEC 2.2, 2.3, 2.5): numba, same signatures as the reference.

What each kernel is made of, and why (measured with ``benchmarks/bench_qsa.py``):

* compress: one numba pass (``prange`` over chunks of output rows) reads each
  block's ``R`` raw rows straight from the pages, sums them in token order,
  applies RMSNorm and RoPE on a scratch row and writes the block key once. The
  reference gathers the keys into a new tensor and makes about ten float32
  temporaries of them. The RMSNorm sums of squares of 16 blocks run as the
  lanes of two vectors (:func:`._tile_ops.square_sums_in_order`: still one
  ordered chain per block, 2.3x fewer cycles than 8 interleaved scalar
  chains), and the RoPE loops write the output row directly (each loop then
  writes one array that none of its reads share, which LLVM vectorises).
  Every loop over channels starts at index 0 of a slice: a loop from a
  non-zero start (``range(2 * half, dim)``) compiled to gathers and scatters
  behind numba's negative-index check, and took 40% of the kernel.
* block-key cache: the store pools only the blocks a call completes, with the
  compress kernel's per-block helpers (the same bits), into pages co-indexed
  with the indexer cache; the load copies a page's blocks at a time; the
  block score over the pages is :mod:`._paged_score`'s kernel (shared with
  the k-pool score) without head weights.
* block score: one task per (sequence, chunk of block keys). The chunk's keys
  are read in place (float32, or bf16 as bits; fp16 widened into scratch),
  and each group of the sequence's rows (about 32 (row, head) lanes, queries
  transposed) runs over them in register tiles of 16 lanes x 8 keys
  (:mod:`._tile_ops`: fused multiply-adds, or for bf16 ``VDPBF16PS`` on
  channel pairs, twice the multiply-adds per instruction). Each dot product is
  the same chain in a fixed channel order whatever shares its tile, so a
  row's scores do not depend on which other rows share the call (SPEC 2.6); a
  BLAS GEMM does not promise that (``torch.mm`` rounds a row differently as
  the row count changes). That order differs from the reference's separate
  products and sums within SPEC 4. The epilogue (ReLU, the sum over a row's
  heads in order, the division) runs on each tile in registers where the
  head count divides 16 (:func:`._score_tasks.write_group_scores`): for 4
  heads a 4 x 4 transpose within each row's lanes, then whole-vector sums;
  40% less epilogue time than transposing the dots through memory at 2048
  blocks, 20% at 8192 (same bits).
* sparse attention (:mod:`._sparse_attend`, shared with MLA): one task per
  (row, KV head) computes the whole query group's logits with the
  block-score tile (the group's heads as lanes) on the selected keys where
  they lie in the pages (their flat starts from the page table; each tile
  prefetches the next tile's keys), the softmax per head with a vectorised
  float32 ``exp`` (:func:`._math.exp_f32`), and ``P @ V`` with a second
  register tile (:func:`._tile_ops.weighted_rows`: 8 heads x 32 channels of
  accumulators, tokens in order) on values gathered 128 at a time with a
  prefetch 8 tokens ahead, then divides once; groups of at most 8 heads pack
  ``16 // group`` prefill rows into one tile. Nothing the size of the
  history is materialised; dense SDPA would read all of it. Keys read in
  place instead of gathered first: 1.3-1.4x faster (bf16/fp32); the value
  prefetch another 5-15%. (The first version, with accumulators in memory
  and a libm ``exp`` per weight, was 4x slower.)

bf16 and fp16 tensors enter numba as their raw 16-bit patterns and are
widened and rounded to nearest-even with integer arithmetic, exactly as torch
casts (:mod:`._bits`). With
``fastmath=False`` LLVM neither reorders sums nor fuses multiply-adds, so
compress equals the reference bit for bit. Inner loops index contiguous slices
with ``range`` indices: numba's negative-index handling of computed indices
would stop LLVM from vectorising them.

Validation (missing pages, ``-1`` inside a counted region, short ``freqs_cis``)
runs before a kernel starts, so a kernel never reads through an invalid page.
It runs as numba loops rather than torch ops, and small inputs run on one
thread (:func:`._parallel.threads_for`): torch's and numba's thread pools
otherwise fight for the cores around every small call.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from ..._checks import check_freqs_cis_rows
from ...cache.layout import page_error
from ..._address import array_at
from ._bits import as_numba, copy_row, narrow, numba_dtype, widen
from ._score_tasks import plan_score_tasks, row_group, score_task, write_group_scores
from ._tile_ir import KEYS_PER_TILE, SQUARE_SUM_ROWS
from ._tile_ops import KEYS_AHEAD, KEYS_PER_TASK, dots_of_rows, new_scratch, square_sums_in_order
from ._pages import first_missing_page
from ._paged_rows import flat_plane
from ._paged_score import PagedScorePlan
from ._parallel import PARALLEL_JIT, next_task, threads_for
from ._sparse_attend import sparse_attention

_ROWS_PER_TASK = 64  # block-key rows per compress task (groups of SQUARE_SUM_ROWS: their RMSNorm sums run at once)


# ---- compress -------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True, inline="always")
def _pooled_mean(block, keys, page_stride, base, page_size, table, b, j, ratio, inverse_ratio, like):
    """``block [D]`` = the mean of sequence ``b``'s raw keys ``j*R .. j*R + R - 1`` (summed in token order in
    float32, divided once, rounded to ``like``'s dtype); ``keys`` the flat cache (``flat_plane``, one head)."""
    dim = block.shape[0]
    column = j * ratio // page_size  # one division per block; its tokens follow on
    slot = j * ratio - column * page_size
    for i in range(ratio):
        if slot == page_size:
            column, slot = column + 1, 0
        start = table[b, column] * page_stride + base + slot * dim
        slot += 1
        raw = keys[start : start + dim]  # a slice: indices from range() vectorise, offsets do not
        if i == 0:
            for d in range(dim):
                block[d] = widen(raw[d])
        else:
            for d in range(dim):
                block[d] = block[d] + widen(raw[d])
    if inverse_ratio != 0.0:
        for d in range(dim):
            block[d] = widen(narrow(block[d] * inverse_ratio, like))
    else:
        for d in range(dim):
            block[d] = widen(narrow(block[d] / np.float32(ratio), like))


@numba.njit(cache=True, nogil=True, inline="always")
def _norm_rope_into(out_row, block, inv_rms, scales, cosines, sines):
    """``out_row [D]`` = ``block`` (a pooled mean, overwritten) RMS-normed with ``inv_rms`` and ``scales = 1 +
    gamma``, rounded, then NeoX-rotated over its first ``2 * len(cosines)`` channels with the rounded
    ``cosines``/``sines``; each step rounded to ``out_row``'s dtype."""
    dim, half = block.shape[0], cosines.shape[0]
    for d in range(dim):
        block[d] = widen(narrow(block[d] * inv_rms * scales[d], out_row))
    # each loop writes one array that none of its reads share, so LLVM vectorises it
    low, high = block[:half], block[half : 2 * half]  # slices, again for vectorisation
    out_low, out_high = out_row[:half], out_row[half : 2 * half]
    for i in range(half):
        out_low[i] = narrow(low[i] * cosines[i] - high[i] * sines[i], out_row)
    for i in range(half):
        out_high[i] = narrow(high[i] * cosines[i] + low[i] * sines[i], out_row)
    unrotated, out_unrotated = block[2 * half :], out_row[2 * half :]
    for d in range(dim - 2 * half):
        out_unrotated[d] = narrow(unrotated[d], out_row)


@numba.njit(cache=True, nogil=True, inline="always")
def _rounded_rotation(cosines, sines, pairs, like):
    """``cosines``/``sines [half]`` = the (cos, sin) pairs of one ``freqs`` row, rounded to ``like``'s dtype."""
    for i in range(cosines.shape[0]):  # unsigned indices: no negative-index check
        cosines[i] = widen(narrow(pairs[np.uint64(2) * np.uint64(i)], like))
        sines[i] = widen(narrow(pairs[np.uint64(2) * np.uint64(i) + np.uint64(1)], like))


@numba.njit(cache=True, nogil=True, inline="always")
def _norm_scales(gamma):
    """``1 + gamma`` as float32 ``[D]``: the zero-centred RMSNorm's per-channel scales."""
    scales = np.empty(gamma.shape[0], np.float32)
    for d in range(gamma.shape[0]):
        scales[d] = np.float32(1.0) + gamma[d]
    return scales


@numba.njit(cache=True, nogil=True, inline="always")
def _group_inverse_rms(acc, squares, inv_rms, eps):
    """``inv_rms[k] = 1 / sqrt(mean(acc[k] ** 2) + eps)`` for the ``SQUARE_SUM_ROWS`` rows of ``acc [16, D]``
    (sums of squares in channel order, the rows as the lanes of a vector; rows without data give values to
    ignore)."""
    square_sums_in_order(acc, squares)
    for k in range(SQUARE_SUM_ROWS):
        inv_rms[k] = np.float32(1.0) / np.sqrt(squares[k] / np.float32(acc.shape[1]) + np.float32(eps))


@numba.njit(cache=True, nogil=True, inline="always")
def _inverse_ratio(ratio):
    """``1 / R`` where ``x / R == x * (1/R)`` exactly (``R`` a power of two: both round the same exact value),
    else 0 (divide)."""
    return np.float32(1.0) / np.float32(ratio) if ratio & (ratio - 1) == 0 else np.float32(0.0)


@numba.njit(**PARALLEL_JIT)
def _compress_kernel(out, keys, page_stride, base, page_size, table, num_blocks, gamma, freqs, ratio, eps, threads):
    """``out [B*max_blocks, D]``; ``keys`` the flat cache (see ``flat_plane``, one head);
    ``freqs [positions, rotary]`` float32, (cos, sin) pairs interleaved; ``num_blocks [B]`` pooled blocks per
    sequence. ``threads`` workers take the tasks of ``_ROWS_PER_TASK`` rows in runs as they go
    (:func:`._parallel.claim_tasks`), each with one set of scratch (against numba's equal split of a
    ``prange`` over the tasks: 1.04-1.15x faster in bf16, 1.05-1.28x in fp32, at 4 x 8192-131072 keys)."""
    rows, dim = out.shape
    max_blocks = rows // num_blocks.shape[0]
    half = freqs.shape[1] // 2
    # cos/sin of every block start, rounded to the keys' dtype once: every sequence reads this
    # small table in order, instead of every ratio-th row of the whole freqs_cis table
    rotations = np.empty((min(max_blocks, np.max(num_blocks)), 2, half), np.float32)
    for j in prange(rotations.shape[0]):
        _rounded_rotation(rotations[j, 0], rotations[j, 1], freqs[j * ratio], out)
    scales = _norm_scales(gamma)
    inverse_ratio = _inverse_ratio(ratio)
    tasks = (rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    workers = max(1, min(threads, tasks))
    claimed = np.zeros(1, np.int64)
    for worker in prange(workers):
        acc = np.empty((SQUARE_SUM_ROWS, dim), np.float32)
        squares = np.empty(SQUARE_SUM_ROWS, np.float32)
        inv_rms = np.empty(SQUARE_SUM_ROWS, np.float32)
        own_run = np.zeros(2, np.int64)  # this worker's claimed run: [next task, end]
        while True:
            task = next_task(claimed, own_run, tasks, workers)
            if task < 0:
                break
            task_end = min((task + 1) * _ROWS_PER_TASK, rows)
            for group_start in range(task * _ROWS_PER_TASK, task_end, SQUARE_SUM_ROWS):
                group = min(SQUARE_SUM_ROWS, task_end - group_start)
                for k in range(group):  # 1. mean of the R raw keys, in token order, rounded
                    row = group_start + k
                    b, j = row // max_blocks, row % max_blocks
                    if j >= num_blocks[b]:
                        acc[k, :] = 0.0
                    else:
                        _pooled_mean(acc[k], keys, page_stride, base, page_size, table, b, j, ratio,
                                     inverse_ratio, out)
                _group_inverse_rms(acc, squares, inv_rms, eps)  # 2. sums of squares in channel order
                for k in range(group):  # 3. RMSNorm, RoPE, store
                    row = group_start + k
                    b, j = row // max_blocks, row % max_blocks
                    out_row = out[row]
                    if j >= num_blocks[b]:
                        for d in range(dim):
                            out_row[d] = narrow(np.float32(0.0), out)
                    else:
                        _norm_rope_into(out_row, acc[k], inv_rms[k], scales, rotations[j, 0], rotations[j, 1])


@numba.njit(**PARALLEL_JIT)
def _store_blocks_kernel(target, target_stride, target_base, blocks_per_page, keys, page_stride, base, page_size,
                         table, first_blocks, num_blocks, gamma, freqs, ratio, eps, threads):
    """Blocks ``first_blocks[b] .. num_blocks[b] - 1`` of each sequence ``b``, pooled as in
    :func:`_compress_kernel`, block ``j`` written to row ``j % blocks_per_page`` of page ``table[b, j //
    blocks_per_page]`` of ``target`` (a flat block-key cache: ``target_stride`` per page, its layer from
    ``target_base``). ``first_blocks <= num_blocks``. ``threads`` workers take the tasks of ``_ROWS_PER_TASK``
    new blocks in runs as they go (:func:`._parallel.next_task`), each with one set of scratch."""
    batch = num_blocks.shape[0]
    dim = gamma.shape[0]
    half = freqs.shape[1] // 2
    row_starts = np.zeros(batch + 1, np.int64)  # new blocks as rows, sequence after sequence
    for b in range(batch):
        row_starts[b + 1] = row_starts[b] + max(num_blocks[b] - first_blocks[b], 0)
    rows = row_starts[batch]
    scales = _norm_scales(gamma)
    inverse_ratio = _inverse_ratio(ratio)
    tasks = (rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    workers = max(1, min(threads, tasks))
    claimed = np.zeros(1, np.int64)
    for worker in prange(workers):
        acc = np.empty((SQUARE_SUM_ROWS, dim), np.float32)
        squares = np.empty(SQUARE_SUM_ROWS, np.float32)
        inv_rms = np.empty(SQUARE_SUM_ROWS, np.float32)
        cosines = np.empty(half, np.float32)
        sines = np.empty(half, np.float32)
        own_run = np.zeros(2, np.int64)  # this worker's claimed run: [next task, end]
        while True:
            task = next_task(claimed, own_run, tasks, workers)
            if task < 0:
                break
            task_end = min((task + 1) * _ROWS_PER_TASK, rows)
            for group_start in range(task * _ROWS_PER_TASK, task_end, SQUARE_SUM_ROWS):
                group = min(SQUARE_SUM_ROWS, task_end - group_start)
                for k in range(group):
                    row = group_start + k
                    b = np.searchsorted(row_starts, row, side="right") - 1
                    j = first_blocks[b] + row - row_starts[b]
                    _pooled_mean(acc[k], keys, page_stride, base, page_size, table, b, j, ratio, inverse_ratio,
                                 target)
                _group_inverse_rms(acc, squares, inv_rms, eps)
                for k in range(group):
                    row = group_start + k
                    b = np.searchsorted(row_starts, row, side="right") - 1
                    j = first_blocks[b] + row - row_starts[b]
                    _rounded_rotation(cosines, sines, freqs[j * ratio], target)
                    start = table[b, j // blocks_per_page] * target_stride + target_base + j % blocks_per_page * dim
                    _norm_rope_into(target[start : start + dim], acc[k], inv_rms[k], scales, cosines, sines)


@numba.njit(**PARALLEL_JIT)
def _load_blocks_kernel(out, source, source_stride, source_base, blocks_per_page, table, num_blocks):
    """``out [B*max_blocks, D]``: row ``b*max_blocks + j`` = block ``j`` of sequence ``b`` from the flat
    block-key cache ``source`` (laid out as for :func:`_store_blocks_kernel`) for ``j < num_blocks[b]``, zero
    elsewhere. One task per (sequence, logical page): a page's blocks are ``blocks_per_page`` consecutive rows
    in the cache and in ``out``, so each task is one contiguous copy (a copy per row, with its page lookup
    and division, took twice as long)."""
    rows, dim = out.shape
    batch = num_blocks.shape[0]
    max_blocks = rows // batch
    pages_per_sequence = (max_blocks + blocks_per_page - 1) // blocks_per_page
    flat_out = out.reshape(rows * dim)
    for task in prange(batch * pages_per_sequence):
        b, page = task // pages_per_sequence, task % pages_per_sequence
        first = page * blocks_per_page
        end = min(first + blocks_per_page, max_blocks)
        stored = min(max(num_blocks[b] - first, 0), end - first)
        target = flat_out[(b * max_blocks + first) * dim : (b * max_blocks + end) * dim]
        if stored > 0:
            start = table[b, page] * source_stride + source_base
            copy_row(target[: stored * dim], source[start : start + stored * dim])
        target[stored * dim :] = 0


def _checked_block_sources(freqs_cis, num_blocks, blocks, lookup_table, ratio, dtype):
    """Validate that ``freqs_cis`` has a row for every block start and the table every page that blocks ``0 ..
    num_blocks[b] - 1`` read (``ValueError`` before anything is written); returns the RoPE rows the
    kernels read (``freqs [positions, rotary]`` float32 numpy, each value as the keys' dtype rounds it)."""
    check_freqs_cis_rows(freqs_cis.shape[0], num_blocks, ratio)
    b, t = first_missing_page(lookup_table.numpy(), blocks.shape[0], blocks.shape[3], num_blocks * ratio)
    if b >= 0:
        raise page_error(lookup_table, blocks.shape[0], blocks.shape[3], b, t)
    needed_positions = int(num_blocks.max()) * ratio - ratio + 1 if num_blocks.shape[0] else 0
    if freqs_cis.dtype == torch.float64:  # round once, from float64 straight to the keys' dtype
        freqs_cis = freqs_cis.to(dtype)
    return freqs_cis[: max(needed_positions, 1)].float().contiguous().numpy()


def qsa_compress_keys_paged(block_keys, gamma, freqs_cis, key_counts, blocks, lookup_table, layer, ratio, eps):
    """Same contract as :func:`sparsekv.kernels.reference.qsa.qsa_compress_keys_paged`."""
    batch = key_counts.shape[0]
    max_blocks = block_keys.shape[0] // batch
    # host math in numpy: a torch op costs several microseconds each, this whole wrapper ~10
    num_blocks = np.clip(key_counts.numpy().astype(np.int64) // ratio, 0, max_blocks)
    freqs = _checked_block_sources(freqs_cis, num_blocks, blocks, lookup_table, ratio, block_keys.dtype)
    out = (block_keys if block_keys.is_contiguous()
           else torch.empty_like(block_keys, memory_format=torch.contiguous_format))
    keys, page_stride, base = flat_plane(blocks, 0, layer)
    with threads_for(block_keys.numel() * ratio) as threads:
        _compress_kernel(as_numba(out), keys, page_stride, base, blocks.shape[3], lookup_table.numpy(),
                         num_blocks.astype(np.int32), gamma.float().contiguous().numpy(), freqs, ratio, float(eps),
                         threads)
    if out is not block_keys:
        block_keys.copy_(out)


def qsa_store_block_keys_paged(block_blocks, gamma, freqs_cis, key_counts, first_blocks, blocks, lookup_table, layer,
                               ratio, eps, max_new_blocks):
    """Same contract as :func:`sparsekv.kernels.reference.qsa.qsa_store_block_keys_paged`."""
    num_blocks = key_counts.numpy().astype(np.int64) // ratio
    first = first_blocks.numpy().astype(np.int64)
    if not (first < num_blocks).any():  # a decode step between block ends: nothing completes
        return
    freqs = _checked_block_sources(freqs_cis, num_blocks, blocks, lookup_table, ratio, block_blocks.dtype)
    b, j = first_missing_page(lookup_table.numpy(), block_blocks.shape[0], block_blocks.shape[3], num_blocks)
    if b >= 0:
        raise page_error(lookup_table, block_blocks.shape[0], block_blocks.shape[3], b, j)
    keys, page_stride, base = flat_plane(blocks, 0, layer)
    target, target_stride, target_base = flat_plane(block_blocks, 0, layer)
    with threads_for(int((num_blocks - first).clip(0).sum()) * ratio * gamma.shape[0]) as threads:
        _store_blocks_kernel(target, target_stride, target_base, block_blocks.shape[3], keys, page_stride, base,
                             blocks.shape[3], lookup_table.numpy(), first, num_blocks,
                             gamma.float().contiguous().numpy(), freqs, ratio, float(eps), threads)


def qsa_load_block_keys_paged(block_keys, key_counts, block_blocks, lookup_table, layer, ratio):
    """Same contract as :func:`sparsekv.kernels.reference.qsa.qsa_load_block_keys_paged`."""
    batch = key_counts.shape[0]
    max_blocks = block_keys.shape[0] // batch
    num_blocks = np.clip(key_counts.numpy().astype(np.int64) // ratio, 0, max_blocks)
    b, j = first_missing_page(lookup_table.numpy(), block_blocks.shape[0], block_blocks.shape[3], num_blocks)
    if b >= 0:
        raise page_error(lookup_table, block_blocks.shape[0], block_blocks.shape[3], b, j)
    out = (block_keys if block_keys.is_contiguous()
           else torch.empty_like(block_keys, memory_format=torch.contiguous_format))
    source, source_stride, source_base = flat_plane(block_blocks, 0, layer)
    with threads_for(block_keys.numel()):
        _load_blocks_kernel(as_numba(out), source, source_stride, source_base, block_blocks.shape[3],
                            lookup_table.numpy(), num_blocks)
    if out is not block_keys:
        block_keys.copy_(out)


# ---- block score --------------------------------------------------------------------

@numba.njit(**PARALLEL_JIT)
def _block_score_kernel(scores, q, keys, offsets, positions, ratio, max_blocks, scale, threads):
    """``scores [total_q, out_cols]``; ``q [total_q, heads, D]``; ``keys [B*max_blocks, D]``.

    Task = (sequence, chunk of its block keys): each group of the sequence's
    rows runs over the chunk's keys, read in place (:func:`._tile_ops.dots_of_rows`), each tile asking for
    the keys ``KEYS_AHEAD`` rows on.
    ``q_t[group]`` holds a row group's queries transposed, lane ``row*heads +
    h``, zeros in the padding lanes.
    ``threads`` workers take the tasks in runs as they go (:func:`._parallel.claim_tasks`), each with one set of
    scratch.
    """
    total_q, heads, dim = q.shape
    batch = offsets.shape[0] - 1
    usable_cols = min(scores.shape[1], max_blocks)
    visible = np.empty(total_q, np.int64)
    for r in range(total_q):
        visible[r] = min(max((positions[r] + 1) // ratio, 0), usable_cols)
    num_keys, task_starts, group_starts, q_t, group_rows = plan_score_tasks(scores, q, offsets, visible)
    group_lanes = q_t.shape[2]
    divisor = np.float32(scale)  # the block score sums relu(dot) unweighted, then divides
    tasks = task_starts[batch]
    workers = max(1, min(threads, tasks))
    claimed = np.zeros(1, np.int64)
    for worker in prange(workers):
        scratch = new_scratch(keys, dim)
        dots = np.empty((KEYS_PER_TASK + KEYS_PER_TILE, group_lanes), np.float32)
        work = np.empty((group_lanes, KEYS_PER_TASK + KEYS_PER_TILE), np.float32)
        own_run = np.zeros(2, np.int64)  # this worker's claimed run: [next task, end]
        while True:
            task = next_task(claimed, own_run, tasks, workers)
            if task < 0:
                break
            b, first_row, end_row, g0, chunk = score_task(task, task_starts, group_starts, num_keys, offsets)
            rows = keys[b * max_blocks + g0 : b * max_blocks + g0 + chunk]
            for r0 in range(first_row, end_row, group_rows):
                r1, needed, lanes = row_group(r0, end_row, group_rows, visible, g0, chunk, heads)
                if needed <= 0:
                    continue
                dots_of_rows(dots, q_t[group_starts[b] + (r0 - first_row) // group_rows], rows[:needed], lanes,
                             scratch, KEYS_AHEAD)
                write_group_scores(scores, dots, work, r0, r1, g0, chunk, needed, visible, lanes, heads, None,
                                   divisor)


@numba.njit(cache=True, nogil=True)
def _block_scores_at(scores_at, q_at, keys_at, offsets_at, positions_at, total_q, heads, dim, out_cols, key_rows,
                     batch, element, ratio, max_blocks, scale, threads):
    """:func:`_block_score_kernel` over tensors given by address (:func:`sparsekv._address.array_at`; each
    C-contiguous): float32 ``scores [total_q, out_cols]``, ``q [total_q, heads, dim]`` and ``keys [key_rows,
    dim]`` of ``element`` (:func:`._bits.numba_dtype`), int32 ``offsets [batch + 1]`` and ``positions
    [total_q]``."""
    _block_score_kernel(array_at(scores_at, (total_q, out_cols), np.float32),
                        array_at(q_at, (total_q, heads, dim), element),
                        array_at(keys_at, (key_rows, dim), element),
                        array_at(offsets_at, (batch + 1,), np.int32), array_at(positions_at, (total_q,), np.int32),
                        ratio, max_blocks, scale, threads)


def qsa_block_score(scores, q, block_keys, query_positions, input_row_offsets, ratio, score_scale):
    """Same contract as :func:`sparsekv.kernels.reference.qsa.qsa_block_score` (int32 positions and offsets)."""
    batch = input_row_offsets.shape[0] - 1
    max_blocks = block_keys.shape[0] // batch
    out = scores if scores.is_contiguous() else torch.empty_like(scores, memory_format=torch.contiguous_format)
    q, block_keys = q.contiguous(), block_keys.contiguous()
    positions, offsets = query_positions.contiguous(), input_row_offsets.contiguous()
    if (q.dtype != block_keys.dtype or positions.dtype != torch.int32 or offsets.dtype != torch.int32
            or scores.dtype != torch.float32):
        raise TypeError(f"qsa_block_score: expected q and block_keys of one dtype, int32 positions and offsets and "
                        f"float32 scores, got {q.dtype}, {block_keys.dtype}, {positions.dtype}, {offsets.dtype}, "
                        f"{scores.dtype}")
    total_q, heads, dim = q.shape
    with threads_for(total_q * max_blocks * heads * dim) as threads:
        _block_scores_at(out.data_ptr(), q.data_ptr(), block_keys.data_ptr(), offsets.data_ptr(), positions.data_ptr(),
                         total_q, heads, dim, out.shape[1], block_keys.shape[0], batch, numba_dtype(q.dtype), ratio,
                         max_blocks, float(score_scale), threads)
    if out is not scores:
        scores.copy_(out)


class BlockScorePlan(PagedScorePlan):
    """:func:`qsa_block_score_paged`'s rows set up once for every layer (:class:`._paged_score.PagedScorePlan`,
    one key per block of ``ratio`` tokens; :class:`sparsekv.ops.qsa.QSABlockScorePlan` uses it)."""

    __slots__ = ()

    def __init__(self, block_blocks: torch.Tensor, lookup_table: torch.Tensor, query_positions: torch.Tensor,
                 input_row_offsets: torch.Tensor, ratio: int, score_scale: float, out_cols: int) -> None:
        super().__init__(block_blocks, lookup_table, query_positions, input_row_offsets, ratio, out_cols,
                         float(score_scale))

    def page_error(self, seq: int, key: int) -> ValueError:
        return page_error(self.lookup_table, self.keys.num_pages, self.keys.per_page, seq, key)

    def run(self, scores: torch.Tensor, q: torch.Tensor, layer: int) -> None:
        """:func:`qsa_block_score_paged` of ``layer`` into ``scores [total_q, out_cols]``."""
        self.run_scores(scores, q, None, layer)


def qsa_block_score_paged(scores, q, block_blocks, lookup_table, query_positions, input_row_offsets, layer, ratio,
                          score_scale):
    """Same contract as :func:`sparsekv.kernels.reference.qsa.qsa_block_score_paged`: the paged score kernel of
    :mod:`._paged_score` without head weights, over the block-key cache's pages (pages validated first;
    :class:`BlockScorePlan`)."""
    BlockScorePlan(block_blocks, lookup_table, query_positions, input_row_offsets, ratio, score_scale,
                   scores.shape[1]).run(scores, q, layer)


# ---- sparse attention -------------------------------------------------------------

def qsa_sparse_attention_paged(out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale,
                               gate):
    """Same contract as :func:`sparsekv.kernels.reference.qsa.qsa_sparse_attention_paged`: the kernel of
    :mod:`._sparse_attend` with the values in the cache's value plane."""
    sparse_attention(out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale, gate, 1)
