"""Public sparse MLA attention (SPEC 3.4): absorbed MLA over the latent rows an indexer selected.

The public function validates its arguments (``ValueError``/``TypeError``
naming the argument), normalises index tensors to int32, allocates its
outputs and calls the out-style torch custom op
``sparsekv::mla_sparse_attention_paged`` whose body runs the backend chosen by
``sparsekv.ops._registry``. The index, count and row-offset rules and their
checks are those of ``qsa_sparse_attention_paged`` (the same helpers); value
checks run on CPU tensors always and on GPU tensors only with
``SPARSEKV_DEBUG=1``.

One decode step of an MLA layer (layer code around the op)::

    q_lat = torch.cat([q_nope @ w_uk, q_rope], dim=-1)      # [T, heads, kv_lora_rank + rope]
    o_lat = mla_sparse_attention_paged(q_lat, latent_cache, layer, indices, counts, offsets,
                                       scale=qk_head_dim ** -0.5, v_head_dim=kv_lora_rank)
    out = o_proj(torch.einsum("thc,hvc->thv", o_lat, w_uv).flatten(1))
"""

from __future__ import annotations

import torch

from .._checks import as_index_tensor, check_bool, check_float, check_instance, check_int, check_tensor
from .._env import host_checks
from ..cache.layout import PagedKVCacheCollection
from ._attention_checks import check_counted_positions, check_row_offsets
from ._registry import kernel, out_op


@out_op("mla_sparse_attention_paged", mutates_args=("out", "lse"))
def _mla_attention_op(
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
    kernel("mla", "mla_sparse_attention_paged", out.device)(
        out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, layer, scale
    )


def mla_sparse_attention_paged(
    q: torch.Tensor,
    kv_collection: PagedKVCacheCollection,
    layer_idx: int,
    indices: torch.Tensor,
    counts: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    scale: float,
    v_head_dim: int,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each query row over the latent rows it selected (SPEC 3.4).

    Every query head attends to the same selected latent rows:
    ``p = softmax(q[r, h] . row * scale)`` over the first ``counts[r]``
    entries of ``indices[r]`` (fp32), ``out[r, h] = sum p * row[:v_head_dim]``.

    Args:
        q: ``[total_q, q_heads, D]`` in the cache dtype (bf16/fp16/fp32), the
            absorbed queries ``[q_nope @ W_uk, q_rope]``; ``D = kv_lora_rank +
            qk_rope_head_dim`` is the cache's head width. Any strides.
        kv_collection: the latent cache: ``KV == 1``, one head of ``D``
            channels (``kv_a_layernorm`` output, then the rope key), this
            call's rows already stored.
        layer_idx: the layer to read.
        indices: ``[total_q, W]`` int32/int64/uint32, request-relative
            positions; only the first ``counts[r]`` of row ``r`` are read
            (duplicates count twice).
        counts: ``[total_q]`` int, ``<= W``; ``<= 0`` gives a zero row.
        input_row_offsets: ``[B+1]`` int, rows of each sequence;
            ``B = len(kv_collection.cache_lengths)``.
        scale: multiplies ``q . row`` (HF: ``qk_head_dim ** -0.5`` times any mscale).
        v_head_dim: value channels, the first ``v_head_dim`` of each row
            (``kv_lora_rank``); ``1 <= v_head_dim <= D``.
        return_lse: also return the ``[total_q, q_heads]`` float32 log-sum-exp
            (natural log of the scaled logits; ``-inf`` for empty rows).
        out: optional ``[total_q, q_heads, v_head_dim]`` tensor of q's dtype
            (any strides) to write the result into.

    Returns ``out [total_q, q_heads, v_head_dim]`` in q's dtype, or ``(out, lse)``.

    Raises ``ValueError`` when a counted entry is ``-1``, negative, at or past
    the tokens the sequence holds (``cache_lengths[b] +`` its rows in this
    call), or on a missing page, naming row and entry; a raising call writes
    nothing (``out`` keeps its contents).

    Example: GLM-5 shapes ``D = 512 + 64``, ``v_head_dim = 512``; cache
    lengths ``[5]``, offsets ``[0, 1]`` (one new token at position 5, already
    stored), ``indices = [[0, 1, 5, -1]]``, ``counts = [3]``: every head of
    the row attends over latent rows 0, 1 and 5, and ``out`` is
    ``[1, heads, 512]``.
    """
    c = check_instance("kv_collection", kv_collection, PagedKVCacheCollection)
    c._check_layer(layer_idx)
    if c.kv_planes != 1:
        raise ValueError(f"kv_collection: expected a latent cache (KV == 1), got KV == {c.kv_planes}")
    if c.num_heads != 1:
        raise ValueError(f"kv_collection: expected a latent cache with one head, got {c.num_heads} heads")
    scale = check_float("scale", scale)
    check_bool("return_lse", return_lse)
    check_tensor("q", q, ndim=3, dtypes=(c.dtype,), device=c.device)
    total_q, q_heads, head_dim = q.shape
    if head_dim != c.head_size:
        raise ValueError(f"q: head dim {head_dim} differs from the latent cache's head_size {c.head_size}")
    check_int("v_head_dim", v_head_dim, minimum=1)
    if v_head_dim > head_dim:
        raise ValueError(f"v_head_dim: expected <= the latent width {head_dim}, got {v_head_dim}")
    if out is not None:
        check_tensor("out", out, shape=(total_q, q_heads, v_head_dim), dtypes=(q.dtype,), device=c.device)
    indices = as_index_tensor("indices", indices, ndim=2, device=c.device)
    counts = as_index_tensor("counts", counts, ndim=1, device=c.device)
    if indices.shape[0] != total_q:
        raise ValueError(f"indices: expected {total_q} rows (q rows), got {indices.shape[0]}")
    if counts.shape[0] != total_q:
        raise ValueError(f"counts: expected shape ({total_q},) = q rows, got {tuple(counts.shape)}")
    offsets = check_row_offsets(input_row_offsets, c.batch_size, total_q, c.device)
    if host_checks(c.device) and total_q:
        check_counted_positions(indices, counts, offsets, c.cache_lengths)
    if out is None:
        out = torch.empty(total_q, q_heads, v_head_dim, dtype=q.dtype, device=c.device)
    lse = torch.empty(total_q, q_heads, dtype=torch.float32, device=c.device)
    _mla_attention_op(out, lse, q, c.blocks, c.lookup_table, indices, counts, offsets, layer_idx, scale)
    return (out, lse) if return_lse else out
