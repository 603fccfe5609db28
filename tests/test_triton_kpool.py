"""Triton MLA k-pool kernels (compress, ring close, seed tail, pool score) against the reference."""

from __future__ import annotations

import functools

import pytest
import spec4
import torch
from triton_support import DEVICE, gpu_validation_rules, require_triton

pytestmark = pytest.mark.triton
require_triton()

from sparsekv.kernels.reference import kpool as ref
from sparsekv.kernels.triton import kpool as tri

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MODES = ["softmax", "mean", "last"]


# the Triton kernels' fp32 results may differ from the reference by 1e-5 of the output's scale
# (fast exp, tiled sums), and some cases feed NaN on purpose
assert_spec_close = functools.partial(spec4.assert_spec_close, scale_atol=1e-5, nan_ok=True)


def offsets_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def call_inputs(cache_lengths, lengths, dim, kpool, dtype, gen):
    total = sum(lengths)
    k = torch.randn(total, dim, generator=gen).to(dtype).to(DEVICE)
    gate = (2 * torch.randn(total, dim, generator=gen)).to(dtype).to(DEVICE)
    ape = torch.randn(kpool, dim, generator=gen).to(DEVICE)
    offsets = offsets_of(lengths)
    cached = torch.tensor(cache_lengths, dtype=torch.int32, device=DEVICE)
    counts = ref.pool_counts(offsets, cached, kpool)
    pool_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return k, gate, ape, offsets, cached, pool_offsets


# ---- compress --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kpool", [4, 3, 1])
def test_compress_matches_reference(dtype, mode, kpool):
    gen = torch.Generator().manual_seed(kpool * 31 + MODES.index(mode) + 7 * DTYPES.index(dtype))
    cache_lengths, lengths = [6, 0, 5, 8, 2], [7, 3, 0, 21, 9]
    k, gate, ape, offsets, cached, pool_offsets = call_inputs(cache_lengths, lengths, 24, kpool, dtype, gen)
    total_pools = int(pool_offsets[-1])
    expected = torch.full((total_pools, 24), float("nan"), dtype=dtype, device=DEVICE)
    actual = torch.full((total_pools, 24), float("nan"), dtype=dtype, device=DEVICE)
    ref.mla_kpool_compress(expected, k, gate, ape, offsets, pool_offsets, cached, kpool, mode)
    tri.mla_kpool_compress(actual, k, gate, ape, offsets, pool_offsets, cached, kpool, mode)
    assert_spec_close(actual, expected)
    if kpool == 1 or mode == "last":
        assert torch.equal(actual, expected)


# ---- ring close + seed tail -----------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_ring_close_and_seed_tail_match_reference(dtype, mode):
    gen = torch.Generator().manual_seed(50 + MODES.index(mode) + 3 * DTYPES.index(dtype))
    kpool, dim = 4, 16
    cache_lengths, lengths = [6, 5, 8, 3, 9, 0], [3, 1, 2, 0, 11, 2]  # close, too short, aligned, empty, ...
    k, gate, ape, offsets, cached, _ = call_inputs(cache_lengths, lengths, dim, kpool, dtype, gen)
    ring = torch.randn(9, 2, kpool, dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([4, 0, 8, 2, 7, 5], dtype=torch.int32, device=DEVICE)

    expected = torch.full((6, dim), float("nan"), dtype=dtype, device=DEVICE)
    expected_ids = torch.full((6,), 99, dtype=torch.int32, device=DEVICE)
    actual, actual_ids = expected.clone(), expected_ids.clone()
    ref.mla_kpool_ring_close(expected, expected_ids, ring, slots, k, gate, ape, offsets, cached, kpool, mode)
    tri.mla_kpool_ring_close(actual, actual_ids, ring, slots, k, gate, ape, offsets, cached, kpool, mode)
    assert torch.equal(actual_ids, expected_ids)
    assert expected_ids.tolist() == [1, -1, -1, -1, 2, -1]
    assert_spec_close(actual, expected)

    expected_ring, actual_ring = ring.clone(), ring.clone()
    ref.mla_kpool_seed_tail(expected_ring, slots, k, gate, offsets, cached, kpool)
    tri.mla_kpool_seed_tail(actual_ring, slots, k, gate, offsets, cached, kpool)
    assert torch.equal(actual_ring, expected_ring)
    assert not torch.equal(actual_ring, ring)


def pools_by_schedule(k, gate, ape, kpool, mode, chunks):
    """Pool keys of one request fed in ``chunks`` through ring close, compress and seed tail (Triton)."""
    dim, dtype = k.shape[1], k.dtype
    ring = torch.full((2, 2, kpool, dim), float("nan"), dtype=dtype, device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    pools, done = {}, 0
    for n in chunks:
        rows = slice(done, done + n)
        offsets = offsets_of([n])
        cached = torch.tensor([done], dtype=torch.int32, device=DEVICE)
        closed = torch.empty(1, dim, dtype=dtype, device=DEVICE)
        closed_id = torch.empty(1, dtype=torch.int32, device=DEVICE)
        tri.mla_kpool_ring_close(closed, closed_id, ring, slot, k[rows], gate[rows], ape, offsets, cached, kpool,
                                 mode)
        if int(closed_id) >= 0:
            pools[int(closed_id)] = closed[0]
        count = int(ref.pool_counts(offsets, cached, kpool)[0])
        pooled = torch.empty(count, dim, dtype=dtype, device=DEVICE)
        tri.mla_kpool_compress(pooled, k[rows], gate[rows], ape, offsets, torch.tensor([0, count], device=DEVICE,
                               dtype=torch.int32), cached, kpool, mode)
        first = -(-done // kpool)
        for j in range(count):
            pools[first + j] = pooled[j]
        tri.mla_kpool_seed_tail(ring, slot, k[rows], gate[rows], offsets, cached, kpool)
        done += n
    return torch.stack([pools[p] for p in range(done // kpool)])


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_any_schedule_gives_identical_pools(mode):
    gen = torch.Generator().manual_seed(8)
    kpool, dim, total = 4, 16, 19
    k = torch.randn(total, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    gate = torch.randn(total, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    ape = torch.randn(kpool, dim, generator=gen).to(DEVICE)
    one_shot = pools_by_schedule(k, gate, ape, kpool, mode, [total])
    assert torch.equal(pools_by_schedule(k, gate, ape, kpool, mode, [1] * total), one_shot)
    assert torch.equal(pools_by_schedule(k, gate, ape, kpool, mode, [3, 6, 1, 2, 7]), one_shot)


# ---- pool score ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,cache_lengths", [([1, 1, 1], [41, 3, 26]), ([9, 0, 4], [0, 5, 30])])
def test_score_matches_reference(dtype, lengths, cache_lengths):
    gen = torch.Generator().manual_seed(sum(lengths) * 3 + DTYPES.index(dtype))
    kpool, heads, dim, pools_per_page, layers, pad = 4, 6, 16, 2, 2, 8
    ends = [c + n for c, n in zip(cache_lengths, lengths)]
    pages_needed = [max(1, -(-(e // kpool) // pools_per_page)) for e in ends]
    num_pages = sum(pages_needed) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((3, max(pages_needed) + 1), -1, dtype=torch.int32)
    for b, count in enumerate(pages_needed):
        for i in range(count):
            table[b, i] = perm.pop()
    packed = layers * pools_per_page * dim
    storage = torch.randn(num_pages * (packed + pad), generator=gen).to(dtype).to(DEVICE)
    blocks = storage.as_strided((num_pages, 1, layers, pools_per_page, 1, dim),
                                (packed + pad, packed, pools_per_page * dim, dim, dim, 1))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lengths, lengths)]).to(torch.int32)
    total_q = positions.shape[0]
    q = torch.randn(total_q, heads, dim, generator=gen).to(dtype).to(DEVICE)
    weights = torch.randn(total_q, heads, generator=gen).to(DEVICE)
    offsets = offsets_of(lengths)
    for layer, out_cols in [(1, 12), (0, 5)]:  # 5 columns cap visibility
        expected = torch.full((total_q, out_cols), float("nan"), device=DEVICE)
        actual = expected.clone()
        args = (q, weights, blocks, table.to(DEVICE), positions.to(DEVICE), offsets, kpool, layer)
        ref.mla_kpool_score(expected, *args)
        tri.mla_kpool_score(actual, *args)
        assert torch.equal(torch.isinf(actual), torch.isinf(expected))
        assert_spec_close(actual, expected)


def test_score_missing_page_masked_and_debug_raises(monkeypatch):
    gpu_validation_rules(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    blocks = torch.randn(4, 1, 1, 2, 1, 16, generator=gen).to(DEVICE)
    table = torch.tensor([[2, -1, 0]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 2, 16, generator=gen).to(DEVICE)
    weights = torch.ones(1, 2, device=DEVICE)
    positions = torch.tensor([23], dtype=torch.int32, device=DEVICE)  # sees pools 0..5 (pages 0, 1, 2)
    scores = torch.full((1, 8), float("nan"), device=DEVICE)
    tri.mla_kpool_score(scores, q, weights, blocks, table, positions, offsets_of([1]), 4, 0)
    assert scores[0, 2:4].tolist() == [0.0, 0.0]  # pools of the missing page score as zero keys
    good = table.clone()
    good[0, 1] = 1
    expected = scores.clone()
    ref.mla_kpool_score(expected, q, weights, blocks, good, positions, offsets_of([1]), 4, 0)
    keep = [0, 1, 4, 5, 6, 7]
    assert_spec_close(scores[:, keep], expected[:, keep])
    monkeypatch.setenv("SPARSEKV_DEBUG", "1")
    with pytest.raises(ValueError, match=r"row 0 \(sequence 0\) at position 23 sees pool 2"):
        tri.mla_kpool_score(scores, q, weights, blocks, table, positions, offsets_of([1]), 4, 0)
