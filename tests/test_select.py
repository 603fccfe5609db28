"""select_blocks_expand / qsa_select_tokens (SPEC 2.4, 3.3): brute force, CPU vs reference, errors."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qsa_cases import poisoned

from sparsekv import qsa_select_tokens, select_blocks_expand
from sparsekv.kernels.cpu import select as cpu_select
from sparsekv.kernels.cpu.select import _RADIX_BITS, _kth_largest, _order_key
from sparsekv.kernels.reference import select as ref_select


def brute_force_row(scores_row: list[float], t: int, ratio: int, budget: int, include_tail: bool) -> list[int]:
    visible = min(max((t + 1) // ratio, 0), len(scores_row))
    keyed = [(-(s if not math.isnan(s) else -math.inf), g) for g, s in enumerate(scores_row[:visible])]
    chosen = sorted(g for _, g in sorted(keyed)[: budget // ratio])
    tokens = [g * ratio + i for g in chosen for i in range(ratio)]
    if include_tail:
        tokens += list(range(ratio * ((t + 1) // ratio), t + 1))
    return tokens


def random_scores(rng: random.Random, rows: int, cols: int) -> torch.Tensor:
    kind = rng.choice(["continuous", "ties", "specials"])
    if kind == "continuous":
        return torch.randn(rows, cols)
    if kind == "ties":  # few distinct values: ties everywhere, -0.0 == 0.0 included
        pool = [0.0, -0.0, 1.0, 2.5]
    else:
        pool = [0.5, 1.0, float("-inf"), float("nan"), float("inf"), -3.0]
    return torch.tensor([rng.choice(pool) for _ in range(rows * cols)]).reshape(rows, cols)


def random_case(rng: random.Random):
    ratio = rng.choice([1, 2, 3, 4])
    budget = rng.choice([0, ratio, 2 * ratio, 5 * ratio + rng.randrange(ratio), 16])
    rows, cols = rng.randrange(0, 12), rng.randrange(0, 20)
    positions = torch.tensor([rng.randrange(0, (cols + 3) * ratio) for _ in range(rows)], dtype=torch.int32)
    return random_scores(rng, rows, cols), positions, ratio, budget, rng.random() < 0.8


def run_kernel(fn, scores, positions, ratio, budget, include_tail):
    indices = poisoned((scores.shape[0], budget + ratio - 1), torch.int32)
    counts = poisoned((scores.shape[0],), torch.int32)
    fn(indices, counts, scores, positions, ratio, budget, include_tail)
    return indices, counts


def test_reference_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(150):
        scores, positions, ratio, budget, tail = random_case(rng)
        indices, counts = run_kernel(ref_select.select_blocks_expand, scores, positions, ratio, budget, tail)
        for r in range(scores.shape[0]):
            want = brute_force_row(scores[r].tolist(), int(positions[r]), ratio, budget, tail)
            assert int(counts[r]) == len(want)
            assert indices[r].tolist() == want + [-1] * (indices.shape[1] - len(want))


def test_cpu_matches_reference():
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(200):
        case = random_case(rng)
        got = run_kernel(cpu_select.select_blocks_expand, *case)
        want = run_kernel(ref_select.select_blocks_expand, *case)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case


def test_cpu_matches_reference_at_model_size():
    """budget 2048, ratio 4 (512 of up to 900 blocks), continuous and tied scores."""
    positions = torch.tensor([0, 5, 2050, 2051, 3599, 3600], dtype=torch.int32)
    for scores in (torch.randn(6, 900), torch.randint(0, 4, (6, 900)).float()):
        got = run_kernel(cpu_select.select_blocks_expand, scores, positions, 4, 2048, True)
        want = run_kernel(ref_select.select_blocks_expand, scores, positions, 4, 2048, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_short_rows_take_every_causal_token():
    """t + 1 <= budget + R - 1: every position 0..t, in order (SPEC 2.4)."""
    ratio, budget = 4, 8
    positions = torch.arange(0, budget + ratio - 1, dtype=torch.int32)
    scores = torch.randn(positions.shape[0], 5)
    indices, counts = qsa_select_tokens(scores, positions, torch.tensor([0, positions.shape[0]]),
                                        ratio=ratio, budget=budget)
    for r, t in enumerate(positions.tolist()):
        assert counts[r] == t + 1
        assert indices[r, : t + 1].tolist() == list(range(t + 1))
        assert (indices[r, t + 1 :] == -1).all()


def test_ties_go_to_the_lower_block():
    scores = torch.tensor([[1.0, 2.0, 1.0, 2.0, 1.0]])
    indices, counts = select_blocks_expand(scores, torch.tensor([19]), ratio=4, budget=12)
    assert indices[0, : int(counts[0])].tolist() == list(range(4)) + list(range(4, 8)) + list(range(12, 16))


def test_without_tail_and_out_argument():
    scores = torch.tensor([[0.1, 0.3, 0.2]])
    out = (poisoned((1, 4 + 2 - 1), torch.int32), poisoned((1,), torch.int32))
    got = select_blocks_expand(scores, torch.tensor([6]), ratio=2, budget=4, include_tail=False, out=out)
    assert got.indices is out[0] and got.counts is out[1]
    assert out[0].tolist() == [[2, 3, 4, 5, -1]] and out[1].tolist() == [4]


def test_errors():
    scores, positions = torch.randn(2, 3), torch.tensor([3, 4])
    with pytest.raises(TypeError, match="scores"):
        select_blocks_expand(scores.double(), positions, ratio=2, budget=4)
    with pytest.raises(ValueError, match="ratio"):
        select_blocks_expand(scores, positions, ratio=0, budget=4)
    with pytest.raises(ValueError, match="budget"):
        select_blocks_expand(scores, positions, ratio=2, budget=-1)
    with pytest.raises(ValueError, match="query_positions: expected shape"):
        select_blocks_expand(scores, positions[:1], ratio=2, budget=4)
    with pytest.raises(ValueError, match="query_positions: expected values >= 0, got -2 at index 1"):
        select_blocks_expand(scores, torch.tensor([3, -2]), ratio=2, budget=4)
    with pytest.raises(ValueError, match="out\\[0\\]"):
        select_blocks_expand(scores, positions, ratio=2, budget=4, out=(torch.empty(2, 4, dtype=torch.int32),
                                                                       torch.empty(2, dtype=torch.int32)))
    with pytest.raises(ValueError, match="expected the last offset to equal the 2 q rows"):
        qsa_select_tokens(scores, positions, torch.tensor([0, 1]), ratio=2, budget=4)


@settings(max_examples=60)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-45, -1e-45, float("inf"), float("-inf"),
                                 float("nan"), 0.25, 0.5]) | st.floats(width=32), min_size=1, max_size=300),
       st.data())
def test_radix_select_finds_the_kth_largest_and_its_ties(values, data):
    """The CPU select's threshold: the k-th largest score (NaN as -inf, -0.0 as 0.0) and how many of the scores
    equal to it are among the k largest, against a sort."""
    k = data.draw(st.integers(1, len(values)))
    keys = np.array([_order_key(np.float32(v)) for v in values], np.int64)
    ranked = sorted((-math.inf if math.isnan(v) else float(np.float32(v)) for v in values), reverse=True)
    kth = ranked[k - 1]
    threshold, ties = _kth_largest(keys, k, np.empty(1 << _RADIX_BITS, np.int64))
    assert threshold == _order_key(np.float32(kth))
    assert ties == k - sum(1 for v in ranked if v > kth)
