"""What the score plans share (:class:`sparsekv.ops.kpool.KPoolScorePlan`,
:class:`sparsekv.ops.qsa.QSABlockScorePlan`): a batch's query rows over one paged key cache, validated
once and run for any of its layers.

A decode step scores the same rows (positions, row offsets) against the same
cache in every layer, another layer's queries and keys. The plan keeps its
own copies of the positions and offsets and, where the backend offers one
(:func:`._registry.optional_kernel`, the CPU's), the backend's own plan; a
run checks only that layer's arguments, then runs the backend's plan, or the
custom op where there is none or torch traces. The backend is the one
chosen when the plan is made (``SPARSEKV_BACKEND`` then). Pages are read, and
checked, as the lookup table holds them when a run is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.layout import PagedKVCacheCollection
from .._env import host_checks
from ._registry import dispatch_needed, optional_kernel


def _same_values(planned: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether ``given`` holds ``planned``'s values (any integer dtype)."""
    return planned.shape == given.shape and torch.equal(planned, given.to(planned.device))


class PagedScorePlanBase:
    """``collection`` (the key cache), ``query_positions``/``input_row_offsets`` (the plan's own int32
    copies), ``out_cols``; ``backend_plan`` the backend's plan object or ``None``."""

    __slots__ = ("collection", "blocks", "lookup_table", "query_positions", "input_row_offsets", "out_cols",
                 "backend_plan")

    def __init__(self, collection: PagedKVCacheCollection, query_positions: torch.Tensor,
                 input_row_offsets: torch.Tensor, out_cols: int, family: str, backend_name: str,
                 backend_args: tuple) -> None:
        self.collection, self.blocks, self.lookup_table = collection, collection.blocks, collection.lookup_table
        self.query_positions, self.input_row_offsets, self.out_cols = query_positions, input_row_offsets, out_cols
        make = optional_kernel(family, backend_name, collection.device)
        if make is None or dispatch_needed((self.blocks, self.lookup_table, query_positions, input_row_offsets)):
            self.backend_plan = None  # each run goes through the custom op (also while torch traces)
        else:
            self.backend_plan = make(self.blocks, self.lookup_table, query_positions, input_row_offsets,
                                     *backend_args)

    @property
    def total_q(self) -> int:
        return self.query_positions.shape[0]

    def check_for(self, collection: PagedKVCacheCollection | None, name: str, query_positions: torch.Tensor,
                  input_row_offsets: torch.Tensor) -> None:
        """Refuse to stand for another cache than ``collection`` (``name`` is its argument) or, where values are
        checked on the host (:func:`.._env.host_checks`), for other rows than ``query_positions`` and
        ``input_row_offsets``: a layer given a step's plan (an earlier step's plan would score its rows at
        their old positions)."""
        if self.collection is not collection:
            raise ValueError(f"score_plan: expected a plan over {name}, got one over another cache")
        if host_checks(self.blocks.device) and not (
                _same_values(self.query_positions, query_positions)
                and _same_values(self.input_row_offsets, input_row_offsets)):
            raise ValueError("score_plan: expected a plan of these query rows (their positions and row offsets), "
                             "got one of other rows; make one plan per step")

    def check_layer(self, layer_idx: int, name: str) -> None:
        """Refuse a cache whose storage was replaced after planning (``name`` is the cache's argument), and a
        layer it does not have."""
        c = self.collection
        if c.blocks is not self.blocks or c.lookup_table is not self.lookup_table:
            raise ValueError(f"{name}: its blocks or lookup table were replaced after the plan was made; "
                             "make a new plan")
        c._check_layer(layer_idx)

    def check_rows(self, q: torch.Tensor) -> None:
        """``q``'s rows: one per planned query position."""
        if q.shape[0] != self.total_q:
            raise ValueError(f"q: expected {self.total_q} rows (one per planned query position), got {q.shape[0]}")

    def run_into(self, out: torch.Tensor, inputs: tuple[torch.Tensor, ...], backend_run: Callable[[torch.Tensor], None],
                 op_run: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Write the scores into ``out`` (checked), through a contiguous copy where it is not: ``backend_run``
        (the backend's plan) for plain tensors ``inputs``, else ``op_run`` (the custom op)."""
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        if self.backend_plan is not None and not dispatch_needed((target, *inputs)):
            backend_run(target)
        else:
            op_run(target)
        if target is not out:
            out.copy_(target)
        return out


__all__ = ["PagedScorePlanBase"]
