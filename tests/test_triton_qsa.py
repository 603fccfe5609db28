"""Triton QSA kernels (compress, block score, sparse attention) against the reference.

On a machine without CUDA they run in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes are tiny.
"""

from __future__ import annotations

import functools

import pytest
import spec4
import torch
from triton_support import DEVICE, gpu_validation_rules, require_triton

pytestmark = pytest.mark.triton
require_triton()

from sparsekv import rope_freqs_cis
from sparsekv.kernels.reference import qsa as ref
from sparsekv.kernels.triton import qsa as tri
from sparsekv.numerics import sqrt_rn

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---- helpers -------------------------------------------------------------
# the Triton kernels' fp32 results may differ from the reference by 1e-5 of the output's scale
# (fast exp, tiled sums), and some cases feed NaN on purpose
assert_spec_close = functools.partial(spec4.assert_spec_close, scale_atol=1e-5, nan_ok=True)
assert_lse_close = functools.partial(spec4.assert_lse_close, scale_atol=1e-5, nan_ok=True)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def make_blocks(num_pages, kv, layers, page_size, heads, dim, dtype, pad, gen):
    """Random paged blocks; a strided view with ``pad`` extra elements per page when ``pad > 0``."""
    packed = kv * layers * page_size * heads * dim
    storage = torch.randn(num_pages * (packed + pad), generator=gen).to(dtype).to(DEVICE)
    inner = (layers * page_size * heads * dim, page_size * heads * dim, heads * dim, dim, 1)
    return storage.as_strided((num_pages, kv, layers, page_size, heads, dim), (packed + pad, *inner))


def make_table(tokens_per_seq, page_size, num_pages, gen, spare_columns=1):
    """Distinct random pages for every logical page holding a token; ``-1`` elsewhere."""
    needed = [(n + page_size - 1) // page_size for n in tokens_per_seq]
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(tokens_per_seq), max(needed) + spare_columns), -1, dtype=torch.int32)
    for b, count in enumerate(needed):
        for i in range(count):
            table[b, i] = perm.pop()
    return table.to(DEVICE)


def offsets_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


# ---- compress ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,pad", [(32, 16, 0), (24, 8, 40), (16, 16, 8)])
def test_compress_matches_reference(dtype, head_dim, rotary_dim, pad):
    gen = torch.Generator().manual_seed(head_dim * 7 + rotary_dim + pad)
    ratio, page_size, layers, max_blocks = 4, 8, 3, 7
    key_counts_list = [23, 0, 3, 40, 9]  # partial block, empty, no block, clamped by max_blocks
    table = make_table(key_counts_list, page_size, 40, gen)
    blocks = make_blocks(40, 2, layers, page_size, 1, head_dim, dtype, pad, gen)
    gamma = (0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE)
    freqs = rope_freqs_cis(64, rotary_dim, theta=1e4, device=DEVICE)
    key_counts = torch.tensor(key_counts_list, dtype=torch.int32, device=DEVICE)
    for layer in (0, 2):
        expected = poisoned((5 * max_blocks, head_dim), dtype)
        ref.qsa_compress_keys_paged(expected, gamma, freqs, key_counts, blocks, table, layer, ratio, 1e-6)
        actual = poisoned((5 * max_blocks, head_dim), dtype)
        tri.qsa_compress_keys_paged(actual, gamma, freqs, key_counts, blocks, table, layer, ratio, 1e-6)
        assert_spec_close(actual, expected)


def assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same bits everywhere, except that NaN payloads may differ (NaN must still meet NaN)."""
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), "NaN pattern differs"
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
    a, e = actual.cpu().view(bits), expected.cpu().view(bits)
    differ = (a != e) & ~torch.isnan(expected.cpu())
    assert not bool(differ.any()), (
        f"{int(differ.sum())} of {differ.numel()} elements differ in their bits, first at "
        f"{torch.nonzero(differ)[0].tolist()}: {actual.cpu()[differ][:4].tolist()} vs {expected.cpu()[differ][:4].tolist()}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_cache_store_and_load_match_reference(dtype):
    """The block-key cache: the compress kernel writing blocks ``first_blocks[b] ..`` into pages (the rows before
    them untouched), and the rows read back in compress's layout, against the reference (bf16/fp16 bit for bit)."""
    gen = torch.Generator().manual_seed(5)
    ratio, page_size, layers, head_dim, rotary_dim = 4, 8, 2, 24, 8
    counts = [23, 0, 9, 40]
    first = torch.tensor([2, 0, 1, 3], dtype=torch.int32, device=DEVICE)
    table = make_table(counts, page_size, 24, gen)
    blocks = make_blocks(24, 1, layers, page_size, 1, head_dim, dtype, 8, gen)
    block_blocks = poisoned((24, 1, layers, page_size // ratio, 1, head_dim), dtype)
    gamma = (0.3 * torch.randn(head_dim, generator=gen)).to(DEVICE)
    freqs = rope_freqs_cis(64, rotary_dim, theta=1e4, device=DEVICE)
    key_counts = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    most_new = max(n // ratio - int(f) for n, f in zip(counts, first.tolist()))
    expected, actual = block_blocks.clone(), block_blocks.clone()
    ref.qsa_store_block_keys_paged(expected, gamma, freqs, key_counts, first, blocks, table, 1, ratio, 1e-6, most_new)
    tri.qsa_store_block_keys_paged(actual, gamma, freqs, key_counts, first, blocks, table, 1, ratio, 1e-6, most_new)
    check = assert_bit_exact if dtype != torch.float32 else assert_spec_close
    check(actual, expected)
    filled = block_blocks.clone()  # every block stored, then read back with max_blocks cutting sequence 3
    ref.qsa_store_block_keys_paged(filled, gamma, freqs, key_counts, torch.zeros_like(first), blocks, table, 1, ratio,
                                   1e-6, 10)
    expected, actual = poisoned((4 * 7, head_dim), dtype), poisoned((4 * 7, head_dim), dtype)
    ref.qsa_load_block_keys_paged(expected, key_counts, filled, table, 1, ratio)
    tri.qsa_load_block_keys_paged(actual, key_counts, filled, table, 1, ratio)
    assert_bit_exact(actual, expected)
    positions = torch.tensor([20, 22, 8, 8, 39, 35], dtype=torch.int32, device=DEVICE)  # 3 rows of seq 0, 1 of 2
    offsets = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32, device=DEVICE)          # and 2 of seq 3
    q = torch.randn(6, 3, head_dim, generator=gen).to(dtype).to(DEVICE)
    expected, actual = poisoned((6, 9), torch.float32), poisoned((6, 9), torch.float32)  # 9 columns cut seq 3
    ref.qsa_block_score_paged(expected, q, filled, table, positions, offsets, 1, ratio, 4.0)
    tri.qsa_block_score_paged(actual, q, filled, table, positions, offsets, 1, ratio, 4.0)
    assert_spec_close(actual, expected)


def test_compress_bf16_bit_exact_ratio3():
    gen = torch.Generator().manual_seed(11)
    ratio, page_size, head_dim = 3, 4, 32
    counts = [17, 12]
    table = make_table(counts, page_size, 12, gen)
    blocks = make_blocks(12, 2, 1, page_size, 1, head_dim, torch.bfloat16, 0, gen)
    gamma = torch.randn(head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    freqs = rope_freqs_cis(32, 16, device=DEVICE)
    key_counts = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    expected, actual = poisoned((12, head_dim), torch.bfloat16), poisoned((12, head_dim), torch.bfloat16)
    ref.qsa_compress_keys_paged(expected, gamma, freqs, key_counts, blocks, table, 0, ratio, 1e-6)
    tri.qsa_compress_keys_paged(actual, gamma, freqs, key_counts, blocks, table, 0, ratio, 1e-6)
    assert_bit_exact(actual, expected)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # bf16 squares overflowing on purpose
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,rotary_dim,ratio", [(64, 32, 4), (40, 24, 3), (128, 64, 2)])
def test_compress_bit_exact_with_large_magnitudes(dtype, head_dim, rotary_dim, ratio):
    """Every rounding point and summation order is the reference's, so bf16/fp16 outputs agree bit for bit.

    Keys whose magnitudes spread over many binades (per token and per channel)
    make the RMSNorm sum of squares round at almost every add, so a sum taken
    in another order than channel by channel shows up in the normed key; bf16
    keys also reach magnitudes whose squares overflow fp32 (the key is then
    normed to zero). A float64 ``freqs_cis`` table is rounded as the
    reference rounds it.
    """
    gen = torch.Generator().manual_seed(1000 + head_dim + ratio + (dtype == torch.float16))
    page_size, max_blocks, num_pages = 8, 24, 40
    counts = [ratio * 24 + 1, ratio * 17, ratio * 9 + ratio - 1]
    table = make_table(counts, page_size, num_pages, gen)
    blocks = make_blocks(num_pages, 2, 2, page_size, 1, head_dim, torch.float32, 0, gen).cpu()
    exponent_range = 4.0 if dtype == torch.float16 else 24.0  # fp16 tops out at 65504
    token_scale = 10 ** ((torch.rand(num_pages, 1, 2, page_size, 1, 1, generator=gen) * 2 - 1) * exponent_range)
    channel_scale = 10 ** ((torch.rand(head_dim, generator=gen) * 2 - 1) * exponent_range / 4)
    blocks = (blocks * token_scale * channel_scale).clamp(-6e4, 6e4) if dtype == torch.float16 else (
        blocks * token_scale * channel_scale)
    blocks = blocks.to(dtype).to(DEVICE)
    gamma = (0.5 * torch.randn(head_dim, generator=gen)).to(DEVICE)
    key_counts = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    for freqs_dtype, layer in ((torch.float32, 1), (torch.float64, 0)):
        freqs = rope_freqs_cis(ratio * max_blocks, rotary_dim, theta=1e4, dtype=freqs_dtype, device=DEVICE)
        expected = poisoned((len(counts) * max_blocks, head_dim), dtype)
        ref.qsa_compress_keys_paged(expected, gamma, freqs, key_counts, blocks, table, layer, ratio, 1e-6)
        actual = poisoned((len(counts) * max_blocks, head_dim), dtype)
        tri.qsa_compress_keys_paged(actual, gamma, freqs, key_counts, blocks, table, layer, ratio, 1e-6)
        assert_bit_exact(actual, expected)


def sequential_inv_rms(keys: torch.Tensor, eps: float) -> torch.Tensor:
    """``1/sqrt(sum_d x_d^2 / D + eps)`` per row of fp32 ``keys [N, D]``, the squares added in channel order."""
    squares = torch.zeros(keys.shape[0])
    for d in range(keys.shape[1]):
        squares = squares + keys[:, d] * keys[:, d]
    return 1.0 / sqrt_rn(squares / keys.shape[1] + eps)


def gamma_flipping_rounding(key: torch.Tensor, inv_rms: torch.Tensor, other_inv_rms: torch.Tensor,
                            dtype: torch.dtype) -> float | None:
    """A gamma for which ``key * inv_rms * (1 + gamma)`` rounds to ``dtype`` differently than with ``other_inv_rms``.

    Scans ``1 + gamma`` over consecutive fp32 values from 1 up; ``None`` if none of them does.
    """
    factors = 1.0 + torch.arange(1 << 17, dtype=torch.float32) * 2.0**-23
    rounded = (key * inv_rms * factors).to(dtype)
    other = (key * other_inv_rms * factors).to(dtype)
    hits = torch.nonzero(rounded != other)
    return None if hits.numel() == 0 else float(factors[hits[0, 0]] - 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compress_one_ulp_of_the_sum_of_squares_shows(dtype):
    """An RMSNorm scale one fp32 ulp away from the reference's changes the output, and the kernel's does not.

    Each block (``ratio = 1``: the block key is the raw key) gets two
    pass-through channels whose gamma puts the normed value right at a
    rounding boundary: one flips when the scale is one ulp larger, the other
    when it is one ulp smaller. So a sum of squares taken in any order that
    moves the scale by even one ulp fails the bit-exact comparison. The blocks
    are chosen among random keys as those whose sum of squares a tree
    reduction (``torch.sum``) does round differently.
    """
    gen = torch.Generator().manual_seed(77 + (dtype == torch.float16))
    head_dim, rotary_dim, page_size, eps = 128, 2, 8, 1e-6
    spread = 2.0 if dtype == torch.float16 else 6.0
    candidates = torch.randn(4000, head_dim, generator=gen) * 10 ** (
        (torch.rand(4000, 1, generator=gen) * 2 - 1) * spread + torch.rand(head_dim, generator=gen) * 2 - 1)
    candidates = candidates.to(dtype).float()
    inv_rms = sequential_inv_rms(candidates, eps)
    tree_inv_rms = 1.0 / sqrt_rn((candidates * candidates).sum(1) / head_dim + eps)
    sensitive = candidates[inv_rms != tree_inv_rms][: (head_dim - rotary_dim) // 2]
    assert sensitive.shape[0] >= 16, "too few random keys whose sum of squares depends on the order"
    keys, inv_rms = sensitive, sequential_inv_rms(sensitive, eps)
    gamma = 0.1 * torch.randn(head_dim, generator=gen)
    crafted = 0
    for k in range(keys.shape[0]):
        for channel, direction in ((rotary_dim + 2 * k, 1.0), (rotary_dim + 2 * k + 1, -1.0)):
            neighbour = torch.nextafter(inv_rms[k], torch.tensor(direction * float("inf")))
            flip = gamma_flipping_rounding(keys[k, channel], inv_rms[k], neighbour, dtype)
            if flip is not None and keys[k, channel] != 0:
                gamma[channel] = flip
                crafted += 1
    assert crafted >= keys.shape[0], f"only {crafted} channels could be put on a rounding boundary"
    num_blocks = keys.shape[0]
    table = make_table([num_blocks], page_size, num_blocks // page_size + 2, gen)
    blocks = torch.zeros(table.shape[1] + 1, 2, 1, page_size, 1, head_dim, dtype=dtype)
    for position in range(num_blocks):
        blocks[int(table[0, position // page_size]), 0, 0, position % page_size, 0] = keys[position].to(dtype)
    blocks = blocks.to(DEVICE)
    freqs = rope_freqs_cis(num_blocks, rotary_dim, device=DEVICE)
    key_counts = torch.tensor([num_blocks], dtype=torch.int32, device=DEVICE)
    expected, actual = poisoned((num_blocks, head_dim), dtype), poisoned((num_blocks, head_dim), dtype)
    ref.qsa_compress_keys_paged(expected, gamma.to(DEVICE), freqs, key_counts, blocks, table, 0, 1, eps)
    tri.qsa_compress_keys_paged(actual, gamma.to(DEVICE), freqs, key_counts, blocks, table, 0, 1, eps)
    assert_bit_exact(actual, expected)


def test_compress_missing_page_masked_and_debug_raises(monkeypatch):
    gpu_validation_rules(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    ratio, page_size, head_dim = 4, 4, 16
    table = make_table([12, 8], page_size, 8, gen)
    table[0, 1] = -1  # block 1 of sequence 0 has no page
    blocks = make_blocks(8, 2, 1, page_size, 1, head_dim, torch.float32, 0, gen)
    gamma = torch.zeros(head_dim, device=DEVICE)
    freqs = rope_freqs_cis(16, 16, device=DEVICE)
    key_counts = torch.tensor([12, 8], dtype=torch.int32, device=DEVICE)
    actual = poisoned((6, head_dim), torch.float32)
    tri.qsa_compress_keys_paged(actual, gamma, freqs, key_counts, blocks, table, 0, ratio, 1e-6)
    assert torch.equal(actual[1], torch.zeros_like(actual[1]))  # absent keys pool to zero
    good = table.clone()
    good[0, 1] = 0  # any page: block 1 is left out of the comparison
    expected = poisoned((6, head_dim), torch.float32)
    ref.qsa_compress_keys_paged(expected, gamma, freqs, key_counts, blocks, good, 0, ratio, 1e-6)
    assert_spec_close(actual[[0, 2, 3, 4, 5]], expected[[0, 2, 3, 4, 5]])
    monkeypatch.setenv("SPARSEKV_DEBUG", "1")
    with pytest.raises(ValueError, match="sequence 0, position 4"):
        tri.qsa_compress_keys_paged(actual, gamma, freqs, key_counts, blocks, table, 0, ratio, 1e-6)


# ---- block score ---------------------------------------------------------
def score_batch(lengths, cache_lengths, gen):
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lengths, lengths)]).to(torch.int32)
    return positions.to(DEVICE), offsets_of(lengths)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,cache_lengths", [([1, 1, 1], [37, 2, 60]), ([19, 0, 5], [0, 3, 30])])
def test_block_score_matches_reference(dtype, lengths, cache_lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + len(cache_lengths))
    heads, head_dim, ratio, max_blocks, out_cols = 4, 32, 4, 9, 12
    positions, offsets = score_batch(lengths, cache_lengths, gen)
    q = torch.randn(positions.shape[0], heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    keys = torch.randn(len(lengths) * max_blocks, head_dim, generator=gen).to(dtype).to(DEVICE)
    expected = poisoned((positions.shape[0], out_cols), torch.float32)
    ref.qsa_block_score(expected, q, keys, positions, offsets, ratio, head_dim**0.5)
    actual = poisoned((positions.shape[0], out_cols), torch.float32)
    tri.qsa_block_score(actual, q, keys, positions, offsets, ratio, head_dim**0.5)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    assert_spec_close(actual, expected)


def test_block_score_many_heads_and_strided_q():
    gen = torch.Generator().manual_seed(3)
    heads, head_dim, ratio, max_blocks = 5, 16, 2, 40
    positions, offsets = score_batch([3, 2], [70, 9], gen)
    q = torch.randn(5, heads, head_dim + 4, generator=gen).to(DEVICE)[:, :, 2:-2]
    keys = torch.randn(2 * max_blocks, head_dim, generator=gen).to(DEVICE)
    expected, actual = poisoned((5, 37), torch.float32), poisoned((5, 37), torch.float32)
    ref.qsa_block_score(expected, q, keys, positions, offsets, ratio, 3.0)
    tri.qsa_block_score(actual, q, keys, positions, offsets, ratio, 3.0)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    assert_spec_close(actual, expected)


# ---- sparse attention ----------------------------------------------------
def attention_inputs(dtype, gen, *, pad=0, layers=2, with_gate=False):
    page_size, kv_heads, group, head_dim = 4, 2, 3, 32
    cached = [13, 6, 21]
    rows = [2, 1, 3]
    table = make_table(cached, page_size, 20, gen)
    blocks = make_blocks(20, 2, layers, page_size, kv_heads, head_dim, dtype, pad, gen)
    total_q, width = sum(rows), 11
    seq_of_row = torch.repeat_interleave(torch.arange(3), torch.tensor(rows))
    indices = torch.full((total_q, width), -1, dtype=torch.int32)
    counts = torch.tensor([5, 0, 11, 7, -2, 3], dtype=torch.int32)
    garbage = torch.tensor([-1, 10**6, -7], dtype=torch.int32)[torch.arange(width) % 3]
    for r in range(total_q):
        n = cached[int(seq_of_row[r])]
        indices[r] = torch.randint(0, n, (width,), generator=gen, dtype=torch.int32)  # duplicates happen
        valid = max(int(counts[r]), 0)
        indices[r, valid:] = garbage[valid:]  # entries past counts are never read
    q = torch.randn(total_q, kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    gate = torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE) if with_gate else None
    return {"q": q, "blocks": blocks, "lookup_table": table, "indices": indices.to(DEVICE),
            "counts": counts.to(DEVICE), "input_row_offsets": offsets_of(rows), "gate": gate}


def run_attention(module, args, layer, scale):
    q = args["q"]
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], torch.float32)
    module.qsa_sparse_attention_paged(out, lse, q, args["blocks"], args["lookup_table"], args["indices"],
                                      args["counts"], args["input_row_offsets"], layer, scale, args["gate"])
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_gate", [False, True])
def test_sparse_attention_matches_reference(dtype, with_gate):
    gen = torch.Generator().manual_seed(21 + DTYPES.index(dtype) + 10 * with_gate)
    args = attention_inputs(dtype, gen, pad=12, with_gate=with_gate)
    for layer in (0, 1):
        expected_out, expected_lse = run_attention(ref, args, layer, 0.3)
        out, lse = run_attention(tri, args, layer, 0.3)
        assert_spec_close(out, expected_out)
        assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
        assert_lse_close(lse, expected_lse, args["counts"])
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[4], torch.zeros_like(out[4]))


def test_sparse_attention_invalid_entries_are_skipped_and_debug_raises(monkeypatch):
    gpu_validation_rules(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    args = attention_inputs(torch.float32, gen)
    indices, counts = args["indices"].clone(), args["counts"]
    indices[0, 1] = -1  # row 0 (counts 5): a -1 inside the counted region
    indices[2, 4] = 10**5  # row 2: beyond the lookup table
    out, lse = run_attention(tri, {**args, "indices": indices}, 0, 0.5)
    # Same as attending without those entries.
    dropped = indices.clone()
    dropped[0, 1:-1] = indices[0, 2:].clone()
    dropped[2, 4:-1] = indices[2, 5:].clone()
    fewer = counts.clone()
    fewer[0] -= 1
    fewer[2] -= 1
    expected_out, expected_lse = run_attention(ref, {**args, "indices": dropped, "counts": fewer}, 0, 0.5)
    assert_spec_close(out, expected_out)
    assert_lse_close(lse, expected_lse, fewer)
    monkeypatch.setenv("SPARSEKV_DEBUG", "1")
    with pytest.raises(ValueError, match="row 0, entry 1"):
        run_attention(tri, {**args, "indices": indices}, 0, 0.5)


def test_sparse_attention_all_entries_invalid_gives_zero_row(monkeypatch):
    gpu_validation_rules(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    args = attention_inputs(torch.bfloat16, gen)
    indices = args["indices"].clone()
    indices[3] = -1
    out, lse = run_attention(tri, {**args, "indices": indices}, 1, 0.5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert bool(torch.isneginf(lse[3]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attention_split_rows_match_reference(dtype, monkeypatch):
    from sparsekv.kernels.triton import _attention

    monkeypatch.setattr(_attention, "PROGRAMS_PER_SM", 1000)  # force the split + merge path
    assert _attention.num_splits(4, 1, 300, 64, torch.device(DEVICE)) > 1 or DEVICE == "cuda"
    gen = torch.Generator().manual_seed(40 + DTYPES.index(dtype))
    page_size, head_dim, cached, width = 16, 32, [200, 90], 300
    table = make_table(cached, page_size, 24, gen)
    blocks = make_blocks(24, 2, 1, page_size, 1, head_dim, dtype, 0, gen)
    seq_of_row = [0, 0, 1, 1]
    indices = torch.stack([torch.randint(0, cached[b], (width,), generator=gen) for b in seq_of_row])
    counts = torch.tensor([300, 150, 0, 61], dtype=torch.int32)
    args = {"q": torch.randn(4, 4, head_dim, generator=gen).to(dtype).to(DEVICE), "blocks": blocks,
            "lookup_table": table, "indices": indices.to(torch.int32).to(DEVICE), "counts": counts.to(DEVICE),
            "input_row_offsets": offsets_of([2, 2]),
            "gate": torch.randn(4, 4, head_dim, generator=gen).to(dtype).to(DEVICE)}
    expected_out, expected_lse = run_attention(ref, args, 0, 0.2)
    out, lse = run_attention(tri, args, 0, 0.2)
    assert_spec_close(out, expected_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    assert_lse_close(lse, expected_lse, args["counts"])
