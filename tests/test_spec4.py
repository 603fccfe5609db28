"""The SPEC 4 comparison itself: what it accepts and what it refuses."""

from __future__ import annotations

import pytest
import torch
from spec4 import assert_lse_close, assert_spec_close


def _nudge(x: torch.Tensor, index: int, ulps: int) -> torch.Tensor:
    bits = x.clone().view(torch.int16)
    bits[index] += ulps
    return bits.view(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_noise_floor_forgives_only_cancelled_elements(dtype):
    expected = torch.cat([torch.linspace(-1.0, 1.0, 199), torch.tensor([3e-7])]).to(dtype)
    tiny_off = _nudge(expected, 199, 5)  # the tiny element, 5 ulps away (absolute error ~1e-9)
    with pytest.raises(AssertionError, match="5 ulps apart"):
        assert_spec_close(tiny_off, expected)
    assert_spec_close(tiny_off, expected, noise_floor=3e-5)
    large_off = _nudge(expected, 0, 2)  # -1.0, 2 ulps away: never forgiven
    with pytest.raises(AssertionError, match="2 ulps apart"):
        assert_spec_close(large_off, expected, noise_floor=3e-5)


def test_float32_bound_is_relative_plus_scaled_absolute():
    expected = torch.tensor([1.0, 1e-3, -2.0])
    assert_spec_close(expected * (1 + 5e-6), expected)
    with pytest.raises(AssertionError, match="max error"):
        assert_spec_close(expected + torch.tensor([0.0, 1e-4, 0.0]), expected)


def test_spec_close_reports_instead_of_raising():
    from spec4 import spec_close

    expected = torch.tensor([1.0, -2.0, float("inf")])
    assert spec_close(expected.clone(), expected)[0]
    assert spec_close(expected + torch.tensor([0.0, 1e-3, 0.0]), expected)[1].startswith("max error")
    assert spec_close(torch.tensor([3, 4], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)) == (
        False, "1 entries differ")
    assert spec_close(expected[:2], expected) == (False, "shape (2,) != (3,)")


def test_atol_lets_a_16_bit_element_within_it_count_as_one_ulp():
    expected = torch.tensor([2.3e-6] + [1.0] * 199, dtype=torch.bfloat16)
    off = expected.clone()
    off[0] = 2.26e-6  # several bf16 ulps below, 4e-8 away
    with pytest.raises(AssertionError, match="ulps apart"):
        assert_spec_close(off, expected)
    assert_spec_close(off, expected, atol=1e-7)
    with pytest.raises(AssertionError, match="ulps apart"):
        assert_spec_close(off, expected, atol=1e-8)


def test_an_lse_that_cancels_near_zero_gets_its_terms_rounding_and_no_more():
    """Seed 137336528's row: lse -0.0171 (its row max and log-sum cancel), 2.4e-7 apart from the reference,
    outside 1e-5 of itself; a row 1e-4 off (a key's weight lost) still fails."""
    expected = torch.tensor([[float("-inf"), -0.0171]])
    counts = torch.tensor([0, 37])
    with pytest.raises(AssertionError, match="max error"):
        assert_spec_close(expected + torch.tensor([[0.0, 2.4e-7]]), expected)
    assert_lse_close(expected + torch.tensor([[0.0, 2.4e-7]]), expected, counts)
    with pytest.raises(AssertionError, match="max error"):
        assert_lse_close(expected + torch.tensor([[0.0, 1e-4]]), expected, counts)
