"""The QSA block-key cache: qsa_store_block_keys_paged / qsa_load_block_keys_paged against compress, CPU against
the reference, and their errors (nothing written by a call that raises)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qsa_cases import DTYPES, assert_spec_close, build_paged_cache, make_collection

from sparsekv import (PagedKVCacheCollection, make_pooled_collection, plan_qsa_block_score_paged, qsa_block_score,
                      qsa_block_score_paged, qsa_compress_keys_paged, rope_freqs_cis)
from sparsekv.kernels.cpu import qsa as cpu_qsa
from sparsekv.kernels.reference import qsa as ref_qsa
from sparsekv.ops.qsa import qsa_load_block_keys_paged, qsa_store_block_keys_paged

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element as bit patterns (NaN poison included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))


def block_case(rng: random.Random, dtype: torch.dtype, dim: int = 12):
    """Raw keys in a paged indexer cache (NaN wherever no key is) and a NaN-poisoned block cache on the same pages."""
    ratio = rng.choice([1, 2, 3, 4])
    per_page = rng.choice([1, 2, 3])
    batch = rng.randrange(1, 5)
    key_counts = [rng.choice([0, rng.randrange(1, 40), ratio * rng.randrange(1, 9)]) for _ in range(batch)]
    num_layers = rng.randrange(1, 3)
    layer = rng.randrange(num_layers)
    histories = [torch.randn(n, 1, dim).to(dtype) for n in key_counts]
    blocks, table = build_paged_cache(histories, page_size=ratio * per_page, num_layers=num_layers, layer=layer,
                                      stride_pad=rng.choice([0, 5]), rng=rng)
    block_blocks = torch.full((blocks.shape[0], rng.choice([1, 2]), num_layers, per_page, 1, dim), float("nan"),
                              dtype=dtype)
    gamma = torch.randn(dim) * 0.3
    freqs = rope_freqs_cis(max(key_counts) + 1, rng.choice([2, dim]), theta=1e4)
    return ratio, key_counts, blocks, table, block_blocks, layer, gamma, freqs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_store_then_load_equals_compress_on_cpu_and_reference(dtype, seed):
    """Blocks stored from random first blocks on (the rows before them untouched), then all of them loaded: the CPU
    kernels and the reference write the same bits, and the loaded rows are compress's rows."""
    rng = random.Random(seed)
    for _ in range(4):
        ratio, key_counts, blocks, table, block_blocks, layer, gamma, freqs = block_case(rng, dtype)
        counts = torch.tensor(key_counts, dtype=torch.int32)
        first = torch.tensor([rng.randrange(n // ratio + 1) for n in key_counts], dtype=torch.int32)
        stored = {}
        for name, backend in (("cpu", cpu_qsa), ("reference", ref_qsa)):
            target = block_blocks.clone()
            backend.qsa_store_block_keys_paged(target, gamma, freqs, counts, first, blocks, table, layer, ratio, 1e-6,
                                               max(n // ratio for n in key_counts))
            stored[name] = target
        assert same_bits(stored["cpu"], stored["reference"])
        max_blocks = max(n // ratio for n in key_counts) + rng.choice([0, 1])
        want = torch.empty(len(key_counts) * max_blocks, blocks.shape[-1], dtype=dtype)
        ref_qsa.qsa_compress_keys_paged(want, gamma, freqs, counts, blocks, table, layer, ratio, 1e-6)
        for b, n in enumerate(key_counts):  # the rows before the first stored block are still the poison
            for j in range(n // ratio):
                row = stored["cpu"][table[b, j // block_blocks.shape[3]], 0, layer, j % block_blocks.shape[3], 0]
                if j < first[b]:
                    assert row.isnan().all()
                else:
                    assert same_bits(row, want[b * max_blocks + j])
        full = block_blocks.clone()  # every block stored: loading gives compress's output whatever max_blocks
        cpu_qsa.qsa_store_block_keys_paged(full, gamma, freqs, counts, torch.zeros_like(counts), blocks, table, layer,
                                           ratio, 1e-6, max(n // ratio for n in key_counts))
        for cut in (max_blocks, max(max_blocks - 1, 0)):
            want = torch.empty(len(key_counts) * cut, blocks.shape[-1], dtype=dtype)
            ref_qsa.qsa_compress_keys_paged(want, gamma, freqs, counts, blocks, table, layer, ratio, 1e-6)
            for backend in (cpu_qsa, ref_qsa):
                got = torch.full_like(want, float("nan"))
                backend.qsa_load_block_keys_paged(got, counts, full, table, layer, ratio)
                assert same_bits(got, want), (backend.__name__, cut)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpu_store_bits_do_not_depend_on_the_worker_count(dtype, seed, monkeypatch):
    """The store kernel's 64-block tasks taken as they go by 1, 2 or 5 workers (more than the threads there are):
    the reference's bits each time, from random first blocks on."""
    rng = random.Random(seed)
    ratio, per_page, dim = 2, 4, rng.choice([24, 128])
    key_counts = [rng.randrange(1000, 1500) for _ in range(3)]  # runs of several tasks each
    histories = [torch.randn(n, 1, dim).to(dtype) for n in key_counts]
    blocks, table = build_paged_cache(histories, page_size=ratio * per_page, num_layers=1, layer=0, stride_pad=0,
                                      rng=rng)
    block_blocks = torch.full((blocks.shape[0], 1, 1, per_page, 1, dim), float("nan"), dtype=dtype)
    gamma, freqs = torch.randn(dim) * 0.3, rope_freqs_cis(max(key_counts) + 1, dim, theta=1e4)
    counts = torch.tensor(key_counts, dtype=torch.int32)
    first = torch.tensor([rng.randrange(n // ratio // 2) for n in key_counts], dtype=torch.int32)
    most = max(n // ratio for n in key_counts)
    want = block_blocks.clone()
    ref_qsa.qsa_store_block_keys_paged(want, gamma, freqs, counts, first, blocks, table, 0, ratio, 1e-6, most)
    for workers in (1, 2, 5):
        monkeypatch.setattr(cpu_qsa, "threads_for", lambda work, n=workers: contextlib.nullcontext(n))
        got = block_blocks.clone()
        cpu_qsa.qsa_store_block_keys_paged(got, gamma, freqs, counts, first, blocks, table, 0, ratio, 1e-6, most)
        assert same_bits(got, want), f"{workers} workers"


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_schedule_of_calls_keeps_every_block(data):
    """Calls of any sizes (mid-block ends, calls completing no block, sequences at different lengths), each storing
    the blocks it completes through the public op: then the public load equals compress."""
    rng = random.Random(data.draw(st.integers(0, 2**31 - 1)))
    dtype = data.draw(st.sampled_from(DTYPES))
    ratio, key_counts, blocks, table, block_blocks, layer, gamma, freqs = block_case(rng, dtype)
    done = [0] * len(key_counts)
    calls = data.draw(st.integers(1, 5))
    for call in range(calls):
        after = key_counts if call == calls - 1 else [d + data.draw(st.integers(0, n - d))
                                                      for n, d in zip(key_counts, done)]
        index = make_collection(blocks, table, done)
        block_cache = make_pooled_collection(block_blocks, torch.tensor(done), table, kpool=ratio)
        qsa_store_block_keys_paged(gamma, freqs, torch.tensor(after), index, block_cache, layer, ratio=ratio, eps=1e-6)
        done = after
    max_blocks = max(n // ratio for n in key_counts) + 1
    index = make_collection(blocks, table, key_counts)
    want = qsa_compress_keys_paged(gamma, freqs, torch.tensor(key_counts), index, layer, ratio=ratio, eps=1e-6,
                                   max_blocks=max_blocks)
    block_cache = make_pooled_collection(block_blocks, torch.tensor(key_counts), table, kpool=ratio)
    got = qsa_load_block_keys_paged(torch.tensor(key_counts), block_cache, layer, ratio=ratio, max_blocks=max_blocks)
    assert same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_paged_score_equals_the_score_of_the_loaded_keys(dtype, seed):
    """The block score read where the blocks lie in the pages equals, bit for bit, the block score of the same
    blocks copied out (CPU); the reference agrees within SPEC 4. Ragged rows at any position a sequence's keys
    allow, 1-5 heads, ``out_cols`` cutting the blocks or past them."""
    rng = random.Random(seed)
    for _ in range(4):
        ratio, key_counts, blocks, table, block_blocks, layer, gamma, freqs = block_case(rng, dtype)
        counts = torch.tensor(key_counts, dtype=torch.int32)
        cpu_qsa.qsa_store_block_keys_paged(block_blocks, gamma, freqs, counts, torch.zeros_like(counts), blocks,
                                           table, layer, ratio, 1e-6, max(n // ratio for n in key_counts))
        rows = [rng.randrange(0, 4) if n else 0 for n in key_counts]
        positions = torch.tensor([rng.randrange(n) for n, k in zip(key_counts, rows) for _ in range(k)],
                                 dtype=torch.int32)
        offsets = torch.tensor([0] + rows).cumsum(0).to(torch.int32)
        heads = rng.randrange(1, 6)
        q = torch.randn(positions.shape[0], heads, blocks.shape[-1]).to(dtype)
        out_cols = max(n // ratio for n in key_counts) + rng.choice([-1, 0, 2])
        out_cols = max(out_cols, 0)
        cache = make_pooled_collection(block_blocks, counts, table, kpool=ratio)
        paged = qsa_block_score_paged(q, cache, layer, positions, offsets, ratio=ratio, score_scale=3.0,
                                      out_cols=out_cols)
        loaded = torch.empty(len(key_counts) * out_cols, blocks.shape[-1], dtype=dtype)
        cpu_qsa.qsa_load_block_keys_paged(loaded, counts, block_blocks, table, layer, ratio)
        want = qsa_block_score(q, loaded, positions, offsets, ratio=ratio, score_scale=3.0)
        assert torch.equal(paged, want)
        reference = torch.empty_like(paged)
        ref_qsa.qsa_block_score_paged(reference, q, block_blocks, table, positions, offsets, layer, ratio, 3.0)
        assert_spec_close(paged, reference, what="cpu vs reference")


def test_paged_score_errors():
    index, block_cache, _, _ = _error_case()
    q = torch.randn(3, 2, 8)
    positions, offsets = torch.tensor([9, 3, 4]), torch.tensor([0, 1, 3])
    with pytest.raises(TypeError, match=r"q: expected dtype torch.float32 \(same as block_cache\), got torch.float16"):
        qsa_block_score_paged(q.half(), block_cache, 0, positions, offsets, ratio=2, score_scale=1.0, out_cols=5)
    with pytest.raises(ValueError, match="block_cache: head width 8 differs from q's head dim 4"):
        qsa_block_score_paged(q[..., :4], block_cache, 0, positions, offsets, ratio=2, score_scale=1.0, out_cols=5)
    with pytest.raises(ValueError, match="out_cols: required when out is not given"):
        qsa_block_score_paged(q, block_cache, 0, positions, offsets, ratio=2, score_scale=1.0)
    table = block_cache.lookup_table.clone()
    table[1, 0] = -1
    out = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"paged cache: sequence 1, position 0"):
        qsa_block_score_paged(q, _with(block_cache, lookup_table=table), 0, positions, offsets, ratio=2,
                              score_scale=1.0, out=out)
    assert not out.any()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_paged_score_plan_runs_as_the_one_shot_op_and_checks_pages_at_each_run(backend, monkeypatch):
    """Runs of one plan equal the public op bit for bit, with the plan's own positions after the caller
    changes theirs; a page taken away after planning raises at the run and writes nothing."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    _, block_cache, _, _ = _error_case()
    positions, offsets = torch.tensor([9, 3, 4]), torch.tensor([0, 1, 3])
    plan = plan_qsa_block_score_paged(block_cache, positions, offsets, ratio=2, score_scale=1.5, out_cols=5)
    queries = [torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    want = [qsa_block_score_paged(q, block_cache, 0, positions, offsets, ratio=2, score_scale=1.5, out_cols=5)
            for q in queries]
    positions.zero_()
    for q, expected in zip(queries, want):
        assert torch.equal(plan.run(q, 0).view(torch.int32), expected.view(torch.int32))
    block_cache.lookup_table[1, 0] = -1
    out = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"paged cache: sequence 1, position 0"):
        plan.run(queries[0], 0, out=out)
    assert not out.any()
    with pytest.raises(ValueError, match=r"q: expected 3 rows \(one per planned query position\), got 2"):
        plan.run(queries[0][:2], 0)


def _error_case():
    """Two sequences of 10 and 5 tokens, R = 2, 2 blocks per page (page size 4), fp32; 4 and 2 tokens cached."""
    rng = random.Random(0)
    histories = [torch.randn(10, 1, 8), torch.randn(5, 1, 8)]
    blocks, table = build_paged_cache(histories, page_size=4, rng=rng)
    index = make_collection(blocks, table, [4, 2])
    block_blocks = torch.randn(blocks.shape[0], 1, 1, 2, 1, 8)
    block_cache = PagedKVCacheCollection(block_blocks, torch.tensor([2, 1]), table, max_seq_length=3,
                                         max_cache_length=2)
    return index, block_cache, torch.randn(8), rope_freqs_cis(16, 8, theta=1e4)


def _with(collection: PagedKVCacheCollection, **changes) -> PagedKVCacheCollection:
    fields = dict(blocks=collection.blocks, cache_lengths=collection.cache_lengths,
                  lookup_table=collection.lookup_table, max_seq_length=collection.max_seq_length,
                  max_cache_length=collection.max_cache_length)
    fields.update(changes)
    return PagedKVCacheCollection(fields.pop("blocks"), fields.pop("cache_lengths"), fields.pop("lookup_table"),
                                  **fields)


@pytest.mark.parametrize("change, error, match", [
    ("not a collection", TypeError, "block_cache: expected a PagedKVCacheCollection, got Tensor"),
    ("three rows per page", ValueError,
     r"block_cache: 3 rows per page x ratio 2 differs from index_cache's page size 4"),
    ("fewer pages", ValueError, "block_cache: .* pages, expected index_cache's"),
    ("another table", ValueError, "block_cache.lookup_table: differs from index_cache's"),
    ("lengths not in blocks", ValueError, r"block_cache.cache_lengths: sequence 1 has 0 blocks cached, expected 1 "
                                          r"\(index_cache.cache_lengths\[1\] // ratio\)"),
    ("fp16 blocks", TypeError, "block_cache: expected dtype torch.float32 .* got torch.float16"),
    ("key counts behind", ValueError,
     "key_counts: sequence 0 has 1 complete blocks, fewer than the 2 block_cache holds"),
    ("missing page", ValueError, r"paged cache: sequence 0, position 8"),
    ("max_seq_length short", ValueError, r"block_cache.max_seq_length: 2, but sequence 0 completes 3 blocks"),
])
def test_store_errors_name_the_argument_and_write_nothing(change, error, match):
    index, block_cache, gamma, freqs = _error_case()
    key_counts = torch.tensor([10, 5])
    if change == "not a collection":
        block_cache = block_cache.blocks
    elif change == "three rows per page":
        block_cache = _with(block_cache, blocks=torch.randn(block_cache.num_pages, 1, 1, 3, 1, 8))
    elif change == "fewer pages":
        block_cache = _with(block_cache, blocks=block_cache.blocks[:-1])
    elif change == "another table":
        other = index.lookup_table.clone()
        other[0, 0], other[1, 0] = other[1, 0].item(), other[0, 0].item()
        block_cache = _with(block_cache, lookup_table=other)
    elif change == "lengths not in blocks":
        block_cache = _with(block_cache, cache_lengths=torch.tensor([2, 0]))
    elif change == "fp16 blocks":
        block_cache = _with(block_cache, blocks=block_cache.blocks.half())
    elif change == "key counts behind":
        key_counts = torch.tensor([3, 5])
    elif change == "max_seq_length short":
        block_cache = _with(block_cache, max_seq_length=2)
    elif change == "missing page":
        table = index.lookup_table.clone()
        table[0, 2] = -1  # tokens 8..9: the page of block 4, which this call completes
        index, block_cache = _with(index, lookup_table=table), _with(block_cache, lookup_table=table)
    before = block_cache.blocks.clone() if isinstance(block_cache, PagedKVCacheCollection) else None
    with pytest.raises(error, match=match):
        qsa_store_block_keys_paged(gamma, freqs, key_counts, index, block_cache, 0, ratio=2, eps=1e-6)
    if before is not None:
        assert torch.equal(block_cache.blocks, before)


def test_load_errors():
    index, block_cache, _, _ = _error_case()
    with pytest.raises(ValueError, match=r"key_counts: expected shape \(2,\) = batch, got \(3,\)"):
        qsa_load_block_keys_paged(torch.tensor([4, 2, 2]), block_cache, 0, ratio=2, max_blocks=5)
    with pytest.raises(ValueError, match="max_blocks: required when out is not given"):
        qsa_load_block_keys_paged(torch.tensor([4, 2]), block_cache, 0, ratio=2)
    table = block_cache.lookup_table.clone()
    table[1, 0] = -1
    out = torch.zeros(2 * 5, 8)
    with pytest.raises(ValueError, match=r"paged cache: sequence 1, position 0"):
        qsa_load_block_keys_paged(torch.tensor([10, 5]), _with(block_cache, lookup_table=table), 0, ratio=2, out=out)
    assert not out.any()
    with pytest.raises(ValueError, match="layer_idx: expected < num_layers = 1, got 1"):
        qsa_load_block_keys_paged(torch.tensor([4, 2]), block_cache, 1, ratio=2, max_blocks=5)
