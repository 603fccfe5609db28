"""mla_kpool_compress and kpool_pool_row_offsets (SPEC 3.1): math, modes, edge cases, errors, backends."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from spec4 import assert_spec_close

from sparsekv import kpool_pool_row_offsets, mla_kpool_compress
from sparsekv.kernels.cpu import kpool as cpu
from sparsekv.kernels.cpu._math import exp_f32
from sparsekv.kernels.reference import kpool as ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def ragged_batch(lengths, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    k = torch.randn(total, dim, generator=gen).to(dtype)
    gate = (2 * torch.randn(total, dim, generator=gen)).to(dtype)
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    return k, gate, offsets, gen


def brute_force(k, gate, ape, lengths, cache_lengths, kpool, mode):
    """Loop over sequences and whole pools; float64 math, one cast. Independent of the kernels."""
    rows, start = [], 0
    for n, c in zip(lengths, cache_lengths):
        first_pool = -(-c // kpool)
        for pool in range(first_pool, (c + n) // kpool):
            members = [start + pos - c for pos in range(pool * kpool, (pool + 1) * kpool)]
            keys = k[members].double()
            if mode == "softmax":
                weights = torch.softmax(gate[members].double() + ape.double(), dim=0)  # per channel
                rows.append((weights * keys).sum(0))
            elif mode == "mean":
                rows.append(keys.mean(0))
            else:
                rows.append(keys[-1])
        start += n
    if not rows:
        return torch.empty(0, k.shape[1], dtype=k.dtype)
    return torch.stack(rows).to(k.dtype)


# sequences: (new rows, cached tokens) with empty, short, aligned and unaligned cases
def batch_layout(kpool):
    return [(3 * kpool + 1, 0), (0, 5), (kpool - 1 if kpool > 1 else 0, 1), (2 * kpool + 3, kpool + 1),
            (5 * kpool, 2 * kpool), (1, kpool - 1 if kpool > 1 else 3)]


# ---------------------------------------------------------------------------
# pool_row_offsets rule
# ---------------------------------------------------------------------------
def test_pool_row_offsets_docstring_example():
    offsets = torch.tensor([0, 7, 10, 15])
    cache = torch.tensor([6, 0, 3])
    assert kpool_pool_row_offsets(offsets, cache, kpool=4).tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("kpool", [1, 2, 3, 4, 16])
def test_pool_row_offsets_counts_whole_pools(kpool):
    gen = torch.Generator().manual_seed(kpool)
    lengths = torch.randint(0, 40, (9,), generator=gen)
    cache = torch.randint(0, 50, (9,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    got = kpool_pool_row_offsets(offsets, cache, kpool=kpool)
    assert got.dtype == torch.int32
    expected = [0]
    for n, c in zip(lengths.tolist(), cache.tolist()):
        whole = [p for p in range(0, (c + n) // kpool + 1) if p * kpool >= c and (p + 1) * kpool <= c + n]
        expected.append(expected[-1] + len(whole))
    assert got.tolist() == expected


# ---------------------------------------------------------------------------
# math against an independent computation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("kpool", [1, 2, 4, 16])
def test_compress_matches_brute_force(kpool, dim, dtype, seed):
    layout = batch_layout(kpool)
    lengths, cache = [n for n, _ in layout], [c for _, c in layout]
    k, gate, offsets, gen = ragged_batch(lengths, dim, dtype, seed=seed)
    ape = torch.randn(kpool, dim, generator=gen)
    cache_t = torch.tensor(cache, dtype=torch.int32)
    pool_offsets = kpool_pool_row_offsets(offsets, cache_t, kpool=kpool)
    # A pooled value carries the float32 rounding of up to 16 weighted members (each up to `members`), in
    # every backend: one that cancels is then some of its own ulps from the float64 brute force and from
    # the other backend (docs/spec-notes.md): fp16 1.07e-4 2 ulps (1.2e-7) off the brute force, members
    # near 2.4 (seed 1041707548); fp16 2.4e-4 2 ulps and bf16 2.3e-6 4 ulps between the backends; a
    # float32 0.016 4.6e-7 off the brute force, members up to 4. So each comparison allows 1e-6 of them.
    members = float(k.float().abs().max()) + float(ape.abs().max())
    for mode in ("softmax", "mean", "last"):
        expected = brute_force(k, gate, ape, lengths, cache, kpool, mode)
        out = mla_kpool_compress(k, gate, ape, offsets, pool_offsets, cache_t, kpool=kpool, mode=mode)
        assert_spec_close(out, expected, atol=1e-6 * members)
        oracle = torch.full_like(expected, float("nan"))
        ref.mla_kpool_compress(oracle, k, gate, ape, offsets, pool_offsets, cache_t, kpool, mode)
        assert_spec_close(oracle, expected, atol=1e-6 * members)
        assert_spec_close(out, oracle, what="cpu path vs reference", scale_atol=1e-7, atol=1e-6 * members)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["softmax", "mean", "last"])
def test_kpool_one_returns_k_exactly(dtype, mode, seed):
    k, gate, offsets, gen = ragged_batch([5, 0, 7], 64, dtype, seed=seed)
    k[0, :3] = torch.tensor([-0.0, float("inf"), 1e-30]).to(dtype)  # signed zero, inf, tiny survive
    ape = torch.randn(1, 64, generator=gen)
    cache = torch.tensor([3, 0, 11], dtype=torch.int32)
    out = mla_kpool_compress(k, gate, ape, offsets, None, cache, kpool=1, mode=mode)
    assert torch.equal(out.view(torch.uint8), k.view(torch.uint8))


def test_softmax_weights_each_channel_separately():
    # Channel 0's gate favours member 0, channel 1's favours member 3: a single weight per
    # token (softmax of a per-token gate) could not give both channels their favourite key.
    kpool, dim = 4, 2
    k = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]])
    gate = torch.tensor([[50.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 50.0]])
    ape = torch.zeros(kpool, dim)
    offsets, cache = torch.tensor([0, 4]), torch.tensor([0])
    out = mla_kpool_compress(k, gate, ape, offsets, None, cache, kpool=kpool)
    torch.testing.assert_close(out, torch.tensor([[1.0, 40.0]]), rtol=1e-6, atol=1e-6)
    per_token = torch.softmax(gate.sum(1), 0)[:, None]
    assert not torch.allclose(out, (per_token * k).sum(0, keepdim=True), atol=1e-3)


def test_ape_shifts_the_weights_per_member_and_channel():
    k = torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    gate = torch.zeros(2, 2)
    ape = torch.tensor([[0.0, 0.0], [0.0, float(torch.log(torch.tensor(3.0)))]])
    out = mla_kpool_compress(k, gate, ape, torch.tensor([0, 2]), None, torch.tensor([0]), kpool=2)
    # channel 0: equal weights -> 2; channel 1: weights 1/4, 3/4 -> 2.5
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.5]]), rtol=1e-6, atol=1e-6)


def test_unaligned_cache_skips_the_open_pool_and_the_tail():
    k, gate, offsets, gen = ragged_batch([7], 8, torch.float32, seed=3)
    ape = torch.randn(4, 8, generator=gen)
    out = mla_kpool_compress(k, gate, ape, offsets, None, torch.tensor([6]), kpool=4, mode="last")
    # positions 6..12: only pool 2 (positions 8..11 = rows 2..5) is emitted; its last member is row 5
    assert torch.equal(out, k[5:6])


def test_all_empty_and_short_requests_emit_nothing():
    k, gate, offsets, gen = ragged_batch([0, 3, 0, 2], 16, torch.bfloat16, seed=4)
    ape = torch.randn(4, 16, generator=gen)
    out = mla_kpool_compress(k, gate, ape, offsets, None, torch.tensor([0, 0, 9, 5]), kpool=4)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_strided_inputs_and_out():
    k_wide = torch.randn(20, 128)
    gate_wide = torch.randn(20, 128)
    k, gate = k_wide[:, ::2], gate_wide[:, 1::2]
    ape = torch.randn(4, 64)
    offsets, cache = torch.tensor([0, 9, 20]), torch.tensor([2, 0])
    expected = brute_force(k, gate, ape, [9, 11], [2, 0], 4, "softmax")
    holder = torch.full((expected.shape[0], 130), float("nan"))
    out = holder[:, 1:129:2]
    returned = mla_kpool_compress(k, gate, ape, offsets, None, cache, kpool=4, out=out)
    assert returned is out
    assert_spec_close(out.clone(), expected, scale_atol=1e-7)
    assert torch.isnan(holder[:, 0::2]).all(), "wrote outside out"


# ---------------------------------------------------------------------------
# cpu fast path == reference on random odd shapes
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [0, 1, 3])
def test_cpu_backend_matches_reference(dtype, case, seed):
    gen = torch.Generator().manual_seed(seed)
    kpool = [2, 3, 4, 16][case]
    dim = [60, 64, 96, 128][case]
    batch = int(torch.randint(1, 7, (1,), generator=gen))
    lengths = torch.randint(0, 90, (batch,), generator=gen).tolist()
    cache = torch.randint(0, 40, (batch,), generator=gen).to(torch.int32)
    k, gate, offsets, gen = ragged_batch(lengths, dim, dtype, seed)
    gate = (gate.float() * 30).to(dtype)  # large logits: exp underflows for some members
    ape = torch.randn(kpool, dim, generator=gen)
    pool_offsets = kpool_pool_row_offsets(offsets, cache, kpool=kpool)
    for mode in ("softmax", "mean", "last"):
        want = torch.full((int(pool_offsets[-1]), dim), float("nan"), dtype=dtype)
        got = torch.full_like(want, float("nan"))
        ref.mla_kpool_compress(want, k, gate, ape, offsets, pool_offsets, cache, kpool, mode)
        cpu.mla_kpool_compress(got, k, gate, ape, offsets, pool_offsets, cache, kpool, mode)
        assert_spec_close(got, want, what=mode, scale_atol=1e-7)
        if mode != "softmax":  # no exp: the same roundings as the reference
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@numba.njit(cache=False)
def _cpu_exp(xs):
    out = np.empty_like(xs)
    for i in range(xs.shape[0]):
        out[i] = exp_f32(xs[i])
    return out


def test_cpu_exp_is_within_one_ulp_of_the_correctly_rounded_exp():
    # every 997th float32 in [-87, 0] (the softmax's max-subtracted range above the underflow floor)
    first, last = np.float32(-0.0).view(np.uint32), np.float32(-87.0).view(np.uint32)
    xs = np.arange(first, last + 1, 997, dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = _cpu_exp(xs)
    want = np.exp(xs.astype(np.float64)).astype(np.float32)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1, f"{ulps.max()} ulps at x = {xs[ulps.argmax()]}"
    assert (ulps == 0).mean() > 0.98
    edge = _cpu_exp(np.array([0.0, -0.0, -87.5, -1e4, -np.inf, np.nan], np.float32))
    assert edge[:2].tolist() == [1.0, 1.0], "a channel's max member must weigh exactly 1"
    assert edge[2:5].tolist() == [0.0, 0.0, 0.0] and np.isnan(edge[5])


# ---------------------------------------------------------------------------
# errors (SPEC 3.1), each with its message
# ---------------------------------------------------------------------------
def _good_args():
    k = torch.randn(10, 8)
    return dict(k=k, gate=torch.randn(10, 8), ape=torch.randn(4, 8), input_row_offsets=torch.tensor([0, 7, 10]),
                pool_row_offsets=torch.tensor([0, 1, 1]), cache_lengths=torch.tensor([6, 0]))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=torch.randn(10)), "k: expected a 2-d tensor"),
        (dict(gate=torch.randn(10, 7)), "gate: expected the shape of k"),
        (dict(gate=torch.randn(10, 8, 1)), "gate: expected the shape of k"),
        (dict(gate=torch.randn(10, 8).to(torch.bfloat16)), "gate: expected k's dtype"),
        (dict(ape=torch.randn(3, 8)), r"ape: expected shape \[kpool, D\] = \(4, 8\)"),
        (dict(ape=torch.randn(4, 7)), r"ape: expected shape \[kpool, D\]"),
        (dict(ape=torch.randn(4, 8).to(torch.bfloat16)), "ape: expected dtype float32"),
        (dict(input_row_offsets=torch.tensor([0, 10])), r"input_row_offsets: expected shape \(3,\)"),
        (dict(input_row_offsets=torch.tensor([0, 7, 5])), "input_row_offsets: expected non-decreasing"),
        (dict(input_row_offsets=torch.tensor([1, 7, 10])), r"input_row_offsets: expected offsets\[0\] == 0"),
        (dict(input_row_offsets=torch.tensor([0, 7, 9])), "expected the last offset to equal the 10 rows of k, got 9"),
        (dict(pool_row_offsets=torch.tensor([0, 2, 2])), r"pool_row_offsets: expected \[0, 1, 1\]"),
        (dict(pool_row_offsets=torch.tensor([0, 1])), r"pool_row_offsets: expected shape \(3,\)"),
        (dict(pool_row_offsets=torch.tensor([0, 0, 1])), r"pool_row_offsets: expected \[0, 1, 1\]"),
        (dict(cache_lengths=torch.tensor([6, -1])), "cache_lengths: expected values >= 0"),
        (dict(cache_lengths=torch.tensor([6, 0, 0])), r"input_row_offsets: expected shape \(4,\)"),
    ],
)
def test_compress_errors(change, message):
    args = _good_args()
    args.update(change)
    with pytest.raises(TypeError if "dtype" in message else ValueError, match=message):
        mla_kpool_compress(**args, kpool=4)


def test_compress_errors_on_params_and_out():
    args = _good_args()
    with pytest.raises(ValueError, match="kpool: expected an int >= 1, got 0"):
        mla_kpool_compress(**args, kpool=0)
    with pytest.raises(TypeError, match="kpool: expected an int"):
        mla_kpool_compress(**args, kpool=4.0)
    with pytest.raises(ValueError, match="mode: expected one of softmax, mean, last, got 'max'"):
        mla_kpool_compress(**args, kpool=4, mode="max")
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 8\)"):
        mla_kpool_compress(**args, kpool=4, out=torch.empty(2, 8))
    with pytest.raises(TypeError, match="out: expected dtype"):
        mla_kpool_compress(**args, kpool=4, out=torch.empty(1, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="k: expected dtype"):
        mla_kpool_compress(**{**args, "k": torch.ones(10, 8, dtype=torch.int32)}, kpool=4)
    with pytest.raises(ValueError, match="kpool: expected an int >= 1"):
        kpool_pool_row_offsets(args["input_row_offsets"], args["cache_lengths"], kpool=0)


def test_compress_custom_op_passes_opcheck():
    args = _good_args()
    pooled = torch.empty(1, 8)
    offsets = args["input_row_offsets"].to(torch.int32)
    torch.library.opcheck(
        torch.ops.sparsekv.mla_kpool_compress.default,
        (pooled, args["k"], args["gate"], args["ape"], offsets, args["pool_row_offsets"].to(torch.int32),
         args["cache_lengths"].to(torch.int32), 4, "softmax"),
    )


@pytest.mark.parametrize("cache_lengths, message", [
    (torch.tensor([-8, 0]), "cache_lengths: expected values >= 0, got -8 at index 0"),
    (torch.tensor([2**40, 0]), r"cache_lengths: expected values that fit in int32 .* got 1099511627776 at index 0"),
])
def test_pool_row_offsets_refuses_what_compress_refuses(cache_lengths, message):
    offsets = torch.tensor([0, 8, 8])
    with pytest.raises(ValueError, match=message):
        kpool_pool_row_offsets(offsets, cache_lengths, kpool=4)
    args = _good_args()
    args.update(input_row_offsets=torch.tensor([0, 8, 10]), cache_lengths=cache_lengths, pool_row_offsets=None)
    with pytest.raises(ValueError, match=message):
        mla_kpool_compress(**args, kpool=4)


def test_pool_row_offsets_refuses_bad_offsets():
    with pytest.raises(ValueError, match="input_row_offsets: expected non-decreasing"):
        kpool_pool_row_offsets(torch.tensor([0, 8, 5]), torch.tensor([0, 0]), kpool=4)
    with pytest.raises(ValueError, match=r"input_row_offsets: expected shape \(3,\)"):
        kpool_pool_row_offsets(torch.tensor([0, 8]), torch.tensor([0, 0]), kpool=4)
