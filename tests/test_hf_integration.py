"""Hugging Face transformers integration: a patched Qwen4Exp model against the unpatched one.

The oracle is Hugging Face's own model code (its per-query QSA indexer and
masked attention), run on the same checkpoint without the patch. The tiny
model has a small indexer budget (8 tokens) and prompts of 13 and 21 tokens
generating 24 more, so selection prunes most of the history. It has eight
indexer heads so that exact score ties (all heads' ReLU at zero), where
Hugging Face's ``topk`` and sparsekv break ties differently, do not occur.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Qwen4ExpForCausalLM, Qwen4ExpTextConfig, Qwen4ExpTextModel  # noqa: E402

from hf_parity import NEW_TOKENS, PROMPT_LENGTHS, generate, left_padded_batch, prefill_and_decode  # noqa: E402
from hf_parity import assert_outputs_close, run_on_triton  # noqa: E402
from hf_parity import one_torch_thread  # noqa: E402, F401  (a fixture, used through pytestmark)

from sparsekv import InsufficientPagesError  # noqa: E402
from sparsekv.integrations.transformers import (  # noqa: E402
    UnsupportedFeatureError,
    end_generation,
    get_manager,
    patch_model,
    unpatch_model,
)

SEED = 20261201
VOCAB = 96

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_config() -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
        layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, hc_count=2, hc_lowrank=8, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(SEED)
    model = Qwen4ExpForCausalLM(tiny_config())
    path = tmp_path_factory.mktemp("qwen4_exp_tiny")
    model.save_pretrained(path)
    return path


def load(checkpoint, cls=Qwen4ExpForCausalLM, dtype=torch.float32):
    return cls.from_pretrained(checkpoint, dtype=dtype).eval()


def assert_no_pages(model) -> None:
    manager = get_manager(model)
    manager.check_invariants()
    assert manager.num_requests == 0
    assert manager.metrics().groups["main"].pages_used == 0


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Hugging Face's own greedy generation (tokens, per-step logits) on the unpatched checkpoint."""
    ids, mask = left_padded_batch(SEED, VOCAB)
    with torch.no_grad():
        out = generate(load(checkpoint), ids, mask)
    return ids, mask, out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("page_size", [8, 6], ids=["block_key_cache", "no_block_key_cache"])
def test_generate_matches_hf_and_frees_pages(checkpoint, reference, page_size):
    """With a block-key cache (the page size a multiple of the indexer's ratio 4) and without one."""
    ids, mask, ref_tokens, ref_logits = reference
    model = patch_model(load(checkpoint), page_size=page_size, num_pages=48)
    assert ("index_blocks" in get_manager(model).metrics().groups) == (page_size % 4 == 0)
    for _ in range(2):  # two generations in a row: the second starts from a clean manager
        out = generate(model, ids, mask)
        assert torch.equal(out.sequences, ref_tokens)
        logits = torch.stack(out.logits, dim=1)
        assert logits.shape == ref_logits.shape == (2, NEW_TOKENS, VOCAB)
        assert (logits - ref_logits).abs().max().item() <= 2e-3
        assert_no_pages(model)
        # The cache generate returned was released with it and refuses further use.
        with pytest.raises(ValueError, match="released"):
            with torch.no_grad():
                model(ids[:, -1:], past_key_values=out.past_key_values)


def test_generate_continues_a_prefilled_cache(checkpoint):
    """A cache prefilled by a direct call, handed to generate: same tokens as HF, released when generate returns."""
    ids, mask = left_padded_batch(SEED + 3, VOCAB)

    def run(model):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            prompt_mask = mask[:, :-3]  # generate places tokens at the mask's cumulative positions: so must we
            model(ids[:, :-3], attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache)
            return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                                  min_new_tokens=6, do_sample=False)

    expected = run(load(checkpoint))
    model = patch_model(load(checkpoint), page_size=8, num_pages=32)
    assert torch.equal(run(model), expected)
    assert_no_pages(model)


def test_weights_are_shared_and_unpatch_restores(checkpoint):
    model = load(checkpoint)
    attention = model.model.layers[0].self_attn
    patch_model(model)
    layer = model._sparsekv_patch.adapter.layers[0]
    assert layer.q_proj is attention.q_proj and layer.indexer.index_qk_proj is attention.indexer.index_qk_proj
    assert set(model.state_dict()) == set(load(checkpoint).state_dict())
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)
    unpatch_model(model)
    assert "forward" not in attention.__dict__ and "generate" not in model.__dict__
    assert not hasattr(model, "_sparsekv_patch")


@pytest.mark.parametrize("cls", [Qwen4ExpForCausalLM, Qwen4ExpTextModel], ids=["causal_lm", "text_model"])
def test_direct_prefill_and_decode_match_hf(checkpoint, cls):
    ids, mask = left_padded_batch(SEED + 1, VOCAB)
    steps = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(SEED + 2))
    expected, _ = prefill_and_decode(load(checkpoint, cls), ids, mask, steps)
    model = patch_model(load(checkpoint, cls), page_size=8, num_pages=32)
    got, cache = prefill_and_decode(model, ids, mask, steps)
    assert_outputs_close(got, expected, mask)
    assert get_manager(model).num_requests == 2
    end_generation(cache)
    assert_no_pages(model)


def test_direct_calls_release_pages_with_cache_or_reset(checkpoint, monkeypatch):
    ids, mask = left_padded_batch(SEED, VOCAB)
    model = patch_model(load(checkpoint), page_size=8, num_pages=32)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("the patched model must not build the dense [B, 1, T, S] mask")

    monkeypatch.setattr(transformers.models.qwen4_exp.modeling_qwen4_exp, "create_causal_mask", no_dense_mask)
    manager = get_manager(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)  # a temporary generation, released at once
        assert manager.num_requests == 0
        out = model(ids, attention_mask=mask)  # the model creates a cache and returns it
        assert manager.num_requests == 2 and out.past_key_values.get_seq_length() == ids.shape[1]
        out.past_key_values.reset()
        assert_no_pages(model)
        cache = model(ids, attention_mask=mask).past_key_values  # a reset cache starts again
        assert manager.num_requests == 2
    del out, cache
    gc.collect()
    assert_no_pages(model)


def test_unsupported_features_raise(checkpoint):
    ids, mask = left_padded_batch(SEED, VOCAB)
    model = patch_model(load(checkpoint), page_size=8, num_pages=32)
    with torch.no_grad():
        with pytest.raises(UnsupportedFeatureError, match="beam search"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=2)
        with pytest.raises(UnsupportedFeatureError, match="cache_implementation"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static")
        right_padded = mask.flip(1)
        with pytest.raises(UnsupportedFeatureError, match="left padding only"):
            model(ids, attention_mask=right_padded)
        with pytest.raises(UnsupportedFeatureError, match="output_attentions"):
            model(ids, attention_mask=mask, output_attentions=True)
        cache = model(ids, attention_mask=mask).past_key_values
        with pytest.raises(UnsupportedFeatureError, match="beam search"):
            cache.reorder_cache(torch.tensor([1, 0]))
        with pytest.raises(UnsupportedFeatureError, match="cropping"):
            cache.crop(-1)
        with pytest.raises(ValueError, match="position_ids"):
            model(ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                  position_ids=torch.tensor([[50], [50]]), past_key_values=cache)
        manager = get_manager(model)
        assert [manager.cache_length(rid) for rid in cache.layers[0].generation.request_ids] == list(PROMPT_LENGTHS)
        # A cache filled without sparsekv cannot be adopted.
        foreign = load(checkpoint)(ids, attention_mask=mask).past_key_values
        with pytest.raises(ValueError, match="fresh DynamicCache"):
            model(ids[:, -1:], past_key_values=foreign)
    with pytest.raises(UnsupportedFeatureError, match="inference-only"):
        model(ids, attention_mask=mask, use_cache=False)
    step_mask = torch.cat([mask, mask[:, -1:]], 1)
    with pytest.raises(UnsupportedFeatureError, match="inference-only"):
        model(ids[:, -1:], attention_mask=step_mask, past_key_values=cache)
    with torch.no_grad(), pytest.raises(RuntimeError, match="failed midway"):  # HF's layers ran before the error
        model(ids[:, -1:], attention_mask=step_mask, past_key_values=cache)
    end_generation(cache)
    assert_no_pages(model)


def test_out_of_pages_changes_nothing(checkpoint):
    ids, mask = left_padded_batch(SEED, VOCAB)
    model = patch_model(load(checkpoint), page_size=8, num_pages=4)  # 21 + 13 tokens need 3 + 2 pages
    with torch.no_grad(), pytest.raises(InsufficientPagesError):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
    assert_no_pages(model)


def test_core_package_does_not_import_transformers():
    code = ("import sys, sparsekv, sparsekv.cli, sparsekv.layers, sparsekv.integrations, "
            "sparsekv.integrations.generate; sys.exit(int('transformers' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_real_tokens_only_reach_the_cache(checkpoint):
    """The manager's pages hold each row's real tokens at positions 0, 1, ...: padding leaves no trace."""
    ids, mask = left_padded_batch(SEED, VOCAB)
    model = patch_model(load(checkpoint), page_size=8, num_pages=32)
    short = ids[1:, -PROMPT_LENGTHS[1]:]
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
        alone = model(short)
    generations = [out.past_key_values.layers[0].generation for out in (padded, alone)]
    manager = get_manager(model)
    blocks = manager.blocks("main")
    length = PROMPT_LENGTHS[1]
    rows = []
    for generation, row in zip(generations, (1, 0)):
        pages = manager.pages_of(generation.request_ids[row])
        rows.append(torch.cat([blocks[p] for p in pages], dim=2)[:, :, :length])
    assert torch.allclose(rows[0], rows[1], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(generations[0].leading_pads, [0, max(PROMPT_LENGTHS) - length])


def test_run_generate_reports(checkpoint):
    from sparsekv.integrations.generate import GenerateError, run_generate

    report = run_generate(checkpoint, prompt_tokens=30, new_tokens=3, batch=2, page_size=8, progress=False)
    assert report.model_type == "qwen4_exp_text" and report.pages_used == 2 * 5  # 33 tokens per row, 8 per page
    assert 0 < report.sparse_read_fraction < 1 and report.decode_tokens_per_s > 0
    with pytest.raises(GenerateError, match="config.json"):
        run_generate(checkpoint / "missing", prompt_tokens=4, new_tokens=1)


def test_generate_command(checkpoint, capsys):
    """``sparsekv generate`` runs a checkpoint folder and prints its report; a missing folder is exit status 2."""
    from sparsekv.cli import main

    assert main(["generate", "--model", str(checkpoint), "--prompt-tokens", "20", "--new-tokens", "2",
                 "--page-size", "8", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pages_used"] == 3 and report["decode_tokens_per_s"] > 0  # 22 tokens, 8 per page
    assert main(["generate", "--model", str(checkpoint / "missing"), "--prompt-tokens", "4",
                 "--new-tokens", "1", "--no-progress"]) == 2


@pytest.mark.triton
def test_prefill_and_decode_match_hf_on_the_triton_backend(checkpoint, monkeypatch):
    """The kernels a GPU runs (Triton; here its interpreter on CPU tensors) inside the patched model."""
    ids, mask = left_padded_batch(SEED + 1, VOCAB)
    steps = torch.randint(2, VOCAB, (2, 4), generator=torch.Generator().manual_seed(SEED + 2))
    expected, _ = prefill_and_decode(load(checkpoint), ids, mask, steps)
    ran = run_on_triton(monkeypatch)
    model = patch_model(load(checkpoint), page_size=8, num_pages=32)
    got, cache = prefill_and_decode(model, ids, mask, steps)
    assert_outputs_close(got, expected, mask)
    end_generation(cache)
    assert_no_pages(model)
    assert ran >= {("triton", op) for op in ("paged_store", "qsa_store_block_keys_paged", "qsa_block_score_paged",
                                             "select_blocks_expand", "qsa_sparse_attention_paged")}, sorted(ran)
