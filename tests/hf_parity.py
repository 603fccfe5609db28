"""Helpers of the parity tests against Hugging Face's own modules (tests/test_hf_*.py).

A tiny seeded HF model is built from a config, saved with ``save_pretrained``
and sparsekv's layers load the same files by HF's names. HF's attention
modules are then called directly, chunk by chunk, with an HF cache; sparsekv's
layers run the same chunks on a paged cache.
"""

from __future__ import annotations

import torch

from sparsekv.cache.manager import PagedKVCacheManager
from sparsekv.layers import CheckpointReader, load_module_weights

FP32_RTOL = 1e-5


def seed_hf_model(model: torch.nn.Module, seed: int) -> None:
    """Random, well-scaled values for every parameter (HF initialises gates to ones, ape and biases to zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("weights_proj.weight"):
                # positive head weights over positive inputs: an index score is zero only when every head's
                # relu is, which keeps exact ties (which HF's topk breaks in no fixed way) rare
                value = noise.abs() * param.shape[-1] ** -0.5
            elif param.dim() >= 2:
                value = noise * param.shape[-1] ** -0.5
            elif "norm" in name and name.endswith("weight"):
                value = 1 + 0.2 * noise
            else:
                value = 0.3 * noise
            param.copy_(value.to(param.dtype))


def save_and_reload(model: torch.nn.Module, folder) -> CheckpointReader:
    model.save_pretrained(folder)
    return CheckpointReader(folder)


def prefix_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The checkpoint prefix of ``module`` inside ``model`` (``"model.layers.1.self_attn."``)."""
    return next(name for name, candidate in model.named_modules() if candidate is module) + "."


def load_into(layer: torch.nn.Module, reader: CheckpointReader, prefix: str) -> torch.nn.Module:
    load_module_weights(layer, reader, prefix)
    return layer


def hidden_inputs(tokens: int, hidden: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, hidden]`` layer inputs with a positive offset (see :func:`seed_hf_model`)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen) * 0.5 + 1.0).to(dtype)


def causal_float_mask(start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """HF's eager 4-d additive causal mask ``[1, 1, count, start + count]`` for rows at positions ``start..``."""
    keys = torch.arange(start + count)
    rows = torch.arange(start, start + count)
    visible = keys[None, :] <= rows[:, None]
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


def run_schedule(manager: PagedKVCacheManager, chunks: list[int], step) -> list:
    """Claim one request, then for each chunk size: allocate, prepare, ``step(batch, start, n)``, commit."""
    manager.claim("r")
    start, results = 0, []
    for n in chunks:
        manager.allocate("r", n)
        batch = manager.prepare(["r"], [n])
        with torch.no_grad():
            results.append(step(batch, start, n))
        manager.step("r", [0] * n)
        start += n
    return results


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any() and not torch.isnan(want).any()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def compare_selection(ours: list[int], theirs: list[int], scores: torch.Tensor, kpool: int, *,
                      rtol: float = 1e-6) -> bool:
    """True when the two selections name the same tokens; False when they differ only by tied scores.

    ``scores``: this row's pool scores (sparsekv's). Pools in one selection
    and not the other must all score the lowest score either picked within
    ``rtol`` (the top-k boundary fell inside a group of scores equal up to
    float32 summation order: HF sums q.k by BLAS, sparsekv in channel order);
    anything else fails the test.
    """
    mine, hers = set(ours), set(theirs)
    assert len(ours) == len(mine) and len(ours) == len(theirs), (sorted(ours), sorted(theirs))
    if mine == hers:
        return True
    differing = {t // kpool for t in mine ^ hers}
    picked = [float(scores[t // kpool]) for t in mine if t // kpool < scores.shape[0]]
    boundary = min(s for s in picked if s != float("-inf"))  # tail tokens belong to no scored pool
    assert all(abs(float(scores[p]) - boundary) <= rtol * abs(boundary) for p in differing), (
        sorted(mine ^ hers), boundary, [float(scores[p]) for p in differing])
    return False
