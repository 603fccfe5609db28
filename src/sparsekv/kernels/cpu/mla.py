"""Fast CPU sparse MLA attention (SPEC 3.4): numba, same signature as the reference.

Absorbed MLA is sparse attention with one KV head that every query head
reads, rows of ``D = kv_lora_rank + qk_rope_head_dim`` channels, and values
that are the rows' own first ``v_head_dim`` channels: the kernel of
:mod:`._sparse_attend` with ``kv_heads = 1`` and the values in the key rows.
Every head reads the same rows, so one row brings ``heads * (D +
v_head_dim)`` multiply-adds per ``D`` elements read: at 64-128 heads the
kernel is bound by the multiply-add rate, not by memory. With at most 8 heads
``16 // heads`` prefill rows of a sequence share one query tile. Nothing the
size of the history is materialised.
"""

from __future__ import annotations

from ._sparse_attend import sparse_attention

__all__ = ["mla_sparse_attention_paged"]

KEY_CHUNK = 1024
"""Keys whose softmax denominators and P.V a row with more than 8 heads sums apart before adding the chunks
(:func:`._sparse_attend.sparse_attention`): a decode step of one sequence then runs its chunks on different
threads, each over all heads and half the rows, instead of each thread reading every row for half the
heads."""


def mla_sparse_attention_paged(out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale):
    """Same contract as :func:`sparsekv.kernels.reference.mla.mla_sparse_attention_paged`."""
    sparse_attention(out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale, None, None,
                     KEY_CHUNK)
