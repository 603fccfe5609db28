"""SPEC 2.6: one prefill, chunks that stop mid-block and token-by-token decode give identical outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv import (
    PagedKVCacheCollection,
    paged_store,
    qsa_block_score,
    qsa_compress_keys_paged,
    qsa_select_tokens,
    qsa_sparse_attention_paged,
    rope_freqs_cis,
)

RATIO, BUDGET, DIM, PAGE, HEADS = 4, 8, 16, 8, 2


def run_schedule(chunks: list[list[int]], raw: list[torch.Tensor], q_index: list[torch.Tensor],
                 kv: list[torch.Tensor], q_main: list[torch.Tensor], max_blocks: int):
    """Run the QSA layer step over a batch of sequences; ``chunks[b]`` lists sequence b's rows per call.

    Calls run while any sequence has rows left (a sequence with none left gets 0 rows).
    Returns the final block keys and, per sequence and position, the score row, selection and output.
    """
    batch, dtype = len(raw), raw[0].dtype
    pages = [-(-r.shape[0] // PAGE) for r in raw]
    table = torch.full((batch, max(pages)), -1, dtype=torch.int32)
    page_ids = iter(torch.randperm(sum(pages)).tolist())
    for b in range(batch):
        for i in range(pages[b]):
            table[b, i] = next(page_ids)
    index_blocks = torch.zeros(sum(pages), 1, 1, PAGE, 1, DIM, dtype=dtype)
    main_blocks = torch.zeros(sum(pages), 2, 1, PAGE, 1, DIM, dtype=dtype)
    gamma, freqs = torch.linspace(-0.3, 0.3, DIM), rope_freqs_cis(64, 8)
    done = [0] * batch
    per_position = [{} for _ in range(batch)]
    block_keys = None
    for step in range(max(len(c) for c in chunks)):
        rows = [c[step] if step < len(c) else 0 for c in chunks]
        lengths = torch.tensor(done, dtype=torch.int32)
        offsets = torch.tensor([0] + rows).cumsum(0)
        index_cache = PagedKVCacheCollection(index_blocks, lengths, table, max(rows), max(done))
        main_cache = PagedKVCacheCollection(main_blocks, lengths, table, max(rows), max(done))

        def take(xs, done=tuple(done), rows=tuple(rows)):
            return torch.cat([x[d : d + n] for x, d, n in zip(xs, done, rows)])

        paged_store(index_cache, take(raw), offsets, layer_idx=0, plane=0)
        paged_store(main_cache, take(kv), offsets, layer_idx=0, plane=0)
        paged_store(main_cache, take(kv) * 2, offsets, layer_idx=0, plane=1)
        key_counts = lengths + torch.tensor(rows, dtype=torch.int32)
        block_keys = qsa_compress_keys_paged(gamma, freqs, key_counts, index_cache, 0, ratio=RATIO, eps=1e-6,
                                             max_blocks=max_blocks)
        positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, rows)])
        scores = qsa_block_score(take(q_index), block_keys, positions, offsets, ratio=RATIO, score_scale=4.0)
        indices, counts = qsa_select_tokens(scores, positions, offsets, ratio=RATIO, budget=BUDGET)
        out = qsa_sparse_attention_paged(take(q_main), main_cache, 0, indices, counts, offsets, scale=0.25)
        r = 0
        for b in range(batch):
            for t in range(done[b], done[b] + rows[b]):
                per_position[b][t] = (scores[r], indices[r], counts[r], out[r])
                r += 1
            done[b] += rows[b]
    return block_keys, per_position


def chunks_from_cuts(length: int, cuts: list[int]) -> list[int]:
    points = sorted({c for c in cuts if 0 < c < length})
    bounds = [0] + points + [length]
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_schedules_give_identical_outputs(dtype, data):
    lengths = data.draw(st.lists(st.integers(1, 18), min_size=1, max_size=3), label="lengths")
    max_blocks = data.draw(st.integers(1, 9), label="max_blocks")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    raw = [torch.randn(n, 1, DIM).to(dtype) for n in lengths]
    q_index = [torch.randn(n, HEADS, DIM).to(dtype) for n in lengths]
    kv = [torch.randn(n, 1, DIM).to(dtype) for n in lengths]
    q_main = [torch.randn(n, 2, DIM).to(dtype) for n in lengths]
    chunked = [chunks_from_cuts(n, data.draw(st.lists(st.integers(1, n), max_size=6), label="cuts"))
               for n in lengths]
    schedules = {
        "prefill": [[n] for n in lengths],
        "chunks": chunked,
        "decode": [[1] * n for n in lengths],
    }
    results = {name: run_schedule(chunks, raw, q_index, kv, q_main, max_blocks) for name, chunks in schedules.items()}
    base_keys, base_rows = results["prefill"]
    for name, (keys, rows) in results.items():
        assert torch.equal(keys, base_keys), f"{name}: block keys differ"
        for b, n in enumerate(lengths):
            for t in range(n):
                s, i, c, o = rows[b][t]
                s0, i0, c0, o0 = base_rows[b][t]
                assert torch.equal(s, s0), f"{name}: scores of sequence {b} position {t} differ"
                assert torch.equal(i, i0) and torch.equal(c, c0), f"{name}: selection {b}/{t} differs"
                assert torch.equal(o, o0), f"{name}: attention output {b}/{t} differs"
