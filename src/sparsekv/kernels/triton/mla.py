"""Triton sparse MLA attention (SPEC 3.4), same function and signature as ``kernels/reference/mla.py``.

One program per (query row, block of ``BH`` heads, split). Every head reads
the same latent rows, so the block's heads are the rows of the matrix
products and each latent row is loaded once per program, in two tiles: the
value channels ``[0, v_head_dim)`` (``kv_lora_rank``; they serve as keys
*and* values) and the rest ``[v_head_dim, D)`` (the rope key, none for
GLM-5-Next). The index row is read ``BN`` entries at a time (a page-table
lookup per entry) with an fp32 online softmax; 16-bit weights enter P.V as
three 16-bit parts (``_attention.split_mma``) so that P.V stays at about
fp32 precision.

When rows x head blocks are too few to fill the GPU (small-batch decode),
the index row is cut into spans whose partial results a second kernel
merges (``_attention``'s split and merge, one head per merge program).

Invalid entries inside the counted region (``-1``, a position past the
lookup table, a missing page) are skipped on the device; a row with nothing
valid outputs zeros and ``lse = -inf``. On CPU tensors (the interpreter) and
with ``SPARSEKV_DEBUG=1`` the op first runs the reference's host-side checks
and raises the same ``ValueError``, before anything is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ..reference.qsa import check_counted_entries
from ._attention import finish, merge_kernel, num_splits, online_softmax, selected_entries, split_mma, store_partials
from ._common import TL_DTYPES, find_sequence, mma, next_pow2, page_stride_of, search_steps, unit_stride

__all__ = ["mla_sparse_attention_paged"]

#: Heads per program: the rows of the tensor-core products (at least 16).
HEADS_PER_PROGRAM = 16


def _mla_launch(total_q: int, q_heads: int, width: int, block_v: int, is_fp32: bool, device: torch.device) -> dict:
    """Launch parameters of :func:`_mla_attention_kernel` for ``total_q`` rows of ``q_heads`` heads over index
    rows of ``width`` entries whose value channels fill a ``block_v``-wide tile: ``BH`` heads and ``BN`` entries
    per program and iteration, ``splits`` spans per index row (1: no merge), its warps and software-pipeline
    stages. For bf16/fp16, 32 heads (16 where there are no more) x 64 entries in 2 stages (an H200 sweep of
    233 launches, 128 heads, 2048 entries a row: 1.95x the 16 heads x 32 entries in 3 stages at B=64 x 32k,
    1.48x at B=4 x 128k with 8 splits). The fp32 launch was not swept."""
    if is_fp32:
        block_h, block_n, stages = HEADS_PER_PROGRAM, 16, 3
    else:
        block_h = min(2 * HEADS_PER_PROGRAM, max(HEADS_PER_PROGRAM, next_pow2(q_heads)))
        block_n, stages = 64, 2
    head_blocks = triton.cdiv(q_heads, block_h)
    return {"BH": block_h, "BN": block_n, "splits": num_splits(total_q, head_blocks, width, block_n, device),
            "num_warps": 4 if block_v <= 128 else 8, "num_stages": stages}


@triton.jit
def _mla_attention_kernel(
    out_ptr, lse_ptr, q_ptr, blocks_ptr, lookup_ptr, indices_ptr, counts_ptr, offsets_ptr,
    part_acc_ptr, part_stats_ptr,
    num_seqs, width, span, num_pages, max_pages, lookup_stride, page_stride, layer_offset, scale,
    q_stride_row, q_stride_head, out_stride_row, out_stride_head, indices_stride, lse_stride_row, lse_stride_head,
    Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DTYPE: tl.constexpr, IS_FP32: tl.constexpr, SPLIT: tl.constexpr, SPLIT_SCALE: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(2)
    seq = find_sequence(offsets_ptr, row, num_seqs, STEPS)
    count = tl.minimum(tl.load(counts_ptr + row), width)
    begin = split * span
    end = tl.minimum(count, begin + span)

    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    head_ok = heads < Q_HEADS
    value_dims = tl.arange(0, BV)
    value_ok = value_dims < V_DIM
    rest_dims = V_DIM + tl.arange(0, BR)
    rest_ok = rest_dims < HEAD_DIM
    q_rows = q_ptr + row.to(tl.int64) * q_stride_row + heads[:, None] * q_stride_head
    q_value = tl.load(q_rows + value_dims[None, :], mask=head_ok[:, None] & value_ok[None, :], other=0.0)
    q_rest = tl.load(q_rows + rest_dims[None, :], mask=head_ok[:, None] & rest_ok[None, :], other=0.0)

    running_max = tl.full((BH,), float("-inf"), tl.float32)
    denom = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BV), tl.float32)
    entries = tl.arange(0, BN)
    for start in range(begin, end, BN):
        page, page_row, valid = selected_entries(indices_ptr, indices_stride, row, start, entries, end, lookup_ptr,
                                                 lookup_stride, seq, max_pages, num_pages, PAGE_SIZE)
        base = blocks_ptr + layer_offset + (page * page_stride + page_row.to(tl.int64) * HEAD_DIM)[:, None]
        latent = tl.load(base + value_dims[None, :], mask=valid[:, None] & value_ok[None, :], other=0.0)
        rest = tl.load(base + rest_dims[None, :], mask=valid[:, None] & rest_ok[None, :], other=0.0)
        if IS_FP32:
            logits = tl.dot(q_value, tl.trans(latent), input_precision="ieee")
            logits += tl.dot(q_rest, tl.trans(rest), input_precision="ieee")
        else:
            logits = mma(q_value, tl.trans(latent)) + mma(q_rest, tl.trans(rest))
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        weights, rescale, new_max, denom = online_softmax(logits, running_max, denom)
        if IS_FP32:
            update = tl.dot(weights, latent, input_precision="ieee")
        else:
            update = split_mma(weights, latent, SPLIT_SCALE)
        acc = acc * rescale[:, None] + update
        running_max = new_max

    if SPLIT:
        store_partials(acc, running_max, denom, row, heads, head_ok, value_dims, split, part_acc_ptr, part_stats_ptr,
                       Q_HEADS, BV)
    else:
        finish(acc, running_max, denom, row, heads, head_ok, value_dims, value_ok,
                out_ptr, lse_ptr, out_ptr, out_stride_row, out_stride_head, 0, 0,
                lse_stride_row, lse_stride_head, False, DTYPE)


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
    """Absorbed MLA attention of each query row over the latent rows its index row selects (see the reference).

    ``out [total_q, q_heads, v_head_dim]`` (q's dtype), ``lse [total_q, q_heads]`` float32.
    Example: ``indices[1] = [0, 3, 3, -1]``, ``counts[1] = 3``: every head of
    row 1 attends over latent rows 0, 3, 3 of its sequence; the ``-1`` is never read.
    """
    total_q, q_heads, head_dim = q.shape
    v_dim = out.shape[2]
    num_seqs = input_row_offsets.shape[0] - 1
    if total_q == 0 or q_heads == 0:
        return
    if _common.host_checks(q.device):
        check_counted_entries(lookup_table, blocks.shape[0], blocks.shape[3], indices, counts, input_row_offsets)
    if out.stride(2) != 1:
        packed = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        mla_sparse_attention_paged(packed, lse, q, blocks, lookup_table, indices, counts, input_row_offsets,
                                   layer, scale)
        out.copy_(packed)
        return
    q, indices, lookup_table = unit_stride(q), unit_stride(indices), unit_stride(lookup_table)
    counts, input_row_offsets = unit_stride(counts), unit_stride(input_row_offsets)
    _, _, _, page_size, _, _ = blocks.shape
    width = indices.shape[1]
    block_v = max(next_pow2(v_dim), 16)
    block_rest = max(next_pow2(head_dim - v_dim), 16)
    is_fp32 = q.dtype == torch.float32
    launch = _mla_launch(total_q, q_heads, width, block_v, is_fp32, q.device)
    block_n, splits = launch["BN"], launch["splits"]
    head_blocks = triton.cdiv(q_heads, launch["BH"])
    span = triton.cdiv(triton.cdiv(max(width, 1), splits), block_n) * block_n
    if splits > 1:
        parts = total_q * q_heads * splits
        part_acc = torch.empty(parts * block_v, dtype=torch.float32, device=q.device)
        part_stats = torch.empty(parts * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_stats = lse
    dtype = TL_DTYPES[out.dtype]
    _mla_attention_kernel[(total_q, head_blocks, splits)](
        out, lse, q, blocks, lookup_table, indices, counts, input_row_offsets, part_acc, part_stats,
        num_seqs, width, span, blocks.shape[0], lookup_table.shape[1], lookup_table.stride(0),
        page_stride_of(blocks), layer * page_size * head_dim, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), indices.stride(0), lse.stride(0), lse.stride(1),
        Q_HEADS=q_heads, HEAD_DIM=head_dim, V_DIM=v_dim, PAGE_SIZE=page_size, DTYPE=dtype, IS_FP32=is_fp32,
        SPLIT=splits > 1, SPLIT_SCALE=4096.0 if blocks.dtype == torch.float16 else 1.0,
        BH=launch["BH"], BN=block_n, BV=block_v, BR=block_rest, STEPS=search_steps(num_seqs),
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    if splits > 1:  # one head per merge program (GROUP = 1; a 2-lane block, the second lane masked)
        merge_kernel[(total_q, q_heads)](
            out, lse, out, part_acc, part_stats, splits,
            out.stride(0), out.stride(1), 0, 0, lse.stride(0), lse.stride(1),
            Q_HEADS=q_heads, GROUP=1, HEAD_DIM=v_dim, HAS_GATE=False, DTYPE=dtype, BGP=2, BD=block_v,
        )
