"""Pieces shared by the MLA + DSA layers: Hugging Face's RoPE of these families, and their cache groups.

RoPE (``glm_moe_dsa`` and ``deepseek_v32``; ``glm5_next`` is NoPE) rounds at
the points HF's modeling code does, so fp32 results match it to the last bit
and 16-bit ones to HF's own rounding:

* ``inv_freq = 1 / theta ** (arange(0, dim, 2) / dim)`` in float32 (YaRN:
  blended with ``inv_freq / factor``, see :func:`rope_inv_freq`), angles
  ``position * inv_freq`` in float32, ``cos`` / ``sin`` (times YaRN's
  attention factor) rounded to the activation dtype;
* products and sums in the activation dtype (each op rounded), as HF's
  elementwise code does.

Two layouts of the rotated channels:

* ``"interleave"`` (the MLA attention of both families, GLM-5's indexer):
  pairs ``(x0, x1), (x2, x3), ...`` each rotated by one frequency; the result
  is written de-interleaved, ``[even channels rotated | odd channels rotated]``,
  exactly as HF writes it. Queries and keys share the layout, so their dot
  products are those of the interleaved rotation.
* ``"half"`` (DeepSeek-V3.2's indexer): NeoX half-split, ``x * cos +
  rotate_half(x) * sin``.

The cache of one MLA model (:func:`mla_cache_groups`) has two co-indexed
groups: the latent rows (``KV = 1``, one head of ``kv_lora_rank +
qk_rope_head_dim`` channels, one layer per indexed layer) and the indexer's
keys (one head of ``index_head_dim``, one entry per ``index_kpool`` tokens,
one layer per layer that runs its own indexer).
"""

from __future__ import annotations

import math

import torch

from ..cache.groups import CacheGroupSpec
from .config import MlaConfig, yarn_mscale

ROPE_LAYOUTS = ("interleave", "half")


def rope_inv_freq(rotary_dim: int, theta: float, yarn: dict | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] float32, attention_factor)`` of the default RoPE, or of YaRN.

    ``yarn``: HF's YaRN entries (``factor``, ``original_max_position_embeddings``,
    optional ``beta_fast`` 32, ``beta_slow`` 1, ``mscale``, ``mscale_all_dim``,
    ``attention_factor``, ``truncate`` true): frequencies past the correction
    range are divided by ``factor``, a linear ramp blends the two inside it, and
    cos/sin are multiplied by the attention factor. The default RoPE has factor 1.
    """
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim)
    if not yarn:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.get("beta_fast") or 32), correction_dim(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-point range: keep the ramp finite
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, rotary_dim // 2]`` in ``dtype``: the angle of each channel pair at each position.

    Angles ``position * inv_freq`` in float32, times ``attention_factor``, rounded to ``dtype``.
    Example: ``rope_cos_sin(torch.tensor([0, 3]), *rope_inv_freq(4, 1e4), torch.float32)[0][1, 0] == cos(3.0)``.
    """
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate ``x [T, ..., rotary_dim]`` with ``cos``/``sin [T, rotary_dim // 2]`` (broadcast over the middle dims).

    ``layout`` is ``"interleave"`` or ``"half"`` (module docstring). Arithmetic
    in ``x``'s dtype, one rounding per op. Returns a new tensor.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if layout == "interleave":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    if layout == "half":
        half = x.shape[-1] // 2
        cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos2 + rotated_half * sin2
    raise ValueError(f"layout: expected one of {ROPE_LAYOUTS}, got {layout!r}")


def mla_cache_groups(config: MlaConfig, dtype: torch.dtype, *, latent: str = "latent",
                     indexer: str = "indexer") -> list[CacheGroupSpec]:
    """The two co-indexed cache groups of an MLA + DSA model (module docstring).

    Cache layer ``i`` of ``latent`` belongs to ``config.index_layers[i]``,
    layer ``j`` of ``indexer`` to ``config.full_index_layers[j]``. The
    manager's page size must be a multiple of ``config.index_kpool``.

    Example (GLM-5-Next defaults, bf16): latent rows of 512 channels for 11
    layers, one pooled indexer key of 128 channels per 16 tokens.
    """
    return [CacheGroupSpec(latent, 1, len(config.index_layers), 1, config.latent_dim, dtype),
            CacheGroupSpec(indexer, 1, len(config.full_index_layers), 1, config.index_head_dim, dtype,
                           tokens_per_entry=config.index_kpool)]


__all__ = ["ROPE_LAYOUTS", "apply_rope", "mla_cache_groups", "rope_cos_sin", "rope_inv_freq"]
