"""Triton sparse MLA attention against the reference.

On a machine without CUDA it runs in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes are small.
"""

from __future__ import annotations

import functools
import random

import pytest
import spec4
import torch
from triton_support import DEVICE, gpu_validation_rules, require_triton

pytestmark = pytest.mark.triton
require_triton()

from test_mla_attention import DTYPE_IDS, random_case, small_setup  # noqa: E402

from sparsekv.kernels.reference import mla as ref_mla  # noqa: E402
from sparsekv.kernels.triton import mla as tri_mla  # noqa: E402

# fp32 results may differ from the reference by 1e-5 of the output's scale (online softmax, tiled sums)
assert_spec_close = functools.partial(spec4.assert_spec_close, scale_atol=1e-5)
assert_lse_close = functools.partial(spec4.assert_lse_close, scale_atol=1e-5)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def on_device(case):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def run(module, case):
    q = case["q"]
    out = torch.full((q.shape[0], q.shape[1], case["v_head_dim"]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    module.mla_sparse_attention_paged(out, lse, q, case["blocks"], case["table"], case["indices"], case["counts"],
                                      case["offsets"], case["layer"], case["scale"])
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_matches_reference(dtype):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    outs, want_outs = [], []
    for _ in range(3):
        case = on_device(random_case(rng, dtype))
        out, lse = run(tri_mla, case)
        want_out, want_lse = run(ref_mla, case)
        assert_lse_close(lse, want_lse, case["counts"])
        outs.append(out.reshape(-1))
        want_outs.append(want_out.reshape(-1))
    noise_floor = 2.4e-4 if dtype == torch.float16 else 3e-5
    assert_spec_close(torch.cat(outs), torch.cat(want_outs), what="out", noise_floor=noise_floor)


@pytest.mark.parametrize("splits", [1, 3])
def test_split_rows_merge_and_strided_out(splits, monkeypatch):
    """A decode row cut into spans (merged by the second kernel) and a non-contiguous ``out``."""
    monkeypatch.setattr(tri_mla, "num_splits", lambda *args: splits)
    rng = random.Random(11)
    case = random_case(rng, torch.bfloat16)
    while case["q"].shape[0] == 0 or int(case["counts"].max()) < 40:
        case = random_case(rng, torch.bfloat16)
    case = on_device(case)
    q = case["q"]
    out = torch.full((q.shape[0], case["v_head_dim"], q.shape[1]), float("nan"), dtype=q.dtype,
                     device=DEVICE).transpose(1, 2)
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    tri_mla.mla_sparse_attention_paged(out, lse, q, case["blocks"], case["table"], case["indices"], case["counts"],
                                       case["offsets"], case["layer"], case["scale"])
    want_out, want_lse = run(ref_mla, case)
    assert_lse_close(lse, want_lse, case["counts"])
    assert_spec_close(out, want_out, what="out", noise_floor=3e-5)


def test_invalid_entries_are_skipped_and_debug_raises(monkeypatch):
    gpu_validation_rules(monkeypatch)
    coll, q, indices, counts, offsets = small_setup()
    case = on_device({"q": q, "blocks": coll.blocks, "table": coll.lookup_table, "counts": counts.int(),
                      "offsets": offsets.int(), "layer": 0, "scale": 0.5, "v_head_dim": 10,
                      "indices": torch.tensor([[0, -1, 5], [10**5, -1, 2]], dtype=torch.int32)})
    out, lse = run(tri_mla, case)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
    want_out, want_lse = run(ref_mla, {**case, "indices": case["indices"][:, [0, 2, 1]],
                                       "counts": torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)})
    assert_spec_close(out, want_out, what="out")
    assert_lse_close(lse, want_lse, counts)
    monkeypatch.setenv("SPARSEKV_DEBUG", "1")
    with pytest.raises(ValueError, match="row 0, entry 1 .* is position -1 of sequence 0: position -1 is negative"):
        run(tri_mla, case)


def test_missing_page_raises_on_host_before_writing(monkeypatch):
    gpu_validation_rules(monkeypatch)
    monkeypatch.setenv("SPARSEKV_DEBUG", "1")  # CUDA tensors are checked on the host only in debug mode
    coll, q, indices, counts, offsets = small_setup()
    table = coll.lookup_table.clone()
    table[1, 0] = -1  # positions 0..3 of sequence 1
    out = torch.full((2, 3, 10), float("nan"), device=DEVICE)
    lse = torch.full((2, 3), float("nan"), device=DEVICE)
    with pytest.raises(ValueError, match="row 1, entry 0 .* is position 3 of sequence 1: its page"):
        tri_mla.mla_sparse_attention_paged(out, lse, q.to(DEVICE), coll.blocks.to(DEVICE),
                                           table.to(DEVICE), indices.int().to(DEVICE), counts.int().to(DEVICE),
                                           offsets.int().to(DEVICE), 0, 1.0)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_public_op_on_the_triton_backend(monkeypatch):
    from sparsekv import mla_sparse_attention_paged
    from test_qsa_cases import make_collection

    coll, q, indices, counts, offsets = small_setup()
    want = mla_sparse_attention_paged(q, coll, 0, indices, counts, offsets, scale=0.3, v_head_dim=10)
    monkeypatch.setenv("SPARSEKV_BACKEND", "triton")
    device_coll = make_collection(coll.blocks.to(DEVICE), coll.lookup_table.to(DEVICE), [5, 8])
    got = mla_sparse_attention_paged(q.to(DEVICE), device_coll, 0, indices.to(DEVICE), counts.to(DEVICE),
                                     offsets.to(DEVICE), scale=0.3, v_head_dim=10)
    assert_spec_close(got.cpu(), want, what="out")
