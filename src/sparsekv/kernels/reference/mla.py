"""Reference sparse MLA attention (SPEC 3.4): readable PyTorch, the oracle.

Every other backend exports this function with the same signature (outputs
first) and must agree with it within SPEC 4. Arguments arrive already
validated by ``sparsekv.ops.mla``; index tensors are int32 on the data's
device. The only checks made here are those no public op can make without
reading the data (a ``-1`` inside a counted region, a missing page); they run
for every row before anything is written, so a raising call writes nothing.

Absorbed MLA: the cache holds one latent row per token (``kv_lora_rank``
channels of the normed compressed KV, then ``qk_rope_head_dim`` channels of
the token's rope key) in a single plane with one head. Every query head
attends to the same selected rows; the values are the rows' first
``v_head_dim`` channels.

Rounding points: fp32 logits ``q . row * scale``, max-subtracted softmax,
fp32 ``P @ V``, one division by the denominator, one cast to ``q.dtype``.
"""

from __future__ import annotations

import torch

from ...cache.layout import ragged_rows, resolve_pages
from .qsa import check_counted_entries


def mla_sparse_attention_paged(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    scale: float,
) -> None:
    """Absorbed MLA attention of each query row over the latent rows its index row selects.

    Args:
        out: OUT ``[total_q, q_heads, v_head_dim]``, ``q.dtype``; ``v_head_dim``
            (``= kv_lora_rank``) is ``out.shape[2] <= D``.
        lse: OUT ``[total_q, q_heads]`` float32, natural-log log-sum-exp of the
            scaled logits; ``-inf`` for rows with ``counts <= 0``.
        q: ``[total_q, q_heads, D]``, ``D = kv_lora_rank + qk_rope_head_dim``:
            the absorbed queries ``[q_nope @ W_uk, q_rope]``.
        blocks: latent cache ``[num_pages, 1, num_layers, page_size, 1, D]``
            (may be a strided view).
        lookup_table: ``[B, max_pages]`` int32, sentinel ``-1``.
        indices: ``[total_q, W]`` int32 request-relative positions; only the
            first ``counts[r]`` entries of row ``r`` are read (duplicates
            count twice).
        counts: ``[total_q]`` int32; ``counts[r] <= 0`` gives an exact zero
            output row; counts above ``W`` read ``W`` entries.
        input_row_offsets: ``[B+1]`` int32, maps rows to sequences.
        layer: layer index into ``blocks``.
        scale: multiplies ``q . row`` before the softmax.

    ``out[r, h] = sum_n p[h, n] * row_n[:v_head_dim]`` with
    ``p[h] = softmax_n(q[r, h] . row_n * scale)`` over the counted entries.

    Raises ``ValueError`` (:func:`.qsa.counted_entry_error`) naming the row
    and the entry when a counted entry is negative (``-1``) or its page is
    missing or out of range, before writing anything.

    Example: offsets ``[0, 2]``, ``indices[1] = [0, 3, 3, -1]``,
    ``counts[1] = 3``: row 1 attends over latent rows 0, 3 and 3 (the
    duplicate twice) of sequence 0; the ``-1`` is never read.
    """
    total_q = q.shape[0]
    v_head_dim = out.shape[2]
    if total_q == 0:
        return
    check_counted_entries(lookup_table, blocks.shape[0], blocks.shape[3], indices, counts, input_row_offsets)
    out.zero_()
    lse.fill_(float("-inf"))
    seq_of_row, _ = ragged_rows(input_row_offsets)
    for r in range(total_q):
        count = min(int(counts[r]), indices.shape[1])
        if count <= 0:
            continue
        positions = indices[r, :count].long()
        pages, rows = resolve_pages(lookup_table, blocks.shape[0], blocks.shape[3],
                                    torch.full_like(positions, int(seq_of_row[r])), positions)
        latent = blocks[pages, 0, layer, rows, 0].float()  # [count, D]
        logits = (q[r].float() @ latent.T) * scale  # [q_heads, count]
        row_max = logits.max(dim=1, keepdim=True).values
        weights = torch.exp(logits - row_max)
        denom = weights.sum(dim=1, keepdim=True)
        out[r] = ((weights @ latent[:, :v_head_dim]) / denom).to(out.dtype)
        lse[r] = (row_max + torch.log(denom)).squeeze(1)
