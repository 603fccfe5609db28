"""Hugging Face transformers integration of the MLA + DSA families against the unpatched models.

The oracle is Hugging Face's own model code (its dense-mask DSA attention and
indexers), run on the same checkpoint without the patch. Each tiny model
(float32, seeded by ``hf_parity.seed_hf_model``, saved with
``save_pretrained`` and loaded back) has small top-k budgets (GLM-5-Next: 8
tokens in pools of 4 plus the open tail; GLM-5 / DeepSeek-V3.2: 6 tokens), so
prompts of 21 and 13 tokens generating 24 more prune most of the history.

Exact score ties, which Hugging Face's ``topk`` breaks in no fixed order while
sparsekv takes the lower position, do not occur with these seeds and shapes:
``seed_hf_model`` makes the indexer head weights positive, so a score ties only
when every one of the eight heads' ReLU is zero. That is rare, not impossible
(the GLM-5 text-model test with decode tokens seeded 5 meets one, and its
hidden states then differ at that step), so :func:`record_boundary_gaps`
checks that every top-k boundary the tests cross is strict.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_parity import NEW_TOKENS, generate, left_padded_batch, prefill_and_decode, run_on_triton  # noqa: E402
from hf_parity import assert_outputs_close, seed_hf_model  # noqa: E402
from hf_parity import one_torch_thread  # noqa: E402, F401  (a fixture, used through pytestmark)

from sparsekv.integrations.transformers import (  # noqa: E402
    UnsupportedFeatureError,
    end_generation,
    get_manager,
    patch_model,
    unpatch_model,
)

VOCAB = 64
PAGE = 8
MLA = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
           kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, index_n_heads=8, index_head_dim=8,
           intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
           pad_token_id=None, bos_token_id=None, eos_token_id=None)
FAMILIES = ("glm5_next", "glm_moe_dsa", "deepseek_v32")
SEEDS = {"glm5_next": 11, "glm_moe_dsa": 12, "deepseek_v32": 13}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def glm5_next_text_config() -> transformers.Glm5NextTextConfig:
    """Layers: full indexer, shared (reuses layer 0's selection), linear attention; one MoE layer."""
    return transformers.Glm5NextTextConfig(
        **MLA, num_hidden_layers=3, layer_types=["indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense"], index_topk=8,
        index_kpool=4, index_kpool_always_select_tail=True, linear_head_dim=8, linear_num_heads=2, hc_mult=2)


def build_model(family: str):
    if family == "glm5_next":
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                      projection_intermediate_size=16, patch_size=2, image_size=8)
        config = transformers.Glm5NextConfig(text_config=glm5_next_text_config().to_dict(), vision_config=vision)
        model = transformers.Glm5NextForConditionalGeneration(config)
    elif family == "glm_moe_dsa":
        config = transformers.GlmMoeDsaConfig(**MLA, num_hidden_layers=3, qk_rope_head_dim=4, index_topk=6,
                                              first_k_dense_replace=2, indexer_types=["full", "shared", "full"])
        model = transformers.GlmMoeDsaForCausalLM(config)
    else:
        config = transformers.DeepseekV32Config(**MLA, num_hidden_layers=2, qk_rope_head_dim=4, index_topk=6,
                                                first_k_dense_replace=1, n_group=1, topk_group=1)
        model = transformers.DeepseekV32ForCausalLM(config)
    seed_hf_model(model, seed=SEEDS[family])
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        paths[family] = tmp_path_factory.mktemp(family)
        build_model(family).save_pretrained(paths[family])
    return paths


def load(path, family: str, text_only: bool = False):
    cls = {"glm5_next": transformers.Glm5NextForConditionalGeneration,
           "glm_moe_dsa": transformers.GlmMoeDsaForCausalLM,
           "deepseek_v32": transformers.DeepseekV32ForCausalLM}[family]
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation("eager")
    if not text_only:
        return model
    return model.model.language_model if family == "glm5_next" else model.model


def assert_no_pages(model) -> None:
    manager = get_manager(model)
    manager.check_invariants()
    assert manager.num_requests == 0
    metrics = manager.metrics().groups
    assert metrics["latent"].pages_used == 0 and metrics["indexer"].pages_used == 0


def record_boundary_gaps(adapter) -> list[float]:
    """Hook every sparsekv indexer: per pruning query row, the relative gap between last kept and first dropped pool."""
    gaps: list[float] = []

    def hook(indexer, _inputs, result):
        scores = result.scores.float()
        for row in scores:
            finite = row[torch.isfinite(row) & (row > torch.finfo(torch.float32).min)].sort(descending=True).values
            k = indexer.topk // indexer.kpool
            if finite.numel() > k:
                gaps.append(float(finite[k - 1] - finite[k]) / max(abs(float(finite[k - 1])), 1e-30))

    for layer in adapter.layers:
        if layer.indexer is not None:
            layer.indexer.register_forward_hook(hook)
    return gaps


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_hf_and_frees_pages(checkpoints, family):
    ids, mask = left_padded_batch(SEEDS[family], VOCAB)
    with torch.no_grad():
        ref = generate(load(checkpoints[family], family), ids, mask)
    ref_logits = torch.stack(ref.logits, dim=1)
    model = load(checkpoints[family], family)
    attention = next(layer.self_attn for layer in model.modules() if hasattr(layer, "self_attn"))
    patch_model(model, page_size=PAGE, num_pages=24)
    adapter = model._sparsekv_patch.adapter
    gaps = record_boundary_gaps(adapter)
    assert adapter.layers[0].kv_b_proj is attention.kv_b_proj  # the HF module itself, not a copy
    assert adapter.layers[0].indexer.wk is attention.indexer.wk
    for _ in range(2):  # two generations in a row: the second starts from a clean manager
        adapter.reset_read_counts()
        out = generate(model, ids, mask)
        assert torch.equal(out.sequences, ref.sequences)
        logits = torch.stack(out.logits, dim=1)
        assert logits.shape == ref_logits.shape == (2, NEW_TOKENS, VOCAB)
        assert (logits - ref_logits).abs().max().item() <= 2e-3
        assert_no_pages(model)
        # the budgets prune: the patched layers read well under what dense causal attention would
        assert 0 < int(adapter.tokens_read) < 0.7 * int(adapter.tokens_causal)
    assert len(gaps) > 50 and min(gaps) > 1e-5  # selections really prune, and never at a tied boundary
    unpatch_model(model)
    assert "forward" not in attention.__dict__


@pytest.mark.triton
def test_generate_matches_hf_on_the_triton_backend(checkpoints, monkeypatch):
    """GLM-5-Next (k-pool indexer, sparse MLA) on the kernels a GPU runs (Triton's interpreter here)."""
    family = "glm5_next"
    ids, mask = left_padded_batch(SEEDS[family], VOCAB)
    with torch.no_grad():
        ref = generate(load(checkpoints[family], family), ids, mask)
    ran = run_on_triton(monkeypatch)
    model = patch_model(load(checkpoints[family], family), page_size=PAGE, num_pages=24)
    out = generate(model, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert (torch.stack(out.logits, dim=1) - torch.stack(ref.logits, dim=1)).abs().max().item() <= 2e-3
    assert_no_pages(model)
    assert ran >= {("triton", op) for op in ("paged_store", "mla_kpool_compress", "mla_kpool_score",
                                             "mla_sparse_attention_paged")}, sorted(ran)


@pytest.mark.parametrize("family", ["glm5_next", "glm_moe_dsa"])
def test_text_model_prefill_and_decode_match_hf(checkpoints, family):
    """The bare text model: prefill, then 7 decode steps (GLM-5-Next: crossing two k-pool boundaries)."""
    ids, mask = left_padded_batch(SEEDS[family] + 1, VOCAB)
    steps = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    expected, _ = prefill_and_decode(load(checkpoints[family], family, text_only=True), ids, mask, steps)
    model = patch_model(load(checkpoints[family], family, text_only=True), page_size=PAGE, num_pages=24)
    gaps = record_boundary_gaps(model._sparsekv_patch.adapter)
    got, cache = prefill_and_decode(model, ids, mask, steps)
    assert len(gaps) > 20 and min(gaps) > 1e-5  # no tied top-k boundary (decode steps seed 5 has one)
    assert_outputs_close(got, expected, mask)
    end_generation(cache)
    assert_no_pages(model)


def test_unsupported_features_raise(checkpoints):
    ids, mask = left_padded_batch(3, VOCAB)
    model = patch_model(load(checkpoints["glm_moe_dsa"], "glm_moe_dsa"), page_size=PAGE, num_pages=24)
    with torch.no_grad():
        with pytest.raises(UnsupportedFeatureError, match="beam search"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=2)
        with pytest.raises(UnsupportedFeatureError, match="left padding only"):
            model(ids, attention_mask=mask.flip(1))
    with pytest.raises(UnsupportedFeatureError, match="inference-only"):
        model(ids, attention_mask=mask, use_cache=False)
    assert_no_pages(model)
    with pytest.raises(ValueError, match="multiple of"):  # a page must hold whole k-pools (4 tokens)
        patch_model(load(checkpoints["glm5_next"], "glm5_next"), page_size=6)


@pytest.mark.parametrize("family", ["glm5_next", "deepseek_v32"])
def test_generate_command(checkpoints, family, capsys):
    """``sparsekv generate`` runs an MLA checkpoint folder and reports the latent pages it used."""
    from sparsekv.cli import main

    assert main(["generate", "--model", str(checkpoints[family]), "--prompt-tokens", "20", "--new-tokens", "2",
                 "--page-size", "8", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pages_used"] == 3 and 0 < report["sparse_read_fraction"] < 1  # 22 tokens, 8 per page
