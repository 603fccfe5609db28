"""Reference QSA kernels (SPEC 2.2, 2.3, 2.5): readable PyTorch, the oracle.

Every other backend exports these functions with the same signatures
(outputs first) and must agree with them within SPEC 4. Arguments arrive
already validated by ``sparsekv.ops.qsa``; index tensors are int32 on the
data's device. The checks made here are only those no public op can make
without reading the data (a missing page, a ``-1`` inside a counted region),
and they raise ``ValueError`` naming the sequence/row and position.

Rounding points (``dtype`` = the keys' dtype):

* compress: mean of the ``R`` raw keys summed in order ``i = 0..R-1`` in fp32
  and divided by ``R``, cast; zero-centred RMSNorm in fp32 with the sum of
  squares taken in channel order ``d = 0..D-1``, ``x * (1/sqrt(ss/D + eps)) *
  (1 + gamma)``, cast; NeoX RoPE with cos/sin cast to ``dtype``, products and
  sums in fp32, cast. Every step has one defined order, so a fast path can
  (and the CPU one does) reproduce the output bit for bit.
* block score: fp32 dot products, ReLU per head, head sum in fp32, divided
  by ``score_scale``.
* sparse attention: fp32 logits, max-subtracted softmax, fp32 ``P @ V``,
  optional ``* sigmoid(gate)`` in fp32, one cast to ``q.dtype``.
"""

from __future__ import annotations

import torch

from ..._checks import check_freqs_cis_rows
from ...cache.layout import check_needed_pages, page_problem, ragged_rows, resolve_pages
from ...numerics import apply_rope_neox, div_rn, sqrt_rn


def counted_entry_error(lookup_table: torch.Tensor, num_pages: int, page_size: int, indices: torch.Tensor,
                        counts: torch.Tensor, row: int, entry: int, seq: int) -> ValueError:
    """The ``ValueError`` for entry ``entry`` of index row ``row`` (of sequence ``seq``), counted but
    negative or without a valid page: names the row, the entry, the position passed and why."""
    t = int(indices[row, entry])
    return ValueError(f"indices: row {row}, entry {entry} (inside the counted region, counts[{row}] = "
                      f"{int(counts[row])}) is position {t} of sequence {seq}: "
                      f"{page_problem(lookup_table, num_pages, page_size, seq, t)}")


def check_counted_entries(lookup_table: torch.Tensor, num_pages: int, page_size: int, indices: torch.Tensor,
                          counts: torch.Tensor, input_row_offsets: torch.Tensor) -> None:
    """Raise :func:`counted_entry_error` for the first counted entry (row by row, entry by entry) that is
    negative or has no valid page. Memory in proportion to ``indices``."""
    width = indices.shape[1]
    counted = torch.arange(width, device=indices.device)[None, :] < counts.to(torch.int64)[:, None]
    seq_of_row, _ = ragged_rows(input_row_offsets)
    positions = indices.to(torch.int64)
    logical = torch.div(positions, page_size, rounding_mode="floor")
    in_table = (positions >= 0) & (logical < lookup_table.shape[1])
    pages = lookup_table[seq_of_row[:, None], torch.where(in_table, logical, torch.zeros_like(logical))]
    bad = counted & ~(in_table & (pages >= 0) & (pages < num_pages))
    if bool(bad.any()):
        row, entry = (int(i) for i in torch.nonzero(bad)[0])
        raise counted_entry_error(lookup_table, num_pages, page_size, indices, counts, row, entry,
                                  int(seq_of_row[row]))


def qsa_compress_keys_paged(
    block_keys: torch.Tensor,
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
    eps: float,
) -> None:
    """Pool every complete ``ratio``-token block of raw keys into one normed, rotated block key.

    Args:
        block_keys: OUT ``[B * max_blocks, D]``, the keys' dtype. Sequence
            ``b``'s block ``j`` goes to row ``b * max_blocks + j`` with
            ``max_blocks = block_keys.shape[0] // B``; rows past the sequence's
            complete blocks are written as zeros.
        gamma: ``[D]`` (``k_layernorm`` weight), any float dtype.
        freqs_cis: ``[positions, rotary_dim]`` cos/sin pairs (see
            ``sparsekv.rope_freqs_cis``); row ``j * ratio`` rotates block ``j``.
        key_counts: ``[B]`` int32, raw keys per sequence including this
            call's tokens. Sequence ``b`` pools ``min(key_counts[b] // ratio,
            max_blocks)`` blocks; a trailing partial block is never pooled.
        blocks: the indexer cache ``[num_pages, KV, num_layers, page_size, 1, D]``,
            possibly a strided view (``page_stride = blocks.stride(0)``);
            plane 0 of ``layer``, head 0 is read.
        lookup_table: ``[B, max_pages]`` int32, sentinel ``-1``.
        layer: layer index into ``blocks``.
        ratio: tokens per block ``R``.
        eps: RMSNorm epsilon.

    Raises ``ValueError`` naming the sequence and position when a needed
    page is missing, and when a needed ``freqs_cis`` row is absent, before
    writing anything.

    Example: ``key_counts = [9, 3]``, ``ratio = 4``, ``B * max_blocks = 2 * 2``:
    rows 0, 1 pool tokens 0..3 and 4..7 of sequence 0 (token 8 waits for its
    block to fill); rows 2, 3 (sequence 1, no complete block) are zero.
    """
    batch = key_counts.shape[0]
    max_blocks = block_keys.shape[0] // batch
    rotary_dim = freqs_cis.shape[1]
    blocks_per_seq = torch.clamp(key_counts.to(torch.int64) // ratio, 0, max_blocks)
    check_freqs_cis_rows(freqs_cis.shape[0], blocks_per_seq, ratio)
    check_needed_pages(lookup_table, blocks.shape[0], blocks.shape[3], blocks_per_seq * ratio)
    block_keys.zero_()
    for b in range(batch):
        num_blocks = int(blocks_per_seq[b])
        if num_blocks <= 0:
            continue
        positions = torch.arange(num_blocks * ratio, device=blocks.device)
        seq_ids = torch.full_like(positions, b)
        pages, rows = resolve_pages(lookup_table, blocks.shape[0], blocks.shape[3], seq_ids, positions)
        raw = blocks[pages, 0, layer, rows, 0].reshape(num_blocks, ratio, -1)

        # 1. mean of the block's raw keys, summed in token order, in fp32.
        total = raw[:, 0].float()
        for i in range(1, ratio):
            total = total + raw[:, i].float()
        mean = div_rn(total, ratio).to(block_keys.dtype).float()
        # 2. zero-centred RMSNorm. The sum of squares runs over the channels in
        #    order d = 0..D-1: a vectorised reduction's order depends on the
        #    machine, and a one-ulp change of x here can become several ulps after
        #    the RoPE subtraction below.
        squares = torch.zeros(num_blocks, dtype=torch.float32, device=blocks.device)
        for d in range(mean.shape[1]):
            squares = squares + mean[:, d] * mean[:, d]
        inv_rms = 1.0 / sqrt_rn(div_rn(squares, mean.shape[1]) + eps)  # two roundings, as SPEC 2.2 states
        normed = (mean * inv_rms[:, None] * (1.0 + gamma.float())).to(block_keys.dtype)
        # 3. RoPE at each block's first token.
        first_tokens = torch.arange(num_blocks, device=blocks.device) * ratio
        rotated = apply_rope_neox(normed, freqs_cis[first_tokens], rotary_dim)
        block_keys[b * max_blocks : b * max_blocks + num_blocks] = rotated


def qsa_store_block_keys_paged(
    block_blocks: torch.Tensor,
    gamma: torch.Tensor,
    freqs_cis: torch.Tensor,
    key_counts: torch.Tensor,
    first_blocks: torch.Tensor,
    blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
    eps: float,
    max_new_blocks: int,
) -> None:
    """Compress the blocks ``first_blocks[b] .. key_counts[b] // ratio - 1`` of each sequence (as
    :func:`qsa_compress_keys_paged` pools them) and store block ``j`` in a block-key cache.

    Args:
        block_blocks: OUT, the block-key cache ``[num_pages, KV, num_layers, P, 1, D]`` with ``P =
            page_size // ratio`` rows per page, the same page ids as ``blocks`` (``lookup_table`` serves
            both): block ``j`` of sequence ``b`` goes to row ``j % P`` of page ``lookup_table[b, j // P]``,
            plane 0 of ``layer``. Nothing else is written.
        first_blocks: ``[B]`` int32, the blocks already stored (``<= key_counts[b] // ratio``).
        max_new_blocks: at least ``key_counts[b] // ratio - first_blocks[b]`` for every ``b`` (a GPU
            kernel's grid size; unused here).
        The others as for :func:`qsa_compress_keys_paged`.

    Example: ``key_counts = [9]``, ``first_blocks = [1]``, ``ratio = 4``: block 1 (tokens 4..7) is stored;
    block 0 is left as it is; token 8 waits for its block to fill.
    """
    num_blocks = key_counts.to(torch.int64) // ratio
    batch, most = key_counts.shape[0], int(num_blocks.max()) if key_counts.numel() else 0
    every_block = torch.empty(batch * most, block_blocks.shape[-1], dtype=block_blocks.dtype,
                              device=block_blocks.device)
    qsa_compress_keys_paged(every_block, gamma, freqs_cis, key_counts, blocks, lookup_table, layer, ratio, eps)
    per_page = block_blocks.shape[3]
    for b in range(batch):
        new = torch.arange(int(first_blocks[b]), int(num_blocks[b]), device=block_blocks.device)
        if new.numel() == 0:
            continue
        pages, rows = resolve_pages(lookup_table, block_blocks.shape[0], per_page, torch.full_like(new, b), new)
        block_blocks[pages, 0, layer, rows, 0] = every_block[b * most + new]


def qsa_load_block_keys_paged(
    block_keys: torch.Tensor,
    key_counts: torch.Tensor,
    block_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    layer: int,
    ratio: int,
) -> None:
    """:func:`qsa_compress_keys_paged`'s output read from a block-key cache that
    :func:`qsa_store_block_keys_paged` filled: row ``b * max_blocks + j`` is block ``j`` of sequence ``b``
    as stored (row ``j % P`` of page ``lookup_table[b, j // P]``) for ``j < min(key_counts[b] // ratio,
    max_blocks)``, zero elsewhere. Raises ``ValueError`` naming the sequence and block of a missing page.
    """
    batch = key_counts.shape[0]
    max_blocks = block_keys.shape[0] // batch
    num_blocks = torch.clamp(key_counts.to(torch.int64) // ratio, 0, max_blocks)
    per_page = block_blocks.shape[3]
    check_needed_pages(lookup_table, block_blocks.shape[0], per_page, num_blocks)
    block_keys.zero_()
    for b in range(batch):
        stored = torch.arange(int(num_blocks[b]), device=block_blocks.device)
        pages, rows = resolve_pages(lookup_table, block_blocks.shape[0], per_page, torch.full_like(stored, b), stored)
        block_keys[b * max_blocks : b * max_blocks + stored.numel()] = block_blocks[pages, 0, layer, rows, 0]


def qsa_block_score(
    scores: torch.Tensor,
    q: torch.Tensor,
    block_keys: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    ratio: int,
    score_scale: float,
) -> None:
    """Score every query row against its own sequence's block keys.

    Args:
        scores: OUT ``[total_q, out_cols]`` float32.
            ``scores[r, g] = sum_h relu(q[r, h] . block_keys[b*max_blocks + g]) / score_scale``
            for visible blocks ``g < min((t+1) // ratio, max_blocks)``, ``-inf``
            elsewhere (including every column ``>= max_blocks``).
        q: ``[total_q, n_heads, D]``, normed and rotated queries.
        block_keys: ``[B * max_blocks, D]``, the output of the compress op;
            ``max_blocks = block_keys.shape[0] // B``.
        query_positions: ``[total_q]`` int32, position ``t`` of each row inside
            its sequence.
        input_row_offsets: ``[B+1]`` int32; rows of sequence ``b`` are
            ``input_row_offsets[b] .. input_row_offsets[b+1]``.
        ratio: tokens per block.
        score_scale: the divisor (``sqrt(D)`` in the model).

    Example: offsets ``[0, 1, 3]``, positions ``[9, 2, 3]``, ratio 4: row 0
    sees blocks 0, 1 (10 // 4 = 2) of sequence 0; row 1 sees none (3 // 4 = 0);
    row 2 sees block 0 of sequence 1 (4 // 4 = 1).
    """
    batch = input_row_offsets.shape[0] - 1
    max_blocks = block_keys.shape[0] // batch
    out_cols = scores.shape[1]
    usable_cols = min(out_cols, max_blocks)
    scores.fill_(float("-inf"))
    columns = torch.arange(usable_cols, device=scores.device)
    for b in range(batch):
        start, end = int(input_row_offsets[b]), int(input_row_offsets[b + 1])
        if end <= start or usable_cols == 0:
            continue
        keys = block_keys[b * max_blocks : b * max_blocks + usable_cols].float()  # [G, D]
        # One row at a time: a matrix product over many rows may round differently
        # from one over a single row, and a row's scores must not depend on which
        # other rows share its call (SPEC 2.6).
        for r in range(start, end):
            per_head = q[r].float() @ keys.T  # [H, G]
            summed = div_rn(per_head.clamp_min(0.0).sum(dim=0), score_scale)  # [G]
            visible = min(max((int(query_positions[r]) + 1) // ratio, 0), max_blocks)
            scores[r, :usable_cols] = torch.where(columns < visible, summed, float("-inf"))


def keys_seen(query_positions: torch.Tensor, input_row_offsets: torch.Tensor, ratio: int,
              out_cols: int) -> torch.Tensor:
    """``[B]`` int64: the most keys any row of each sequence sees, ``min((t+1) // ratio, out_cols)`` (blocks
    of a block score, pools of a k-pool score): what a score over paged keys needs pages for."""
    seq_of_row, _ = ragged_rows(input_row_offsets)
    seen = torch.clamp(torch.div(query_positions.to(torch.int64) + 1, ratio, rounding_mode="floor"), 0, out_cols)
    needed = torch.zeros(input_row_offsets.shape[0] - 1, dtype=torch.int64, device=seen.device)
    return needed.scatter_reduce(0, seq_of_row, seen, reduce="amax")


def qsa_block_score_paged(
    scores: torch.Tensor,
    q: torch.Tensor,
    block_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    query_positions: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    ratio: int,
    score_scale: float,
) -> None:
    """:func:`qsa_block_score` over the blocks of a block-key cache (:func:`qsa_store_block_keys_paged`), read
    where they lie: row ``r`` sees blocks ``g < min((t+1) // ratio, out_cols)`` of its sequence (``out_cols =
    scores.shape[1]``), block ``g`` in row ``g % P`` of page ``lookup_table[b, g // P]``. Raises
    ``ValueError`` naming the sequence and block of a missing page."""
    batch = input_row_offsets.shape[0] - 1
    out_cols = scores.shape[1]
    most = keys_seen(query_positions, input_row_offsets, ratio, out_cols)
    block_keys = torch.empty(batch * out_cols, block_blocks.shape[-1], dtype=block_blocks.dtype,
                             device=block_blocks.device)
    qsa_load_block_keys_paged(block_keys, most * ratio, block_blocks, lookup_table, layer, ratio)
    qsa_block_score(scores, q, block_keys, query_positions, input_row_offsets, ratio, score_scale)


def qsa_sparse_attention_paged(
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
    gate: torch.Tensor | None,
) -> None:
    """Attention of each query row over the cached tokens its index row selects.

    Args:
        out: OUT ``[total_q, q_heads, head_size]``, ``q.dtype``.
        lse: OUT ``[total_q, q_heads]`` float32, natural-log log-sum-exp of the
            scaled logits; ``-inf`` for rows with ``counts <= 0``.
        q: ``[total_q, q_heads, head_size]``.
        blocks: main cache ``[num_pages, 2, num_layers, page_size, kv_heads, head_size]``
            (plane 0 keys, plane 1 values; may be a strided view).
        lookup_table: ``[B, max_pages]`` int32, sentinel ``-1``.
        indices: ``[total_q, W]`` int32 request-relative positions; only the
            first ``counts[r]`` entries of row ``r`` are read (duplicates
            count twice).
        counts: ``[total_q]`` int32, ``<= W``; ``counts[r] <= 0`` gives an
            exact zero output row.
        input_row_offsets: ``[B+1]`` int32, maps rows to sequences.
        layer: layer index into ``blocks``.
        scale: multiplies ``q . k`` before the softmax.
        gate: optional ``[total_q, q_heads, head_size]``; the output becomes
            ``out * sigmoid(gate)`` (fp32, before the cast).

    GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.

    Raises ``ValueError`` (:func:`counted_entry_error`) naming the row and
    the entry when a counted entry is negative (``-1``) or its page is
    missing or out of range, before writing anything.

    Example: offsets ``[0, 2]``, ``indices[1] = [0, 1, 2, 3, 4, -1]``,
    ``counts[1] = 5``: row 1 attends over tokens 0..4 of sequence 0; the
    trailing ``-1`` is never read.
    """
    total_q, q_heads, _ = q.shape
    kv_heads = blocks.shape[4]
    group = q_heads // kv_heads
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
        b = int(seq_of_row[r])
        positions = indices[r, :count].long()
        pages, rows = resolve_pages(lookup_table, blocks.shape[0], blocks.shape[3],
                                    torch.full_like(positions, b), positions)
        keys = blocks[pages, 0, layer, rows].float()  # [count, kv_heads, D]
        values = blocks[pages, 1, layer, rows].float()
        keys = keys.repeat_interleave(group, dim=1)  # [count, q_heads, D]
        values = values.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[r].float(), keys) * scale  # [q_heads, count]
        row_max = logits.max(dim=1, keepdim=True).values
        weights = torch.exp(logits - row_max)
        denom = weights.sum(dim=1, keepdim=True)
        result = torch.einsum("hn,nhd->hd", weights, values) / denom
        if gate is not None:
            result = result * torch.sigmoid(gate[r].float())
        out[r] = result.to(out.dtype)
        lse[r] = (row_max + torch.log(denom)).squeeze(1)
