"""Shared numerics against independent formulas: the RoPE table, the NeoX rotation, rounded division and root."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparsekv.numerics import apply_rope_neox, div_rn, rope_freqs_cis, sqrt_rn


def expected_row(position: int, rotary_dim: int, theta: float) -> list[float]:
    """Row ``position`` of the table, straight from SPEC 2.2 with Python floats: ``[cos_0, sin_0, cos_1, ...]``."""
    row = []
    for i in range(rotary_dim // 2):
        angle = position * theta ** (-2.0 * i / rotary_dim)
        row += [math.cos(angle), math.sin(angle)]
    return row


@pytest.mark.parametrize("rotary_dim, theta", [(64, 1e7), (6, 10000.0), (2, 1e4)])
def test_freqs_cis_rows_are_cos_sin_pairs_of_the_spec_angles(rotary_dim, theta):
    positions = [0, 1, 2, 7, 63, 1000, 131071]
    table = rope_freqs_cis(max(positions) + 1, rotary_dim, theta, dtype=torch.float64)
    assert table.shape == (max(positions) + 1, rotary_dim) and table.dtype == torch.float64
    for p in positions:
        want = torch.tensor(expected_row(p, rotary_dim, theta), dtype=torch.float64)
        # the float64 angles may differ from the table's in their last bits (~1e-11 at p = 131071)
        torch.testing.assert_close(table[p], want, rtol=0, atol=1e-9)


def test_freqs_cis_with_cos_and_sin_swapped_is_caught():
    table = rope_freqs_cis(8, 4, 1e4, dtype=torch.float64)
    swapped = table.reshape(8, 2, 2).flip(-1).reshape(8, 4)
    want = torch.tensor(expected_row(3, 4, 1e4), dtype=torch.float64)
    assert not torch.allclose(swapped[3], want, atol=1e-3)
    assert torch.allclose(table[3], want, atol=1e-12)


def test_freqs_cis_is_rounded_once_to_the_requested_dtype():
    exact = rope_freqs_cis(50, 8, 1e7, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(rope_freqs_cis(50, 8, 1e7, dtype=dtype), exact.to(dtype))


def test_rope_neox_rotates_the_half_split_pairs():
    x = torch.randn(3, 10, dtype=torch.float64).float()
    freqs = rope_freqs_cis(5, 6, 1e4)[torch.tensor([0, 2, 4])]
    got = apply_rope_neox(x, freqs, 6)
    for r, p in enumerate([0, 2, 4]):
        for i in range(3):
            angle = p * 1e4 ** (-2.0 * i / 6)
            c, s = math.cos(angle), math.sin(angle)
            lo, hi = float(x[r, i]), float(x[r, i + 3])
            assert got[r, i].item() == pytest.approx(lo * c - hi * s, rel=1e-5, abs=1e-6)
            assert got[r, i + 3].item() == pytest.approx(hi * c + lo * s, rel=1e-5, abs=1e-6)
    assert torch.equal(got[:, 6:], x[:, 6:])  # channels past rotary_dim pass through


def test_rope_freqs_cis_argument_errors():
    with pytest.raises(ValueError, match="rotary_dim: expected an even number, got 5"):
        rope_freqs_cis(4, 5)
    with pytest.raises(TypeError, match="num_positions: expected an int"):
        rope_freqs_cis(4.0, 4)
    with pytest.raises(ValueError, match="num_positions: expected an int >= 0"):
        rope_freqs_cis(-1, 4)
    with pytest.raises(ValueError, match="theta: expected a finite float > 0, got 0.0"):
        rope_freqs_cis(4, 4, 0.0)
    with pytest.raises(TypeError, match="theta: expected a float"):
        rope_freqs_cis(4, 4, "1e4")


@pytest.mark.parametrize("float64_root_error", [0.0, 2.0**-25, -(2.0**-25)])
def test_sqrt_rn_is_numpys_correctly_rounded_fp32_root(monkeypatch, float64_root_error):
    """Against numpy's IEEE fp32 square root, on values spread over the whole fp32 range and the edge cases;
    also when the float64 root it starts from is off by up to half an fp32 ulp (the nudge must repair it)."""
    x = torch.rand(200_000) * 10.0 ** (torch.rand(200_000) * 76 - 38)
    x = torch.cat([x, torch.tensor([0.0, 1e-45, 1.2e-38, 1.0, 2.0, 4.0, 3.4e38, float("inf"), float("nan")])])
    exact_sqrt = torch.sqrt
    if float64_root_error:
        monkeypatch.setattr(torch, "sqrt", lambda t: exact_sqrt(t) * (1.0 + float64_root_error))
    got = sqrt_rn(x)
    want = torch.from_numpy(np.sqrt(x.numpy()))
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), f"{int((~same).sum())} roots differ, first at x = {x[~same][:3].tolist()}"


@pytest.mark.parametrize("divisor", [3, 40, 11.313708498984761])
def test_div_rn_is_numpys_correctly_rounded_fp32_quotient(divisor):
    """On the GPU where there is one (CUDA multiplies by a rounded reciprocal when dividing by a Python number)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(100_000) * 10.0 ** (torch.rand(100_000) * 20 - 10)
    got = div_rn(x.to(device), divisor).cpu()
    want = torch.from_numpy(x.numpy() / np.float32(divisor))
    assert got.dtype == torch.float32 and bool((got.view(torch.int32) == want.view(torch.int32)).all())
