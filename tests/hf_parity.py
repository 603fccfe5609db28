"""Helpers of the parity tests against Hugging Face's own modules (tests/test_hf_*.py).

A tiny seeded HF model is built from a config, saved with ``save_pretrained``
and sparsekv's layers load the same files by HF's names. HF's attention
modules are then called directly, chunk by chunk, with an HF cache; sparsekv's
layers run the same chunks on a paged cache.

The integration tests (tests/test_hf_integration*.py) share the inputs and
drivers below: a left-padded batch of two prompts, greedy generation, and
prefill followed by single-token decode steps, each run on the patched and
the unpatched model; and :func:`run_on_triton`, for the kernels a GPU runs.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.cache.manager import PagedKVCacheManager
from sparsekv.layers import CheckpointReader, load_module_weights

FP32_RTOL = 1e-5
#: Prompt lengths of the integration tests' two-row batch, and the tokens they generate.
PROMPT_LENGTHS = (21, 13)
NEW_TOKENS = 24


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models' matmuls take microseconds; torch's thread pool only adds waiting on a busy machine.

    A module that imports this fixture and wants it for every test marks it
    autouse through ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def left_padded_batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of PROMPT_LENGTHS tokens in ``[2, vocab)``, left-padded with token 1 under mask 0.

    ``(ids, mask)``, both int64 ``[2, max(PROMPT_LENGTHS)]``.
    """
    gen = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.ones(len(PROMPT_LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length:] = torch.randint(2, vocab, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def generate(model, ids, mask):
    """Greedy generation of exactly NEW_TOKENS tokens, returning the sequences and per-step logits."""
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)


def prefill_and_decode(model, ids, mask, steps):
    """Prefill the left-padded prompts, then decode ``steps [B, S]`` one token at a time.

    Returns the outputs per call (logits where the model has a head, else
    hidden states) and the cache. On a patched model every decode step also
    checks the manager: it holds each row's real tokens only.
    """
    from transformers import DynamicCache

    from sparsekv.integrations.transformers import get_manager

    cache = DynamicCache(config=model.config)
    outputs = []
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        outputs.append(first.logits if hasattr(first, "logits") else first.last_hidden_state)
        for i in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(steps[:, i:i + 1], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        past_key_values=cache)
            outputs.append(out.logits if hasattr(out, "logits") else out.last_hidden_state)
            if getattr(model, "_sparsekv_patch", None) is not None:
                manager = get_manager(model)
                manager.check_invariants()
                held = [manager.cache_length(rid) for rid in cache.layers[0].generation.request_ids]
                assert held == mask.sum(-1).tolist()  # real tokens only: padding is never stored
    return outputs, cache


def assert_outputs_close(got: list, expected: list, mask: torch.Tensor, atol: float = 2e-5) -> None:
    """:func:`prefill_and_decode`'s outputs against the unpatched model's, within ``atol``: the prefill's
    real rows (``mask``; padding rows are not compared), then every decode step."""
    real = mask.bool()
    assert (got[0][real] - expected[0][real]).abs().max().item() <= atol
    for step in range(1, len(got)):
        assert (got[step] - expected[step]).abs().max().item() <= atol, f"decode step {step}"


def run_on_triton(monkeypatch) -> set[tuple[str, str]]:
    """Make every op run its Triton kernel (here in Triton's interpreter; the test is skipped without Triton)
    and return the set that fills with ``(package, op)`` of each kernel that runs, ``package`` the one it
    came from (``"triton"`` for ``sparsekv.kernels.triton``)."""
    from triton_support import require_triton

    from sparsekv.ops import _registry

    require_triton()
    if torch.cuda.is_available():  # the models stay on CPU tensors: the interpreter runs the kernels
        pytest.skip("runs the Triton kernels in the interpreter; on a GPU machine the kernel tests run them")
    monkeypatch.setenv("SPARSEKV_BACKEND", "triton")
    ran: set[tuple[str, str]] = set()
    load_kernel = _registry.load_kernel

    def recording_load_kernel(backend: str, family: str, name: str):
        found = load_kernel(backend, family, name)
        package = found.__module__.rsplit(".", 2)[-2]

        def run(*args):
            ran.add((package, name))
            return found(*args)
        return run

    monkeypatch.setattr(_registry, "load_kernel", recording_load_kernel)
    return ran
