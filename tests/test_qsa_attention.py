"""qsa_sparse_attention_paged (SPEC 2.5) and the whole QSA step against dense attention."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from spec4 import assert_lse_close
from test_qsa_cases import (DTYPES, assert_spec_close, build_paged_cache, check_rows_sharing_a_tile, make_collection,
                            poisoned, prefill_selections)

from sparsekv import (
    qsa_block_score,
    qsa_compress_keys_paged,
    qsa_select_tokens,
    qsa_sparse_attention_paged,
    rope_freqs_cis,
)
from sparsekv.kernels.cpu import qsa as cpu_qsa
from sparsekv.kernels.reference import qsa as ref_qsa


def sdpa_over(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain SDPA of one query row ``[Hq, D]`` over ``keys/values [n, Hkv, D]`` (GQA by repetition), fp32."""
    group = q_row.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q_row.float()[:, None, :], k, v, scale=scale)[:, 0, :]


def main_cache(rng, lengths, kv_heads, dim, dtype, *, num_layers=2, layer=1, page_size=8):
    keys = [torch.randn(n, kv_heads, dim).to(dtype) for n in lengths]
    values = [torch.randn(n, kv_heads, dim).to(dtype) for n in lengths]
    blocks, table = build_paged_cache(keys, values=values, kv=2, page_size=page_size, num_layers=num_layers,
                                      layer=layer, stride_pad=rng.choice([0, 5]), rng=rng)
    return keys, values, blocks, table


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_equals_dense_causal_attention_within_budget(dtype, seed):
    """t + 1 <= budget + R - 1 selects every causal token: the result is dense causal attention."""
    rng = random.Random(seed)
    ratio, budget, dim, kv_heads, q_heads = 4, 8, 16, 2, 6
    rows_per_seq = [3, 1, 5]
    cache_lengths = [4, 0, 6]  # every row's t + 1 <= 11 = budget + ratio - 1
    lengths = [c + n for c, n in zip(cache_lengths, rows_per_seq)]
    keys, values, blocks, table = main_cache(rng, lengths, kv_heads, dim, dtype)
    coll = make_collection(blocks, table, cache_lengths)
    offsets = torch.tensor([0] + rows_per_seq).cumsum(0)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lengths, rows_per_seq)])
    q = torch.randn(positions.shape[0], q_heads, dim).to(dtype)
    scores = torch.randn(positions.shape[0], 4)  # any scores: everything visible is taken
    indices, counts = qsa_select_tokens(scores, positions, offsets, ratio=ratio, budget=budget)
    scale = dim ** -0.5
    out = qsa_sparse_attention_paged(q, coll, 1, indices, counts, offsets, scale=scale)
    seq_of_row = torch.repeat_interleave(torch.arange(3), torch.tensor(rows_per_seq))
    for r, t in enumerate(positions.tolist()):
        b = int(seq_of_row[r])
        want = sdpa_over(q[r], keys[b][: t + 1], values[b][: t + 1], scale)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[r].float(), want, rtol=tol, atol=tol)


def test_whole_step_equals_attention_over_brute_force_top_k(seed):
    """Beyond the budget: compress -> score -> select -> attention equals SDPA over the brute-force top-k."""
    rng = random.Random(seed)
    ratio, budget, dim, heads, eps = 4, 12, 16, 3, 1e-6
    lengths = [37, 22]
    offsets = torch.tensor([0, 3, 5])
    positions = torch.tensor([20, 30, 36, 14, 21])
    raw = [torch.randn(n, 1, dim) for n in lengths]
    index_blocks, index_table = build_paged_cache(raw, page_size=8, rng=rng)
    index_cache = make_collection(index_blocks, index_table, [34, 20])
    gamma, freqs = torch.randn(dim) * 0.2, rope_freqs_cis(64, 8)
    max_blocks = 9
    block_keys = qsa_compress_keys_paged(gamma, freqs, torch.tensor(lengths), index_cache, 0, ratio=ratio, eps=eps,
                                         max_blocks=max_blocks)
    q_index = torch.randn(5, heads, dim)
    scores = qsa_block_score(q_index, block_keys, positions, offsets, ratio=ratio, score_scale=math.sqrt(dim))
    indices, counts = qsa_select_tokens(scores, positions, offsets, ratio=ratio, budget=budget)

    keys, values, blocks, table = main_cache(rng, lengths, 1, dim, torch.float32, num_layers=1, layer=0)
    main = make_collection(blocks, table, [34, 20])
    q = torch.randn(5, 2, dim)
    out = qsa_sparse_attention_paged(q, main, 0, indices, counts, offsets, scale=0.3)

    for r, t in enumerate(positions.tolist()):
        b = 0 if r < 3 else 1
        brute = []
        for g in range((t + 1) // ratio):
            m = raw[b][g * ratio : (g + 1) * ratio, 0].double().mean(0)
            x = m / torch.sqrt((m * m).mean() + eps) * (1 + gamma.double())
            c, s = freqs[g * ratio, 0::2].double(), freqs[g * ratio, 1::2].double()
            k = torch.cat([x[:4] * c - x[4:8] * s, x[4:8] * c + x[:4] * s, x[8:]])
            brute.append(((q_index[r].double() @ k).clamp_min(0).sum() / math.sqrt(dim), g))
        top = sorted(g for _, g in sorted(brute, key=lambda sg: (-sg[0], sg[1]))[: budget // ratio])
        tokens = [g * ratio + i for g in top for i in range(ratio)] + list(range(ratio * ((t + 1) // ratio), t + 1))
        assert indices[r, : int(counts[r])].tolist() == tokens
        want = sdpa_over(q[r], keys[b][tokens], values[b][tokens], 0.3)
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)


def random_attention_case(rng, dtype):
    batch = rng.randrange(1, 6)
    # groups past one 16-lane query tile and odd widths (bf16 channel pairs) included
    kv_heads, group = rng.choice([1, 2]), rng.choice([1, 3, 12, 17])
    dim = rng.choice([8, 24, 37])
    rows = [rng.randrange(0, 4) for _ in range(batch)]
    cache_lengths = [rng.randrange(0, rng.choice([30, 300])) for _ in range(batch)]
    lengths = [c + n for c, n in zip(cache_lengths, rows)]
    _, _, blocks, table = main_cache(rng, lengths, kv_heads, dim, dtype, page_size=rng.choice([4, 16]))
    offsets = torch.tensor([0] + rows).cumsum(0).to(torch.int32)
    total_q, width = sum(rows), rng.choice([1, 7, 40, 200])  # 200: more than one 128-token chunk
    indices = torch.full((total_q, width), 10**6, dtype=torch.int32)  # garbage past the counts: never read
    counts = torch.zeros(total_q, dtype=torch.int32)
    seq_of_row = torch.repeat_interleave(torch.arange(batch), torch.tensor(rows))
    for r in range(total_q):
        held = lengths[int(seq_of_row[r])]
        counts[r] = rng.choice([0, -1, min(width, held), rng.randrange(0, min(width, held) + 1)])
        for i in range(max(int(counts[r]), 0)):
            indices[r, i] = rng.randrange(held)  # duplicates allowed
    q = torch.randn(total_q, kv_heads * group, dim).to(dtype)
    gate = torch.randn_like(q) if rng.random() < 0.5 else None
    return {"q": q, "blocks": blocks, "table": table, "indices": indices, "counts": counts, "offsets": offsets,
                "layer": 1, "scale": dim ** -0.5, "gate": gate}


def run_kernel(fn, case):
    q = case["q"]
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:2], torch.float32)
    fn(out, lse, q, case["blocks"], case["table"], case["indices"], case["counts"], case["offsets"],
       case["layer"], case["scale"], case["gate"])
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_matches_reference(dtype):
    rng = random.Random(random.randrange(1 << 30))
    outs, want_outs = [], []
    for _ in range(12):
        case = random_attention_case(rng, dtype)
        out, lse = run_kernel(cpu_qsa.qsa_sparse_attention_paged, case)
        want_out, want_lse = run_kernel(ref_qsa.qsa_sparse_attention_paged, case)
        assert_lse_close(lse, want_lse, case["counts"])
        outs.append(out.reshape(-1))
        want_outs.append(want_out.reshape(-1))
        empty = case["counts"] <= 0
        assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    # noise_floor: an output that is the cancellation of its values may differ by its terms' float32
    # rounding (a few ulps of float32 at the largest value's scale); the fast path sums in another (fixed)
    # order than the reference's einsum. One ulp of the output dtype covers that only above
    # ~2**-16 (bf16) / ~2**-13 (fp16, three more mantissa bits) of the largest value: at 3e-5 fp16 failed
    # about one seed in 200 (an output 3.3e-5 of the largest, 2 fp16 ulps = 0.5 float32 ulp of the largest)
    noise_floor = 2.4e-4 if dtype == torch.float16 else 3e-5
    assert_spec_close(torch.cat(outs), torch.cat(want_outs), what="out", noise_floor=noise_floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_rows_sharing_a_tile_give_the_bits_of_rows_alone(dtype, monkeypatch):
    """Prefill rows of KV heads with up to 8 query heads packed into one tile over the union of their
    selections (16 lanes; 32 rows of one head, MLA's expanded form), gated or not: the bits of one row per
    task, SPEC 4 against the reference."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for kv_heads, group, packed_rows in ((3, 1, 32), (2, 5, 3), (1, 8, 2)):
        dim, width = rng.choice([16, 37]), rng.choice([9, 24])
        cached, rows = [rng.randrange(0, 30), rng.randrange(0, 30)], [rng.randrange(32, 50), rng.randrange(1, 24)]
        lengths = [c + n for c, n in zip(cached, rows)]
        _, _, blocks, table = main_cache(rng, lengths, kv_heads, dim, dtype, page_size=rng.choice([16, 5]))
        indices, counts = prefill_selections(rng, cached, rows, width)
        q = torch.randn(sum(rows), kv_heads * group, dim).to(dtype)
        case = {"q": q, "blocks": blocks, "table": table, "indices": indices, "counts": counts,
                "offsets": torch.tensor([0, rows[0], sum(rows)], dtype=torch.int32), "layer": 1,
                "scale": dim ** -0.5, "gate": torch.randn_like(q) if rng.random() < 0.5 else None}
        check_rows_sharing_a_tile(lambda case: run_kernel(cpu_qsa.qsa_sparse_attention_paged, case),
                                  lambda case: run_kernel(ref_qsa.qsa_sparse_attention_paged, case),
                                  case, group, packed_rows, monkeypatch)


def test_gate_duplicates_and_lse():
    rng = random.Random(5)
    keys, values, blocks, table = main_cache(rng, [6], 1, 8, torch.float32, num_layers=1, layer=0)
    coll = make_collection(blocks, table, [5])
    q, gate = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    indices = torch.tensor([[1, 1, 4, -1]])
    out, lse = qsa_sparse_attention_paged(q, coll, 0, indices, torch.tensor([3]), torch.tensor([0, 1]),
                                          scale=0.5, gate=gate, return_lse=True)
    tokens = [1, 1, 4]  # the duplicate counts twice
    want = sdpa_over(q[0], keys[0][tokens], values[0][tokens], 0.5) * torch.sigmoid(gate[0])
    torch.testing.assert_close(out[0], want)
    logits = (q[0] @ keys[0][tokens, 0].T) * 0.5
    torch.testing.assert_close(lse[0], torch.logsumexp(logits, dim=1))


def _attention_setup():
    rng = random.Random(2)
    _, _, blocks, table = main_cache(rng, [6, 9], 2, 8, torch.float32, num_layers=1, layer=0, page_size=4)
    coll = make_collection(blocks, table, [5, 8])
    return coll, torch.randn(2, 4, 8), torch.tensor([0, 1, 2])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_kernel_errors_name_row_and_position(backend):
    coll, q, offsets = _attention_setup()
    fn = (ref_qsa if backend == "reference" else cpu_qsa).qsa_sparse_attention_paged
    out, lse = torch.empty_like(q), torch.empty(2, 4)
    indices = torch.tensor([[0, 1, 2], [3, -1, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1, entry 1 .* is position -1 of sequence 1: position -1 is negative"):
        fn(out, lse, q, coll.blocks, coll.lookup_table, indices, torch.tensor([3, 2], dtype=torch.int32),
           offsets.int(), 0, 1.0, None)
    table = coll.lookup_table.clone()
    table[1, 1] = -1  # positions 4..7 of sequence 1
    indices = torch.tensor([[0, 1, 2], [3, 6, 5]], dtype=torch.int32)
    message = (r"indices: row 1, entry 1 \(inside the counted region, counts\[1\] = 3\) "
               r"is position 6 of sequence 1: its page \(lookup_table\[1, 1\]\) is the sentinel")
    with pytest.raises(ValueError, match=message):
        fn(out, lse, q, coll.blocks, table, indices, torch.tensor([3, 3], dtype=torch.int32), offsets.int(), 0,
           1.0, None)
    # the same bad entries past the counts are never read
    fn(out, lse, q, coll.blocks, table, indices, torch.tensor([3, 1], dtype=torch.int32), offsets.int(), 0, 1.0, None)


def test_public_errors():
    coll, q, offsets = _attention_setup()
    indices, counts = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([3, 3])
    with pytest.raises(ValueError, match="row 1, entry 2 holds position 9, outside \\[0, 9\\)"):
        qsa_sparse_attention_paged(q, coll, 0, torch.tensor([[0, 1, 2], [3, 4, 9]]), counts, offsets, scale=1.0)
    with pytest.raises(ValueError, match="row 0, entry 1 holds position -1"):
        qsa_sparse_attention_paged(q, coll, 0, torch.tensor([[0, -1, 2], [3, 4, 5]]), counts, offsets, scale=1.0)
    with pytest.raises(ValueError, match="counts: row 1 counts 4 entries but indices has 3 columns"):
        qsa_sparse_attention_paged(q, coll, 0, indices, torch.tensor([3, 4]), offsets, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple of the cache's 2 KV heads"):
        qsa_sparse_attention_paged(torch.randn(2, 3, 8), coll, 0, indices, counts, offsets, scale=1.0)
    with pytest.raises(ValueError, match="head dim 6"):
        qsa_sparse_attention_paged(torch.randn(2, 4, 6), coll, 0, indices, counts, offsets, scale=1.0)
    with pytest.raises(TypeError, match="q: expected dtype"):
        qsa_sparse_attention_paged(q.half(), coll, 0, indices, counts, offsets, scale=1.0)
    with pytest.raises(ValueError, match="gate"):
        qsa_sparse_attention_paged(q, coll, 0, indices, counts, offsets, scale=1.0, gate=torch.randn(2, 4, 1))
    with pytest.raises(ValueError, match="indices: expected 2 rows"):
        qsa_sparse_attention_paged(q, coll, 0, indices[:1], counts, offsets, scale=1.0)
    with pytest.raises(ValueError, match="input_row_offsets"):
        qsa_sparse_attention_paged(q, coll, 0, indices, counts, torch.tensor([0, 2]), scale=1.0)
    keys_only = make_collection(coll.blocks[:, :1], coll.lookup_table, [5, 8])
    with pytest.raises(ValueError, match="KV == 2"):
        qsa_sparse_attention_paged(q, keys_only, 0, indices, counts, offsets, scale=1.0)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_raising_kernel_leaves_outputs_untouched(backend):
    coll, q, offsets = _attention_setup()
    fn = (ref_qsa if backend == "reference" else cpu_qsa).qsa_sparse_attention_paged
    out, lse = torch.full_like(q, float("nan")), torch.full((2, 4), 7.0)
    out_before, lse_before = out.clone(), lse.clone()
    indices = torch.tensor([[0, 1, 2], [3, 4, 99]], dtype=torch.int32)  # row 1's last entry: beyond the table
    with pytest.raises(ValueError, match="row 1, entry 2 .* position 99 of sequence 1: logical page 24 is beyond"):
        fn(out, lse, q, coll.blocks, coll.lookup_table, indices, torch.tensor([3, 3], dtype=torch.int32),
           offsets.int(), 0, 1.0, None)
    assert torch.equal(out.isnan(), out_before.isnan()) and torch.equal(lse, lse_before), "wrote before raising"
