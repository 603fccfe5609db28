"""Triton paged store against the reference (interpreter on CPU, real kernels on a GPU)."""

from __future__ import annotations

import pytest
import torch

from triton_support import DEVICE, gpu_validation_rules, require_triton

pytestmark = pytest.mark.triton
require_triton()

from sparsekv import PagedKVCacheCollection, paged_store
from sparsekv.kernels.reference import cache as ref
from sparsekv.kernels.triton import cache as tri


def make_blocks(num_pages, kv, layers, page_size, heads, dim, dtype, pad, gen):
    """Random blocks, as a strided view (page stride padded by ``pad`` elements) when ``pad > 0``."""
    packed = kv * layers * page_size * heads * dim
    storage = torch.randn(num_pages * (packed + pad), generator=gen).to(dtype).to(DEVICE)
    return storage.as_strided((num_pages, kv, layers, page_size, heads, dim),
                              (packed + pad, layers * page_size * heads * dim, page_size * heads * dim,
                               heads * dim, dim, 1))


def make_batch(cache_lengths, new_rows, page_size, num_pages, gen, max_pages=None):
    """A lookup table with distinct random pages for every needed logical page, sentinels elsewhere."""
    needed = [(c + n + page_size - 1) // page_size for c, n in zip(cache_lengths, new_rows)]
    max_pages = max_pages or max(max(needed), 1) + 1
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(cache_lengths), max_pages), -1, dtype=torch.int32)
    for b, count in enumerate(needed):
        for i in range(count):
            table[b, i] = perm.pop()
    offsets = torch.tensor([0] + list(torch.tensor(new_rows).cumsum(0).tolist()), dtype=torch.int32)
    return table.to(DEVICE), torch.tensor(cache_lengths, dtype=torch.int32, device=DEVICE), offsets.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pad", [0, 24])
def test_store_matches_reference(dtype, pad):
    gen = torch.Generator().manual_seed(1234 + pad)
    page_size, heads, dim, layers = 4, 2, 12, 3
    cache_lengths, new_rows = [5, 0, 7, 3], [3, 6, 0, 9]
    table, lengths, offsets = make_batch(cache_lengths, new_rows, page_size, 16, gen)
    blocks = make_blocks(16, 2, layers, page_size, heads, dim, dtype, pad, gen)
    values = torch.randn(sum(new_rows), heads, dim, generator=gen).to(dtype).to(DEVICE)
    for plane, layer in [(0, 2), (1, 0)]:
        expected = blocks.clone()
        ref.paged_store(expected, values, table, lengths, offsets, plane, layer)
        tri.paged_store(blocks, values, table, lengths, offsets, plane, layer)
        assert torch.equal(blocks, expected)


def test_store_strided_values_and_one_page():
    gen = torch.Generator().manual_seed(7)
    blocks = make_blocks(1, 1, 2, 8, 3, 5, torch.float32, 0, gen)
    table, lengths, offsets = make_batch([2], [5], 8, 1, gen, max_pages=1)
    wide = torch.randn(5, 3, 9, generator=gen).to(DEVICE)
    values = wide[:, :, 2:7]  # rows and heads strided, channels contiguous
    expected = blocks.clone()
    ref.paged_store(expected, values, table, lengths, offsets, 0, 1)
    tri.paged_store(blocks, values, table, lengths, offsets, 0, 1)
    assert torch.equal(blocks, expected)


def test_missing_pages_are_masked_and_debug_raises(monkeypatch):
    gpu_validation_rules(monkeypatch)
    gen = torch.Generator().manual_seed(99)
    page_size = 4
    table, lengths, offsets = make_batch([2, 0], [7, 3], page_size, 8, gen)
    table[0, 1] = -1  # positions 4..7 of sequence 0 have no page
    table[1, 0] = 8  # out of range page id
    blocks = make_blocks(8, 2, 1, page_size, 1, 6, torch.float32, 0, gen)
    values = torch.randn(10, 1, 6, generator=gen).to(DEVICE)
    before = blocks.clone()
    tri.paged_store(blocks, values, table, lengths, offsets, 1, 0)
    # Only sequence 0's positions 2, 3 (page table[0, 0]) and 8 (page table[0, 2]) are written.
    expected = before.clone()
    p0, p2 = int(table[0, 0]), int(table[0, 2])
    expected[p0, 1, 0, 2:4] = values[0:2]
    expected[p2, 1, 0, 0] = values[6]
    assert torch.equal(blocks, expected)

    monkeypatch.setenv("SPARSEKV_DEBUG", "1")
    with pytest.raises(ValueError, match="sequence 0, position 4"):
        tri.paged_store(blocks, values, table, lengths, offsets, 1, 0)
    assert torch.equal(blocks, expected)


def test_public_op_dispatches_to_triton(monkeypatch):
    monkeypatch.setenv("SPARSEKV_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    table, lengths, offsets = make_batch([3, 1], [2, 4], 4, 6, gen)
    blocks = make_blocks(6, 2, 2, 4, 1, 8, torch.bfloat16, 0, gen)
    values = torch.randn(6, 1, 8, generator=gen).to(torch.bfloat16).to(DEVICE)
    expected = blocks.clone()
    ref.paged_store(expected, values, table, lengths, offsets, 0, 1)
    coll = PagedKVCacheCollection(blocks, lengths, table, max_seq_length=4, max_cache_length=3)
    paged_store(coll, values, offsets, layer_idx=1, plane=0)
    assert torch.equal(blocks, expected)


def test_empty_batch_rows_is_a_no_op():
    gen = torch.Generator().manual_seed(3)
    table, lengths, offsets = make_batch([4, 2], [0, 0], 4, 4, gen)
    blocks = make_blocks(4, 2, 1, 4, 1, 8, torch.float16, 0, gen)
    before = blocks.clone()
    tri.paged_store(blocks, torch.empty(0, 1, 8, dtype=torch.float16, device=DEVICE), table, lengths, offsets, 0, 0)
    assert torch.equal(blocks, before)


def test_cpu_tensors_raise_on_missing_page_without_debug():
    gen = torch.Generator().manual_seed(13)
    table, lengths, offsets = make_batch([0], [5], 4, 4, gen)
    table[0, 1] = -1
    blocks = make_blocks(4, 1, 1, 4, 1, 8, torch.float32, 0, gen)
    before = blocks.clone()
    values = torch.randn(5, 1, 8, generator=gen).to(DEVICE)
    if DEVICE == "cuda":
        pytest.skip("GPU tensors mask missing pages unless SPARSEKV_DEBUG=1")
    with pytest.raises(ValueError, match="sequence 0, position 4"):
        tri.paged_store(blocks, values, table, lengths, offsets, 0, 0)
    assert torch.equal(blocks, before)
