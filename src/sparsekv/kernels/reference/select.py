"""Reference block selection (SPEC 2.4, 3.3): top-k blocks, expanded to token positions.

Shared by QSA (``qsa_select_tokens``) and the k-pool indexer
(``mla_kpool_expand_topk``): a "block" is a QSA block or a k-pool pool, and
``ratio`` is ``R`` or ``kpool``. Every backend exports ``select_blocks_expand``
with this signature and must produce identical outputs (selections are exact).

Choices where the SPEC is silent:

* Visibility is decided by position alone: ``v = min((t+1) // ratio,
  scores.shape[1])`` (``0`` for ``t < 0``). A visible cell whose score is
  ``-inf`` (or NaN, which ranks as ``-inf``) is still selectable; it ranks
  last and, among equals, the lower block id wins. So ``counts`` depend only
  on positions, never on score values, and "``t + 1 <= budget + ratio - 1``
  selects every causal token" holds whatever the scores are.
* When ``scores.shape[1]`` clamps ``v`` below ``(t+1) // ratio`` (a capped
  ``max_blocks``), the tail is still ``[ratio * ((t+1) // ratio), t]``: the
  blocks in between are not selected.
"""

from __future__ import annotations

import torch


def select_blocks_expand(
    indices: torch.Tensor,
    counts: torch.Tensor,
    scores: torch.Tensor,
    query_positions: torch.Tensor,
    ratio: int,
    budget: int,
    include_tail: bool,
) -> None:
    """Pick each row's top ``budget // ratio`` visible blocks and list their tokens.

    Args:
        indices: OUT ``[total_q, W]`` int32, ``W >= budget + ratio - 1``
            (``W = budget + ratio - 1`` from the public ops). Row ``r`` gets the
            selected blocks' tokens ``g*ratio .. g*ratio + ratio - 1`` in
            ascending block order, then (when ``include_tail``) the open tail
            ``ratio*((t+1)//ratio) .. t``, then ``-1`` up to ``W``.
        counts: OUT ``[total_q]`` int32, the number of valid entries per row.
        scores: ``[total_q, num_cols]`` float32 (``-inf`` where invisible).
        query_positions: ``[total_q]`` int32, ``t`` of each row in its sequence.
        ratio: tokens per block (``>= 1``).
        budget: token budget; ``K = budget // ratio`` blocks at most.
        include_tail: append the tokens of the incomplete block that ends at ``t``.

    With ``v`` visible blocks (module docstring), ``v <= K`` takes all of
    them; otherwise the ``K`` highest scores, ties to the lower block id.

    Example: ``ratio = 4``, ``budget = 8`` (``K = 2``), ``t = 13`` (``v = 3``),
    scores ``[0.5, 0.9, 0.5]``: blocks 1 and 0 win (0 beats 2 on the tie), so
    the row is ``[0..7, 12, 13, -1]`` (tail ``12..13`` since ``14 % 4 = 2``),
    ``counts = 10``.
    """
    total_q = indices.shape[0]
    num_cols = scores.shape[1]
    max_selected = budget // ratio
    device = indices.device
    within_block = torch.arange(ratio, device=device)
    indices.fill_(-1)
    counts.zero_()
    for r in range(total_q):
        t = int(query_positions[r])
        visible = min(max((t + 1) // ratio, 0), num_cols)
        if visible <= max_selected:
            chosen = torch.arange(visible, device=device)
        else:
            ranked = scores[r, :visible].float()
            ranked = torch.where(torch.isnan(ranked), float("-inf"), ranked)
            order = torch.sort(ranked, descending=True, stable=True).indices  # stable: lower id first on ties
            chosen = torch.sort(order[:max_selected]).values
        tokens = (chosen[:, None] * ratio + within_block[None, :]).reshape(-1)
        if include_tail and t >= 0:
            tail = torch.arange(ratio * ((t + 1) // ratio), t + 1, device=device)
            tokens = torch.cat([tokens, tail])
        indices[r, : tokens.shape[0]] = tokens.to(torch.int32)
        counts[r] = tokens.shape[0]
