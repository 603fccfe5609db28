"""The SPEC 4 comparison every kernel test and ``benchmarks/gpu_check.py`` use: one definition of
"agrees with the reference".

float32: ``|actual - expected| <= 1e-5 * |expected| + scale_atol * max|expected|``
(infinities must match exactly); bfloat16/float16: at most one ulp apart
(``+0 == -0``) and equal in at least 99% of elements. NaN is refused unless
``nan_ok``, and then it must sit exactly where the reference has it.

``atol`` (default 0) widens the bound by an absolute amount: a caller whose
output is a sum of products passes the terms' float32 rounding (e.g. ``1e-6 *
sum|q_i k_i|``), since an output that cancels to near zero differs between
two valid summation orders by that much, not by ``1e-5`` of itself
(docs/spec-notes.md). For 16-bit outputs an element within ``atol`` of the
reference counts as at most one ulp apart (the 99% rule still counts it).

``noise_floor`` (16-bit outputs only, default 0): an element whose reference
magnitude is at most ``noise_floor * max|expected|`` may instead differ by up
to that much in absolute value. Such a value is the cancellation of much
larger terms and carries their float32 rounding error, many of its own ulps,
so the one-ulp rule cannot hold there between two valid summation orders
(docs/spec-notes.md); the 99% rule still counts every element.
"""

from __future__ import annotations

import math

import torch


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map 16-bit floats to integers whose difference counts ulps (sign-magnitude -> ordered)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def spec_close(actual: torch.Tensor, expected: torch.Tensor, *, scale_atol: float = 1e-6, nan_ok: bool = False,
               noise_floor: float = 0.0, atol: float = 0.0) -> tuple[bool, str]:
    """``(agrees, detail)``: the SPEC 4 comparison without raising (``benchmarks/gpu_check.py`` reports it).

    Integer tensors (selections, ids) must be equal. ``detail`` says why a
    comparison fails, or how close it came when it passes.
    """
    if actual.shape != expected.shape:
        return False, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return False, f"dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if not actual.is_floating_point():
        differ = int((actual != expected).sum())
        return differ == 0, "exact" if differ == 0 else f"{differ} entries differ"
    if not nan_ok and bool(torch.isnan(actual).any()):
        return False, "NaN in the output (unwritten or poisoned elements)"
    if not torch.equal(torch.isnan(actual), torch.isnan(expected)):
        return False, "NaN pattern differs"
    if actual.numel() == 0:
        return True, "empty"
    if actual.dtype in (torch.bfloat16, torch.float16):
        ulps = (ordered_bits(actual) - ordered_bits(expected)).abs()
        ulps = torch.where(torch.isnan(expected), torch.zeros_like(ulps), ulps)
        if noise_floor > 0:
            e, a = expected.double(), actual.double()
            floor = noise_floor * float(e[torch.isfinite(e)].abs().max()) if torch.isfinite(e).any() else 0.0
            cancelled = (e.abs() <= floor) & ((a - e).abs() <= floor)
            ulps = torch.where(cancelled, torch.clamp(ulps, max=1), ulps)
        if atol > 0:
            within = (actual.double() - expected.double()).abs() <= atol
            ulps = torch.where(within, torch.clamp(ulps, max=1), ulps)
        worst, equal = int(ulps.max()), float((ulps == 0).float().mean())
        if worst > 1:
            return False, f"{worst} ulps apart"
        if equal < 0.99:
            return False, f"only {equal:.2%} equal"
        return True, f"{worst} ulp apart at most, {equal:.2%} equal"
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    if not torch.equal(finite, torch.isfinite(a)):
        return False, "inf/NaN positions differ"
    infinite = torch.isinf(e)
    if not torch.equal(a[infinite], e[infinite]):
        return False, "inf mismatch"
    err = (a[finite] - e[finite]).abs()
    scale = e[finite].abs().max() if finite.any() else 0.0
    bound = 1e-5 * e[finite].abs() + scale_atol * scale + atol
    worst = float(err.max()) if err.numel() else 0.0
    if not bool((err <= bound).all()):
        return False, (f"max error {worst:.3g} over the bound 1e-5*|expected| + {scale_atol:g}*max|expected|"
                       + (f" + {atol:.3g}" if atol else ""))
    return True, f"max error {worst:.1e}"


def assert_spec_close(actual: torch.Tensor, expected: torch.Tensor, *, what: str = "",
                      scale_atol: float = 1e-6, nan_ok: bool = False, noise_floor: float = 0.0,
                      atol: float = 0.0) -> None:
    """Assert SPEC 4 agreement (:func:`spec_close`); ``what`` names the comparison in failure messages."""
    ok, detail = spec_close(actual, expected, scale_atol=scale_atol, nan_ok=nan_ok, noise_floor=noise_floor,
                            atol=atol)
    assert ok, f"{what}: {detail}"


def assert_lse_close(actual: torch.Tensor, expected: torch.Tensor, counts: torch.Tensor, *, what: str = "lse",
                     **spec: object) -> None:
    """:func:`assert_spec_close` (``spec``: its other options) for an attention's log-sum-exp ``[rows, heads]``
    whose rows counted at most ``max(counts)`` keys, with ``atol`` the float32 rounding its terms carry.

    ``lse = m + log(d)``: ``m`` the row's largest scaled logit, ``d = sum exp(l - m)`` in ``[1, n]`` for
    ``n`` counted keys. Both terms are at most ``|lse| + log(n)`` in size and ``d``'s float32 sum is
    within ``n`` roundings of itself, so two valid evaluations differ by up to about ``2**-23 * (|lse| +
    2 log(n) + n)``: an lse that cancels to near 0 (``m`` near ``-log d``) is then many of its own ulps
    off, not within ``1e-5`` of itself (seed 137336528: ``-0.0171``, 2.4e-7 apart; docs/spec-notes.md).
    """
    finite = torch.isfinite(expected)
    keys = float(counts.clamp(min=1).max()) if counts.numel() else 1.0
    largest = float(expected[finite].abs().max()) if bool(finite.any()) else 0.0
    assert_spec_close(actual, expected, what=what, atol=2.0**-23 * (largest + 2 * math.log(keys) + keys), **spec)
