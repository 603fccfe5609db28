"""qsa_block_score (SPEC 2.3): reference vs a per-row naive, CPU vs reference, errors."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_qsa_cases import DTYPES, assert_spec_close, poisoned

from sparsekv import qsa_block_score
from sparsekv.kernels.cpu import qsa as cpu_qsa
from sparsekv.kernels.reference import qsa as ref_qsa


def random_case(rng: random.Random, dtype: torch.dtype, *, dim: int | None = None):
    dim = dim or rng.choice([8, 20, 37, 128])  # 37: an odd D (bf16 channel pairs get a zero channel)
    ratio = rng.choice([1, 2, 4, 5])
    batch = rng.randrange(1, 10)
    heads = rng.choice([1, 3, 4])
    max_blocks = rng.randrange(0, 12)
    rows = [rng.randrange(0, 5) for _ in range(batch)]
    offsets = torch.tensor([0] + rows).cumsum(0).to(torch.int32)
    total_q = int(offsets[-1])
    # positions from 0 up to beyond max_blocks * ratio (visibility clamps at max_blocks)
    positions = torch.tensor([rng.randrange(0, (max_blocks + 3) * ratio) for _ in range(total_q)], dtype=torch.int32)
    q = torch.randn(total_q, heads, dim).to(dtype)
    block_keys = torch.randn(batch * max_blocks, dim).to(dtype)
    out_cols = max_blocks + rng.choice([0, 0, 3])
    return {"q": q, "block_keys": block_keys, "positions": positions, "offsets": offsets, "ratio": ratio,
                "scale": math.sqrt(dim), "out_cols": out_cols}


def run_kernel(fn, case):
    out = poisoned((case["q"].shape[0], case["out_cols"]), torch.float32)
    fn(out, case["q"], case["block_keys"], case["positions"], case["offsets"], case["ratio"], case["scale"])
    return out


def term_rounding(case) -> float:
    """The float32 rounding of a score's terms, ``1e-6 * max sum_d |q_d k_d| / scale``: a score that cancels
    to near zero may differ by this much between two valid summation orders (tests/spec4.py)."""
    if case["q"].numel() == 0 or case["block_keys"].numel() == 0:
        return 0.0
    terms = torch.einsum("thd,kd->thk", case["q"].float().abs(), case["block_keys"].float().abs())
    return 1e-6 * float(terms.max()) / case["scale"]


def naive_scores(case):
    q, keys, offsets = case["q"].double(), case["block_keys"].double(), case["offsets"].tolist()
    batch = len(offsets) - 1
    max_blocks = keys.shape[0] // batch
    out = torch.full((q.shape[0], case["out_cols"]), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for r in range(offsets[b], offsets[b + 1]):
            visible = min((int(case["positions"][r]) + 1) // case["ratio"], max_blocks)
            for g in range(visible):
                dots = q[r] @ keys[b * max_blocks + g]
                out[r, g] = dots.clamp_min(0).sum() / case["scale"]
    return out.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_reference_matches_naive(dtype, seed):
    rng = random.Random(seed)
    for _ in range(10):
        case = random_case(rng, dtype, dim=rng.choice([8, 20]))
        assert_spec_close(run_kernel(ref_qsa.qsa_block_score, case), naive_scores(case), what="reference",
                          atol=term_rounding(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_matches_reference(dtype):
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(15):
        case = random_case(rng, dtype)
        got = run_kernel(cpu_qsa.qsa_block_score, case)
        assert_spec_close(got, run_kernel(ref_qsa.qsa_block_score, case), what="cpu vs reference",
                          atol=term_rounding(case))


def test_visibility_and_extra_columns():
    """Block g is visible iff g*R + R - 1 <= t and g < max_blocks; everything else is -inf."""
    batch, max_blocks, ratio = 2, 3, 4
    q = torch.ones(6, 2, 4)
    keys = torch.ones(batch * max_blocks, 4)
    offsets = torch.tensor([0, 4, 6])
    positions = torch.tensor([0, 2, 3, 7, 11, 40])
    scores = qsa_block_score(q, keys, positions, offsets, ratio=ratio, score_scale=2.0, out_cols=5)
    finite = torch.isfinite(scores)
    want_visible = [0, 0, 1, 2, 3, 3]
    assert finite.sum(dim=1).tolist() == want_visible
    for r, v in enumerate(want_visible):
        assert finite[r, :v].all()
        assert torch.equal(scores[r, :v], torch.full((v,), 4.0))  # 2 heads * relu(4) / 2


def test_relu_is_per_head_before_the_sum():
    q = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])  # head 0 dot = +k0, head 1 dot = -k0
    keys = torch.tensor([[3.0, 5.0]])
    scores = qsa_block_score(q, keys, torch.tensor([3]), torch.tensor([0, 1]), ratio=4, score_scale=1.0)
    assert scores.tolist() == [[3.0]]  # relu(3) + relu(-3), not relu(3 - 3)


def test_out_argument():
    rng = random.Random(9)
    case = random_case(rng, torch.float32)
    out = poisoned((case["q"].shape[0], case["out_cols"]), torch.float32)
    got = qsa_block_score(case["q"], case["block_keys"], case["positions"], case["offsets"].long(),
                          ratio=case["ratio"], score_scale=case["scale"], out=out)
    assert got is out
    assert_spec_close(out, naive_scores(case))


def test_errors():
    q, keys = torch.randn(3, 2, 8), torch.randn(4, 8)
    offsets, positions = torch.tensor([0, 1, 3]), torch.tensor([4, 5, 6])
    kw = {"ratio": 4, "score_scale": 1.0}
    with pytest.raises(ValueError, match="out_cols: expected >= max_blocks = 2"):
        qsa_block_score(q, keys, positions, offsets, out_cols=1, **kw)
    with pytest.raises(ValueError, match="not a multiple of the batch size 2"):
        qsa_block_score(q, torch.randn(5, 8), positions, offsets, **kw)
    with pytest.raises(ValueError, match="width 6 differs"):
        qsa_block_score(q, torch.randn(4, 6), positions, offsets, **kw)
    with pytest.raises(TypeError, match="block_keys"):
        qsa_block_score(q, keys.half(), positions, offsets, **kw)
    with pytest.raises(ValueError, match="query_positions: expected values >= 0"):
        qsa_block_score(q, keys, torch.tensor([4, -1, 6]), offsets, **kw)
    with pytest.raises(ValueError, match="expected the last offset to equal the 3 q rows"):
        qsa_block_score(q, keys, positions, torch.tensor([0, 1, 2]), **kw)
    with pytest.raises(ValueError, match="empty batch"):
        qsa_block_score(q, keys, positions, torch.tensor([0]), **kw)
    with pytest.raises(ValueError, match="score_scale"):
        qsa_block_score(q, keys, positions, offsets, ratio=4, score_scale=0.0)
    with pytest.raises(ValueError, match="query_positions: expected shape"):
        qsa_block_score(q, keys, positions[:2], offsets, **kw)


@pytest.mark.parametrize("heads", [3, 5])
def test_cpu_many_keys_and_rows_equals_reference_and_rows_alone(heads):
    """Keys spanning several tasks and tiles, rows spanning several row groups (with padding lanes): the
    CPU scores match the reference, and each row scored alone (its sequence only) gives the same bits."""
    generator = torch.Generator().manual_seed(heads)
    dim, ratio, max_blocks, rows = 24, 2, 300, [19, 1]
    offsets = torch.tensor([0, rows[0], sum(rows)], dtype=torch.int32)
    positions = torch.tensor([2 * max_blocks - 40 + 3 * i for i in range(rows[0])] + [257], dtype=torch.int32)
    case = {"q": torch.randn(sum(rows), heads, dim, generator=generator),
            "block_keys": torch.randn(2 * max_blocks, dim, generator=generator), "positions": positions,
            "offsets": offsets, "ratio": ratio, "scale": math.sqrt(dim), "out_cols": max_blocks + 1}
    got = run_kernel(cpu_qsa.qsa_block_score, case)
    assert_spec_close(got, run_kernel(ref_qsa.qsa_block_score, case), what="cpu vs reference")
    for r in [0, 5, 6, 18, 19]:
        seq = 0 if r < rows[0] else 1
        alone = dict(case, q=case["q"][r : r + 1], positions=positions[r : r + 1],
                     offsets=torch.tensor([0, 1], dtype=torch.int32),
                     block_keys=case["block_keys"][seq * max_blocks : (seq + 1) * max_blocks])
        assert torch.equal(run_kernel(cpu_qsa.qsa_block_score, alone)[0], got[r]), f"row {r} alone differs"


@pytest.mark.parametrize("heads", [3, 4])
def test_cpu_kernel_bits_do_not_depend_on_the_worker_count(heads):
    """The kernel's tasks taken as they go by 1, 2 or 5 workers (more than the threads there are; each with
    its own scratch): the same bits, with and without the in-register epilogue (4 heads), and the reference's
    values."""
    from sparsekv.kernels.cpu._bits import as_numba

    generator = torch.Generator().manual_seed(heads)
    dim, ratio, max_blocks, rows = 40, 4, 700, 3
    case = {"q": torch.randn(2 * rows, heads, dim, generator=generator).to(torch.bfloat16),
            "block_keys": torch.randn(2 * max_blocks, dim, generator=generator).to(torch.bfloat16),
            "positions": torch.tensor([4 * max_blocks - 1 - i for i in range(rows)] + [1001, 2000, 2030],
                                      dtype=torch.int32),
            "offsets": torch.tensor([0, rows, 2 * rows], dtype=torch.int32), "ratio": ratio,
            "scale": math.sqrt(dim), "out_cols": max_blocks}
    outs = []
    for workers in (1, 2, 5):
        out = poisoned((2 * rows, max_blocks), torch.float32)
        cpu_qsa._block_score_kernel(out.numpy(), as_numba(case["q"]), as_numba(case["block_keys"]),
                                    case["offsets"].numpy(), case["positions"].numpy(), ratio, max_blocks,
                                    case["scale"], workers)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_spec_close(outs[0], run_kernel(ref_qsa.qsa_block_score, case), what="cpu vs reference")


def test_cpu_without_heads_is_an_empty_sum():
    """Zero index heads: every visible block scores 0 (the empty sum), on the CPU as in the reference."""
    case = {"q": torch.randn(3, 0, 16), "block_keys": torch.randn(20, 16),
            "positions": torch.tensor([9, 20, 39], dtype=torch.int32),
            "offsets": torch.tensor([0, 1, 3], dtype=torch.int32), "ratio": 4, "scale": 4.0, "out_cols": 10}
    got, want = run_kernel(cpu_qsa.qsa_block_score, case), run_kernel(ref_qsa.qsa_block_score, case)
    assert torch.equal(got, want) and bool((want == 0).any())


@pytest.mark.parametrize("scores_dtype", [torch.float64, torch.float16])
def test_cpu_refuses_scores_it_does_not_write(scores_dtype):
    """The CPU kernel writes float32 at the scores' address: another dtype raises ``TypeError``, nothing written
    (a float16 buffer is half the bytes the kernel would write)."""
    scores = torch.full((3, 10), 7.0, dtype=scores_dtype)
    expected = f"qsa_block_score: expected .* float32 scores, got .*{scores_dtype}"
    with pytest.raises(TypeError, match=expected):
        cpu_qsa.qsa_block_score(scores, torch.randn(3, 2, 16), torch.randn(20, 16),
                                torch.tensor([9, 20, 39], dtype=torch.int32),
                                torch.tensor([0, 1, 3], dtype=torch.int32), 4, 4.0)
    assert bool((scores == 7.0).all())


def test_cpu_causal_prefill_rows_that_end_before_a_task():
    """A causal prefill over several tasks of keys: the first rows see none of the later tasks' blocks (their
    row groups skip those tasks); every row matches the reference and its own bits alone."""
    generator = torch.Generator().manual_seed(11)
    dim, ratio, max_blocks, heads = 24, 2, 300, 4
    positions = torch.tensor([0, 5, 60, 254, 255, 256, 257, 400, 598, 599], dtype=torch.int32)
    case = {"q": torch.randn(len(positions), heads, dim, generator=generator),
            "block_keys": torch.randn(max_blocks, dim, generator=generator), "positions": positions,
            "offsets": torch.tensor([0, len(positions)], dtype=torch.int32), "ratio": ratio,
            "scale": math.sqrt(dim), "out_cols": max_blocks}
    got = run_kernel(cpu_qsa.qsa_block_score, case)
    assert_spec_close(got, run_kernel(ref_qsa.qsa_block_score, case), what="cpu vs reference")
    for r in range(len(positions)):
        alone = dict(case, q=case["q"][r : r + 1], positions=positions[r : r + 1],
                     offsets=torch.tensor([0, 1], dtype=torch.int32))
        assert torch.equal(run_kernel(cpu_qsa.qsa_block_score, alone)[0], got[r]), f"row {r} alone differs"
