"""The SPEC 4 comparison every kernel test uses: one definition of "agrees with the reference".

float32: ``|actual - expected| <= 1e-5 * |expected| + scale_atol * max|expected|``
(infinities must match exactly); bfloat16/float16: at most one ulp apart
(``+0 == -0``) and equal in at least 99% of elements. NaN is refused unless
``nan_ok``, and then it must sit exactly where the reference has it.

``noise_floor`` (16-bit outputs only, default 0): an element whose reference
magnitude is at most ``noise_floor * max|expected|`` may instead differ by up
to that much in absolute value. Such a value is the cancellation of much
larger terms and carries their float32 rounding error, many of its own ulps,
so the one-ulp rule cannot hold there between two valid summation orders
(docs/spec-notes.md); the 99% rule still counts every element.
"""

from __future__ import annotations

import torch


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map 16-bit floats to integers whose difference counts ulps (sign-magnitude -> ordered)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_spec_close(actual: torch.Tensor, expected: torch.Tensor, *, what: str = "",
                      scale_atol: float = 1e-6, nan_ok: bool = False, noise_floor: float = 0.0) -> None:
    """Assert SPEC 4 agreement; ``what`` names the comparison in failure messages."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.cpu(), expected.cpu()
    if not nan_ok:
        assert not torch.isnan(actual).any(), f"{what}: NaN in the output (unwritten or poisoned elements)"
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), f"{what}: NaN pattern differs"
    if actual.numel() == 0:
        return
    if actual.dtype in (torch.bfloat16, torch.float16):
        ulps = (ordered_bits(actual) - ordered_bits(expected)).abs()
        ulps = torch.where(torch.isnan(expected), torch.zeros_like(ulps), ulps)
        if noise_floor > 0:
            e, a = expected.double(), actual.double()
            floor = noise_floor * float(e[torch.isfinite(e)].abs().max()) if torch.isfinite(e).any() else 0.0
            cancelled = (e.abs() <= floor) & ((a - e).abs() <= floor)
            ulps = torch.where(cancelled, torch.clamp(ulps, max=1), ulps)
        assert int(ulps.max()) <= 1, f"{what}: {int(ulps.max())} ulps apart"
        equal = float((ulps == 0).float().mean())
        assert equal >= 0.99, f"{what}: only {equal:.2%} equal"
        return
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    assert torch.equal(finite, torch.isfinite(a)), f"{what}: inf/NaN positions differ"
    infinite = torch.isinf(e)
    assert torch.equal(a[infinite], e[infinite]), f"{what}: inf mismatch"
    err = (a[finite] - e[finite]).abs()
    scale = e[finite].abs().max() if finite.any() else 0.0
    bound = 1e-5 * e[finite].abs() + scale_atol * scale
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max()) if err.numel() else 0.0}"
