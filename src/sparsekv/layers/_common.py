"""Pieces shared by the model layers: stage timers, ragged positions, frozen linear projections."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..cache.layout import ragged_rows

__all__ = ["StageTimerLike", "batch_positions", "frozen_linear", "no_timer"]

#: ``timer(stage_name)`` returns a context manager timing that stage (see the demo's ``StageTimer``).
StageTimerLike = Callable[[str], contextlib.AbstractContextManager]


def no_timer(_stage: str) -> contextlib.AbstractContextManager:
    """The default ``timer``: times nothing."""
    return contextlib.nullcontext()


def batch_positions(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor) -> torch.Tensor:
    """Position ``t`` of every row of a ragged batch: ``cache_lengths[b] + i``, int32 ``[T]``.

    Example: offsets ``[0, 2, 3]``, cache lengths ``[5, 0]`` give ``[5, 6, 0]``.
    """
    seq_ids, local = ragged_rows(input_row_offsets)
    return (cache_lengths.to(torch.int64)[seq_ids] + local).to(torch.int32)


def frozen_linear(inputs: int, outputs: int, bias: bool, dtype: torch.dtype | None, device) -> nn.Linear:
    """An ``nn.Linear(inputs, outputs)`` whose weights need no gradient (they are loaded, never trained)."""
    layer = nn.Linear(inputs, outputs, bias=bias, dtype=dtype, device=device)
    layer.requires_grad_(False)
    return layer
