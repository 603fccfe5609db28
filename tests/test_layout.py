"""Paged storage: address math, store/load round trips, sentinel handling, errors."""

from __future__ import annotations

import numba
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv import SENTINEL, UINT32_SENTINEL, PagedKVCacheCollection, paged_store
from sparsekv.cache.layout import packed_page_elements
from sparsekv.kernels.cpu import _parallel as parallel
from sparsekv.kernels.cpu import cache as cpu_cache
from sparsekv.kernels.reference import cache as ref_cache


def make_collection(*, num_pages, kv, layers, page_size, heads, head_size, cache_lengths, pad=0,
                    dtype=torch.float32, seed=0, max_seq_length=0):
    """Blocks as a (possibly padded) strided view of one flat buffer, pages scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    packed = packed_page_elements(kv, layers, page_size, heads, head_size)
    stride = packed + pad
    flat = torch.randn(num_pages * stride + 3, generator=gen).to(dtype)
    blocks = flat.as_strided((num_pages, kv, layers, page_size, heads, head_size),
                             (stride, layers * page_size * heads * head_size, page_size * heads * head_size,
                              heads * head_size, head_size, 1), storage_offset=3)
    batch = len(cache_lengths)
    need = [-(-(c + max_seq_length) // page_size) for c in cache_lengths]
    max_pages = max(need + [1])
    perm = torch.randperm(num_pages, generator=gen).tolist()
    if sum(need) > num_pages:
        raise ValueError("test setup: not enough pages")
    table = torch.full((batch, max_pages), SENTINEL, dtype=torch.int32)
    for b in range(batch):
        for i in range(need[b]):
            table[b, i] = perm.pop()
    coll = PagedKVCacheCollection(blocks, torch.tensor(cache_lengths, dtype=torch.int32), table,
                                  max_seq_length=max_seq_length, max_cache_length=max(cache_lengths + [0]),
                                  page_stride=-1 if pad == 0 else stride)
    return coll, flat, stride


@pytest.mark.parametrize("pad", [0, 7])
@pytest.mark.parametrize("kv", [1, 2])
def test_address_math_matches_memory(pad, kv):
    page_size, heads, head_size, layers = 5, 3, 6, 3
    coll, flat, stride = make_collection(num_pages=9, kv=kv, layers=layers, page_size=page_size, heads=heads,
                                         head_size=head_size, cache_lengths=[11, 4, 9], pad=pad)
    assert coll.page_stride == stride
    for b in range(3):
        for t in range(coll.cache_length(b)):
            page = int(coll.lookup_table[b, t // page_size])
            for plane in range(kv):
                for layer in range(layers):
                    for h in range(heads):
                        for d in (0, head_size - 1):
                            # independent address computation straight from SPEC 1.1
                            addr = (page * stride + ((plane * layers + layer) * page_size + t % page_size)
                                    * heads * head_size + h * head_size + d)
                            assert coll.element_offset(b, t, plane, layer, h, d) == addr
                            view = coll.get_key_cache(layer) if plane == 0 else coll.get_value_cache(layer)
                            loaded = view.load(b, torch.tensor([t]))[0, h, d]
                            assert loaded == flat[3 + addr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@given(lengths=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 9)), min_size=1, max_size=6),
       pad=st.sampled_from([0, 5]), layer=st.integers(0, 1), plane=st.integers(0, 1),
       seed=st.integers(0, 2**31 - 1))
def test_store_load_round_trip_ragged(dtype, lengths, pad, layer, plane, seed):
    cache_lengths = [c for c, _ in lengths]
    new = [n for _, n in lengths]
    page_size = 4
    pages_needed = sum(-(-(c + max(new)) // page_size) for c in cache_lengths)
    coll, flat, _ = make_collection(num_pages=pages_needed + 2, kv=2, layers=2, page_size=page_size, heads=2,
                                    head_size=3, cache_lengths=cache_lengths, pad=pad, dtype=dtype, seed=seed,
                                    max_seq_length=max(new))
    before = flat.clone()
    offsets = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    values = torch.randn(int(offsets[-1]), 2, 3, generator=torch.Generator().manual_seed(seed)).to(dtype)
    view = coll.get_key_cache(layer) if plane == 0 else coll.get_value_cache(layer)
    view.store(values, offsets)
    for b, (c, n) in enumerate(zip(cache_lengths, new)):
        got = view.load(b, torch.arange(c, c + n))
        torch.testing.assert_close(got, values[offsets[b]:offsets[b + 1]], rtol=0, atol=0)
    # every element outside the stored rows is untouched (addresses from SPEC 1.1, computed here)
    touched = torch.zeros_like(flat, dtype=torch.bool)
    row = 2 * 3
    for b, (c, n) in enumerate(zip(cache_lengths, new)):
        for t in range(c, c + n):
            page = int(coll.lookup_table[b, t // page_size])
            start = 3 + page * coll.page_stride + ((plane * 2 + layer) * page_size + t % page_size) * row
            touched[start:start + row] = True
    assert torch.equal(flat[~touched], before[~touched])


@pytest.mark.parametrize("plane", [0, 1])
def test_view_store_is_storage_only_and_writes_what_the_op_writes(monkeypatch, plane):
    """``PagedKVCache.store`` runs the storage's own address math, without the op registry."""
    coll, flat, _ = make_collection(num_pages=7, kv=2, layers=2, page_size=4, heads=2, head_size=3,
                                    cache_lengths=[5, 0, 2], pad=5, dtype=torch.bfloat16, max_seq_length=4)
    op_coll = PagedKVCacheCollection(torch.empty_like(flat).copy_(flat).as_strided(
        coll.blocks.shape, coll.blocks.stride(), 3), coll.cache_lengths, coll.lookup_table,
        max_seq_length=4, max_cache_length=5, page_stride=coll.page_stride)
    offsets = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    values = torch.randn(7, 2, 3).to(torch.bfloat16)
    paged_store(op_coll, values, offsets, layer_idx=1, plane=plane)
    monkeypatch.setenv("SPARSEKV_BACKEND", "not-a-backend")  # any op call would raise now
    view = coll.get_key_cache(1) if plane == 0 else coll.get_value_cache(1)
    view.store(values, offsets)
    assert torch.equal(coll.blocks.view(torch.int16), op_coll.blocks.view(torch.int16))
    with pytest.raises(ValueError, match="SPARSEKV_BACKEND"):
        paged_store(op_coll, values, offsets, layer_idx=1, plane=plane)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@given(lengths=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 9)), min_size=1, max_size=5),
       pad=st.sampled_from([0, 5]), layer=st.integers(0, 1), plane=st.integers(0, 1), heads=st.integers(1, 3),
       head_size=st.integers(1, 7), page_size=st.sampled_from([1, 3, 4]), seed=st.integers(0, 2**31 - 1))
def test_cpu_store_kernel_writes_what_the_reference_writes(dtype, lengths, pad, layer, plane, heads, head_size,
                                                           page_size, seed):
    """The CPU backend's store against the reference's on the same buffer, every element compared (the
    padding between pages included)."""
    cache_lengths, new = [c for c, _ in lengths], [n for _, n in lengths]
    pages_needed = sum(-(-(c + max(new)) // page_size) for c in cache_lengths)
    coll, flat, _ = make_collection(num_pages=pages_needed + 2, kv=2, layers=2, page_size=page_size, heads=heads,
                                    head_size=head_size, cache_lengths=cache_lengths, pad=pad, dtype=dtype,
                                    seed=seed, max_seq_length=max(new))
    offsets = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    values = torch.randn(int(offsets[-1]), heads, head_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected_flat = flat.clone()
    expected = expected_flat.as_strided(coll.blocks.shape, coll.blocks.stride(), 3)
    ref_cache.paged_store(expected, values, coll.lookup_table, coll.cache_lengths, offsets, plane, layer)
    cpu_cache.paged_store(coll.blocks, values, coll.lookup_table, coll.cache_lengths, offsets, plane, layer)
    assert torch.equal(flat.view(torch.uint8), expected_flat.view(torch.uint8))


def test_cpu_store_kernel_on_several_threads(monkeypatch, seed):
    """A store large enough for every thread (the threshold lowered, the contention policy told the cores
    are free) writes what the reference writes."""
    monkeypatch.setattr(parallel, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(parallel.CONTENTION, "allow_parallel", lambda now, threads=2: True)
    given_threads = []

    class RecordedThreads(parallel.numba_threads):
        def __enter__(self):
            given_threads.append(super().__enter__())
            return given_threads[-1]

    monkeypatch.setattr(parallel, "threads_for", lambda work: RecordedThreads(work))
    coll, flat, _ = make_collection(num_pages=40, kv=2, layers=1, page_size=4, heads=2, head_size=5,
                                    cache_lengths=[3, 0, 9], pad=3, seed=seed, max_seq_length=37)
    offsets = torch.tensor([0, 37, 38, 61], dtype=torch.int32)
    values = torch.randn(61, 2, 5)
    expected_flat = flat.clone()
    ref_cache.paged_store(expected_flat.as_strided(coll.blocks.shape, coll.blocks.stride(), 3), values,
                          coll.lookup_table, coll.cache_lengths, offsets, 1, 0)
    paged_store(coll, values, offsets, layer_idx=0, plane=1)
    assert given_threads == [numba.get_num_threads()]
    assert torch.equal(flat, expected_flat)


@pytest.mark.parametrize("through", ["op", "storage"])
@pytest.mark.parametrize("bad_page", [SENTINEL, 9, 1000])
def test_store_through_missing_page_raises_and_writes_nothing(bad_page, through):
    """The op (the CPU backend here) and the storage's own store validate every destination first."""
    coll, flat, _ = make_collection(num_pages=9, kv=2, layers=1, page_size=4, heads=1, head_size=2,
                                    cache_lengths=[3, 6], max_seq_length=2)
    coll.lookup_table[1, 1] = bad_page  # sequence 1's positions 4..7
    before = flat.clone()
    values, offsets = torch.ones(4, 1, 2), torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 1, position 6"):
        if through == "op":
            paged_store(coll, values, offsets, layer_idx=0, plane=0)
        else:
            coll.get_key_cache(0).store(values, offsets)
    assert torch.equal(flat, before)


def test_load_beyond_table_or_negative_raises():
    coll, _, _ = make_collection(num_pages=4, kv=1, layers=1, page_size=4, heads=1, head_size=2,
                                 cache_lengths=[5])
    with pytest.raises(ValueError, match="beyond the lookup table"):
        coll.get_key_cache(0).load(0, torch.tensor([100]))
    with pytest.raises(ValueError, match="position -1 is negative"):
        coll.get_key_cache(0).load(0, torch.tensor([-1]))


def test_uint32_lookup_table_and_sentinel():
    blocks = torch.arange(3 * 1 * 1 * 2 * 1 * 2, dtype=torch.float32).reshape(3, 1, 1, 2, 1, 2)
    table = torch.tensor([[2, UINT32_SENTINEL]], dtype=torch.int64).to(torch.uint32)
    coll = PagedKVCacheCollection(blocks, torch.tensor([2], dtype=torch.int32).to(torch.uint32), table,
                                  max_seq_length=0, max_cache_length=2)
    assert coll.lookup_table.dtype == torch.int32
    assert coll.lookup_table.tolist() == [[2, SENTINEL]]
    torch.testing.assert_close(coll.get_key_cache(0).load(0, torch.tensor([1])), blocks[2, 0, 0, 1][None])
    with pytest.raises(ValueError, match="unassigned"):
        coll.get_key_cache(0).load(0, torch.tensor([2]))


def test_int64_values_beyond_int32_are_reported_as_passed():
    blocks = torch.zeros(2, 1, 1, 2, 1, 2)
    with pytest.raises(ValueError, match=r"lookup_table: .*fit in int32.*got 4294967296 at index \[0, 0\]"):
        PagedKVCacheCollection(blocks, torch.tensor([1]), torch.tensor([[2**32]]), 0, 1)
    strided = torch.zeros(3, 2, dtype=torch.int64).t()  # [2, 3], not contiguous
    strided[1, 2] = -(2**31) - 1
    with pytest.raises(ValueError, match=r"lookup_table: .*fit in int32.*got -2147483649 at index \[1, 2\]"):
        PagedKVCacheCollection(blocks, torch.tensor([1, 1]), strided, 0, 1)
    with pytest.raises(ValueError, match=r"cache_lengths: .*fit in int32.*got 1099511627776 at index 1"):
        PagedKVCacheCollection(blocks, torch.tensor([3, 2**40]), torch.zeros(2, 1, dtype=torch.int64), 0, 1)
    with pytest.raises(ValueError, match=r"cache_lengths: .*fit in int32.*got 3000000000 at index 0"):
        PagedKVCacheCollection(blocks, torch.tensor([3_000_000_000]).to(torch.uint32),
                               torch.zeros(1, 1, dtype=torch.int32), 0, 1)


def test_negative_page_ids_are_not_called_the_sentinel():
    coll, _, _ = make_collection(num_pages=4, kv=1, layers=1, page_size=4, heads=1, head_size=2,
                                 cache_lengths=[5])
    coll.lookup_table[0, 1] = -7
    with pytest.raises(ValueError, match=r"sequence 0, position 5: its page \(lookup_table\[0, 1\]\) is -7, "
                                         r"outside \[0, 4\)"):
        coll.get_key_cache(0).load(0, torch.tensor([5]))
    coll.lookup_table[0, 1] = -1
    with pytest.raises(ValueError, match="is the sentinel"):
        coll.get_key_cache(0).load(0, torch.tensor([5]))


@pytest.mark.parametrize("value", [2.7, 3.0, "3", None])
def test_max_seq_length_must_be_an_int(value):
    with pytest.raises(TypeError, match="max_seq_length: expected an int"):
        PagedKVCacheCollection(torch.zeros(2, 1, 1, 2, 1, 2), torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32),
                               value, 1)


def test_store_of_more_rows_than_max_seq_length_raises_and_writes_nothing():
    coll, flat, _ = make_collection(num_pages=4, kv=1, layers=1, page_size=4, heads=1, head_size=2,
                                    cache_lengths=[0, 1], max_seq_length=2)
    before = flat.clone()
    with pytest.raises(ValueError, match="sequence 1 stores 3 rows, more than the collection's max_seq_length = 2"):
        coll.get_key_cache(0).store(torch.ones(5, 1, 2), torch.tensor([0, 2, 5]))
    assert torch.equal(flat, before)
    coll.get_key_cache(0).store(torch.ones(4, 1, 2), torch.tensor([0, 2, 4]))  # two rows each: allowed


def test_constructor_and_view_errors():
    blocks = torch.zeros(4, 1, 2, 4, 1, 8)
    lengths, table = torch.zeros(2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)
    coll = PagedKVCacheCollection(blocks, lengths, table, 1, 0)
    with pytest.raises(ValueError, match="KV == 1"):
        coll.get_value_cache(0)
    with pytest.raises(ValueError, match="layer_idx"):
        coll.get_key_cache(2)
    with pytest.raises(ValueError, match="blocks: expected a 6-d tensor"):
        PagedKVCacheCollection(blocks[0], lengths, table, 1, 0)
    with pytest.raises(ValueError, match="KV"):
        PagedKVCacheCollection(torch.zeros(4, 3, 1, 4, 1, 8), lengths, table, 1, 0)
    with pytest.raises(TypeError, match="blocks: expected dtype"):
        PagedKVCacheCollection(blocks.to(torch.int32), lengths, table, 1, 0)
    with pytest.raises(ValueError, match="lookup_table: expected 2 rows"):
        PagedKVCacheCollection(blocks, lengths, table[:1], 1, 0)
    with pytest.raises(ValueError, match="page_stride: expected blocks.stride"):
        PagedKVCacheCollection(blocks, lengths, table, 1, 0, page_stride=200)
    with pytest.raises(ValueError, match="page_stride: expected -1 or >="):
        PagedKVCacheCollection(blocks, lengths, table, 1, 0, page_stride=3)
    with pytest.raises(ValueError, match="max_cache_length"):
        PagedKVCacheCollection(blocks, torch.tensor([5, 0]), table, 1, 0)
    with pytest.raises(ValueError, match="contiguous"):
        PagedKVCacheCollection(blocks.transpose(3, 5), lengths, table, 1, 0)


def test_store_argument_errors():
    coll, _, _ = make_collection(num_pages=4, kv=2, layers=1, page_size=4, heads=1, head_size=2,
                                 cache_lengths=[0], max_seq_length=2)
    view = coll.get_key_cache(0)
    with pytest.raises(ValueError, match="values: expected shape"):
        view.store(torch.zeros(2, 2, 2), torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="values: expected dtype"):
        view.store(torch.zeros(2, 1, 2, dtype=torch.float16), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="expected the last offset to equal the 2 rows of values, got 3"):
        view.store(torch.zeros(2, 1, 2), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        coll2, _, _ = make_collection(num_pages=4, kv=2, layers=1, page_size=4, heads=1, head_size=2,
                                      cache_lengths=[0, 0], max_seq_length=2)
        coll2.get_key_cache(0).store(torch.zeros(2, 1, 2), torch.tensor([0, 3, 2]))
