"""Model layers on paged caches: QSA attention (Qwen4Exp), the k-pool indexer (GLM-5-Next), MLA attention.

The oracles are written here from the SPEC and the layer docstrings (plain
dense PyTorch over whole sequences), not from the layer code.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv import (make_pooled_collection, mla_kpool_compress, plan_qsa_block_score_paged, qsa_select_tokens,
                      rope_freqs_cis)
from sparsekv.cache.manager import CacheGroupSpec, PagedKVCacheManager
from sparsekv.demo import seed_parameters
from sparsekv.layers import (Glm5NextConfig, Glm5NextIndexerSlice, GlmMoeDsaConfig, KPoolIndexerLayer, MlaSlice,
                             MlaSparseAttention, QSAAttention, Qwen4ExpConfig, RotaryTable, mla_cache_groups)
from sparsekv.layers import mla as mla_module
from sparsekv.layers.kpool import step_score_plan
from sparsekv.layers.qsa import every_causal_token

QWEN = Qwen4ExpConfig(hidden_size=48, num_hidden_layers=1, qsa_layers=(0,), num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, rope_theta=1e4,
                      indexer_n_heads=2, indexer_head_dim=16, indexer_compress_ratio=4, indexer_budget=8)
GLM = Glm5NextConfig(hidden_size=40, num_hidden_layers=1, index_layers=(0,), q_lora_rank=24, index_n_heads=3,
                     index_head_dim=12, index_topk=8, index_kpool=4)
PAGE = 8


def _qsa_layer(dtype: torch.dtype, seed: int) -> QSAAttention:
    layer = QSAAttention(QWEN, dtype=dtype)
    seed_parameters(layer, seed)
    return layer


def _qsa_manager(dtype: torch.dtype, *, blocks: bool = False, prefix_caching: bool = False) -> PagedKVCacheManager:
    groups = [CacheGroupSpec("main", 2, 1, QWEN.num_key_value_heads, QWEN.head_dim, dtype),
              CacheGroupSpec("index", 1, 1, 1, QWEN.indexer_head_dim, dtype)]
    if blocks:
        groups.append(CacheGroupSpec("index_blocks", 1, 1, 1, QWEN.indexer_head_dim, dtype,
                                     tokens_per_entry=QWEN.indexer_compress_ratio))
    return PagedKVCacheManager(groups, page_size=PAGE, num_pages=64, enable_prefix_caching=prefix_caching)


def _run_qsa(layer, manager, schedule, hidden_by_rid, mode="sparse", prompts=None):
    """Run ``schedule`` (a list of steps, each a list of (rid, n)) and return each request's outputs and results.

    With an ``"index_blocks"`` group in ``manager`` the layer keeps its block keys there. ``prompts`` (token ids
    per request) are claimed as prompts (prefix hits skip their cached rows) and committed as the tokens.
    ``mode``: one mode, or one per step."""
    tokens = prompts or {rid: [0] * len(hidden) for rid, hidden in hidden_by_rid.items()}
    done = {rid: manager.claim(rid, prompts[rid] if prompts else None) for rid in hidden_by_rid}
    outputs = {rid: [] for rid in hidden_by_rid}
    results = []
    for i, step in enumerate(schedule):
        for rid, n in step:
            manager.allocate(rid, n)
        batch = manager.prepare([rid for rid, _ in step], [n for _, n in step])
        hidden = torch.cat([hidden_by_rid[rid][done[rid]:done[rid] + n] for rid, n in step])
        block_cache = batch.collection("index_blocks") if "index_blocks" in batch.groups else None
        with torch.no_grad():
            result = layer(hidden, input_row_offsets=batch.input_row_offsets, kv_cache=batch.collection("main"),
                           index_cache=batch.collection("index"), cache_layer=0,
                           mode=mode if isinstance(mode, str) else mode[i], block_cache=block_cache)
        offsets = batch.input_row_offsets.tolist()
        for b, (rid, n) in enumerate(step):
            outputs[rid].append(result.output[offsets[b]:offsets[b + 1]])
            manager.step(rid, tokens[rid][done[rid]:done[rid] + n])
            done[rid] += n
        results.append(result)
    return {rid: torch.cat(chunks) for rid, chunks in outputs.items()}, results


def test_qsa_layer_with_a_step_score_plan_equals_it_without_and_refuses_another_caches_rows_or_scale():
    layer = _qsa_layer(torch.float32, 3)
    manager = _qsa_manager(torch.float32, blocks=True)
    manager.claim("r")
    manager.allocate("r", 37)
    batch = manager.prepare(["r"], [37])
    hidden = torch.randn(37, QWEN.hidden_size, generator=torch.Generator().manual_seed(5))
    call = dict(input_row_offsets=batch.input_row_offsets, kv_cache=batch.collection("main"),
                index_cache=batch.collection("index"), cache_layer=0, block_cache=batch.collection("index_blocks"))
    positions = torch.arange(37, dtype=torch.int32)
    with torch.no_grad():
        plain = layer(hidden, **call)
        plan = layer.indexer.step_score_plan(call["index_cache"], call["block_cache"], positions,
                                             batch.input_row_offsets)
        planned = layer(hidden, **call, score_plan=plan)
        assert torch.equal(planned.indices, plain.indices) and torch.equal(planned.output, plain.output)
        other = layer.indexer.step_score_plan(call["index_cache"], call["index_cache"], positions,
                                              batch.input_row_offsets)
        with pytest.raises(ValueError, match="score_plan: expected a plan over block_cache, got one over another"):
            layer(hidden, **call, score_plan=other)
        other_rows = layer.indexer.step_score_plan(call["index_cache"], call["block_cache"], positions.flip(0),
                                                   batch.input_row_offsets)
        with pytest.raises(ValueError, match="score_plan: expected a plan of these query rows"):
            layer(hidden, **call, score_plan=other_rows)
        other_scale = plan_qsa_block_score_paged(call["block_cache"], positions, batch.input_row_offsets,
                                                 ratio=plan.ratio, score_scale=1.0, out_cols=plan.out_cols)
        with pytest.raises(ValueError, match=r"score_plan: expected ratio 4 and score_scale .* got 4 and 1.0"):
            layer(hidden, **call, score_plan=other_scale)


def _reference_dense_layer(layer: QSAAttention, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's documented math over one whole sequence, fp32, full causal attention."""
    cfg = layer.config
    heads, kv_heads, dim, rot = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    w = {k: v.float() for k, v in layer.state_dict().items()}
    x = hidden.float()
    tokens = x.shape[0]
    q_and_gate = (x @ w["q_proj.weight"].T).reshape(tokens, heads, 2 * dim)
    q, gate = q_and_gate[..., :dim], q_and_gate[..., dim:]
    k = (x @ w["k_proj.weight"].T).reshape(tokens, kv_heads, dim)
    v = (x @ w["v_proj.weight"].T).reshape(tokens, kv_heads, dim)

    def norm(t, weight):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1 + weight)

    def rope(t):
        half = rot // 2
        inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
        ang = torch.arange(tokens, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
        lo, hi = t[..., :half], t[..., half:rot]
        return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin, t[..., rot:]], dim=-1)

    q, k = rope(norm(q, w["q_norm.weight"])), rope(norm(k, w["k_norm.weight"]))
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dim)
    logits = logits.masked_fill(torch.ones(tokens, tokens).triu(1).bool()[None], float("-inf"))
    attended = torch.einsum("hts,shd->thd", logits.softmax(-1), v) * torch.sigmoid(gate)
    return attended.reshape(tokens, heads * dim) @ w["o_proj.weight"].T


def test_qsa_layer_dense_mode_matches_reference_math():
    layer = _qsa_layer(torch.float32, seed=3)
    hidden = torch.randn(21, QWEN.hidden_size, generator=torch.Generator().manual_seed(5))
    outputs, _ = _run_qsa(layer, _qsa_manager(torch.float32), [[("a", 9)], [("a", 12)]], {"a": hidden}, mode="dense")
    expected = _reference_dense_layer(layer, hidden)
    torch.testing.assert_close(outputs["a"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qsa_sparse_equals_dense_under_the_budget(dtype):
    layer = _qsa_layer(dtype, seed=11)
    hidden = torch.randn(37, QWEN.hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
    schedule = [[("a", 13)], [("a", 1)], [("a", 23)]]
    sparse, results = _run_qsa(layer, _qsa_manager(dtype), schedule, {"a": hidden}, mode="sparse")
    dense, _ = _run_qsa(layer, _qsa_manager(dtype), schedule, {"a": hidden}, mode="dense")
    window = QWEN.indexer_budget + QWEN.indexer_compress_ratio - 1  # 11 tokens: every causal token selected
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(sparse["a"][:window].float(), dense["a"][:window].float(), **tol)
    # Past the window the selection drops tokens, so outputs must differ somewhere.
    assert (sparse["a"][window:].float() - dense["a"][window:].float()).abs().max() > 1e-2
    counts = torch.cat([r.counts for r in results])
    positions = torch.arange(37)
    expected_counts = torch.where(positions + 1 <= window, positions + 1,
                                  QWEN.indexer_budget + (positions + 1) % QWEN.indexer_compress_ratio)
    assert torch.equal(counts.long(), expected_counts)


def test_qsa_outputs_do_not_depend_on_the_schedule():
    layer = _qsa_layer(torch.float32, seed=2)
    gen = torch.Generator().manual_seed(9)
    hidden = {"a": torch.randn(30, QWEN.hidden_size, generator=gen), "b": torch.randn(17, QWEN.hidden_size,
                                                                                        generator=gen)}
    one_shot, _ = _run_qsa(layer, _qsa_manager(torch.float32), [[("a", 30), ("b", 17)]], hidden)
    # chunks that end mid-block, a first call with no complete block (b: 3 tokens), decode-sized steps
    mixed = [[("a", 7)], [("a", 1), ("b", 3)], [("b", 5), ("a", 13)], [("a", 9), ("b", 1)], [("b", 8)]]
    chunked, _ = _run_qsa(layer, _qsa_manager(torch.float32), mixed, hidden)
    for rid in hidden:
        torch.testing.assert_close(chunked[rid], one_shot[rid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qsa_block_cache_gives_the_same_bits(dtype):
    """A layer keeping its block keys in a block-key cache (pooled once, in the call that completes them)
    returns what the layer pooling every block on every call returns, bit for bit: chunks ending mid-block,
    a dense call in between, decode steps, two sequences at different lengths."""
    layer = _qsa_layer(dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    hidden = {"a": torch.randn(42, QWEN.hidden_size, generator=gen).to(dtype),
              "b": torch.randn(30, QWEN.hidden_size, generator=gen).to(dtype)}
    schedule = [[("a", 7)], [("a", 6), ("b", 3)], [("b", 14), ("a", 13)], [("a", 1), ("b", 1)],
                [("a", 1), ("b", 1)], [("a", 9), ("b", 11)], [("a", 1)], [("a", 4)]]
    modes = ["sparse", "sparse", "dense", "sparse", "sparse", "sparse", "sparse", "sparse"]
    plain, plain_results = _run_qsa(layer, _qsa_manager(dtype), schedule, hidden, mode=modes)
    cached, cached_results = _run_qsa(layer, _qsa_manager(dtype, blocks=True), schedule, hidden, mode=modes)
    for rid in hidden:
        assert torch.equal(cached[rid], plain[rid]), rid
    for with_cache, without in zip(cached_results, plain_results):
        if without.indices is not None:
            assert torch.equal(with_cache.indices, without.indices)
    assert any(r.indices is not None and (r.counts > QWEN.indexer_budget).any() for r in plain_results[3:])


def test_qsa_block_cache_serves_a_prefix_hit():
    """A second request whose prompt shares full pages with the first reads the first one's block keys from the
    shared pages: its outputs equal, bit for bit, those of the same two requests without a block cache."""
    layer = _qsa_layer(torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    shared = torch.randn(24, QWEN.hidden_size, generator=gen)
    hidden = {"a": torch.cat([shared, torch.randn(3, QWEN.hidden_size, generator=gen)]),
              "b": torch.cat([shared, torch.randn(5, QWEN.hidden_size, generator=gen)])}
    prompts = {"a": list(range(1, 28)), "b": list(range(1, 25)) + [90, 91, 92, 93, 94]}
    outputs = {}
    for blocks in (False, True):
        manager = _qsa_manager(torch.float32, blocks=blocks, prefix_caching=True)
        _run_qsa(layer, manager, [[("a", 27)]], {"a": hidden["a"]}, prompts={"a": prompts["a"]})
        outputs[blocks], results = _run_qsa(layer, manager, [[("b", 5)]], {"b": hidden["b"]},
                                            prompts={"b": prompts["b"]})
        assert manager.cache_length("b") == 29 and results[0].positions.tolist() == [24, 25, 26, 27, 28]
        assert (results[0].counts < results[0].positions + 1).all()  # a selection: the blocks were scored
    assert torch.equal(outputs[True]["b"], outputs[False]["b"])


def test_qsa_layer_rejects_unknown_mode():
    layer = _qsa_layer(torch.float32, seed=0)
    manager = _qsa_manager(torch.float32)
    manager.claim("a")
    manager.allocate("a", 2)
    batch = manager.prepare(["a"], [2])
    with pytest.raises(ValueError, match="mode"):
        layer(torch.zeros(2, QWEN.hidden_size), input_row_offsets=batch.input_row_offsets,
              kv_cache=batch.collection("main"), index_cache=batch.collection("index"), cache_layer=0, mode="full")


# ---------------------------------------------------------------------------
# k-pool indexer
# ---------------------------------------------------------------------------
def _kpool_run(layer: KPoolIndexerLayer, hidden: torch.Tensor, chunks: list[int], dtype: torch.dtype):
    manager = PagedKVCacheManager([CacheGroupSpec("pooled", 1, 1, 1, GLM.index_head_dim, dtype,
                                                  tokens_per_entry=GLM.index_kpool)],
                                  page_size=PAGE, num_pages=32, enable_prefix_caching=False)
    ring = layer.indexer.new_ring(3)
    manager.claim("r")
    done, results = 0, []
    for n in chunks:
        manager.allocate("r", n)
        batch = manager.prepare(["r"], [n])
        with torch.no_grad():
            results.append(layer(hidden[done:done + n], input_row_offsets=batch.input_row_offsets,
                                 cache_lengths=batch.cache_lengths, ring=ring, slot_ids=torch.tensor([2]),
                                 pooled_cache=batch.collection("pooled"), cache_layer=0))
        manager.step("r", [0] * n)
        done += n
    pools = done // GLM.index_kpool
    stored = manager.prepare(["r"], [0]).collection("pooled").get_key_cache(0).load(0, torch.arange(pools))[:, 0]
    return stored, results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kpool_pooled_keys_do_not_depend_on_the_schedule(dtype):
    layer = KPoolIndexerLayer(GLM, dtype=dtype)
    seed_parameters(layer, 4)
    hidden = torch.randn(43, GLM.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    one_shot, _ = _kpool_run(layer, hidden, [43], dtype)
    chunked, results = _kpool_run(layer, hidden, [5, 3, 1, 1, 9, 2, 22], dtype)
    assert one_shot.shape == chunked.shape == (10, GLM.index_head_dim)
    # Given the same key/gate rows, pooling through the ring is bit-identical to one compress (SPEC 3.2) ...
    keys = torch.cat([r.keys for r in results])
    gates = torch.cat([r.gates for r in results])
    expected = mla_kpool_compress(keys, gates, layer.indexer.ape, torch.tensor([0, 43]), None, torch.tensor([0]),
                                  kpool=GLM.index_kpool)
    assert torch.equal(chunked, expected)
    # ... while the projections of differently sized batches may round differently.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(chunked.float(), one_shot.float(), **tol)


def test_kpool_selection_matches_dense_oracle():
    layer = KPoolIndexerLayer(GLM, dtype=torch.float32)
    seed_parameters(layer, 8)
    hidden = torch.randn(29, GLM.hidden_size, generator=torch.Generator().manual_seed(2))
    stored, (result,) = _kpool_run(layer, hidden, [29], torch.float32)
    w = {k: v.float() for k, v in layer.state_dict().items()}
    kpool, heads, dim = GLM.index_kpool, GLM.index_n_heads, GLM.index_head_dim
    # Projections (DeepSeek-V3.2 style names) and the documented head-weight scale.
    x = hidden
    latent = x @ w["q_a_proj.weight"].T
    latent = latent / torch.sqrt(latent.pow(2).mean(-1, keepdim=True) + GLM.rms_norm_eps) * w["q_a_layernorm.weight"]
    q = (latent @ w["indexer.wq_b.weight"].T).reshape(-1, heads, dim)
    keys = torch.nn.functional.layer_norm(x @ w["indexer.wk.weight"].T, (dim,), w["indexer.k_norm.weight"],
                                          w["indexer.k_norm.bias"], 1e-6)
    gates = x @ w["indexer.index_kpool_compress_gate"].T
    head_weights = (x @ w["indexer.weights_proj.weight"].T) * heads ** -0.5 * dim ** -0.5
    torch.testing.assert_close(result.head_weights, head_weights, rtol=1e-5, atol=1e-6)
    # Pools: per-channel softmax of gate + ape over each pool's members (SPEC 3.1).
    members = keys[: (29 // kpool) * kpool].reshape(-1, kpool, dim)
    logits = gates[: (29 // kpool) * kpool].reshape(-1, kpool, dim) + w["indexer.index_kpool_compress_ape"][None]
    pooled = (logits.softmax(dim=1) * members).sum(dim=1)
    torch.testing.assert_close(stored, pooled, rtol=1e-5, atol=1e-6)
    # Scores and top-k expansion (SPEC 3.3).
    for t in range(29):
        visible = (t + 1) // kpool
        scores = (head_weights[t][:, None] * (q[t] @ pooled[:visible].T).clamp_min(0)).sum(0)
        keep = GLM.index_topk // kpool
        chosen = torch.arange(visible) if visible <= keep else torch.sort(torch.topk(scores, keep).indices).values
        tail = torch.arange(t + 1 - (t + 1) % kpool, t + 1)
        expected = torch.cat([(chosen[:, None] * kpool + torch.arange(kpool)).reshape(-1), tail])
        count = int(result.counts[t])
        assert result.indices[t, :count].tolist() == expected.tolist(), f"row {t}"
        assert bool((result.indices[t, count:] == -1).all())


def test_kpool_ape_stays_float32_in_a_bf16_model():
    slice_ = Glm5NextIndexerSlice(GLM, 16, dtype=torch.bfloat16)
    assert slice_.layers[0].indexer.index_kpool_compress_ape.dtype == torch.float32
    assert slice_.layers[0].indexer.wk.weight.dtype == torch.bfloat16


def test_kpool_indexer_refuses_a_score_plan_of_another_cache_rows_or_pool_size():
    indexer = Glm5NextIndexerSlice(GLM, 16).layers[0].indexer
    blocks = torch.zeros(2, 1, 1, PAGE // GLM.index_kpool, 1, GLM.index_head_dim)
    cache = make_pooled_collection(blocks, torch.tensor([5]), torch.tensor([[0]], dtype=torch.int32), kpool=4)
    other = make_pooled_collection(blocks, torch.tensor([5]), torch.tensor([[1]], dtype=torch.int32), kpool=4)
    offsets, lengths = torch.tensor([0, 1]), torch.tensor([4])
    call = dict(input_row_offsets=offsets, cache_lengths=lengths, ring=None, slot_ids=None, pooled_cache=cache,
                cache_layer=0)
    hidden, latent = torch.zeros(1, GLM.hidden_size), torch.zeros(1, GLM.q_lora_rank)
    with pytest.raises(ValueError, match="score_plan: expected a plan over pooled_cache, got one over another"):
        indexer(hidden, latent, **call, score_plan=step_score_plan(other, offsets, lengths, 4))
    with pytest.raises(ValueError, match=r"score_plan: expected kpool 4 \(the indexer's\), got 2"):
        indexer(hidden, latent, **call, score_plan=step_score_plan(cache, offsets, lengths, 2))
    earlier_step = step_score_plan(cache, offsets, lengths - 1, 4)  # its row one position back
    with pytest.raises(ValueError, match="score_plan: expected a plan of these query rows"):
        indexer(hidden, latent, **call, score_plan=earlier_step)


# ---------------------------------------------------------------------------
# MLA sparse attention (GLM-5 shapes, tiny)
# ---------------------------------------------------------------------------
DSA = GlmMoeDsaConfig(hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      q_lora_rank=24, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                      index_n_heads=4, index_head_dim=16, index_topk=9, indexer_types=("full", "shared"))


def _mla_run(slice_: MlaSlice, tokens: torch.Tensor, chunks: list[int], mode: str):
    manager = PagedKVCacheManager(mla_cache_groups(DSA, torch.float32), page_size=PAGE, num_pages=16,
                                  enable_prefix_caching=False)
    manager.claim("r")
    done, outputs, results = 0, [], []
    for n in chunks:
        manager.allocate("r", n)
        batch = manager.prepare(["r"], [n])
        with torch.no_grad():
            hidden, per_layer = slice_(tokens[done:done + n], input_row_offsets=batch.input_row_offsets,
                                       latent_cache=batch.collection("latent"), index_cache=batch.collection("indexer"),
                                       mode=mode)
        manager.step("r", [0] * n)
        outputs.append(hidden)
        results.append(per_layer)
        done += n
    return torch.cat(outputs), results


def test_mla_absorbed_equals_expanded_and_shared_layers_reuse_the_selection():
    slice_ = MlaSlice(DSA, 50)
    seed_parameters(slice_, 6)
    assert slice_.attentions[1].indexer is None
    tokens = torch.randint(0, 50, (29,), generator=torch.Generator().manual_seed(4))
    absorbed, results = _mla_run(slice_, tokens, [7, 11, 1, 1, 9], "absorbed")
    for chunks in ([29], [7, 11, 1, 1, 9]):
        for mode in ("expanded", "auto"):
            torch.testing.assert_close(_mla_run(slice_, tokens, chunks, mode)[0], absorbed, rtol=1e-5, atol=1e-5)
    for per_layer in results:
        assert torch.equal(per_layer[1].indices, per_layer[0].indices)
    counts = torch.cat([r[0].counts for r in results])
    assert counts.tolist() == [min(t + 1, 9) for t in range(29)]  # kpool 1: topk tokens, no tail


def test_mla_forms_agree_on_a_ragged_batch_with_idle_sequences():
    """Three requests, each call giving rows to some of them only: expanded (a temporary page table with
    no page for an idle sequence) and auto equal absorbed."""
    slice_ = MlaSlice(DSA, 50)
    seed_parameters(slice_, 6)

    def run(mode):
        manager = PagedKVCacheManager(mla_cache_groups(DSA, torch.float32), page_size=PAGE, num_pages=32,
                                      enable_prefix_caching=False)
        for rid in "abc":
            manager.claim(rid)
        tokens, outputs = torch.Generator().manual_seed(1), []
        for lengths in ([7, 0, 5], [0, 9, 3], [4, 2, 0]):
            for rid, n in zip("abc", lengths):
                if n:
                    manager.allocate(rid, n)
            batch = manager.prepare(list("abc"), lengths)
            with torch.no_grad():
                hidden, _ = slice_(torch.randint(0, 50, (sum(lengths),), generator=tokens),
                                   input_row_offsets=batch.input_row_offsets, latent_cache=batch.collection("latent"),
                                   index_cache=batch.collection("indexer"), mode=mode)
            for rid, n in zip("abc", lengths):
                if n:
                    manager.step(rid, [0] * n)
            outputs.append(hidden)
        return torch.cat(outputs)

    absorbed = run("absorbed")
    for mode in ("expanded", "auto"):
        torch.testing.assert_close(run(mode), absorbed, rtol=1e-5, atol=1e-5)


def test_mla_auto_form_follows_the_multiply_adds_and_the_memory_cap(monkeypatch):
    """A prefill selecting much of a short history runs expanded; a decode step, expanded keys and values past
    EXPANDED_MAX_BYTES, or neighbouring rows that select different keys (a wide union per tile) run absorbed."""
    layer = MlaSparseAttention(DSA, 0)
    causal = torch.arange(9)[None, :].expand(29, 9).clone()
    form = layer.attention_form(causal, torch.arange(1, 30).clamp(max=9), torch.tensor([0, 29]), torch.tensor([0]))
    decode = layer.attention_form(causal[:2], torch.full((2,), 9), torch.tensor([0, 1, 2]), torch.tensor([600, 40]))
    assert (form, decode) == ("expanded", "absorbed")
    shared, spread = torch.arange(9)[None, :].expand(64, 9), (torch.arange(64)[:, None] + torch.arange(9)[None]) % 64
    counts, offsets = torch.full((64,), 9), torch.tensor([0, 64])
    assert mla_module.selection_spread(shared, counts, offsets, 32) == 1.0
    assert mla_module.selection_spread(spread, counts, offsets, 32) == 40 * 32 / (32 * 9)  # 40 distinct keys
    assert layer.attention_form(shared, counts, offsets, torch.tensor([0])) == "expanded"
    assert layer.attention_form(spread, counts, offsets, torch.tensor([0])) == "absorbed"
    monkeypatch.setattr(mla_module, "EXPANDED_MAX_BYTES", 64 * 4 * 2 * 20 * 4 - 1)  # one page of 64 tokens, less 1
    assert layer.attention_form(shared, counts, offsets, torch.tensor([0])) == "absorbed"


def test_mla_layer_errors():
    layer = MlaSparseAttention(DSA, 1)  # a shared layer
    manager = PagedKVCacheManager(mla_cache_groups(DSA, torch.float32), page_size=PAGE, num_pages=4)
    manager.claim("r")
    manager.allocate("r", 2)
    batch = manager.prepare(["r"], [2])
    kwargs = dict(input_row_offsets=batch.input_row_offsets, latent_cache=batch.collection("latent"), cache_layer=1)
    with pytest.raises(ValueError, match="shared indexer layer"):
        layer(torch.zeros(2, 40), **kwargs)
    with pytest.raises(ValueError, match="mode"):
        layer(torch.zeros(2, 40), mode="dense", **kwargs)
    with pytest.raises(ValueError, match="index_cache"):
        MlaSparseAttention(DSA, 0)(torch.zeros(2, 40), **kwargs)
    with pytest.raises(ValueError, match="layer_id"):
        MlaSparseAttention(GLM, 1)
    indexer = KPoolIndexerLayer(GLM)
    with pytest.raises(ValueError, match="ring"):
        indexer(torch.zeros(2, GLM.hidden_size), input_row_offsets=batch.input_row_offsets,
                cache_lengths=batch.cache_lengths, ring=None, slot_ids=None, pooled_cache=None, cache_layer=0)


def test_weights_proj_dtype_follows_hf_loading():
    # HF keeps indexer.weights_proj float32 in float16 models of the kpool = 1 families only
    assert MlaSparseAttention(DSA, 0, dtype=torch.float16).indexer.weights_proj.weight.dtype == torch.float32
    assert MlaSparseAttention(DSA, 0, dtype=torch.bfloat16).indexer.weights_proj.weight.dtype == torch.bfloat16
    assert KPoolIndexerLayer(GLM, dtype=torch.float16).indexer.weights_proj.weight.dtype == torch.float16


def test_rotary_table_grows_past_the_positions_asked_for():
    """A prompt of exactly 2**n tokens must not make the next decode step rebuild the table."""
    rotary = RotaryTable(8, theta=1e4)
    first = rotary.table(2048)
    assert first.shape[0] > 2048
    assert rotary.table(2049) is first
    assert torch.equal(first, rope_freqs_cis(first.shape[0], 8, 1e4))
    given = RotaryTable(8, rows=lambda n: torch.ones(n, 8))
    assert given.theta is None and torch.equal(given.table(5), torch.ones(1024, 8))
    for theta, rows in ((None, None), (1e4, lambda n: torch.ones(n, 8))):
        with pytest.raises(ValueError, match="exactly one of theta and rows"):
            RotaryTable(8, theta, rows=rows)


@pytest.mark.parametrize(("budget", "ratio"), [(8, 4), (2048, 4), (12, 3)])
def test_short_histories_select_every_causal_token_without_scoring(budget, ratio, seed):
    """Rows that see at most budget + R - 1 tokens: the layer's direct selection is what
    qsa_select_tokens returns for any scores (SPEC 2.4), so compress and score can be skipped."""
    width = budget + ratio - 1
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 5, width]
    positions = torch.cat([torch.randint(0, n, (3,), generator=gen) for n in lengths]).to(torch.int32)
    offsets = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    scores = torch.randn(9, width // ratio + 2, generator=gen)
    want = qsa_select_tokens(scores, positions, offsets, ratio=ratio, budget=budget)
    got = every_causal_token(positions, width)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
