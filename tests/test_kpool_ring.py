"""Pools that span calls (SPEC 3.2): ring close, seed tail, and schedule invariance of the pooled keys."""

from __future__ import annotations

import math
import random

import pytest
import torch
from spec4 import assert_spec_close
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv import (
    kpool_indexer_step,
    make_pooled_collection,
    mla_kpool_compress,
    mla_kpool_ring_close,
    mla_kpool_seed_tail,
)
from sparsekv.ops._registry import load_kernel
from sparsekv.kernels.cpu import kpool as cpu
from sparsekv.kernels.reference import kpool as ref

PAGE_SIZE = 16  # tokens per page; the pooled group holds PAGE_SIZE // kpool pools per page


def pooled_of_one_shot(k, gate, ape, kpool, mode):
    """Pooled keys of one request compressed in a single call from position 0."""
    offsets = torch.tensor([0, k.shape[0]])
    return mla_kpool_compress(k, gate, ape, offsets, None, torch.tensor([0]), kpool=kpool, mode=mode)


def run_schedule(keys, gates, ape, kpool, mode, calls, slots, gen):
    """Feed each request's tokens in the order ``calls`` says; return each request's stored pools."""
    num_requests, dim, dtype = len(keys), keys[0].shape[1], keys[0].dtype
    pages_per_request = [max(1, math.ceil(k.shape[0] / PAGE_SIZE)) for k in keys]
    max_pages = max(pages_per_request)
    num_pages = sum(pages_per_request) + 3
    physical = torch.randperm(num_pages, generator=gen)  # scattered pages, some never used
    table = torch.full((num_requests, max_pages), -1, dtype=torch.int32)
    used = 0
    for r, count in enumerate(pages_per_request):
        table[r, :count] = physical[used: used + count]
        used += count
    pools_per_page = PAGE_SIZE // kpool
    blocks = torch.full((num_pages, 1, 2, pools_per_page, 1, dim), float("nan"), dtype=dtype)
    ring = torch.full((max(slots) + 1, 2, kpool, dim), float("nan"), dtype=dtype)
    done = [0] * num_requests
    for call in calls:
        requests = [r for r, _ in call]
        lengths = [n for _, n in call]
        k = torch.cat([keys[r][done[r]: done[r] + n] for r, n in call])
        gate = torch.cat([gates[r][done[r]: done[r] + n] for r, n in call])
        offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        cache = torch.tensor([done[r] for r in requests], dtype=torch.int32)
        pooled_cache = make_pooled_collection(blocks, cache, table[requests], kpool=kpool)
        kpool_indexer_step(ring, torch.tensor([slots[r] for r in requests]), k, gate, ape, offsets, cache,
                           pooled_cache, 1, kpool=kpool, mode=mode)
        for r, n in call:
            done[r] += n
    final = make_pooled_collection(blocks, torch.tensor(done), table, kpool=kpool).get_key_cache(1)
    return [final.load(r, torch.arange(done[r] // kpool))[:, 0] for r in range(num_requests)]


@st.composite
def schedules(draw):
    kpool = draw(st.sampled_from([1, 2, 4, 16]))
    num_requests = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 2 * kpool + 11), min_size=num_requests, max_size=num_requests))
    style = draw(st.sampled_from(["one_shot", "decode", "chunks", "mixed"]))
    remaining, calls = list(lengths), []
    while any(remaining):
        active = [r for r in range(num_requests) if remaining[r] > 0]
        if style == "one_shot":
            call = [(r, remaining[r]) for r in active]
        elif style == "decode":
            call = [(r, 1) for r in active]
        else:
            chosen = draw(st.lists(st.sampled_from(active), min_size=1, unique=True))
            chosen = draw(st.permutations(chosen))  # batch rows in any order
            call = []
            for r in chosen:
                if style == "mixed" and draw(st.booleans()):
                    call.append((r, 1))
                else:
                    call.append((r, draw(st.integers(1, remaining[r]))))
            idle = [r for r in range(num_requests) if r not in chosen]
            if idle and draw(st.booleans()):
                call.append((idle[0], 0))  # an empty request in the batch
        for r, n in call:
            remaining[r] -= n
        calls.append(call)
    slots = draw(st.permutations(list(range(num_requests + 2))))[:num_requests]
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    mode = draw(st.sampled_from(["softmax", "softmax", "mean", "last"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return kpool, lengths, calls, list(slots), dtype, mode, seed


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_any_schedule_gives_the_one_shot_pooled_keys(case):
    kpool, lengths, calls, slots, dtype, mode, seed = case
    gen = torch.Generator().manual_seed(seed)
    dim = 64
    keys = [torch.randn(n, dim, generator=gen).to(dtype) for n in lengths]
    gates = [(3 * torch.randn(n, dim, generator=gen)).to(dtype) for n in lengths]
    ape = torch.randn(kpool, dim, generator=gen)
    stored = run_schedule(keys, gates, ape, kpool, mode, calls, slots, gen)
    for r in range(len(lengths)):
        expected = pooled_of_one_shot(keys[r], gates[r], ape, kpool, mode)
        assert stored[r].shape == expected.shape
        assert torch.equal(stored[r].view(torch.uint8), expected.view(torch.uint8)), f"request {r} differs"


# ---------------------------------------------------------------------------
# the two ring ops on their own
# ---------------------------------------------------------------------------
def test_ring_close_docstring_example():
    kpool, dim = 4, 8
    gen = torch.Generator().manual_seed(5)
    ring = torch.randn(3, 2, kpool, dim, generator=gen)
    k, gate = torch.randn(3, dim, generator=gen), torch.randn(3, dim, generator=gen)
    ape = torch.randn(kpool, dim, generator=gen)
    closed, ids = mla_kpool_ring_close(ring, torch.tensor([2, 0]), k, gate, ape, torch.tensor([0, 2, 3]),
                                       torch.tensor([6, 5]), kpool=kpool, mode="softmax")
    assert ids.dtype == torch.int32 and ids.tolist() == [1, -1]
    members_k = torch.cat([ring[2, 0, :2], k[:2]]).double()
    members_gate = torch.cat([ring[2, 1, :2], gate[:2]]).double()
    expected = (torch.softmax(members_gate + ape.double(), 0) * members_k).sum(0).float()
    torch.testing.assert_close(closed[0], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(closed[1], torch.zeros(dim))


@pytest.mark.parametrize("backend", [ref, cpu], ids=["reference", "cpu"])
def test_ring_close_skips_aligned_and_short_requests(backend):
    kpool, dim = 4, 4
    ring = torch.randn(4, 2, kpool, dim)
    k, gate = torch.randn(6, dim), torch.randn(6, dim)
    # c=8 aligned; c=5 n=2 < align 3; c=7 n=0; c=3 n=1 == align -> closes pool 0
    offsets = torch.tensor([0, 3, 5, 5, 6], dtype=torch.int32)
    cache = torch.tensor([8, 5, 7, 3], dtype=torch.int32)
    closed = torch.full((4, dim), float("nan"))
    ids = torch.full((4,), 99, dtype=torch.int32)
    backend.mla_kpool_ring_close(closed, ids, ring, torch.tensor([3, 2, 1, 0], dtype=torch.int32), k, gate,
                                 torch.zeros(kpool, dim), offsets, cache, kpool, "last")
    assert ids.tolist() == [-1, -1, -1, 0]
    assert torch.equal(closed[:3], torch.zeros(3, dim))
    assert torch.equal(closed[3], k[5])  # "last": position 3 is this call's row 5


#: The seed tail of each backend as the op registry picks it.
SEED_TAILS = {backend: load_kernel(backend, "kpool", "mla_kpool_seed_tail") for backend in ("reference", "cpu")}


@pytest.mark.parametrize("backend", sorted(SEED_TAILS))
def test_seed_tail_writes_only_the_open_members(backend):
    kpool, dim = 4, 4
    ring = torch.full((3, 2, kpool, dim), float("nan"))
    k = torch.arange(8 * dim, dtype=torch.float32).reshape(8, dim)
    gate = -k
    # seq 0: c=6, n=7 -> position 12 (row 6) at member 0; seq 1: c=5, n=1 -> position 5 (row 7) at member 1
    offsets = torch.tensor([0, 7, 8], dtype=torch.int32)
    SEED_TAILS[backend](ring, torch.tensor([2, 0], dtype=torch.int32), k, gate, offsets,
                        torch.tensor([6, 5], dtype=torch.int32), kpool)
    written = ~torch.isnan(ring[:, 0, :, 0])
    assert written.nonzero().tolist() == [[0, 1], [2, 0]]
    assert torch.equal(ring[2, 0, 0], k[6]) and torch.equal(ring[2, 1, 0], gate[6])
    assert torch.equal(ring[0, 0, 1], k[7]) and torch.equal(ring[0, 1, 1], gate[7])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_ring_close_cpu_matches_reference(dtype):
    gen = torch.Generator().manual_seed(17)
    kpool, dim, batch = 4, 60, 7
    lengths = torch.randint(0, 9, (batch,), generator=gen)
    cache = torch.randint(0, 30, (batch,), generator=gen).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    total = int(offsets[-1])
    k = torch.randn(total, dim, generator=gen).to(dtype)
    gate = (4 * torch.randn(total, dim, generator=gen)).to(dtype)
    ape = torch.randn(kpool, dim, generator=gen)
    ring = torch.randn(batch + 1, 2, kpool, dim, generator=gen).to(dtype)
    slots = torch.randperm(batch + 1, generator=gen)[:batch].to(torch.int32)
    for mode in ("softmax", "mean", "last"):
        outs = []
        for backend in (ref, cpu):
            closed = torch.full((batch, dim), float("nan"), dtype=dtype)
            ids = torch.full((batch,), 7, dtype=torch.int32)
            backend.mla_kpool_ring_close(closed, ids, ring, slots, k, gate, ape, offsets, cache, kpool, mode)
            outs.append((closed, ids))
        assert torch.equal(outs[0][1], outs[1][1])
        assert_spec_close(outs[1][0], outs[0][0], what=mode, scale_atol=1e-7)
        if mode != "softmax":  # no exp: the same roundings as the reference
            assert torch.equal(outs[0][0].view(torch.uint8), outs[1][0].view(torch.uint8))


def seed_tail_oracle(ring, slot_ids, k, gate, offsets, cache_lengths, kpool):
    """SPEC 3.2 one sequence at a time: each row of the still-open pool goes to member ``position % kpool``."""
    ring = ring.clone()
    for b in range(len(cache_lengths)):
        c, start, end = int(cache_lengths[b]), int(offsets[b]), int(offsets[b + 1])
        open_from = max((c + end - start) // kpool * kpool, c)  # first position of the open pool's members
        for row in range(start, end):
            position = c + row - start
            if position >= open_from:
                ring[int(slot_ids[b]), 0, position % kpool] = k[row]
                ring[int(slot_ids[b]), 1, position % kpool] = gate[row]
    return ring


@pytest.mark.parametrize("backend", sorted(SEED_TAILS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_seed_tail_matches_a_per_sequence_oracle(backend, dtype):
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for kpool in (1, 3, 4):
        batch, dim = 7, 60
        lengths = torch.randint(0, 3 * kpool + 2, (batch,), generator=gen)
        lengths[0] = 0  # an empty sequence in the batch
        cache = torch.randint(0, 30, (batch,), generator=gen).to(torch.int32)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        k = torch.randn(int(offsets[-1]), dim, generator=gen).to(dtype)
        gate = torch.randn(int(offsets[-1]), dim, generator=gen).to(dtype)
        ring = torch.randn(batch + 2, 2, kpool, dim, generator=gen).to(dtype)
        slots = torch.randperm(batch + 2, generator=gen)[:batch].to(torch.int32)
        expected = seed_tail_oracle(ring, slots, k, gate, offsets, cache, kpool)
        SEED_TAILS[backend](ring, slots, k, gate, offsets, cache, kpool)
        assert torch.equal(ring.view(torch.uint8), expected.view(torch.uint8)), f"kpool {kpool}, seed {seed}"


# ---------------------------------------------------------------------------
# a step that raises changes nothing
# ---------------------------------------------------------------------------
def _step_case():
    """Sequence 0 (c=6, n=7) closes pool 1, compresses pool 2 and seeds position 12 into its ring slot;
    sequence 1 (c=1, n=2) only seeds positions 1, 2. Pooled pages hold PAGE_SIZE // kpool = 4 pools."""
    kpool, dim = 4, 8
    gen = torch.Generator().manual_seed(11)
    k, gate = torch.randn(9, dim, generator=gen), torch.randn(9, dim, generator=gen)
    ape = torch.randn(kpool, dim, generator=gen)
    ring = torch.randn(3, 2, kpool, dim, generator=gen)
    blocks = torch.randn(4, 1, 2, PAGE_SIZE // kpool, 1, dim, generator=gen)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    return dict(ring=ring, slot_ids=torch.tensor([2, 0]), k=k, gate=gate, ape=ape,
                input_row_offsets=torch.tensor([0, 7, 9]), cache_lengths=torch.tensor([6, 1])), blocks, table, kpool


def _run_step(args, blocks, table, kpool, layer):
    pooled_cache = make_pooled_collection(blocks, args["cache_lengths"], table, kpool=kpool)
    return kpool_indexer_step(**args, pooled_collection=pooled_cache, layer_idx=layer, kpool=kpool)


@pytest.mark.parametrize("problem", ["layer", "sentinel page", "page out of range"])
def test_indexer_step_that_raises_leaves_ring_and_cache_as_they_were(problem):
    args, blocks, table, kpool = _step_case()
    fresh_args, fresh_blocks = {**args, "ring": args["ring"].clone()}, blocks.clone()
    ring_before, blocks_before = args["ring"].clone(), blocks.clone()
    bad_table, layer = table.clone(), 1
    if problem == "layer":
        layer = 2  # the pooled cache has layers 0 and 1
    else:
        bad_table[0, 0] = -1 if problem == "sentinel page" else 4  # where sequence 0's pools 1 and 2 go
    # the pool is named with the token positions the caller passed (c = 6: pool 1 holds positions 4..7)
    pool_1 = r"pooled cache: sequence 0 \(cache_lengths\[0\] = 6\) stores pool 1 \(positions 4\.\.7\)"
    with pytest.raises(ValueError, match="layer_idx" if problem == "layer" else pool_1):
        _run_step(args, blocks, bad_table, kpool, layer)
    assert torch.equal(args["ring"].view(torch.uint8), ring_before.view(torch.uint8))
    assert torch.equal(blocks.view(torch.uint8), blocks_before.view(torch.uint8))
    # a retry with good arguments gives what a first call gives
    retried = _run_step(args, blocks, table, kpool, 1)
    fresh = _run_step(fresh_args, fresh_blocks, table, kpool, 1)
    assert retried.closed_ids.tolist() == fresh.closed_ids.tolist() == [1, -1]
    assert torch.equal(retried.closed, fresh.closed) and torch.equal(retried.pooled, fresh.pooled)
    assert torch.equal(args["ring"], fresh_args["ring"]) and torch.equal(blocks, fresh_blocks)
    assert not torch.equal(blocks, blocks_before)  # the retry did store pools 1 and 2


def test_a_step_that_stores_nothing_still_checks_its_layer():
    args, blocks, table, kpool = _step_case()
    # one token each after one cached token: no pool closes or completes, so no store runs
    args = {**args, "k": args["k"][:2], "gate": args["gate"][:2], "input_row_offsets": torch.tensor([0, 1, 2]),
            "cache_lengths": torch.tensor([1, 1])}
    ring_before = args["ring"].clone()
    with pytest.raises(ValueError, match="layer_idx"):
        _run_step(args, blocks, table, kpool, 2)  # the pooled cache has layers 0 and 1
    assert torch.equal(args["ring"], ring_before)
    assert _run_step(args, blocks, table, kpool, 1).closed_ids.tolist() == [-1, -1]


# ---------------------------------------------------------------------------
# errors and fake impls
# ---------------------------------------------------------------------------
def _ring_args():
    return dict(ring=torch.zeros(4, 2, 4, 8), slot_ids=torch.tensor([0, 3]), k=torch.randn(5, 8),
                gate=torch.randn(5, 8), input_row_offsets=torch.tensor([0, 2, 5]), cache_lengths=torch.tensor([3, 1]))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(ring=torch.zeros(4, 2, 3, 8)), r"ring: expected shape \[max_slots, 2, kpool, D\]"),
        (dict(ring=torch.zeros(4, 1, 4, 8)), r"ring: expected shape \[max_slots, 2, kpool, D\]"),
        (dict(ring=torch.zeros(4, 2, 4, 8, dtype=torch.bfloat16)), "ring: expected k's dtype"),
        (dict(ring=torch.zeros(4, 2, 8, 4).transpose(2, 3)), "ring: expected a contiguous tensor"),
        (dict(slot_ids=torch.tensor([0])), r"slot_ids: expected shape \(2,\)"),
        (dict(slot_ids=torch.tensor([0, 4])), r"slot_ids: expected values in \[0, 4\)"),
        (dict(slot_ids=torch.tensor([-1, 0])), r"slot_ids: expected values in \[0, 4\)"),
        (dict(slot_ids=torch.tensor([2, 2])), "slot_ids: expected distinct slots"),
        (dict(input_row_offsets=torch.tensor([0, 3, 2])), "input_row_offsets: expected non-decreasing"),
    ],
)
def test_ring_errors(change, message):
    args = _ring_args()
    args.update(change)
    error = TypeError if "dtype" in message else ValueError
    with pytest.raises(error, match=message):
        mla_kpool_seed_tail(**args, kpool=4)
    with pytest.raises(error, match=message):
        mla_kpool_ring_close(**args, ape=torch.zeros(4, 8), kpool=4)


def test_ring_ops_pass_opcheck():
    a = _ring_args()
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    torch.library.opcheck(
        torch.ops.sparsekv.mla_kpool_ring_close.default,
        (torch.empty(2, 8), torch.empty(2, dtype=torch.int32), torch.randn(4, 2, 4, 8), i32(a["slot_ids"]),
         a["k"], a["gate"], torch.zeros(4, 8), i32(a["input_row_offsets"]), i32(a["cache_lengths"]), 4, "mean"),
    )
    torch.library.opcheck(
        torch.ops.sparsekv.mla_kpool_seed_tail.default,
        (a["ring"], i32(a["slot_ids"]), a["k"], a["gate"], i32(a["input_row_offsets"]),
         i32(a["cache_lengths"]), 4),
    )
