"""The register tile behind both score kernels: its summation order, bit for bit, on float32 and bf16 pairs."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys

import llvmlite
import numba
import numpy as np
import pytest
import torch

from sparsekv.kernels.cpu import _tile_ir
from sparsekv._address import array_at
from sparsekv.kernels.cpu._bits import as_numba, numba_dtype
from sparsekv.kernels.cpu._score_tasks import keys_seen, relu_sums, task_in_order, write_group_scores
from sparsekv.kernels.cpu._tile_ir import (KEYS_PER_TILE, SQUARE_SUM_ROWS, VECTOR, WEIGHTED_CHANNELS, WEIGHTED_HEADS,
                                          _check_llvmlite_for_bfloat, _target_has_bf16_dot)
from sparsekv.kernels.cpu._tile_ops import (KEYS_PER_TASK, dots_of_gathered_rows, dots_of_rows, gather_rows,
                                           square_sums_in_order, tile_dots, transpose_dots, weighted_rows)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return as_numba(torch.from_numpy(x).to(torch.bfloat16))


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _pack_pairs(bits: np.ndarray) -> np.ndarray:
    """``[D, lanes]`` bf16 bits -> int32 pairs ``[ceil(D/2), lanes]`` (channel 2j low), zero channel for odd D."""
    dim, lanes = bits.shape
    padded = np.zeros((dim + dim % 2, lanes), np.uint32)
    padded[:dim] = bits
    return (padded[0::2] | (padded[1::2] << 16)).astype(np.uint32).view(np.int32)


def _bf16_case(dim: int, lanes: int, keys: int, seed: int):
    rng = np.random.default_rng(seed)
    q_bits = _bf16_bits(rng.standard_normal((dim, lanes)).astype(np.float32))
    key_bits = _bf16_bits(rng.standard_normal((keys, dim)).astype(np.float32))
    chunk = np.zeros((keys, dim + dim % 2), np.uint16)
    chunk[:, :dim] = key_bits
    return q_bits, key_bits, _pack_pairs(q_bits), chunk


def _pair_order_dots(q_bits: np.ndarray, key_bits: np.ndarray) -> np.ndarray:
    """The documented order in float32: per pair j, channel 2j+1 then 2j. A bf16 product is exact in
    float32, so ``acc + q*k`` rounds once, as a fused multiply-add does."""
    q = _bf16_values(q_bits)  # [D, lanes]
    k = _bf16_values(key_bits)  # [keys, D]
    dim = q.shape[0]
    acc = np.zeros((k.shape[0], q.shape[1]), np.float32)
    for j in range(0, dim, 2):
        for d in ([j + 1, j] if j + 1 < dim else [j]):
            acc = acc + k[:, d : d + 1] * q[d][None, :]
    return acc


@pytest.mark.parametrize("dim", [1, 7, 64, 128])
@pytest.mark.parametrize("lanes", [VECTOR, 3 * VECTOR])
def test_bf16_pairs_follow_the_documented_order_bit_for_bit(dim, lanes):
    keys = 2 * KEYS_PER_TILE + 3
    q_bits, key_bits, q_pairs, chunk = _bf16_case(dim, lanes, keys + KEYS_PER_TILE, seed=dim * lanes)
    dots = np.full((keys + KEYS_PER_TILE, lanes), np.nan, np.float32)
    tile_dots(dots, q_pairs, chunk, lanes, keys)
    want = _pair_order_dots(q_bits, key_bits)
    assert np.array_equal(dots[:keys].view(np.int32), want[:keys].view(np.int32))


@pytest.mark.parametrize("dim", [5, 128])
def test_float32_tile_runs_the_channels_in_order(dim):
    rng = np.random.default_rng(dim)
    lanes, keys = 2 * VECTOR, KEYS_PER_TILE + 1
    q_t = rng.standard_normal((dim, lanes)).astype(np.float32)
    chunk = rng.standard_normal((2 * KEYS_PER_TILE, dim)).astype(np.float32)
    dots = np.full((2 * KEYS_PER_TILE, lanes), np.nan, np.float32)
    tile_dots(dots, q_t, chunk, lanes, keys)
    # fused multiply-add in channel order, emulated exactly: the float64 product of two float32 is
    # exact, and one float64 sum of it and a float32 accumulator rounds the same as the fma would
    # except in double-rounding ties, which a relative bound of one float32 ulp absorbs
    acc = np.zeros((keys, lanes), np.float64)
    for d in range(dim):
        acc = (acc + chunk[:keys, d : d + 1].astype(np.float64) * q_t[d][None, :]).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(dots[:keys], acc, rtol=2e-7, atol=1e-30)


_SUBPROCESS = """
import json, sys, numpy as np
from sparsekv.kernels.cpu._tile_ir import _target_has_bf16_dot
from sparsekv.kernels.cpu._tile_ops import tile_dots
q_pairs = np.array(json.loads(sys.argv[1]), np.uint32).view(np.int32)
chunk = np.array(json.loads(sys.argv[2]), np.uint16)
dots = np.zeros((chunk.shape[0], q_pairs.shape[1]), np.float32)
tile_dots(dots, q_pairs, chunk, q_pairs.shape[1], chunk.shape[0])
print(json.dumps({"has": _target_has_bf16_dot(), "dots": dots.view(np.uint32).tolist()}))
"""


@pytest.mark.skipif(not _target_has_bf16_dot(), reason="this CPU has no VDPBF16PS: the fallback is the only path "
                                                       "and the order test above already checks it")
def test_fallback_without_vdpbf16ps_gives_the_instructions_bits(tmp_path):
    features = numba.core.codegen.get_host_cpu_features().replace("+avx512bf16", "-avx512bf16")
    env = dict(os.environ, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path))
    _, key_bits, q_pairs, chunk = _bf16_case(33, VECTOR, KEYS_PER_TILE, seed=5)
    result = subprocess.run([sys.executable, "-c", _SUBPROCESS, json.dumps(q_pairs.view(np.uint32).tolist()),
                             json.dumps(chunk.tolist())], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    emulated = json.loads(result.stdout.strip().splitlines()[-1])
    assert emulated["has"] is False, "the subprocess still targets VDPBF16PS"
    dots = np.zeros((KEYS_PER_TILE, VECTOR), np.float32)
    tile_dots(dots, q_pairs, chunk, VECTOR, KEYS_PER_TILE)
    assert np.array_equal(np.array(emulated["dots"], np.uint32), dots.view(np.uint32))


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_tiles_keep_their_accumulators_within_the_targets_vector_registers(monkeypatch, avx512):
    """A 16-lane vector is one of AVX-512's 32 registers and two of AVX2's 16: each pass of a tile holds its
    accumulators and operands within them, and the passes together cover every accumulator once."""
    features = {"+avx2", "+fma"} | ({"+avx512f"} if avx512 else set())
    monkeypatch.setattr(_tile_ir, "target_cpu_features", lambda: features)
    registers, per_vector = (32, 1) if avx512 else (16, 2)
    keys = _tile_ir._keys_per_pass()
    assert KEYS_PER_TILE % keys == 0
    assert (keys + 2) * per_vector <= registers  # accumulators, the query vector, the broadcast key
    for heads in (4, 8, 12):
        passes = _tile_ir._weighted_passes(heads)
        covered = sorted((k, v) for pass_heads, halves in passes for k in pass_heads for v in halves)
        assert covered == [(k, v) for k in range(heads) for v in (0, 1)]
        for pass_heads, halves in passes:  # accumulators, the row's values, the broadcast weight
            assert (len(pass_heads) * len(halves) + len(halves) + 1) * per_vector <= registers


def test_an_llvmlite_older_than_the_bfloat_operands_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(llvmlite, "__version__", "0.44.0")
    with pytest.raises(ImportError, match=r"llvmlite >= 0\.45 \(numba >= 0\.62\); this llvmlite is 0\.44\.0"):
        _check_llvmlite_for_bfloat()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim", [7, 64])
@pytest.mark.parametrize("n", [1, 8, 13, 128])
def test_dots_of_rows_equals_the_tile_over_a_zero_padded_copy(dtype, dim, n):
    """Rows read in place (whole tiles) plus a padded tail give the same bits as tiles over a padded copy,
    and nothing past ``n + 7`` rows of ``dots`` is written."""
    gen = torch.Generator().manual_seed(n * dim)
    lanes = VECTOR
    keys = torch.randn(n, dim, generator=gen).to(dtype)
    q = torch.randn(dim, lanes, generator=gen).to(dtype)
    padded_rows = -(-n // KEYS_PER_TILE) * KEYS_PER_TILE
    if dtype == torch.bfloat16:
        q_t = _pack_pairs(as_numba(q))
        copy = np.zeros((padded_rows, dim + dim % 2), np.uint16)
        copy[:n, :dim] = as_numba(keys)
    else:
        q_t = q.float().numpy()
        copy = np.zeros((padded_rows, dim), np.float32)
        copy[:n] = keys.float().numpy()
    want = np.zeros((padded_rows, lanes), np.float32)
    tile_dots(want, q_t, copy, lanes, n)
    dots = np.full((KEYS_PER_TASK + KEYS_PER_TILE, lanes), np.nan, np.float32)
    scratch = np.full((KEYS_PER_TASK + KEYS_PER_TILE, copy.shape[1]), 0x7FC0 if copy.dtype == np.uint16 else np.nan,
                      copy.dtype)  # what new_scratch gives inside a kernel, poisoned but for an odd D's zero channel
    scratch[:, dim:] = 0
    dots_of_rows(dots, q_t, as_numba(keys), lanes, scratch)
    assert np.array_equal(dots[:n].view(np.int32), want[:n].view(np.int32))
    assert np.isnan(dots[padded_rows:]).all(), "wrote past the last tile"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim", [7, 64])
@pytest.mark.parametrize("n", [1, 13, 200])
def test_gathered_rows_equal_the_tile_over_a_gathered_copy(dtype, dim, n):
    """Keys scattered through a flat array (starts in any order, odd offsets included) give the bits of
    tiles over a gathered, padded copy, read in place (float32, even-D bf16) or converted first (fp16,
    odd-D bf16); ``gather_rows`` copies exactly those rows."""
    gen = torch.Generator().manual_seed(n * dim + 1)
    lanes = VECTOR
    flat = torch.randn(300 * dim + 3, generator=gen).to(dtype)
    starts = torch.randperm(300, generator=gen)[:n] * dim + torch.randint(0, 3, (n,), generator=gen)
    padding = 2 * KEYS_PER_TILE
    row_starts = torch.cat([starts, starts[-1:].expand(padding)]).numpy().astype(np.int64)
    rows = torch.stack([flat[s : s + dim] for s in starts.tolist()])
    padded_rows = -(-n // KEYS_PER_TILE) * KEYS_PER_TILE
    if dtype == torch.bfloat16:
        q = torch.randn(dim, lanes, generator=gen).to(dtype)
        q_t = _pack_pairs(as_numba(q))
        copy = np.zeros((padded_rows, dim + dim % 2), np.uint16)
        copy[:n, :dim] = as_numba(rows)
    else:
        q_t = torch.randn(dim, lanes, generator=gen).to(dtype).float().numpy()
        copy = np.zeros((padded_rows, dim), np.float32)
        copy[:n] = rows.float().numpy()
    want = np.zeros((padded_rows, lanes), np.float32)
    tile_dots(want, q_t, copy, lanes, n)
    dots = np.full((n + KEYS_PER_TILE, lanes), np.nan, np.float32)
    scratch = np.zeros((KEYS_PER_TASK + KEYS_PER_TILE, copy.shape[1]), copy.dtype)
    dots_of_gathered_rows(dots, q_t, as_numba(flat), row_starts, n, dim, lanes, scratch)
    assert np.array_equal(dots[:n].view(np.int32), want[:n].view(np.int32))

    target = np.zeros((n, copy.shape[1]), copy.dtype)
    gather_rows(target, as_numba(flat), row_starts, n, dim)
    assert np.array_equal(target, copy[:n])


def _int64s_before_a_guard_page(values: np.ndarray) -> np.ndarray:
    """``values`` copied into the last elements of a page whose next page may not be read (reading past
    the array faults instead of returning garbage)."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if ctypes.CDLL(None, use_errno=True).mprotect(ctypes.c_void_p(start + page), page, 0) != 0:  # PROT_NONE
        pytest.skip(f"mprotect failed: errno {ctypes.get_errno()}")
    guarded = np.frombuffer(region, np.int64, count=len(values), offset=page - 8 * len(values))
    guarded[:] = values
    return guarded


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages through mprotect (Linux)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gathered_tile_reads_no_row_start_past_its_documented_bound(dtype):
    """The gathered tile (and its prefetch of the next tile's keys) reads ``row_starts`` only up to
    ``key0 + 2 * KEYS_PER_TILE``: with the array ending right before a page that may not be read, one
    tile still gives the bits of the tile over a copy."""
    dim, lanes = 64, VECTOR
    gen = torch.Generator().manual_seed(11)
    flat = torch.randn(4 * KEYS_PER_TILE * dim, generator=gen).to(dtype)
    starts = torch.randperm(4 * KEYS_PER_TILE, generator=gen)[:KEYS_PER_TILE] * dim
    row_starts = _int64s_before_a_guard_page(torch.cat([starts, starts[-1:].expand(KEYS_PER_TILE)]).numpy())
    copy = as_numba(torch.stack([flat[s : s + dim] for s in starts.tolist()]))
    q = torch.randn(dim, lanes, generator=gen).to(dtype)
    q_t = _pack_pairs(as_numba(q)) if dtype == torch.bfloat16 else q.numpy()
    want = np.zeros((KEYS_PER_TILE, lanes), np.float32)
    tile_dots(want, q_t, copy, lanes, KEYS_PER_TILE)
    dots = np.zeros((KEYS_PER_TILE, lanes), np.float32)
    tile_dots(dots, q_t, as_numba(flat), lanes, KEYS_PER_TILE, row_starts)
    assert np.array_equal(dots.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("bf16_values", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, rows", [(3, 0), (8, 1), (12, 37), (13, 9), (20, 5)])
def test_weighted_rows_sums_the_rows_in_order_per_head(heads, rows, bf16_values):
    rng = np.random.default_rng(heads * 100 + rows)
    computed = -(-heads // 4) * 4  # heads run in tiles of 12, 8 or 4: never more than 3 padding heads
    head_rows, channels = -(-heads // WEIGHTED_HEADS) * WEIGHTED_HEADS, 2 * WEIGHTED_CHANNELS
    acc = rng.standard_normal((head_rows + 2, channels)).astype(np.float32)
    weights = rng.random((rows + 1, head_rows)).astype(np.float32)
    values = rng.standard_normal((rows + 1, channels)).astype(np.float32)
    if bf16_values:  # bf16 bits, widened inside the tile
        values = _bf16_bits(values)
    widened = _bf16_values(values) if bf16_values else values
    want = acc.astype(np.float64)
    for n in range(rows):  # one rounding per row, as the fused multiply-add chain does (see the tile test)
        products = weights[n, :computed, None].astype(np.float64) * widened[n]
        want[:computed] = (want[:computed] + products).astype(np.float32)
    before = acc.copy()
    prefetching = acc.copy()
    weighted_rows(acc, weights, values, heads, rows)
    np.testing.assert_allclose(acc[:computed], want[:computed], rtol=2e-7, atol=1e-30)
    assert np.array_equal(acc[computed:], before[computed:]), "touched rows past the heads' tiles"
    # prefetching other rows meanwhile (fewer starts than rows included) changes no bit
    ahead = rng.standard_normal(4096).astype(np.float32)
    ahead_starts = rng.integers(0, ahead.size - channels, max(rows - 2, 0)).astype(np.int64)
    weighted_rows(prefetching, weights, values, heads, rows, ahead, ahead_starts)
    assert np.array_equal(prefetching.view(np.int32), acc.view(np.int32))


@pytest.mark.parametrize("keys, lanes", [(1, 16), (13, 32), (128, 48)])
def test_transpose_dots_moves_every_rounded_key_and_nothing_else(keys, lanes):
    rng = np.random.default_rng(keys + lanes)
    rounded = -(-keys // KEYS_PER_TILE) * KEYS_PER_TILE
    dots = rng.standard_normal((rounded + KEYS_PER_TILE, lanes + VECTOR)).astype(np.float32)
    dots_t = np.full((lanes + VECTOR, rounded + KEYS_PER_TILE), np.nan, np.float32)
    transpose_dots(dots, dots_t, keys, lanes)
    assert np.array_equal(dots_t[:lanes, :rounded], dots[:rounded, :lanes].T)
    assert np.isnan(dots_t[lanes:]).all() and np.isnan(dots_t[:, rounded:]).all()


@pytest.mark.parametrize("heads", [1, 2, 4, 5])
@pytest.mark.parametrize("divisor", [1.0, 11.3])
def test_relu_sums_are_the_in_order_chain_then_one_division(heads, divisor):
    """Each total is ``((0 + w_0 relu(x_0)) + ...) / divisor`` in float32, bit for bit (NaN kept, negative
    weights and -0 products included), whichever pass writes, adds or divides."""
    rng = np.random.default_rng(heads)
    keys, lane0 = 37, 3
    lane_dots = (rng.standard_normal((lane0 + heads, keys)) * np.exp(rng.uniform(-8, 8, (lane0 + heads, keys))))
    lane_dots = lane_dots.astype(np.float32)
    lane_dots[lane0, 0], lane_dots[lane0 + heads - 1, 1] = np.nan, -0.0
    weights = rng.standard_normal(heads).astype(np.float32)
    totals = np.full(keys, np.nan, np.float32)
    relu_sums(totals, lane_dots, lane0, heads, weights, np.float32(divisor))
    want = np.empty(keys, np.float32)
    for i in range(keys):
        acc = np.float32(0.0)
        for h in range(heads):
            x = lane_dots[lane0 + h, i]
            acc = np.float32(acc + np.float32(weights[h] * (x if not x <= 0 else np.float32(0.0))))
        want[i] = acc / np.float32(divisor)
    assert np.array_equal(totals.view(np.uint32), want.view(np.uint32))


def test_relu_sums_without_heads_write_the_empty_sum():
    totals = np.full(5, np.nan, np.float32)
    relu_sums(totals, np.zeros((1, 5), np.float32), 0, 0, np.zeros(0, np.float32), np.float32(-3.0))
    assert np.array_equal(totals.view(np.uint32), np.full(5, -0.0, np.float32).view(np.uint32))


def _relu_sum_chain(dots, weights, divisor):
    """``((0 + w_0 relu(x_0)) + ...) / divisor`` in float32, one rounding per step, for ``dots [heads]``."""
    acc = np.float32(0.0)
    for h, x in enumerate(dots):
        acc = np.float32(acc + np.float32(weights[h] * (x if not x <= 0 else np.float32(0.0))))
    return np.float32(acc / np.float32(divisor))


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 8, 16, 32, 48, 64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("every_key_seen", [False, True], ids=["partly-seen", "all-seen"])
def test_group_scores_are_the_relu_sum_chain_in_registers_or_not(heads, weighted, every_key_seen):
    """A row group's scores, for head counts summed on the tiles in registers (1, 2, 4, 8, 16; 32 and 64
    over several tiles) and ones that are transposed first (3, 48), unit or random weights, rows that see
    part of the chunk and a padding row, or rows that fill the lanes and see it all (up to 16 heads the
    tiles then write the scores themselves): every seen key's total equals the in-order chain bit for bit
    (NaN, -0 and negative weights included), and nothing else of ``scores`` changes."""
    rng = np.random.default_rng(10 * heads + weighted)
    if every_key_seen:  # 5 tiles of keys: pairs of tiles and one more where a row's heads fill whole tiles
        rows, key0, chunk = max(1, VECTOR // heads), 24, 40
    else:
        rows, key0, chunk = max(3, 32 // heads) - 1, 24, 45  # a padding row when possible
    divisor = np.float32(11.3)
    lanes = -(-rows * heads // VECTOR) * VECTOR
    rounded = -(-chunk // KEYS_PER_TILE) * KEYS_PER_TILE
    dots = rng.standard_normal((rounded, lanes)) * np.exp(rng.uniform(-8, 8, (rounded, lanes)))
    dots = dots.astype(np.float32)
    dots[0, 0], dots[3, heads - 1], dots[5, :] = np.nan, -0.0, -0.0
    r0 = 2
    visible = np.full(r0 + rows, key0 + chunk, np.int64)
    if not every_key_seen:
        visible[r0] = key0 + 7  # sees 7 of the chunk's keys
        visible[r0 + rows - 1] = key0 - 1  # sees none of them
    weights = rng.standard_normal((lanes // heads + 1, heads)).astype(np.float32) if weighted else None
    scores = rng.standard_normal((r0 + rows + 1, key0 + chunk + 5)).astype(np.float32)
    before = scores.copy()
    work = np.empty((lanes, rounded), np.float32)
    needed = keys_seen(visible, r0, r0 + rows, key0, chunk)
    write_group_scores(scores, dots, work, r0, r0 + rows, key0, chunk, needed, visible, lanes, heads, weights, divisor)
    want = before.copy()
    unit = np.ones(heads, np.float32)
    for r in range(r0, r0 + rows):
        for i in range(max(0, min(chunk, visible[r] - key0))):
            lane = (r - r0) * heads
            want[r, key0 + i] = _relu_sum_chain(dots[i, lane : lane + heads],
                                                unit if weights is None else weights[r - r0], divisor)
    assert np.array_equal(scores.view(np.uint32), want.view(np.uint32))


def test_score_tasks_run_in_key_order_unless_a_sequence_has_several_row_groups():
    task_starts = np.array([0, 3, 7], np.int64)
    decode, prefill = np.array([0, 1, 2], np.int64), np.array([0, 2, 3], np.int64)
    assert [task_in_order(t, task_starts, decode) for t in range(7)] == list(range(7))
    assert [task_in_order(t, task_starts, prefill) for t in range(7)] == [0, 6, 1, 5, 2, 4, 3]


@pytest.mark.parametrize("dim", [1, 15, 16, 64, 100, 128, 200])
def test_square_sums_run_over_the_channels_in_order_for_every_row(dim):
    """Each row's sum is the sequential float32 chain ``s = s + x[d] * x[d]`` (d ascending) bit for bit,
    whether the row's channels go through the vector steps or the scalar tail; a pairwise or lane-split
    sum of these wide-ranging values differs in the last bits."""
    rng = np.random.default_rng(dim)
    rows = (rng.standard_normal((SQUARE_SUM_ROWS, dim)) * np.exp(rng.uniform(-8, 8, (SQUARE_SUM_ROWS, dim))))
    rows = rows.astype(np.float32)
    sums = np.full(SQUARE_SUM_ROWS + 3, np.nan, np.float32)
    square_sums_in_order(rows, sums)
    want = np.zeros(SQUARE_SUM_ROWS, np.float32)
    for d in range(dim):
        want = (want + rows[:, d] * rows[:, d]).astype(np.float32)
    assert sums[:SQUARE_SUM_ROWS].view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert np.isnan(sums[SQUARE_SUM_ROWS:]).all(), "wrote past the rows' sums"
    if dim >= 64:  # the test can tell the order apart
        pairwise = np.array([np.float32(np.sum(r * r, dtype=np.float32)) for r in rows])
        assert not np.array_equal(pairwise, want)


@numba.njit(cache=True)
def _copy_at(address, rows, cols, element):
    return array_at(address, (rows, cols), element).copy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_tensor_by_address_reads_as_its_numpy_view(dtype):
    t = torch.randn(4, 32).to(dtype)[1:]  # contiguous, not at its storage's start
    got = _copy_at(t.data_ptr(), t.shape[0], t.shape[1], numba_dtype(dtype))
    assert got.dtype == as_numba(t).dtype and np.array_equal(got, as_numba(t))
