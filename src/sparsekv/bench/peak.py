"""A same-run peer for compute-bound ops: their multiply-adds at the register tile's peak rate.

A torch copy of the same bytes is the ceiling of a memory-bound op; for an op
that does tens of multiply-adds per byte (block score, pool score, attention)
the ceiling is the machine's multiply-add rate. :func:`tile_peak_peer` times
exactly that: the score tile of :mod:`sparsekv.kernels.cpu._tile_ops` (fused
multiply-adds on float32, ``VDPBF16PS`` on bf16 pairs) over operands that stay
in L1, on every numba thread, for as many multiply-adds as the op needs. Its
column, ``peak time / our time``, is then the fraction of the peak the op
reaches (at most about 1).

Example: block score at decode, 16 query lanes x 8192 blocks x 128 channels
per sequence, 4 sequences, bf16::

    peer = tile_peak_peer({torch.bfloat16: 4 * 16 * 8192 * 128})
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

from ..kernels.cpu._parallel import next_task
from ..kernels.cpu._tile_ops import KEYS_PER_TASK, tile_dots

_LANES = 16  # one vector of lanes, as the score kernels' tile
_CHANNELS = 128


@numba.njit(parallel=True, cache=True, nogil=True)
def _run_tiles(dots, q_t, keys, calls):
    """``calls`` tile passes over the same L1-resident operands, taken by the numba threads as they go
    (:func:`..kernels.cpu._parallel.next_task`, as the score kernels do: a core slower for a while
    does not hold the others up)."""
    threads = dots.shape[0]
    claimed = np.zeros(1, np.int64)
    for t in numba.prange(threads):
        own_run = np.zeros(2, np.int64)  # this worker's claimed run: [next task, end]
        while True:
            call = next_task(claimed, own_run, calls, threads)
            if call < 0:
                break
            tile_dots(dots[t], q_t, keys, _LANES, KEYS_PER_TASK)


def _operands(dtype: torch.dtype):
    """Random query tile, keys and per-thread outputs in the tile's layout for ``dtype``."""
    rng = np.random.default_rng(0)
    threads = numba.get_num_threads()
    dots = np.empty((threads, KEYS_PER_TASK, _LANES), np.float32)
    if dtype == torch.bfloat16:  # bf16 bits of finite values below 1: pairs for VDPBF16PS
        q_t = (rng.integers(0, 2**31, (_CHANNELS // 2, _LANES)) & 0x3F7F3F7F).astype(np.int32)
        keys = (rng.integers(0, 2**15, (KEYS_PER_TASK, _CHANNELS)) & 0x3F7F).astype(np.uint16)
    else:
        q_t = rng.standard_normal((_CHANNELS, _LANES)).astype(np.float32)
        keys = rng.standard_normal((KEYS_PER_TASK, _CHANNELS)).astype(np.float32)
    return dots, q_t, keys


def tile_peak_peer(multiply_adds: dict[torch.dtype, int]) -> Callable[[], object]:
    """A call that does ``multiply_adds[dtype]`` multiply-adds at the tile's peak for each dtype given
    (``torch.bfloat16``: bf16 pairs; any other: float32 fused multiply-adds), rounded up to whole
    tile passes of 128 keys x 16 lanes x 128 channels."""
    per_call = KEYS_PER_TASK * _LANES * _CHANNELS
    work = [(_operands(dtype), max(1, -(-count // per_call))) for dtype, count in multiply_adds.items()]

    def run() -> None:
        for (dots, q_t, keys), calls in work:
            _run_tiles(dots, q_t, keys, calls)

    run()  # compile (or load) before it is timed
    return run


__all__ = ["tile_peak_peer"]
