"""The QSA and selection custom ops under opcheck, FakeTensorMode and torch.compile."""

from __future__ import annotations

import random

import pytest
import torch
from test_qsa_cases import build_paged_cache

import sparsekv  # noqa: F401  (registers the custom ops)
from sparsekv import qsa_block_score, qsa_select_tokens, rope_freqs_cis


def small_case():
    rng = random.Random(0)
    torch.manual_seed(0)
    dim = 8
    index_blocks, table = build_paged_cache([torch.randn(n, 1, dim) for n in (9, 6)], page_size=4, rng=rng)
    index_blocks = torch.nan_to_num(index_blocks)  # opcheck compares outputs; keep spare pages finite
    main_blocks, _ = build_paged_cache([torch.randn(n, 2, dim) for n in (9, 6)], page_size=4, kv=2,
                                       values=[torch.randn(n, 2, dim) for n in (9, 6)], rng=random.Random(0))
    main_blocks = torch.nan_to_num(main_blocks)
    offsets = torch.tensor([0, 2, 3], dtype=torch.int32)
    positions = torch.tensor([7, 8, 5], dtype=torch.int32)
    return {"dim": dim, "index_blocks": index_blocks, "main_blocks": main_blocks, "table": table, "offsets": offsets,
                "positions": positions, "key_counts": torch.tensor([9, 6], dtype=torch.int32),
                "gamma": torch.zeros(dim), "freqs": rope_freqs_cis(16, 4), "q_index": torch.randn(3, 2, dim),
                "q": torch.randn(3, 4, dim)}


def op_arguments(c):
    block_keys = torch.zeros(2 * 3, c["dim"])
    scores = torch.zeros(3, 4)
    indices, counts = torch.zeros(3, 4 + 4 - 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    block_blocks = torch.randn(c["index_blocks"].shape[0], 1, 1, 1, 1, c["dim"])  # ratio 4 = the page size
    return {
        "qsa_compress_keys_paged": (block_keys, c["gamma"], c["freqs"], c["key_counts"], c["index_blocks"], c["table"],
                                    0, 4, 1e-6),
        "qsa_store_block_keys_paged": (block_blocks, c["gamma"], c["freqs"], c["key_counts"],
                                       torch.tensor([1, 0], dtype=torch.int32), c["index_blocks"], c["table"], 0, 4,
                                       1e-6, 1),
        "qsa_load_block_keys_paged": (block_keys.clone(), c["key_counts"], block_blocks, c["table"], 0, 4),
        "qsa_block_score_paged": (scores.clone(), c["q_index"], block_blocks, c["table"], c["positions"],
                                  c["offsets"], 0, 4, 2.0),
        "qsa_block_score": (scores, c["q_index"], torch.randn(6, c["dim"]), c["positions"], c["offsets"], 4, 2.0),
        "select_blocks_expand": (indices, counts, torch.randn(3, 4), c["positions"], 4, 4, True),
        "qsa_sparse_attention_paged": (torch.zeros(3, 4, c["dim"]), torch.zeros(3, 4), c["q"], c["main_blocks"],
                                       c["table"], torch.tensor([[0, 1, 8, 0], [2, 3, 4, 0], [0, 1, 5, 0]],
                                                                dtype=torch.int32),
                                       torch.tensor([3, 2, 3], dtype=torch.int32), c["offsets"], 0, 0.5, None),
    }


@pytest.mark.parametrize("name", ["qsa_compress_keys_paged", "qsa_store_block_keys_paged", "qsa_load_block_keys_paged",
                                  "qsa_block_score", "qsa_block_score_paged", "select_blocks_expand",
                                  "qsa_sparse_attention_paged"])
def test_opcheck(name):
    args = op_arguments(small_case())[name]
    torch.library.opcheck(getattr(torch.ops.sparsekv, name).default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_fake_tensor_mode_shapes():
    """Under FakeTensorMode the ops run their fake impls: outputs keep their shapes, nothing is computed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = op_arguments(small_case())
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        for name, real in args.items():
            fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real)
            assert getattr(torch.ops.sparsekv, name)(*fake) is None
            outputs = fake[:2] if name in ("select_blocks_expand", "qsa_sparse_attention_paged") else fake[:1]
            for f, r in zip(outputs, real):
                assert f.shape == r.shape and f.dtype == r.dtype


def test_custom_ops_compile_fullgraph():
    """Score -> select through the raw custom ops in one graph, equal to eager."""
    c = small_case()
    args = op_arguments(c)
    keys = args["qsa_block_score"][2]

    def step(q, block_keys, positions, offsets):
        scores = torch.empty(q.shape[0], 4)
        torch.ops.sparsekv.qsa_block_score(scores, q, block_keys, positions, offsets, 4, 2.0)
        indices = torch.empty(q.shape[0], 7, dtype=torch.int32)
        counts = torch.empty(q.shape[0], dtype=torch.int32)
        torch.ops.sparsekv.select_blocks_expand(indices, counts, scores, positions, 4, 4, True)
        return scores, indices, counts

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(c["q_index"], keys, c["positions"], c["offsets"])
    want = step(c["q_index"], keys, c["positions"], c["offsets"])
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_public_ops_under_torch_compile():
    c = small_case()
    keys = op_arguments(c)["qsa_block_score"][2]

    def step(q, block_keys, positions, offsets):
        scores = qsa_block_score(q, block_keys, positions, offsets, ratio=4, score_scale=2.0, out_cols=4)
        return qsa_select_tokens(scores, positions, offsets, ratio=4, budget=4)

    compiled = torch.compile(step, backend="aot_eager")
    got = compiled(c["q_index"], keys, c["positions"], c["offsets"])
    want = step(c["q_index"], keys, c["positions"], c["offsets"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
