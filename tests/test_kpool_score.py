"""Pool score, top-k expansion and the pooled-key paged cache (SPEC 3.3, 1.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsekv import (
    PagedKVCacheCollection,
    kpool_indexer_step,
    make_pooled_collection,
    mla_kpool_compress,
    mla_kpool_expand_topk,
    mla_kpool_score,
    plan_kpool_score,
    store_pooled_keys,
)
from sparsekv.kernels.cpu import kpool as cpu
from sparsekv.kernels.cpu._bits import as_numba
from sparsekv.kernels.cpu import _paged_score
from sparsekv.kernels.cpu._paged_score import _paged_score_kernel
from sparsekv.kernels.reference import kpool as ref


def scattered_table(pages_per_seq, num_pages, gen):
    physical = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(pages_per_seq), max(pages_per_seq)), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = physical[used: used + count]
        used += count
    return table


def fill_pooled_cache(pooled_keys, kpool, pools_per_page, layer, num_layers, gen):
    """Pooled cache holding ``pooled_keys[b]`` (``[pools_b, D]``) of each sequence at pool ids 0..pools_b-1."""
    dim, dtype = pooled_keys[0].shape[1], pooled_keys[0].dtype
    pages = [max(1, -(-p.shape[0] // pools_per_page)) for p in pooled_keys]
    num_pages = sum(pages) + 2
    table = scattered_table(pages, num_pages, gen)
    blocks = torch.full((num_pages, 1, num_layers, pools_per_page, 1, dim), float("nan"), dtype=dtype)
    batch = len(pooled_keys)
    empty_cache = torch.zeros(batch, dtype=torch.int32)
    coll = make_pooled_collection(blocks, empty_cache, table, kpool=kpool)
    counts = torch.tensor([p.shape[0] for p in pooled_keys])
    store_pooled_keys(coll, layer, torch.zeros(batch, dim, dtype=dtype), torch.full((batch,), -1),
                      torch.cat(pooled_keys), torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]),
                      empty_cache, kpool=kpool)
    return blocks, table


def brute_force_scores(q, w, pooled_keys, seq_of_row, positions, kpool, out_cols):
    """Loop over rows and visible pools, float64; ``-inf`` elsewhere. Returns ``(scores, terms)``:
    ``terms`` holds each score's ``sum_h |w_h| sum_d |q_hd k_d|`` (0 where invisible), the size of
    what a float32 sum rounds."""
    scores = torch.full((q.shape[0], out_cols), float("-inf"), dtype=torch.float64)
    terms = torch.zeros(q.shape[0], out_cols, dtype=torch.float64)
    for r in range(q.shape[0]):
        keys = pooled_keys[seq_of_row[r]]
        for p in range(out_cols):
            if (p + 1) * kpool - 1 <= positions[r]:
                products = q[r].double() * keys[p].double()  # [H, D]
                scores[r, p] = (w[r].double() * products.sum(-1).clamp_min(0)).sum()
                terms[r, p] = (w[r].double().abs() * products.abs().sum(-1)).sum()
    return scores.float(), terms


def assert_scores_close(actual, expected, terms=None):
    """Within ``1e-5 * (|expected| + 0.01 * max|expected|)``, plus ``1e-6 * terms`` where given: a score whose
    heads cancel carries the float32 rounding of its terms, whatever its own size (docs/spec-notes.md)."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert not torch.isnan(actual).any()
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf) and bool((actual[inf] < 0).all())
    scale = expected[~inf].abs().max() if bool((~inf).any()) else torch.tensor(1.0)
    err = (actual[~inf] - expected[~inf]).abs()
    bound = 1e-5 * (expected[~inf].abs() + 1e-2 * scale)
    if terms is not None:
        bound = bound + 1e-6 * terms[~inf].float()
    assert bool((err <= bound).all()), f"max err {float(err.max())}"


def score_case(dtype, seed, *, kpool=4, heads=5, dim=64, pools_per_page=3):
    gen = torch.Generator().manual_seed(seed)
    seq_lengths = [0, 3, 29, 17, 45]  # tokens in each sequence after this call
    pooled_keys = [torch.randn(n // kpool, dim, generator=gen).to(dtype) for n in seq_lengths]
    blocks, table = fill_pooled_cache(pooled_keys, kpool, pools_per_page, layer=1, num_layers=2, gen=gen)
    # query rows: a prefill chunk of sequence 2, decode rows of the others, none for sequence 0
    rows_per_seq = [0, 1, 9, 1, 2]
    positions = []
    for n, rows in zip(seq_lengths, rows_per_seq):
        positions += list(range(n - rows, n))
    total_q = len(positions)
    q = torch.randn(total_q, heads, dim, generator=gen).to(dtype)
    w = torch.randn(total_q, heads, generator=gen) / heads  # signed weights: relu is per head, before the sum
    offsets = torch.tensor([0] + torch.tensor(rows_per_seq).cumsum(0).tolist(), dtype=torch.int32)
    seq_of_row = sum(([b] * rows for b, rows in enumerate(rows_per_seq)), [])
    coll = make_pooled_collection(blocks, torch.tensor(seq_lengths), table, kpool=kpool)
    return coll, q, w, torch.tensor(positions, dtype=torch.int32), offsets, pooled_keys, seq_of_row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_score_matches_brute_force(dtype, seed):
    coll, q, w, positions, offsets, pooled_keys, seq_of_row = score_case(dtype, seed=seed)
    scores = mla_kpool_score(q, w, coll, 1, positions, offsets, kpool=4)
    assert scores.shape == (q.shape[0], 45 // 4)  # default width: the most pools a row sees
    expected, terms = brute_force_scores(q, w, pooled_keys, seq_of_row, positions.tolist(), 4, scores.shape[1])
    assert_scores_close(scores, expected, terms)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dim", [60, 61])  # odd D: bf16 channel pairs get a zero channel
def test_score_cpu_matches_reference(dtype, dim, seed):
    coll, q, w, positions, offsets, pooled_keys, seq_of_row = score_case(dtype, seed, kpool=2, heads=7, dim=dim,
                                                                         pools_per_page=4)
    out_cols = 30
    got = torch.full((q.shape[0], out_cols), float("nan"))
    want = torch.full_like(got, float("nan"))
    args = (q, w, coll.blocks, coll.lookup_table, positions, offsets, 2, 1)
    ref.mla_kpool_score(want, *args)
    cpu.mla_kpool_score(got, *args)
    _, terms = brute_force_scores(q, w, pooled_keys, seq_of_row, positions.tolist(), 2, out_cols)
    assert_scores_close(got, want, terms)


def test_score_without_heads_is_an_empty_sum():
    """Zero index heads: every visible pool scores 0 (the empty sum), on the CPU as in the reference."""
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=24, heads=0)
    args = (q, w, coll.blocks, coll.lookup_table, positions, offsets, 4, 1)
    got, want = torch.full((q.shape[0], 12), float("nan")), torch.full((q.shape[0], 12), float("nan"))
    cpu.mla_kpool_score(got, *args)
    ref.mla_kpool_score(want, *args)
    assert torch.equal(got, want) and bool((want == 0).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_score_cpu_reads_pages_that_lie_apart(dtype):
    """Blocks that are every other page of a larger buffer (pages apart, each one contiguous): the CPU
    kernel's flat view steps over the gaps and scores as it does on the same pages packed."""
    coll, q, w, positions, offsets, _, _ = score_case(dtype, seed=26)
    buffer = torch.full((2 * coll.num_pages, *coll.blocks.shape[1:]), float("nan"), dtype=dtype)
    apart = buffer[::2]
    apart.copy_(coll.blocks)
    assert not apart.is_contiguous() and apart[0].is_contiguous()
    packed, spread, want = (torch.full((q.shape[0], 12), float("nan")) for _ in range(3))
    cpu.mla_kpool_score(packed, q, w, coll.blocks, coll.lookup_table, positions, offsets, 4, 1)
    cpu.mla_kpool_score(spread, q, w, apart, coll.lookup_table, positions, offsets, 4, 1)
    ref.mla_kpool_score(want, q, w, apart, coll.lookup_table, positions, offsets, 4, 1)
    assert torch.equal(spread, packed)
    assert_scores_close(spread, want)


def test_score_wider_output_and_out_argument():
    coll, q, w, positions, offsets, pooled_keys, seq_of_row = score_case(torch.float32, seed=22)
    holder = torch.full((q.shape[0], 40), float("nan"))
    out = holder[:, ::2]  # strided out, 20 columns
    returned = mla_kpool_score(q, w, coll, 1, positions, offsets, kpool=4, out_cols=20, out=out)
    assert returned is out
    expected, terms = brute_force_scores(q, w, pooled_keys, seq_of_row, positions.tolist(), 4, 20)
    assert_scores_close(out.clone(), expected, terms)
    assert torch.isnan(holder[:, 1::2]).all()


def test_score_errors():
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=23)
    call = dict(q=q, head_weights=w, pooled_collection=coll, layer_idx=1, query_positions=positions,
                input_row_offsets=offsets)
    with pytest.raises(ValueError, match=r"out_cols: expected >= 11 \(the most pools a query row sees\)"):
        mla_kpool_score(**call, kpool=4, out_cols=10)
    with pytest.raises(ValueError, match="q: expected head dim 64"):
        mla_kpool_score(**{**call, "q": q[..., :32]}, kpool=4)
    with pytest.raises(TypeError, match="q: expected the pooled cache's dtype"):
        mla_kpool_score(**{**call, "q": q.to(torch.bfloat16)}, kpool=4)
    with pytest.raises(ValueError, match=r"head_weights: expected shape \(13, 5\)"):
        mla_kpool_score(**{**call, "head_weights": w[:, :4]}, kpool=4)
    with pytest.raises(ValueError, match="query_positions: expected values >= 0"):
        mla_kpool_score(**{**call, "query_positions": positions - 30}, kpool=4)
    with pytest.raises(ValueError, match="expected the last offset to equal the 13 q rows, got 12"):
        mla_kpool_score(**{**call, "input_row_offsets": offsets.clamp_max(12)}, kpool=4)
    with pytest.raises(ValueError, match="layer_idx: expected < num_layers = 2"):
        mla_kpool_score(**{**call, "layer_idx": 2}, kpool=4)
    with pytest.raises(TypeError, match="pooled_collection: expected a PagedKVCacheCollection"):
        mla_kpool_score(**{**call, "pooled_collection": coll.blocks}, kpool=4)


@pytest.mark.parametrize("backend", ["public", "reference", "cpu"])
def test_score_missing_page_raises_before_writing(backend):
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=24, pools_per_page=3)
    table = coll.lookup_table.clone()
    table[2, 1] = -1  # sequence 2, pools 3..5, visible to its rows at t >= 15
    broken = PagedKVCacheCollection(coll.blocks, coll.cache_lengths, table, 10, 20)
    row = int(offsets[2]) + int(torch.nonzero(positions[offsets[2]:offsets[3]] >= 15)[0])
    # the error names the row and the position the caller passed, then the pool and its page
    message = (rf"query_positions: row {row} \(sequence 2\) at position {int(positions[row])} sees pool 3 "
               r"\(positions 12..15\), which has no page in the pooled cache: its page \(lookup_table\[2, 1\]\) "
               r"is the sentinel")
    if backend == "public":
        with pytest.raises(ValueError, match=message):
            mla_kpool_score(q, w, broken, 1, positions, offsets, kpool=4)
        return
    scores = torch.full((q.shape[0], 11), 7.0)
    kernels = ref if backend == "reference" else cpu
    with pytest.raises(ValueError, match=message):
        kernels.mla_kpool_score(scores, q, w, broken.blocks, table, positions, offsets, 4, 1)
    assert bool((scores == 7.0).all()), "wrote before raising"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_plan_runs_each_layer_as_the_one_shot_op(backend, monkeypatch, seed):
    """One plan, two layers' queries and keys: each run equals the public op bit for bit, and the plan keeps
    its own positions when the caller changes theirs between runs (the custom op's path on the reference
    backend, the CPU backend's own plan on the CPU)."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    coll, q, w, positions, offsets, _, _ = score_case(torch.bfloat16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    coll.blocks[:, :, 0] = torch.randn(coll.blocks[:, :, 0].shape, generator=gen).to(torch.bfloat16)
    plan = plan_kpool_score(coll, positions, offsets, kpool=4, out_cols=13)
    expected = [mla_kpool_score(q * (layer + 1), w, coll, layer, positions, offsets, kpool=4, out_cols=13)
                for layer in (0, 1)]
    planned_positions = positions.clone()
    positions.fill_(0)
    for layer in (1, 0):
        got = plan.run(q * (layer + 1), w, layer)
        assert torch.equal(got.view(torch.int32), expected[layer].view(torch.int32))
    out = torch.empty(q.shape[0], 13)
    assert plan.run(q, w, 0, out=out) is out and torch.equal(out, expected[0])
    assert torch.equal(plan.query_positions, planned_positions)


def test_plan_checks_pages_and_arguments_at_each_run():
    """A run reads the lookup table as it is then: a page taken away after planning raises and writes
    nothing; replaced storage, a wrong row count and a bad layer raise too."""
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=29, pools_per_page=3)
    plan = plan_kpool_score(coll, positions, offsets, kpool=4)
    out = torch.full((q.shape[0], 11), float("nan"))
    coll.lookup_table[2, 1] = -1  # sequence 2, pools 3..5
    with pytest.raises(ValueError, match=r"sees pool 3 .* its page \(lookup_table\[2, 1\]\) is the sentinel"):
        plan.run(q, w, 1, out=out)
    assert bool(out.isnan().all()), "wrote before raising"
    with pytest.raises(ValueError, match="q: expected 13 rows .one per planned query position., got 12"):
        plan.run(q[:12], w[:12], 1)
    with pytest.raises(ValueError, match="layer_idx: expected < num_layers = 2, got 2"):
        plan.run(q, w, 2)
    coll.lookup_table = coll.lookup_table.clone()
    with pytest.raises(ValueError, match="pooled_collection: its blocks or lookup table were replaced"):
        plan.run(q, w, 1)


def test_score_ignores_missing_pages_past_the_visible_pools():
    coll, q, w, positions, offsets, pooled_keys, seq_of_row = score_case(torch.float32, seed=25)
    table = coll.lookup_table.clone()
    table[1, :] = -1  # sequence 1 (3 tokens) sees no pool
    broken = PagedKVCacheCollection(coll.blocks, coll.cache_lengths, table, 10, 20)
    scores = mla_kpool_score(q, w, broken, 1, positions, offsets, kpool=4)
    expected, terms = brute_force_scores(q, w, pooled_keys, seq_of_row, positions.tolist(), 4, scores.shape[1])
    assert_scores_close(scores, expected, terms)


def test_score_from_indexer_steps_equals_score_from_one_shot_keys():
    kpool, dim, heads = 4, 64, 3
    gen = torch.Generator().manual_seed(26)
    lengths = [13, 22]
    keys = [torch.randn(n, dim, generator=gen).to(torch.bfloat16) for n in lengths]
    gates = [torch.randn(n, dim, generator=gen).to(torch.bfloat16) for n in lengths]
    ape = torch.randn(kpool, dim, generator=gen)
    table = scattered_table([2, 2], 6, gen)
    blocks = torch.full((6, 1, 1, 16 // kpool, 1, dim), float("nan"), dtype=torch.bfloat16)
    ring = torch.full((2, 2, kpool, dim), float("nan"), dtype=torch.bfloat16)
    done = [0, 0]
    for chunk in ([5, 7], [6, 1], [2, 14]):  # chunks stopping mid-pool
        cache = torch.tensor(done, dtype=torch.int32)
        offsets = torch.tensor([0, chunk[0], sum(chunk)], dtype=torch.int32)
        k = torch.cat([keys[b][done[b]: done[b] + chunk[b]] for b in range(2)])
        gate = torch.cat([gates[b][done[b]: done[b] + chunk[b]] for b in range(2)])
        coll = make_pooled_collection(blocks, cache, table, kpool=kpool)
        kpool_indexer_step(ring, torch.tensor([1, 0]), k, gate, ape, offsets, cache, coll, 0, kpool=kpool)
        done = [d + n for d, n in zip(done, chunk)]
    one_shot = [mla_kpool_compress(keys[b], gates[b], ape, torch.tensor([0, lengths[b]]), None,
                                   torch.tensor([0]), kpool=kpool) for b in range(2)]
    q = torch.randn(2, heads, dim, generator=gen).to(torch.bfloat16)
    w = torch.rand(2, heads, generator=gen)
    positions = torch.tensor([12, 21])
    coll = make_pooled_collection(blocks, torch.tensor(done), table, kpool=kpool)
    scores = mla_kpool_score(q, w, coll, 0, positions, torch.tensor([0, 1, 2]), kpool=kpool)
    expected, terms = brute_force_scores(q, w, one_shot, [0, 1], [12, 21], kpool, scores.shape[1])
    assert_scores_close(scores, expected, terms)


def test_score_op_passes_opcheck():
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=27)
    torch.library.opcheck(
        torch.ops.sparsekv.mla_kpool_score.default,
        (torch.empty(q.shape[0], 12), q, w, coll.blocks, coll.lookup_table, positions, offsets, 4, 1),
    )


# ---------------------------------------------------------------------------
# top-k expansion
# ---------------------------------------------------------------------------
def brute_force_topk(scores, positions, kpool, topk, tail):
    rows, counts = [], []
    width = topk + kpool - 1
    for r, t in enumerate(positions):
        visible = min((t + 1) // kpool, scores.shape[1])
        ranked = sorted(range(visible), key=lambda p: (-float(scores[r, p]), p))[: topk // kpool]
        tokens = [p * kpool + m for p in sorted(ranked) for m in range(kpool)]
        if tail:
            v = t + 1
            tokens += list(range(v - v % kpool, v))
        counts.append(len(tokens))
        rows.append(tokens + [-1] * (width - len(tokens)))
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32)


@pytest.mark.parametrize("kpool, topk", [(4, 16), (4, 2048), (2, 6), (1, 5), (16, 64)])
@pytest.mark.parametrize("tail", [True, False])
def test_expand_topk_matches_brute_force(kpool, topk, tail):
    gen = torch.Generator().manual_seed(kpool * 1000 + topk)
    positions = torch.tensor([0, 2, 3, 13, 40, 77, 150, 151, 198])
    cols = int((positions.max() + 1) // kpool)
    scores = torch.randn(positions.shape[0], cols, generator=gen)
    visible = (positions + 1) // kpool
    scores[torch.arange(cols)[None, :] >= visible[:, None]] = float("-inf")
    scores[4, :3] = scores[4, 3]  # a tie: the lower pool id wins
    indices, counts = mla_kpool_expand_topk(scores, positions, kpool=kpool, topk=topk, always_select_tail=tail)
    want_indices, want_counts = brute_force_topk(scores, positions.tolist(), kpool, topk, tail)
    assert indices.dtype == torch.int32 and counts.dtype == torch.int32
    assert torch.equal(indices, want_indices)
    assert torch.equal(counts, want_counts)


def test_expand_topk_from_scores_end_to_end():
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=28)
    scores = mla_kpool_score(q, w, coll, 1, positions, offsets, kpool=4)
    indices, counts = mla_kpool_expand_topk(scores, positions, kpool=4, topk=8)
    want_indices, want_counts = brute_force_topk(scores, positions.tolist(), 4, 8, True)
    assert torch.equal(indices, want_indices) and torch.equal(counts, want_counts)
    assert indices.shape == (q.shape[0], 8 + 3)


# ---------------------------------------------------------------------------
# pooled-key cache
# ---------------------------------------------------------------------------
def test_store_pooled_keys_round_trip_through_scattered_pages():
    kpool, dim, pools_per_page = 4, 8, 2
    gen = torch.Generator().manual_seed(29)
    table = scattered_table([3, 3, 3], 12, gen)
    blocks = torch.full((12, 1, 1, pools_per_page, 1, dim), float("nan"))
    # tokens cached: 6 (open pool 1), 8 (aligned), 0; new rows 7, 9, 3
    cache = torch.tensor([6, 8, 0])
    closed = torch.randn(3, dim, generator=gen)
    closed_ids = torch.tensor([1, -1, -1])
    pool_offsets = torch.tensor([0, 1, 3, 3])  # pools 2 | 2, 3 | none
    pooled = torch.randn(3, dim, generator=gen)
    coll = make_pooled_collection(blocks, cache, table, kpool=kpool)
    assert coll.cache_lengths.tolist() == [1, 2, 0] and coll.page_size == pools_per_page
    store_pooled_keys(coll, 0, closed, closed_ids, pooled, pool_offsets, cache, kpool=kpool)
    view = coll.get_key_cache(0)
    assert torch.equal(view.load(0, torch.tensor([1, 2]))[:, 0], torch.stack([closed[0], pooled[0]]))
    assert torch.equal(view.load(1, torch.tensor([2, 3]))[:, 0], pooled[1:3])
    # pool 3 of sequence 1 is row 3 % 2 = 1 of logical page 3 // 2 = 1
    assert torch.equal(blocks[table[1, 1], 0, 0, 1, 0], pooled[2])
    assert int((~torch.isnan(blocks[:, 0, 0, :, 0, 0])).sum()) == 4  # nothing else written


def test_store_pooled_keys_sentinel_page_and_bad_ids():
    kpool, dim = 4, 8
    blocks = torch.full((4, 1, 1, 2, 1, dim), float("nan"))
    table = torch.tensor([[0, -1]], dtype=torch.int32)
    coll = make_pooled_collection(blocks, torch.tensor([4]), table, kpool=kpool)
    pooled = torch.randn(2, dim)
    args = (torch.zeros(1, dim), torch.tensor([-1]), pooled, torch.tensor([0, 2]), torch.tensor([4]))
    with pytest.raises(ValueError, match=r"sequence 0 \(cache_lengths\[0\] = 4\) stores pool 2 \(positions 8\.\.11\), "
                                         r"which has no page: its page \(lookup_table\[0, 1\]\) is the sentinel"):
        store_pooled_keys(coll, 0, *args, kpool=kpool)
    assert torch.isnan(blocks).all(), "wrote before raising"
    with pytest.raises(ValueError, match=r"cache_lengths: expected values >= 0, got -8 at index 0"):  # as passed
        store_pooled_keys(coll, 0, torch.zeros(1, dim), torch.tensor([-1]), pooled[:0], torch.tensor([0, 0]),
                          torch.tensor([-8]), kpool=kpool)
    assert torch.isnan(blocks).all(), "wrote before raising"
    with pytest.raises(ValueError, match=r"closed_ids: expected floor\(cache_lengths / kpool\) = \[1\]"):
        store_pooled_keys(coll, 0, torch.zeros(1, dim), torch.tensor([0]), pooled, torch.tensor([0, 2]),
                          torch.tensor([4]), kpool=kpool)
    with pytest.raises(ValueError, match=r"pooled: expected 1 rows"):
        store_pooled_keys(coll, 0, torch.zeros(1, dim), torch.tensor([-1]), pooled, torch.tensor([0, 1]),
                          torch.tensor([4]), kpool=kpool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", [3, 32])
def test_score_cpu_many_pools_and_rows_equals_reference_and_rows_alone(dtype, heads):
    """Pools spanning several score tasks and key tiles, rows spanning several row groups (with padding
    lanes): the CPU scores match the reference, and each row scored alone gives the same bits."""
    gen = torch.Generator().manual_seed(41 + heads)
    kpool, per_page, dim = 2, 5, 40
    seq_lengths = [301, 2 * 133 + 1]
    pooled_keys = [torch.randn(n // kpool, dim, generator=gen).to(dtype) for n in seq_lengths]
    blocks, table = fill_pooled_cache(pooled_keys, kpool, per_page, layer=0, num_layers=1, gen=gen)
    rows_per_seq = [23, 2]
    positions = torch.tensor([t for n, r in zip(seq_lengths, rows_per_seq) for t in range(n - r, n)],
                             dtype=torch.int32)
    q = torch.randn(len(positions), heads, dim, generator=gen).to(dtype)
    w = torch.randn(len(positions), heads, generator=gen) / heads
    offsets = torch.tensor([0, rows_per_seq[0], sum(rows_per_seq)], dtype=torch.int32)
    out_cols = max(seq_lengths) // kpool + 2
    got = torch.full((len(positions), out_cols), float("nan"))
    want = torch.full_like(got, float("nan"))
    ref.mla_kpool_score(want, q, w, blocks, table, positions, offsets, kpool, 0)
    cpu.mla_kpool_score(got, q, w, blocks, table, positions, offsets, kpool, 0)
    assert_scores_close(got, want)
    for r in [0, 9, 10, 22, 23, 24]:
        seq = 0 if r < rows_per_seq[0] else 1
        alone = torch.full((1, out_cols), float("nan"))
        cpu.mla_kpool_score(alone, q[r : r + 1], w[r : r + 1], blocks, table[seq : seq + 1], positions[r : r + 1],
                            torch.tensor([0, 1], dtype=torch.int32), kpool, 0)
        assert torch.equal(alone[0], got[r]), f"row {r} scored alone differs from the batched call"


@pytest.mark.parametrize(("heads", "per_page"), [(3, 8), (32, 8), (3, 13)])
def test_score_cpu_kernel_bits_do_not_depend_on_workers_or_prefetch(heads, per_page):
    """The paged kernel's tasks taken as they go by 1, 2 or 5 workers (more than the threads there are), asking
    for keys 0-3 pages ahead (past the sequences' last pages too; 13-key pages: a partial tile's keys asked for
    apart): the same bits, and the reference's values."""
    gen = torch.Generator().manual_seed(7 + heads + per_page)
    kpool, dim = 4, 48
    seq_lengths = [4 * 700, 4 * 333 + 3]
    pooled_keys = [torch.randn(n // kpool, dim, generator=gen).to(torch.bfloat16) for n in seq_lengths]
    blocks, table = fill_pooled_cache(pooled_keys, kpool, per_page, layer=0, num_layers=1, gen=gen)
    positions = torch.tensor([seq_lengths[0] - 1, seq_lengths[0] - 9, seq_lengths[1] - 1], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3], dtype=torch.int32)
    q = torch.randn(3, heads, dim, generator=gen).to(torch.bfloat16)
    w = torch.randn(3, heads, generator=gen) / heads
    out_cols = seq_lengths[0] // kpool
    plan = cpu.ScorePlan(blocks, table, positions, offsets, kpool, out_cols)
    keys = plan.keys
    outs = []
    for workers, pages_ahead in ((1, 0), (2, 1), (5, 2), (2, 3)):
        out = torch.full((3, out_cols), float("nan"))
        _paged_score_kernel(out.numpy(), as_numba(q), w.numpy(), keys.cache, keys.page_stride, keys.base,
                            keys.per_page, keys.num_pages, plan.table, plan.visible, plan.seq_keys, plan.offsets,
                            np.float32(1.0), pages_ahead, workers)
        outs.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    want = torch.full_like(outs[0], float("nan"))
    ref.mla_kpool_score(want, q, w, blocks, table, positions, offsets, kpool, 0)
    assert_scores_close(outs[0], want)


def test_score_plan_refuses_scores_it_does_not_write():
    """The plan's kernel writes float32 at the scores' address: a float16 tensor raises ``TypeError``, unwritten."""
    gen = torch.Generator().manual_seed(5)
    blocks, table = fill_pooled_cache([torch.randn(40, 16, generator=gen)], 4, 8, layer=0, num_layers=1, gen=gen)
    positions, offsets = torch.tensor([159], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    plan = cpu.ScorePlan(blocks, table, positions, offsets, 4, 40)
    scores = torch.full((1, 40), 7.0, dtype=torch.float16)
    with pytest.raises(TypeError, match="scores: expected float32, got torch.float16"):
        plan.run(scores, torch.randn(1, 2, 16), torch.ones(1, 2), 0)
    assert bool((scores == 7.0).all())


def test_score_plan_asks_at_least_a_page_and_keys_ahead_further_on():
    """The plan's tiles ask for the page ``ceil(KEYS_AHEAD / per_page)`` pages on, at least the next one."""
    gen = torch.Generator().manual_seed(3)
    kpool, dim, pools = 4, 64, 200
    positions, offsets = torch.tensor([4 * pools - 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    assert _paged_score.KEYS_AHEAD == 32
    for per_page, ahead in [(5, 7), (16, 2), (32, 1), (64, 1)]:
        keys = [torch.randn(pools, dim, generator=gen).to(torch.bfloat16)]
        blocks, table = fill_pooled_cache(keys, kpool, per_page, layer=0, num_layers=2, gen=gen)
        plan = cpu.ScorePlan(blocks, table, positions, offsets, kpool, pools)
        assert plan.pages_ahead == ahead, per_page


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_score_far_position_is_refused_in_bounded_memory(backend, monkeypatch):
    """A position far past the pooled cache raises on the table alone: nothing is sized by the position
    (the reference once listed 2**29 pools first and was killed for memory)."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=27)
    far = positions.clone()
    far[-1] = 2**31 - 1
    row, seq = q.shape[0] - 1, coll.batch_size - 1
    with pytest.raises(ValueError, match=rf"query_positions: row {row} \(sequence {seq}\) at position 2147483647 "
                                         r"sees pool \d+ .* beyond the lookup table"):
        mla_kpool_score(q, w, coll, 1, far, offsets, kpool=4)
    scores = torch.full((q.shape[0], 4), 7.0)  # a kernel called directly caps visibility at out_cols
    kernels = ref if backend == "reference" else cpu
    kernels.mla_kpool_score(scores, q, w, coll.blocks, coll.lookup_table, far, offsets, 4, 1)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_score_raising_call_leaves_out_untouched(backend, monkeypatch):
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    coll, q, w, positions, offsets, _, _ = score_case(torch.float32, seed=28, pools_per_page=3)
    table = coll.lookup_table.clone()
    table[2, 1] = coll.num_pages + 2
    broken = PagedKVCacheCollection(coll.blocks, coll.cache_lengths, table, 10, 20)
    out = torch.full((q.shape[0], 11), float("nan"))
    with pytest.raises(ValueError, match=rf"is {coll.num_pages + 2}, outside \[0, {coll.num_pages}\)"):
        mla_kpool_score(q, w, broken, 1, positions, offsets, kpool=4, out=out)
    assert bool(out.isnan().all()), "wrote before raising"


def test_score_cpu_causal_prefill_rows_that_end_before_a_task():
    """A causal prefill over several tasks of pools (128 each): the first rows see none of the later tasks'
    pools (their row groups skip them); CPU scores match the reference and each row's bits alone."""
    gen = torch.Generator().manual_seed(12)
    kpool, dim, heads = 2, 32, 5
    pooled_keys = [torch.randn(300, dim, generator=gen)]
    blocks, table = fill_pooled_cache(pooled_keys, kpool, 16, layer=0, num_layers=1, gen=gen)
    positions = torch.tensor([1, 9, 200, 255, 256, 257, 511, 512, 598, 599], dtype=torch.int32)
    q = torch.randn(len(positions), heads, dim, generator=gen)
    w = torch.randn(len(positions), heads, generator=gen) / heads
    offsets = torch.tensor([0, len(positions)], dtype=torch.int32)
    args = (blocks, table, positions, offsets, kpool, 0)
    got, want = torch.full((len(positions), 300), float("nan")), torch.full((len(positions), 300), float("nan"))
    cpu.mla_kpool_score(got, q, w, *args)
    ref.mla_kpool_score(want, q, w, *args)
    _, terms = brute_force_scores(q, w, pooled_keys, [0] * len(positions), positions.tolist(), kpool, 300)
    assert_scores_close(got, want, terms)
    for r in range(len(positions)):
        alone = torch.full((1, 300), float("nan"))
        cpu.mla_kpool_score(alone, q[r : r + 1], w[r : r + 1], blocks, table, positions[r : r + 1],
                            torch.tensor([0, 1], dtype=torch.int32), kpool, 0)
        assert torch.equal(alone, got[r : r + 1]), f"row {r} alone differs"
