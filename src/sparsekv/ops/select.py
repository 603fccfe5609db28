"""Public selection op: top-k blocks expanded to token positions (SPEC 2.4, 3.3).

``select_blocks_expand`` is shared by QSA (``qsa_select_tokens``) and the
k-pool indexer (``mla_kpool_expand_topk``); its exact rules, including the
choices where the SPEC is silent, are in ``sparsekv.kernels.reference.select``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_bool, check_int, check_nonnegative, check_tensor
from ._registry import kernel, out_op


class SelectedTokens(NamedTuple):
    """Output of a selection: ``indices [total_q, budget + ratio - 1]`` int32, ``counts [total_q]`` int32."""

    indices: torch.Tensor
    counts: torch.Tensor


@out_op("select_blocks_expand", mutates_args=("indices", "counts"))
def _select_blocks_expand_op(
    indices: torch.Tensor,
    counts: torch.Tensor,
    scores: torch.Tensor,
    query_positions: torch.Tensor,
    ratio: int,
    budget: int,
    include_tail: bool,
) -> None:
    kernel("select", "select_blocks_expand", scores.device)(
        indices, counts, scores, query_positions, ratio, budget, include_tail
    )



def select_blocks_expand(
    scores: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    ratio: int,
    budget: int,
    include_tail: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SelectedTokens:
    """Each row's top ``budget // ratio`` visible blocks, expanded to token positions.

    Args:
        scores: ``[total_q, num_cols]`` float32 block scores (``-inf`` where
            invisible). Row ``r`` may pick among its first
            ``v = min((t+1) // ratio, num_cols)`` columns, ``t = query_positions[r]``.
        query_positions: ``[total_q]`` int32/int64/uint32, ``t >= 0``.
        ratio: tokens per block (QSA ``R``, k-pool ``kpool``), ``>= 1``.
        budget: tokens to select at most, excluding the tail, ``>= 0``.
        include_tail: also list the open tail ``ratio*((t+1)//ratio) .. t``.
        out: optional preallocated ``(indices, counts)``.

    Returns ``SelectedTokens(indices, counts)``: ``indices [total_q, budget + ratio - 1]``
    int32 holds the selected blocks' tokens in ascending order, then the tail,
    then ``-1``; ``counts [total_q]`` int32 the number of valid entries.
    When ``v <= budget // ratio`` every visible block is taken; otherwise the
    highest scores win, ties to the lower block id.

    Example: ``ratio=4, budget=8``, ``t=13``, scores ``[0.5, 0.9, 0.5]``:
    indices ``[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, -1]``, counts ``10``
    (blocks 0 and 1 win, ``14 % 4 = 2`` tail tokens ``12, 13``).
    """
    check_int("ratio", ratio, minimum=1)
    check_int("budget", budget, minimum=0)
    check_bool("include_tail", include_tail)
    check_tensor("scores", scores, ndim=2, dtypes=(torch.float32,))
    total_q = scores.shape[0]
    positions = check_nonnegative("query_positions", query_positions, device=scores.device)
    if positions.shape[0] != total_q:
        raise ValueError(f"query_positions: expected shape ({total_q},) = scores rows, got {tuple(positions.shape)}")
    width = budget + ratio - 1
    if out is None:
        indices = torch.empty(total_q, width, dtype=torch.int32, device=scores.device)
        counts = torch.empty(total_q, dtype=torch.int32, device=scores.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out: expected a pair (indices, counts)")
        indices, counts = out
        check_tensor("out[0] (indices)", indices, shape=(total_q, width), dtypes=(torch.int32,), device=scores.device)
        check_tensor("out[1] (counts)", counts, shape=(total_q,), dtypes=(torch.int32,), device=scores.device)
    _select_blocks_expand_op(indices, counts, scores, positions, ratio, budget, include_tail)
    return SelectedTokens(indices, counts)
