"""mla_sparse_attention_paged (SPEC 3.4): backends against the reference, against dense MLA, and every error."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from spec4 import assert_lse_close
from test_qsa_cases import DTYPES, assert_spec_close, build_paged_cache, make_collection, poisoned, prefill_selections
from test_qsa_cases import check_rows_sharing_a_tile

from sparsekv import mla_sparse_attention_paged
from sparsekv.cache.layout import PagedKVCacheCollection
from sparsekv.kernels.cpu import _sparse_attend as cpu_attend
from sparsekv.kernels.cpu import mla as cpu_mla
from sparsekv.kernels.cpu._parallel import numba_threads
from sparsekv.kernels.reference import mla as ref_mla

DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def latent_cache(rng, lengths, width, dtype, *, page_size=16, num_layers=2, layer=1):
    """Random latent rows ``[n_b, 1, width]`` per sequence in a single-plane paged cache (NaN elsewhere)."""
    histories = [torch.randn(n, 1, width).to(dtype) for n in lengths]
    blocks, table = build_paged_cache(histories, page_size=page_size, num_layers=num_layers, layer=layer,
                                      stride_pad=rng.choice([0, 7]), rng=rng)
    return histories, blocks, table


def random_case(rng, dtype, heads=None):
    """A ragged batch: odd head counts (or ``heads``), rope 0 or 16 channels, garbage past the counts,
    duplicates."""
    batch = rng.randrange(1, 5)
    rank, rope = rng.choice([(64, 16), (64, 0), (48, 8)])
    heads = heads or rng.choice([1, 7, 16, 33])
    rows = [rng.randrange(0, 4) for _ in range(batch)]
    cache_lengths = [rng.randrange(0, rng.choice([40, 300])) for _ in range(batch)]
    lengths = [c + n for c, n in zip(cache_lengths, rows)]
    _, blocks, table = latent_cache(rng, lengths, rank + rope, dtype, page_size=rng.choice([16, 5]))
    offsets = torch.tensor([0] + rows).cumsum(0).to(torch.int32)
    total_q, width = sum(rows), rng.choice([1, 37, 200])  # 200: more than one 128-row chunk
    indices = torch.full((total_q, width), 10**6, dtype=torch.int32)  # never read: past the counts
    counts = torch.zeros(total_q, dtype=torch.int32)
    seq_of_row = torch.repeat_interleave(torch.arange(batch), torch.tensor(rows))
    for r in range(total_q):
        held = lengths[int(seq_of_row[r])]
        counts[r] = rng.choice([0, -1, min(width, held), rng.randrange(0, min(width, held) + 1)])
        for i in range(max(int(counts[r]), 0)):
            indices[r, i] = rng.randrange(held)  # duplicates allowed
    q = torch.randn(total_q, heads, rank + rope).to(dtype)
    return {"q": q, "blocks": blocks, "table": table, "indices": indices, "counts": counts, "offsets": offsets,
            "layer": 1, "scale": (rank + rope) ** -0.5, "v_head_dim": rank}


def run_kernel(fn, case):
    q = case["q"]
    out = poisoned((q.shape[0], q.shape[1], case["v_head_dim"]), q.dtype)
    lse = poisoned(q.shape[:2], torch.float32)
    fn(out, lse, q, case["blocks"], case["table"], case["indices"], case["counts"], case["offsets"], case["layer"],
       case["scale"])
    return out, lse


def check_backend_against_reference(fn, dtype, cases, seed, heads=None):
    """``cases`` random cases (of ``heads`` heads if given) through ``fn`` and the reference; SPEC 4 on lse
    and the outputs."""
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    outs, want_outs = [], []
    for _ in range(cases):
        case = random_case(rng, dtype, heads)
        out, lse = run_kernel(fn, case)
        want_out, want_lse = run_kernel(ref_mla.mla_sparse_attention_paged, case)
        assert_lse_close(lse, want_lse, case["counts"])
        empty = case["counts"] <= 0
        assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
        outs.append(out.reshape(-1))
        want_outs.append(want_out.reshape(-1))
    # outputs that are the cancellation of their terms carry the terms' float32 rounding (docs/spec-notes.md)
    noise_floor = 2.4e-4 if dtype == torch.float16 else 3e-5
    assert_spec_close(torch.cat(outs), torch.cat(want_outs), what="out", noise_floor=noise_floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_cpu_matches_reference(dtype):
    check_backend_against_reference(cpu_mla.mla_sparse_attention_paged, dtype, 10, random.randrange(1 << 30))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_cpu_key_chunks_match_reference(dtype, monkeypatch):
    """Rows of more than 8 heads (33) sum their softmax and P.V in key chunks (16 here, so that most rows of
    the random cases have several): SPEC 4 against the reference."""
    monkeypatch.setattr(cpu_mla, "KEY_CHUNK", 16)
    check_backend_against_reference(cpu_mla.mla_sparse_attention_paged, dtype, 6, random.randrange(1 << 30), heads=33)


@pytest.mark.parametrize("key_chunk", [cpu_mla.KEY_CHUNK, 16])
def test_cpu_bits_do_not_depend_on_threads_head_chunks_or_batch(key_chunk, monkeypatch):
    """Each head's arithmetic is fixed: any thread count, head chunking or batch split gives the same bits;
    with key chunks (16) too, a row alone on two threads running its chunks as tasks of their own."""
    monkeypatch.setattr(cpu_mla, "KEY_CHUNK", key_chunk)
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    case = random_case(rng, rng.choice(DTYPES))
    while case["q"].shape[0] == 0 or int(case["counts"].max()) <= 16:
        case = random_case(rng, rng.choice(DTYPES))
    case["q"] = torch.randn(case["q"].shape[0], 37, case["q"].shape[2]).to(case["q"].dtype)
    want_out, want_lse = run_kernel(cpu_mla.mla_sparse_attention_paged, case)
    for threads, heads_per_task, chunk_tasks in ((1, 16, False), (2, 32, False), (2, 37, False), (2, 37, True)):
        monkeypatch.setattr(cpu_attend, "threads_for", lambda work, n=threads: numba_threads(n))
        monkeypatch.setattr(cpu_attend, "heads_per_task", lambda total_q, kv_heads, group, threads, h=heads_per_task: h)
        monkeypatch.setattr(cpu_attend, "chunks_as_tasks", lambda total_q, kv_heads, threads, c=chunk_tasks: c)
        out, lse = run_kernel(cpu_mla.mla_sparse_attention_paged, case)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    offsets = case["offsets"].tolist()
    for b in range(len(offsets) - 1):  # each row alone, as a batch of one sequence (key chunks as tasks)
        for r in range(offsets[b], offsets[b + 1]):
            alone = dict(case, q=case["q"][r : r + 1], indices=case["indices"][r : r + 1],
                         counts=case["counts"][r : r + 1], table=case["table"][b : b + 1],
                         offsets=torch.tensor([0, 1], dtype=torch.int32))
            out, lse = run_kernel(cpu_mla.mla_sparse_attention_paged, alone)
            assert torch.equal(out[0], want_out[r]) and torch.equal(lse[0], want_lse[r])


def prefill_case(rng, dtype, heads):
    """Prefill chunks of two sequences (:func:`test_qsa_cases.prefill_selections`)."""
    rank, rope, width = 32, 8, rng.choice([9, 24])
    cached, rows = [rng.randrange(0, 30), rng.randrange(0, 30)], [rng.randrange(16, 34), rng.randrange(1, 24)]
    lengths = [c + n for c, n in zip(cached, rows)]
    _, blocks, table = latent_cache(rng, lengths, rank + rope, dtype, page_size=rng.choice([16, 5]))
    indices, counts = prefill_selections(rng, cached, rows, width)
    q = torch.randn(sum(rows), heads, rank + rope).to(dtype)
    return {"q": q, "blocks": blocks, "table": table, "indices": indices, "counts": counts,
            "offsets": torch.tensor([0, rows[0], sum(rows)], dtype=torch.int32), "layer": 1,
            "scale": (rank + rope) ** -0.5, "v_head_dim": rank}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_rows_sharing_a_tile_give_the_bits_of_rows_alone(dtype, monkeypatch):
    """Prefill rows of up to 8 heads packed into one tile over the union of their selections: the same bits
    as one row per task, and SPEC 4 against the reference."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for heads in (1, 3, 8):
        check_rows_sharing_a_tile(lambda case: run_kernel(cpu_mla.mla_sparse_attention_paged, case),
                                  lambda case: run_kernel(ref_mla.mla_sparse_attention_paged, case),
                                  prefill_case(rng, dtype, heads), heads, 16 // heads, monkeypatch)


def test_merged_selection():
    indices = torch.tensor([[0, 2, 5, -1], [1, 2, 6, 7], [3, 3, 4, 9], [4, 2, 8, 9]], dtype=torch.int32).numpy()
    counts = np.array([3, 4, 3, 4], np.int32)
    merged, selected = np.empty(8, np.int32), np.ones((8, 4), np.bool_)  # rows written are cleared first
    assert cpu_attend.merged_selection(indices, counts, 0, 2, 2, merged, selected) == 6
    assert merged[:6].tolist() == [0, 1, 2, 5, 6, 7]
    assert selected[:6, ::2].tolist() == [[1, 0], [0, 1], [1, 1], [1, 0], [0, 1], [0, 1]]
    assert (selected[:6, 1::2] == selected[:6, ::2]).all()  # both heads of a row
    for r0 in (1, 2):  # a repeated position, then positions out of order: no shared tile
        assert cpu_attend.merged_selection(indices, counts, r0, 2, 2, merged, np.zeros((8, 4), np.bool_)) == -1
    assert cpu_attend.merged_selection(indices, np.array([3, 0, 3, 4], np.int32), 0, 2, 2, merged, selected) == -1


# ---- against dense MLA in HF's expanded form ----------------------------------------

def mla_weights(gen, heads, rank, nope, v_dim):
    """Random ``kv_b_proj`` halves: ``w_uk [heads, nope, rank]``, ``w_uv [heads, v_dim, rank]`` (float64)."""
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64) * rank ** -0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen, dtype=torch.float64) * rank ** -0.5
    return w_uk, w_uv


def expanded_attention(q_nope, q_rope, latent, rope_keys, w_uk, w_uv, scale, mask):
    """HF's expanded MLA in float64: ``kv_b_proj`` on every cached row, then masked dense attention.

    ``q_nope [H, nope]``, ``q_rope [H, rope]``, ``latent [n, rank]``, ``rope_keys [n, rope]``, ``mask [n]``
    bool (the tokens attended). Returns ``[H, v_dim]``.
    """
    k_nope = torch.einsum("nc,hkc->hnk", latent, w_uk)  # [H, n, nope]
    values = torch.einsum("nc,hvc->hnv", latent, w_uv)  # [H, n, v_dim]
    keys = torch.cat([k_nope, rope_keys[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
    queries = torch.cat([q_nope, q_rope], dim=-1)[:, None, :]
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[None, None, :], scale=scale)[:, 0]


def absorbed_queries(q_nope, q_rope, w_uk):
    """``[q_nope @ W_uk, q_rope]`` per head: ``[T, H, rank + rope]`` float64."""
    return torch.cat([torch.einsum("thk,hkc->thc", q_nope, w_uk), q_rope], dim=-1)


@pytest.mark.parametrize("rope", [16, 0])
def test_equals_expanded_dense_mla_over_selected_tokens(rope):
    """Absorbed op + W_uv == kv_b_proj applied to every row, dense attention masked to the selection (fp32)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    heads, rank, nope, v_dim = 7, 64, 24, 20
    lengths, rows = [37, 90], [2, 1]
    cache_lengths = [n - r for n, r in zip(lengths, rows)]
    latent = [torch.randn(n, rank, generator=gen, dtype=torch.float64) for n in lengths]
    rope_keys = [torch.randn(n, rope, generator=gen, dtype=torch.float64) for n in lengths]
    histories = [torch.cat([c, k], dim=1)[:, None, :].float() for c, k in zip(latent, rope_keys)]
    blocks, table = build_paged_cache(histories, page_size=16, num_layers=2, layer=1, rng=rng)
    coll = make_collection(blocks, table, cache_lengths)
    w_uk, w_uv = mla_weights(gen, heads, rank, nope, v_dim)
    q_nope = torch.randn(3, heads, nope, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(3, heads, rope, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([0, 2, 3])
    seq_of_row = [0, 0, 1]
    positions = [35, 36, 89]
    budget = 29
    indices = torch.full((3, budget + 3), -1, dtype=torch.int32)
    counts = torch.zeros(3, dtype=torch.int32)
    for r, t in enumerate(positions):
        chosen = sorted(rng.sample(range(t + 1), budget))  # distinct, as an indexer's selection
        indices[r, :budget] = torch.tensor(chosen)
        counts[r] = budget
    scale = (nope + rope) ** -0.5
    q_lat = absorbed_queries(q_nope, q_rope, w_uk).float()
    o_lat = mla_sparse_attention_paged(q_lat, coll, 1, indices, counts, offsets, scale=scale, v_head_dim=rank)
    got = torch.einsum("thc,hvc->thv", o_lat.double(), w_uv)
    for r, t in enumerate(positions):
        b = seq_of_row[r]
        mask = torch.zeros(lengths[b], dtype=torch.bool)
        mask[indices[r, :budget].long()] = True
        want = expanded_attention(q_nope[r], q_rope[r], latent[b], rope_keys[b], w_uk, w_uv, scale, mask)
        assert_spec_close(got[r].float(), want.float(), what=f"row {r}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_equals_dense_causal_mla_when_everything_is_selected(dtype):
    """Every causal token selected: the op + W_uv is dense causal MLA (expanded form) of a prefill chunk."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    heads, rank, rope, nope, v_dim = 5, 64, 16, 16, 24
    cached, new = 19, 6
    total = cached + new
    latent = torch.randn(total, rank, generator=gen, dtype=torch.float64).to(dtype).double()
    rope_keys = torch.randn(total, rope, generator=gen, dtype=torch.float64).to(dtype).double()
    blocks, table = build_paged_cache([torch.cat([latent, rope_keys], dim=1)[:, None, :].to(dtype)], page_size=16,
                                      num_layers=1, layer=0, rng=rng)
    coll = make_collection(blocks, table, [cached])
    w_uk, w_uv = mla_weights(gen, heads, rank, nope, v_dim)
    q_nope = torch.randn(new, heads, nope, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(new, heads, rope, generator=gen, dtype=torch.float64)
    q_lat = absorbed_queries(q_nope, q_rope, w_uk).to(dtype)
    positions = torch.arange(cached, total)
    indices = torch.where(torch.arange(total)[None, :] <= positions[:, None], torch.arange(total)[None, :], -1)
    counts = positions + 1
    scale = (nope + rope) ** -0.5
    o_lat = mla_sparse_attention_paged(q_lat, coll, 0, indices, counts, torch.tensor([0, new]), scale=scale,
                                       v_head_dim=rank)
    got = torch.einsum("thc,hvc->thv", o_lat.double(), w_uv)
    # dense causal attention over the whole chunk at once (is_causal with the cached prefix)
    k_nope = torch.einsum("nc,hkc->hnk", latent, w_uk)
    keys = torch.cat([k_nope, rope_keys[None].expand(heads, -1, -1)], dim=-1)
    values = torch.einsum("nc,hvc->hnv", latent, w_uv)
    queries = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, new, nope + rope]
    causal = torch.arange(total)[None, :] <= positions[:, None]
    want = F.scaled_dot_product_attention(queries, keys, values, attn_mask=causal, scale=scale).transpose(0, 1)
    if dtype == torch.float32:
        assert_spec_close(got.float(), want.float(), what="out")
    else:  # the absorbed queries and the output are rounded to 16 bits
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_duplicates_count_twice_and_lse():
    rng = random.Random(5)
    histories, blocks, table = latent_cache(rng, [9], 24, torch.float32, page_size=4, num_layers=1, layer=0)
    coll = make_collection(blocks, table, [8])
    q = torch.randn(1, 3, 24)
    indices = torch.tensor([[1, 1, 8, -1, 10**6]])
    out, lse = mla_sparse_attention_paged(q, coll, 0, indices, torch.tensor([3]), torch.tensor([0, 1]), scale=0.4,
                                          v_head_dim=20, return_lse=True)
    rows = histories[0][[1, 1, 8], 0]  # the duplicate counts twice
    logits = q[0] @ rows.T * 0.4
    torch.testing.assert_close(out[0], torch.softmax(logits, dim=1) @ rows[:, :20])
    torch.testing.assert_close(lse[0], torch.logsumexp(logits, dim=1))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_no_query_rows(backend, monkeypatch):
    """A call with sequences but no rows in this call (all decode rows elsewhere) returns empty outputs."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    coll, q, _, _, _ = small_setup()
    out, lse = mla_sparse_attention_paged(q[:0], coll, 0, torch.zeros(0, 4, dtype=torch.int32),
                                          torch.zeros(0, dtype=torch.int32), torch.tensor([0, 0, 0]), scale=1.0,
                                          v_head_dim=10, return_lse=True)
    assert out.shape == (0, 3, 10) and lse.shape == (0, 3)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("page_gap", [0, 5])
def test_cache_without_pages_and_nothing_counted(backend, page_gap, monkeypatch):
    """A cache of no pages (packed, or a view whose page stride leaves gaps) and rows that count nothing: zero
    rows and ``-inf`` log-sum-exps, nothing read."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    blocks = torch.zeros(64).as_strided((0, 1, 1, 4, 1, 8), (32 + page_gap, 32, 32, 8, 8, 1))
    table = torch.full((1, 2), -1, dtype=torch.int32)
    coll = PagedKVCacheCollection(blocks, torch.tensor([0], dtype=torch.int32), table, max_seq_length=1,
                                  max_cache_length=0, page_stride=32 + page_gap if page_gap else -1)
    out, lse = mla_sparse_attention_paged(torch.randn(1, 16, 8), coll, 0, torch.zeros(1, 3, dtype=torch.int32),
                                          torch.zeros(1, dtype=torch.int32), torch.tensor([0, 1]), scale=0.5,
                                          v_head_dim=4, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 16, 4)) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("change", ["int64 indices", "int64 lookup_table", "int64 counts", "int64 offsets",
                                    "float64 out", "float64 lse"])
def test_cpu_backend_refuses_other_dtypes(change):
    """The CPU backend reads every tensor by address, so it takes only the dtypes it reads: anything else raises
    ``TypeError`` and writes nothing (the public op converts index tensors to int32 first)."""
    args = dict(q=torch.randn(1, 4, 16), blocks=torch.randn(4, 1, 1, 8, 1, 16),
                lookup_table=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
                indices=torch.tensor([[0, 5, 9, 20]], dtype=torch.int32), counts=torch.tensor([4], dtype=torch.int32),
                input_row_offsets=torch.tensor([0, 1], dtype=torch.int32), out=torch.full((1, 4, 8), 7.0),
                lse=torch.full((1, 4), 7.0))
    dtype, name = change.split(" ")
    key = {"offsets": "input_row_offsets"}.get(name, name)
    args[key] = args[key].to(getattr(torch, dtype))
    out, lse = args.pop("out"), args.pop("lse")
    before = out.clone()
    with pytest.raises(TypeError, match="sparse_attention: expected"):
        cpu_mla.mla_sparse_attention_paged(out, lse, layer=0, scale=0.25, **args)
    assert torch.equal(out, before) and bool((lse == 7.0).all())


# ---- out=, strides, errors --------------------------------------------------------

def small_setup():
    rng = random.Random(2)
    _, blocks, table = latent_cache(rng, [6, 9], 12, torch.float32, page_size=4, num_layers=1, layer=0)
    coll = make_collection(blocks, table, [5, 8])
    indices = torch.tensor([[0, 1, 5], [3, 8, 2]], dtype=torch.int32)
    return coll, torch.randn(2, 3, 12), indices, torch.tensor([3, 2]), torch.tensor([0, 1, 2])


def test_out_and_strided_q():
    coll, q, indices, counts, offsets = small_setup()
    want = mla_sparse_attention_paged(q, coll, 0, indices, counts, offsets, scale=0.3, v_head_dim=10)
    strided_q = torch.randn(2, 12, 5).transpose(1, 2)[:, :3]  # [2, 3, 12], non-contiguous
    strided_q.copy_(q)
    out = torch.full((2, 10, 3), float("nan")).transpose(1, 2)  # [2, 3, 10], non-contiguous
    got = mla_sparse_attention_paged(strided_q, coll, 0, indices, counts, offsets, scale=0.3, v_head_dim=10, out=out)
    assert got is out
    assert_spec_close(out, want, what="out=")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_raising_call_writes_nothing(backend, monkeypatch):
    """A missing page inside the held positions (found by the kernel) and a position past them (found by the op)."""
    monkeypatch.setenv("SPARSEKV_BACKEND", backend)
    coll, q, indices, counts, offsets = small_setup()
    table = coll.lookup_table.clone()
    table[1, 0] = -1  # positions 0..3 of sequence 1
    broken = make_collection(coll.blocks, table, [5, 8])
    out = torch.full((2, 3, 10), float("nan"))
    with pytest.raises(ValueError, match="row 1, entry 0 .* is position 3 of sequence 1: its page .* is the sentinel"):
        mla_sparse_attention_paged(q, broken, 0, indices, counts, offsets, scale=1.0, v_head_dim=10, out=out)
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="row 0, entry 2 holds position 7"):
        mla_sparse_attention_paged(q, coll, 0, torch.tensor([[0, 1, 7], [3, 4, 5]]), counts, offsets, scale=1.0,
                                   v_head_dim=10, out=out)
    assert torch.isnan(out).all()
    # entries past the counts are never read: the same broken table with row 1 reading only position 8
    mla_sparse_attention_paged(q, broken, 0, torch.tensor([[0, 1, 5], [8, 3, 2]]), torch.tensor([3, 1]), offsets,
                               scale=1.0, v_head_dim=10, out=out)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_kernel_errors_name_row_and_entry(backend):
    coll, q, _, _, offsets = small_setup()
    fn = (ref_mla if backend == "reference" else cpu_mla).mla_sparse_attention_paged
    out, lse = poisoned((2, 3, 10), torch.float32), poisoned((2, 3), torch.float32)
    indices = torch.tensor([[0, 1, 2], [3, -1, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1, entry 1"):
        fn(out, lse, q, coll.blocks, coll.lookup_table, indices, torch.tensor([3, 2], dtype=torch.int32),
           offsets.int(), 0, 1.0)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_every_public_error():
    coll, q, indices, counts, offsets = small_setup()

    def call(**changes):
        args = {"q": q, "kv_collection": coll, "layer_idx": 0, "indices": indices, "counts": counts,
                "input_row_offsets": offsets, "scale": 1.0, "v_head_dim": 10}
        args.update(changes)
        return mla_sparse_attention_paged(**args)

    kv_cache = make_collection(torch.zeros(4, 2, 1, 4, 1, 12), coll.lookup_table, [5, 8])
    two_heads = make_collection(torch.zeros(4, 1, 1, 4, 2, 6), coll.lookup_table, [5, 8])
    cases = [
        (TypeError, "kv_collection: expected a PagedKVCacheCollection, got Tensor", {"kv_collection": coll.blocks}),
        (ValueError, "layer_idx: expected < num_layers", {"layer_idx": 1}),
        (ValueError, "latent cache \\(KV == 1\\), got KV == 2", {"kv_collection": kv_cache}),
        (ValueError, "one head, got 2 heads", {"kv_collection": two_heads}),
        (TypeError, "scale: expected a float, got str", {"scale": "0.5"}),
        (ValueError, "scale: expected a finite float, got nan", {"scale": float("nan")}),
        (TypeError, "q: expected dtype", {"q": q.half()}),
        (ValueError, "q: expected a 3-d tensor", {"q": q[0]}),
        (ValueError, "q: head dim 11 differs from the latent cache's head_size 12", {"q": q[:, :, :11]}),
        (TypeError, "v_head_dim: expected an int, got float", {"v_head_dim": 10.0}),
        (ValueError, "v_head_dim: expected an int >= 1, got 0", {"v_head_dim": 0}),
        (ValueError, "v_head_dim: expected <= the latent width 12, got 13", {"v_head_dim": 13}),
        (ValueError, "out: expected shape", {"out": torch.empty(2, 3, 12)}),
        (TypeError, "out: expected dtype", {"out": torch.empty(2, 3, 10, dtype=torch.float64)}),
        (TypeError, "indices: expected dtype", {"indices": indices.float()}),
        (ValueError, "indices: expected 2 rows", {"indices": indices[:1]}),
        (ValueError, "counts: expected shape \\(2,\\)", {"counts": counts[:1]}),
        (ValueError, "input_row_offsets: expected shape \\(3,\\)", {"input_row_offsets": torch.tensor([0, 2])}),
        (ValueError, "input_row_offsets: expected the last offset to equal the 2 q rows, got 3",
         {"input_row_offsets": torch.tensor([0, 1, 3])}),
        (ValueError, "input_row_offsets: expected offsets\\[0\\] == 0, got 1",
         {"input_row_offsets": torch.tensor([1, 1, 2])}),
        (ValueError, "input_row_offsets: expected non-decreasing offsets",
         {"input_row_offsets": torch.tensor([0, 3, 2])}),
        (ValueError, "row 1, entry 1 holds position -1", {"indices": torch.tensor([[0, 1, 2], [3, -1, 5]])}),
        (ValueError, "row 0, entry 0 holds position 6, outside \\[0, 6\\)",
         {"indices": torch.tensor([[6, 1, 2], [3, 4, 5]])}),
        (ValueError, "counts: row 1 counts 4 entries but indices has 3 columns", {"counts": torch.tensor([3, 4])}),
        # the argument checks shared with every op, once each for this one
        (TypeError, "q: expected a torch.Tensor, got list", {"q": q.tolist()}),
        (ValueError, "q: expected a tensor on cpu, got one on meta", {"q": q.to("meta")}),
        (ValueError, "layer_idx: expected an int >= 0, got -1", {"layer_idx": -1}),
        (TypeError, "layer_idx: expected an int, got float", {"layer_idx": 0.0}),
        (TypeError, "out: expected a torch.Tensor, got list", {"out": [0.0]}),
        (ValueError, "out: expected a tensor on cpu, got one on meta", {"out": torch.empty(2, 3, 10, device="meta")}),
        (TypeError, "indices: expected a torch.Tensor, got list", {"indices": indices.tolist()}),
        (ValueError, "indices: expected a 2-d tensor", {"indices": indices[0]}),
        (ValueError, "indices: expected values that fit in int32 .* got 2147483648 at index \\[1, 2\\]",
         {"indices": torch.tensor([[0, 1, 2], [3, 4, 2**31]])}),
        (ValueError, "counts: expected a 1-d tensor", {"counts": counts[None]}),
        (TypeError, "counts: expected dtype", {"counts": counts.float()}),
        (ValueError, "input_row_offsets: expected a 1-d tensor", {"input_row_offsets": offsets[None]}),
        (TypeError, "input_row_offsets: expected dtype", {"input_row_offsets": offsets.float()}),
    ]
    for error, message, changes in cases:
        with pytest.raises(error, match=message):
            call(**changes)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        call(return_lse=1)


def test_custom_op_opcheck_and_fake():
    coll, q, indices, counts, offsets = small_setup()
    blocks = torch.nan_to_num(coll.blocks)  # opcheck compares outputs; keep spare pages finite
    args = (torch.zeros(2, 3, 10), torch.zeros(2, 3), q, blocks, coll.lookup_table, indices.int(), counts.int(),
            offsets.int(), 0, 0.5)
    torch.library.opcheck(torch.ops.sparsekv.mla_sparse_attention_paged.default, args,
                          test_utils=("test_schema", "test_faketensor"))

    def step(q_lat):
        return mla_sparse_attention_paged(q_lat, make_collection(blocks, coll.lookup_table, [5, 8]), 0, indices,
                                          counts, offsets, scale=0.5, v_head_dim=10, return_lse=True)

    got = torch.compile(step, backend="aot_eager")(q)
    want = step(q)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
