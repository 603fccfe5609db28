"""Shared numerics: RoPE tables and application, zero-centred RMSNorm, correctly rounded division and square root.

Used by the reference kernels and the model layers, so that both round at
exactly the points SPEC 2 names.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_int


def rope_freqs_cis(num_positions: int, rotary_dim: int, theta: float = 1e7, *,
                   dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``freqs_cis`` table of SPEC 2.2: ``[num_positions, rotary_dim]``.

    Row ``p`` holds interleaved pairs ``[cos_0, sin_0, cos_1, sin_1, ...]`` of
    the angles ``p * theta**(-2i/rotary_dim)``, ``i < rotary_dim/2``, computed
    in float64 and rounded once to ``dtype``.

    Example: ``rope_freqs_cis(4, 2)[1] == [cos(1), sin(1)]``.
    """
    check_int("num_positions", num_positions, minimum=0)
    check_int("rotary_dim", rotary_dim, minimum=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number, got {rotary_dim}")
    theta = check_float("theta", theta, positive=True)
    half = rotary_dim // 2
    inv_freq = float(theta) ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    table = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(num_positions, rotary_dim)
    return table.to(dtype=dtype, device=device)


def div_rn(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded on every device (same shape and dtype as ``x``).

    CUDA turns a division by a Python number into a multiplication by its
    rounded reciprocal (one ulp off for divisors such as 3 or 40); a divisor
    tensor on ``x``'s device keeps the true division.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Square root of fp32 ``x`` (any shape), correctly rounded to nearest, the same bits on every device.

    ``torch.sqrt`` is not correctly rounded on every CPU build (about 15% of
    fp32 results one ulp off with torch 2.13), and CUDA's ``torch.rsqrt`` is
    approximate. The float64 root is rounded to fp32, then nudged one ulp
    where the exact test says so: the true root lies above the midpoint ``m``
    of two neighbouring floats when ``x > m * m``, and ``m * m`` (at most 50
    significant bits) is exact in float64.
    """
    wide = x.double()
    root = torch.sqrt(wide).float()
    up, down = torch.nextafter(root, torch.full_like(root, float("inf"))), torch.nextafter(root, torch.zeros_like(root))
    upper_mid = (root.double() + up.double()) / 2
    lower_mid = (root.double() + down.double()) / 2
    root_rn = torch.where(wide > upper_mid * upper_mid, up, root)
    return torch.where((wide < lower_mid * lower_mid) & (root > 0), down, root_rn)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, fp32 math, cast to ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype)


def apply_rope_neox(x: torch.Tensor, freqs: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NeoX half-split rotation of the first ``rotary_dim`` channels (SPEC 2.2 step 3).

    Args:
        x: ``[..., D]`` in the output dtype.
        freqs: ``[..., rotary_dim]`` rows of a ``freqs_cis`` table (broadcast
            against ``x``'s leading dims); cos/sin are rounded to ``x.dtype``
            first, products and sums are fp32, the result is cast once.
    """
    half = rotary_dim // 2
    cos = freqs[..., 0::2].to(x.dtype).float()
    sin = freqs[..., 1::2].to(x.dtype).float()
    xf = x.float()
    lo, hi = xf[..., :half], xf[..., half:rotary_dim]
    rotated = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin, xf[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)
