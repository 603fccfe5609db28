"""Case builders and comparison metrics shared by the QSA and selection tests.

Also tests the builders themselves, so that the other files can trust them.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from spec4 import assert_lse_close, assert_spec_close

from sparsekv import PagedKVCacheCollection
from sparsekv.kernels.cpu import _sparse_attend as cpu_attend

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- paged caches ------------------------------------------------------------

def build_paged_cache(
    histories: list[torch.Tensor],
    *,
    page_size: int,
    num_layers: int = 1,
    layer: int = 0,
    kv: int = 1,
    values: list[torch.Tensor] | None = None,
    spare_pages: int = 2,
    stride_pad: int = 0,
    spare_table_cols: int = 1,
    rng: random.Random | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache holding ``histories[b] [n_b, heads, D]`` (plane 0) of ``layer``.

    Pages are scattered (a random permutation, spare pages in between); every
    element not holding a history token is NaN, so reading a wrong page,
    plane, layer or row shows up as NaN. ``stride_pad > 0`` returns a strided
    view of a larger allocation (``page_stride = packed + stride_pad``).
    Returns ``(blocks [num_pages, kv, num_layers, page_size, heads, D], lookup_table int32)``.
    """
    rng = rng or random.Random(0)
    heads, dim = histories[0].shape[1:]
    dtype = histories[0].dtype
    pages_per_seq = [-(-h.shape[0] // page_size) for h in histories]
    num_pages = sum(pages_per_seq) + spare_pages
    packed = kv * num_layers * page_size * heads * dim
    storage = torch.full((num_pages, packed + stride_pad), float("nan"), dtype=dtype)
    blocks = storage[:, :packed].view(num_pages, kv, num_layers, page_size, heads, dim)
    page_ids = list(range(num_pages))
    rng.shuffle(page_ids)
    table = torch.full((len(histories), max(pages_per_seq, default=0) + spare_table_cols), -1, dtype=torch.int32)
    for b, history in enumerate(histories):
        for i in range(pages_per_seq[b]):
            page = page_ids.pop()
            table[b, i] = page
            rows = history[i * page_size : (i + 1) * page_size]
            blocks[page, 0, layer, : rows.shape[0]] = rows
            if values is not None:
                blocks[page, 1, layer, : rows.shape[0]] = values[b][i * page_size : (i + 1) * page_size]
    return blocks, table


def make_collection(blocks: torch.Tensor, table: torch.Tensor, cache_lengths: list[int]) -> PagedKVCacheCollection:
    lengths = torch.tensor(cache_lengths, dtype=torch.int32)
    page_stride = blocks.stride(0) if blocks.shape[0] > 1 else -1
    packed = blocks[0].numel()
    return PagedKVCacheCollection(blocks, lengths, table, max_seq_length=1,
                                  max_cache_length=max(cache_lengths, default=0),
                                  page_stride=-1 if page_stride == packed else page_stride)


def random_key_counts(rng: random.Random, batch: int, ratio: int, max_len: int = 40) -> list[int]:
    """Key counts covering 0, fewer than a block, exact multiples and partial last blocks."""
    kinds = [lambda: 0, lambda: rng.randrange(1, ratio) if ratio > 1 else 1,
             lambda: ratio * rng.randrange(1, max_len // ratio + 1),
             lambda: rng.randrange(0, max_len + 1)]
    return [rng.choice(kinds)() for _ in range(batch)]


def prefill_selections(rng: random.Random, cached: list[int], rows: list[int], width: int):
    """``(indices, counts)`` of prefill chunks (``rows[b]`` new rows after ``cached[b]`` tokens): each row
    selects increasing positions, every causal token while they fit ``width``, else the best-scoring ones
    (scores shared by the sequence's rows plus noise of each row, so that neighbours overlap as an
    indexer's do); in the second sequence a few rows select nothing or repeat a position."""
    total_q = sum(rows)
    indices = torch.full((total_q, width), 10**6, dtype=torch.int32)  # never read: past the counts
    counts = torch.zeros(total_q, dtype=torch.int32)
    r = 0
    for b, (c, n) in enumerate(zip(cached, rows)):
        shared_scores = torch.rand(c + n)
        for position in range(c, c + n):
            scores = shared_scores[:position + 1] + 0.2 * torch.rand(position + 1)
            chosen = sorted(scores.topk(min(width, position + 1)).indices.tolist())
            if b == 1 and rng.random() < 0.2 and len(chosen) > 1:
                chosen[1] = chosen[0]  # a duplicate: this row's group runs row by row
            indices[r, :len(chosen)] = torch.tensor(chosen)
            counts[r] = 0 if b == 1 and rng.random() < 0.1 else len(chosen)
            r += 1
    return indices, counts


def check_rows_sharing_a_tile(run, reference, case, group, packed_rows, monkeypatch):
    """``run(case)`` with ``packed_rows`` rows per tile (three such groups per task) gives the bits of one row
    per task, and SPEC 4 against ``reference(case)``; fails when the first rows would not share a tile (the
    case would test nothing)."""
    width = case["indices"].shape[1]
    assert packed_rows <= int(case["offsets"][1]), "the first sequence is shorter than a packed group"
    union = cpu_attend.merged_selection(case["indices"].numpy(), case["counts"].numpy(), 0, packed_rows, group,
                                        np.empty(packed_rows * width, np.int32),
                                        np.empty((packed_rows * width, packed_rows * group), np.bool_))
    entries = int(case["counts"][:packed_rows].sum())
    assert 0 < 4 * union <= 3 * entries, "the first rows do not share a tile: the case tests nothing"
    monkeypatch.setattr(cpu_attend, "rows_per_task", lambda *plan, n=packed_rows: n)
    monkeypatch.setattr(cpu_attend, "groups_per_task", lambda *plan: 3)  # groups of both sequences
    out, lse = run(case)
    monkeypatch.setattr(cpu_attend, "rows_per_task", lambda *plan: 1)
    alone_out, alone_lse = run(case)
    assert torch.equal(out, alone_out) and torch.equal(lse, alone_lse)
    want_out, want_lse = reference(case)
    assert_lse_close(lse, want_lse, case["counts"])
    assert_spec_close(out, want_out, what="out", noise_floor=2.4e-4 if case["q"].dtype == torch.float16 else 3e-5)


def poisoned(shape, dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, -12345, dtype=dtype)


# ---- tests of the builders ----------------------------------------------------

def test_build_paged_cache_places_every_token():
    rng = random.Random(7)
    histories = [torch.randn(n, 1, 6) for n in (0, 5, 11)]
    for stride_pad in (0, 5):
        blocks, table = build_paged_cache(histories, page_size=4, num_layers=3, layer=2, kv=2,
                                          stride_pad=stride_pad, rng=rng)
        assert blocks.stride(0) == blocks[0].numel() + stride_pad
        for b, h in enumerate(histories):
            for t in range(h.shape[0]):
                page = int(table[b, t // 4])
                assert torch.equal(blocks[page, 0, 2, t % 4], h[t])
        assert torch.isnan(blocks[:, :, :2]).all()  # other layers untouched: NaN


def test_assert_spec_close_detects_two_ulps():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    bits = x.view(torch.int16).clone()
    bits[1] += 2
    try:
        assert_spec_close(bits.view(torch.bfloat16), x)
    except AssertionError:
        return
    raise AssertionError("a 2-ulp difference passed")
