"""Paged rows as the CPU kernels of several families read them: the cache as one flat array and the flat
starts of selected tokens (numba, on host arrays)."""

from __future__ import annotations

import numba
import numpy as np
import torch

from ._bits import as_numba, narrow
from ._tile_ops import new_query_tiles, put_queries


def flat_plane(blocks: torch.Tensor, plane: int, layer: int) -> tuple[np.ndarray, int, int]:
    """``blocks``' memory as one flat array, its page stride, and where (plane, layer) starts in a page.

    Element (page, row, head, channel) of that plane and layer is
    ``flat[page*page_stride + base + (row*heads + head)*D + channel]``; the
    same element of plane ``plane + k`` is ``k * plane_span(blocks)`` further.
    A flat array lets LLVM vectorise the channel loops, which it cannot do
    through a strided 6-d view whose innermost stride is only known at run time.
    Pages may lie apart (``blocks.stride(0)``), their insides must be
    contiguous, and there must be at least one page.

    The view is made in numpy: a torch op right after a kernel that streamed
    megabytes of keys runs with its code out of the caches (``as_strided``
    then cost 20-50 us, against 1 us back to back).
    """
    cache = as_numba(blocks)
    if blocks.is_contiguous():
        flat = cache.reshape(-1)
    else:
        flat = np.lib.stride_tricks.as_strided(cache, (flat_span(blocks),), (cache.itemsize,))
    return flat, blocks.stride(0), plane_base(blocks, plane, layer)


def flat_span(blocks: torch.Tensor) -> int:
    """Elements from the first of ``blocks`` to past its last (pages may lie apart): :func:`flat_plane`'s
    length, and that of the array a kernel makes at ``blocks.data_ptr()`` (none without pages)."""
    if blocks.shape[0] == 0:
        return 0
    return (blocks.shape[0] - 1) * blocks.stride(0) + blocks.shape[1] * plane_span(blocks)


def plane_base(blocks: torch.Tensor, plane: int, layer: int) -> int:
    """Where (plane, layer) starts in a page of ``blocks``, in elements (:func:`flat_plane`'s ``base``)."""
    _, _, _, page_size, heads, dim = blocks.shape
    return plane * plane_span(blocks) + layer * page_size * heads * dim


def plane_span(blocks: torch.Tensor) -> int:
    """Elements of one plane (every layer) in a page of ``blocks [pages, KV, layers, page_size, heads, D]``."""
    _, _, layers, page_size, heads, dim = blocks.shape
    return layers * page_size * heads * dim


@numba.njit(cache=True, nogil=True, inline="always")
def _log2_if_power_of_two(n):
    """``log2(n)`` for a power of two ``n >= 1``, else -1."""
    if n <= 0 or n & (n - 1) != 0:
        return -1
    shift = 0
    while (1 << shift) < n:
        shift += 1
    return shift


@numba.njit(cache=True, nogil=True)
def token_starts(starts, positions, table_row, page_size, page_stride, plane_base, kv_heads, kv_head, dim):
    """``starts[i]`` = flat index of KV head ``kv_head`` of token ``positions[i]`` in one plane
    (``plane_base``) of the flat main cache, through the sequence's page-table row; the entries after
    ``len(positions)`` repeat the last start (padding for the tiles' look-ahead)."""
    shift = _log2_if_power_of_two(page_size)  # shifts instead of two integer divisions per token
    n = positions.shape[0]
    for i in range(n):
        position = positions[i]
        if shift >= 0:
            page, slot = position >> shift, position & (page_size - 1)
        else:
            page, slot = position // page_size, position % page_size
        starts[i] = table_row[page] * page_stride + plane_base + (slot * kv_heads + kv_head) * dim
    starts[n:] = starts[n - 1] if n > 0 else 0


@numba.njit(cache=True, nogil=True, inline="always")
def zero_heads(out, lse, r, h0, group):
    """Row ``r``'s heads ``h0 .. h0+group-1`` as a row with no selected token: ``lse`` -inf, ``out`` 0
    (``out [total_q, q_heads, Dv]`` float32 or bf16/fp16 bits, ``lse [total_q, q_heads]`` float32)."""
    for h in range(h0, h0 + group):
        lse[r, h] = -np.inf
        out_row = out[r, h]
        for d in range(out.shape[2]):
            out_row[d] = narrow(np.float32(0.0), out)


@numba.njit(cache=True, nogil=True, inline="always")
def query_tile_of_heads(q, r, h0, group, lanes):
    """One query tile (:func:`._tile_ops.new_query_tiles`, ``lanes`` wide) holding row ``r``'s heads
    ``h0 .. h0+group-1`` of ``q [total_q, q_heads, D]`` in lanes ``0 .. group-1``, zeros after."""
    q_t = new_query_tiles(q, 1, lanes)[0]
    put_queries(q_t, 0, q[r, h0 : h0 + group])
    return q_t
