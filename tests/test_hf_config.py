"""``load_config`` on the config.json that Hugging Face's own config classes write (transformers 5.23)."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest

transformers = pytest.importorskip("transformers")

from sparsekv.layers import (DeepseekV32Config, Glm5NextConfig, GlmMoeDsaConfig, Qwen4ExpConfig,  # noqa: E402
                             load_config, save_config)

QWEN_TEXT = dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                 indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                 indexer_compress_ratio=4)
GLM5_TEXT = dict(hidden_size=40, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                 kv_lora_rank=20, qk_nope_head_dim=12, v_head_dim=10, index_n_heads=3, index_head_dim=12,
                 index_topk=8, index_kpool=4, index_kpool_always_select_tail=False)
DSA = dict(hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
           kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, index_n_heads=3,
           index_head_dim=16, index_topk=6, rope_parameters={"rope_type": "default", "rope_theta": 5e4})


def _saved(tmp_path, hf_config, *, strip_defaults=False) -> dict:
    """The config.json ``save_pretrained`` writes; optionally without the keys equal to HF's class defaults."""
    hf_config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    if strip_defaults:
        defaults = {f.name: f.default for f in dataclasses.fields(type(hf_config))}
        data = {k: v for k, v in data.items() if k == "model_type" or defaults.get(k, object()) != v}
    return data


def test_our_defaults_are_hf_defaults():
    pairs = [(Qwen4ExpConfig, transformers.Qwen4ExpTextConfig), (Glm5NextConfig, transformers.Glm5NextTextConfig),
             (GlmMoeDsaConfig, transformers.GlmMoeDsaConfig), (DeepseekV32Config, transformers.DeepseekV32Config)]
    for ours, theirs in pairs:
        hf_defaults = {f.name: f.default for f in dataclasses.fields(theirs)}
        compared = 0
        for field in dataclasses.fields(ours):
            if field.name in hf_defaults and field.name not in ("layer_types", "indexer_types"):
                assert field.default == hf_defaults[field.name], (ours.__name__, field.name)
                compared += 1
        assert compared >= 8, ours.__name__
        if ours is Glm5NextConfig:
            continue  # NoPE: no rope_parameters
        rope = theirs().rope_parameters  # what HF makes of an absent rope_parameters
        ours_defaults = {f.name: f.default for f in dataclasses.fields(ours)}
        assert ours_defaults["rope_theta"] == rope["rope_theta"] and rope["rope_type"] == "default"
        assert ours_defaults.get("partial_rotary_factor", 1.0) == rope.get("partial_rotary_factor", 1.0)


@pytest.mark.parametrize("strip", [False, True], ids=["as-written", "defaults-left-out"])
def test_qwen4_exp_text_config(tmp_path, strip):
    hf = transformers.Qwen4ExpTextConfig(**QWEN_TEXT)
    config = load_config(_saved(tmp_path, hf, strip_defaults=strip))
    assert isinstance(config, Qwen4ExpConfig)
    assert config.qsa_layers == tuple(i for i, kind in enumerate(hf.layer_types) if kind == "indexed_attention")
    assert config.qsa_layers == (3,)
    assert (config.rotary_dim, config.rope_theta, config.head_dim) == (8, 1e4, 16)
    assert (config.indexer_n_heads, config.indexer_head_dim, config.indexer_budget) == (2, 16, 8)
    assert config.rms_norm_eps == hf.rms_norm_eps


def test_qwen4_exp_multimodal_reads_text_part_and_warns_once_about_vision(tmp_path):
    text = dict(QWEN_TEXT, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    hf = transformers.Qwen4ExpConfig(text_config=text, vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2,
                                                                      "out_hidden_size": 48})
    data = _saved(tmp_path, hf)
    assert data["model_type"] == "qwen4_exp" and "text_config" in data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(data)
    assert len(caught) == 1 and "vision_config" in str(caught[0].message) and "image_token_id" in str(
        caught[0].message)
    assert config.qsa_layers == (1, 3) and config.rotary_dim == 8


def test_qwen4_exp_without_indexer_keys_is_refused():
    with pytest.raises(ValueError, match="not a QSA model"):
        load_config({"model_type": "qwen4_exp_text", "num_hidden_layers": 4})


@pytest.mark.parametrize("strip", [False, True], ids=["as-written", "defaults-left-out"])
def test_glm5_next_text_config(tmp_path, strip):
    hf = transformers.Glm5NextTextConfig(**GLM5_TEXT)
    config = load_config(_saved(tmp_path, hf, strip_defaults=strip))
    assert isinstance(config, Glm5NextConfig)
    assert config.index_layers == (3,) and config.indexer_types == ("full",) * 4
    assert (config.index_kpool, config.index_kpool_always_select_tail, config.index_topk) == (4, False, 8)
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.latent_dim, config.qk_head_dim) == (20, 0, 20, 12)
    assert config.latent_eps == hf.rms_norm_eps == 1e-5


def test_glm5_next_absent_keys_take_hf_defaults():
    config = load_config({"model_type": "glm5_next_text", "hidden_size": 40, "num_hidden_layers": 8})
    hf = transformers.Glm5NextTextConfig(hidden_size=40, num_hidden_layers=8)
    assert config.index_kpool == hf.index_kpool == 16
    assert config.index_kpool_always_select_tail is hf.index_kpool_always_select_tail is True
    assert config.index_layers == tuple(i for i, k in enumerate(hf.layer_types) if k == "indexed_attention")
    assert (config.q_lora_rank, config.num_attention_heads, config.v_head_dim) == (
        hf.q_lora_rank, hf.num_attention_heads, hf.v_head_dim)


def test_glm5_next_nested_and_flat_multimodal(tmp_path):
    pattern = dict(GLM5_TEXT, num_hidden_layers=8, index_topk_pattern="FFFFFFFS")
    hf = transformers.Glm5NextConfig(text_config=pattern)
    data = _saved(tmp_path, hf)
    with pytest.warns(UserWarning, match="vision_config") as caught:
        nested = load_config(data)
    assert len(caught) == 1  # every vision key named in one warning
    assert nested.index_layers == (3, 7) and nested.indexer_types[7] == "shared"
    assert nested.full_index_layers == (3,)
    flat = dict(data["text_config"], model_type="glm5_next", image_token_id=1)
    with pytest.warns(UserWarning, match="image_token_id"):
        assert load_config(flat) == nested


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("strip", [False, True], ids=["as-written", "defaults-left-out"])
def test_dsa_configs(tmp_path, family, strip):
    cls = transformers.GlmMoeDsaConfig if family == "glm_moe_dsa" else transformers.DeepseekV32Config
    extra = {"index_topk_pattern": "FSF"} if family == "glm_moe_dsa" else {}
    config = load_config(_saved(tmp_path, cls(**DSA, **extra), strip_defaults=strip))
    assert config.model_type == family and config.index_kpool == 1
    assert config.index_layers == (0, 1, 2)
    expected = ("full", "shared", "full") if family == "glm_moe_dsa" else ("full",) * 3
    assert config.indexer_types == expected
    assert (config.rope_theta, config.qk_rope_head_dim, config.latent_dim) == (5e4, 8, 28)
    assert config.indexer_rope == ("interleave" if family == "glm_moe_dsa" else "half")
    assert config.latent_eps == 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with their default eps


def test_deepseek_v32_yarn_config(tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3.2's published values
    config = load_config(_saved(tmp_path, transformers.DeepseekV32Config(**dict(DSA, rope_parameters=yarn))))
    assert dict(config.rope_yarn)["factor"] == 40.0 and config.rope_theta == 10000.0
    assert config.softmax_scale == pytest.approx(config.qk_head_dim ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2)
    save_config(config, tmp_path / "config.json")
    assert load_config(tmp_path) == config


def test_sparsekv_form_round_trips(tmp_path):
    for config in (load_config(dict(GLM5_TEXT, model_type="glm5_next")),
                   load_config(dict(DSA, model_type="glm_moe_dsa", indexer_types=["full", "shared", "shared"])),
                   load_config(dict(QWEN_TEXT, model_type="qwen4_exp_text"))):
        save_config(config, tmp_path / "config.json")
        assert load_config(tmp_path) == config


@pytest.mark.parametrize("data, message", [
    (dict(DSA, model_type="deepseek_v32", rope_parameters={"rope_type": "longrope"}), "'longrope' is not supported"),
    (dict(DSA, model_type="deepseek_v32", rope_parameters={"rope_type": "yarn", "factor": 40}),
     "YaRN needs 'original_max_position_embeddings'"),
    (dict(QWEN_TEXT, model_type="qwen4_exp_text", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 16}),
     "'yarn' is not supported"),
    (dict(DSA, model_type="deepseek_v32", index_kpool=4), "'index_kpool' is not a known deepseek_v32 key"),
    (dict(DSA, model_type="deepseek_v32", indexer_types=["full", "shared", "full"]), "no shared layers"),
    (dict(DSA, model_type="glm_moe_dsa", indexer_types=["shared", "full", "full"]), "first indexed layer"),
    (dict(DSA, model_type="glm_moe_dsa", layer_types=["indexed_attention"]), "'layer_types'"),
    (dict(DSA, model_type="glm_moe_dsa", num_key_value_heads=2), "num_key_value_heads"),
    (dict(GLM5_TEXT, model_type="glm5_next_text", qk_rope_head_dim=8), "NoPE"),
    (dict(GLM5_TEXT, model_type="glm5_next_text", index_topk=10), "multiple of index_kpool"),
    (dict(QWEN_TEXT, model_type="qwen4_exp_text", indexer_kv_heads=2), "indexer_kv_heads"),
    ({"model_type": "qwen4_exp", "text_config": {"model_type": "glm5_next_text"}}, "text_config.model_type"),
])
def test_bad_hf_configs_name_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        load_config(data)
