"""Triton top-k selection + expansion against the reference: outputs must be identical."""

from __future__ import annotations

import pytest
import torch

from triton_support import DEVICE, require_triton

pytestmark = pytest.mark.triton
require_triton()

from sparsekv.kernels.reference import select as ref
from sparsekv.kernels.triton import select as tri


def run(module, scores, positions, ratio, budget, include_tail, width=None):
    width = width or budget + ratio - 1
    indices = torch.full((scores.shape[0], width), 12345, dtype=torch.int32, device=DEVICE)  # poison
    counts = torch.full((scores.shape[0],), 12345, dtype=torch.int32, device=DEVICE)
    module.select_blocks_expand(indices, counts, scores, positions, ratio, budget, include_tail)
    return indices, counts


def check_same(scores, positions, ratio, budget, include_tail, width=None):
    expected = run(ref, scores, positions, ratio, budget, include_tail, width)
    actual = run(tri, scores, positions, ratio, budget, include_tail, width)
    assert torch.equal(actual[1], expected[1]), (actual[1], expected[1])
    assert torch.equal(actual[0], expected[0])


def causal_scores(positions, ratio, num_cols, gen, values=None):
    scores = torch.randn(positions.shape[0], num_cols, generator=gen) if values is None else values
    visible = torch.clamp((positions.long() + 1) // ratio, min=0)
    scores = torch.where(torch.arange(num_cols)[None, :] < visible[:, None], scores, float("-inf"))
    return scores.to(DEVICE)


@pytest.mark.parametrize("ratio,budget", [(4, 16), (3, 9), (1, 5), (4, 18)])
@pytest.mark.parametrize("include_tail", [True, False])
def test_select_matches_reference(ratio, budget, include_tail):
    gen = torch.Generator().manual_seed(ratio * 100 + budget + include_tail)
    positions = torch.tensor([0, 2, 3, 13, 15, 16, 40, 61, 99, 130, -1], dtype=torch.int32)
    num_cols = 30  # caps visibility for the later rows
    scores = causal_scores(positions, ratio, num_cols, gen)
    check_same(scores, positions.to(DEVICE), ratio, budget, include_tail)


def test_select_ties_go_to_lower_ids_and_special_values():
    gen = torch.Generator().manual_seed(9)
    positions = torch.tensor([59, 59, 59, 47], dtype=torch.int32)
    values = torch.randint(0, 3, (4, 15), generator=gen).float()  # many exact ties
    values[1] = torch.tensor([0.0, -0.0] * 7 + [0.0])
    values[2, ::3] = float("nan")
    values[2, 1::3] = float("-inf")
    values[3, :] = float("-inf")
    scores = causal_scores(positions, 4, 15, gen, values)
    check_same(scores, positions.to(DEVICE), 4, 20, True)


def test_select_long_rows_cross_tiles():
    gen = torch.Generator().manual_seed(77)
    positions = torch.tensor([20000, 4095, 9000, 17999], dtype=torch.int32)  # rows span several 2048-wide tiles
    scores = causal_scores(positions, 4, 4500, gen)
    scores[0, 1000:3000] = 2.5  # a big tie straddling the threshold and a tile edge
    scores[3] = torch.randint(-3, 4, (4500,), generator=gen).float()  # few distinct values: many ties
    check_same(scores, positions.to(DEVICE), 4, 512, True, width=600)


def test_select_example_from_docstring():
    scores = torch.tensor([[0.5, 0.9, 0.5]], device=DEVICE)
    indices, counts = run(tri, scores, torch.tensor([13], dtype=torch.int32, device=DEVICE), 4, 8, True)
    assert counts.tolist() == [10]
    assert indices.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, -1]]
