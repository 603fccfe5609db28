"""A same-run ``read`` peer for the paged score rows: the keys an op reads, read where they lie in the pages.

A paged cache stores ``blocks [pages, KV, layers, page_size, heads, D]``, so
one layer's keys of a page are a run of ``page_size * heads * D`` elements,
and the next page's run is a whole page (every layer) or more away: the
hardware prefetcher stops at each run's end. :func:`page_read_peer` reads an
op's keys that way, page by page in the op's order, as the time to bring
them where the op computes, in place of a read of as many bytes in one span
(:func:`.common.read_peer`). Measured here (2 threads, 16 layers of bf16
pages in turn, 134 MB, 8192 keys a sequence, 21 interleaved rounds x 3):
8 KB runs 32.5-33.7 GB/s, the same pages in order 33.4-35.3, ``torch.sum``
of one span 34.7-36.0; 4 KB runs 24.4-35.8 against 29.2-35.6.

Example: the keys that 4 sequences' rows see, each call the next of 16 layers::

    peer = page_read_peer(blocks, lookup_table, seq_keys=[8192] * 4, layers=16)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numba
import numpy as np
import torch

from ..kernels.cpu._parallel import next_task
from .common import layer_turns

_WORD_BYTES = 4
_PAD = 16  # int32 slots between two threads' totals: one cache line each


@numba.njit(parallel=True, cache=True, nogil=True)
def _sum_spans(words, starts, lengths, threads):
    """The int32 sum (wrapping) of ``words[starts[i] : starts[i] + lengths[i]]`` over every span ``i``, spans
    taken by ``threads`` workers as they go (:func:`..kernels.cpu._parallel.next_task`, as the score kernels
    take their tasks)."""
    spans = starts.shape[0]
    totals = np.zeros(threads * _PAD, np.int32)
    claimed = np.zeros(1, np.int64)
    for worker in numba.prange(threads):
        own_run = np.zeros(2, np.int64)
        total = np.int32(0)
        while True:
            i = next_task(claimed, own_run, spans, threads)
            if i < 0:
                break
            span = words[starts[i] : starts[i] + lengths[i]]
            for j in range(span.shape[0]):
                total += span[j]
        totals[worker * _PAD] = total
    grand = np.int32(0)
    for worker in range(threads):  # numba adds int32 as int64 (and numpy sums them so): wrapped at each step
        grand = np.int32(grand + totals[worker * _PAD])
    return grand


def page_spans(blocks: torch.Tensor, lookup_table: torch.Tensor, seq_keys: Sequence[int], layer: int,
               plane: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` in 4-byte words of ``blocks``' storage: for each sequence ``b`` in turn, the runs of
    its first ``seq_keys[b]`` keys, page by page (``lookup_table [B, max_pages]``), in plane ``plane`` of layer
    ``layer``. ``blocks [pages, KV, layers, page_size, heads, D]``, contiguous. A run's bytes are rounded to
    whole words (at most 3 bytes left at each end)."""
    page_size, heads, dim = blocks.shape[3:]
    key_bytes = heads * dim * blocks.element_size()
    stride = [s * blocks.element_size() for s in blocks.stride()]
    starts, lengths = [], []
    for b, keys in enumerate(seq_keys):
        for page in range(-(-int(keys) // page_size)):
            run = min(page_size, int(keys) - page * page_size)
            start = int(lookup_table[b, page]) * stride[0] + plane * stride[1] + layer * stride[2]
            first = -(-start // _WORD_BYTES)
            starts.append(first)
            lengths.append(max(0, (start + run * key_bytes) // _WORD_BYTES - first))
    return np.array(starts, np.int64), np.array(lengths, np.int64)


def page_read_peer(blocks: torch.Tensor, lookup_table: torch.Tensor, seq_keys: Sequence[int], layers: int = 1,
                   plane: int = 0) -> Callable[[], object]:
    """A call that reads the keys :func:`page_spans` names where they lie (sums them as int32 words, writes
    nothing) on numba's threads, each call the next of ``layers`` layers (``0, 1, ..., 0``: a model's step,
    :func:`.common.layer_turns`)."""
    if not blocks.is_contiguous():
        raise ValueError("blocks: expected contiguous page storage")
    storage = blocks.reshape(-1).view(torch.uint8).numpy()
    words = storage[: storage.shape[0] // _WORD_BYTES * _WORD_BYTES].view(np.int32)
    spans = [page_spans(blocks, lookup_table, seq_keys, layer, plane) for layer in range(layers)]
    turns = layer_turns(layers)
    threads = numba.get_num_threads()

    def run() -> int:
        starts, lengths = spans[next(turns)]
        return int(_sum_spans(words, starts, lengths, threads))

    return run


__all__ = ["page_read_peer", "page_spans"]
