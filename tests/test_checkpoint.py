"""Configs from config.json and weights from safetensors checkpoints, by the checkpoints' names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sparsekv.cache.manager import CacheGroupSpec, PagedKVCacheManager
from sparsekv.demo import seed_parameters
from sparsekv.layers import (CheckpointReader, Glm5NextConfig, Glm5NextIndexerSlice, Qwen4ExpConfig, Qwen4ExpSlice,
                             load_config, load_module_weights, load_slice_weights, open_checkpoint, slice_state)

QWEN_JSON = {
    "model_type": "qwen4_exp", "architectures": ["Qwen4ExpForCausalLM"], "torch_dtype": "bfloat16",
    "hidden_size": 32, "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "indexer_n_heads": 2, "indexer_head_dim": 8, "indexer_compress_ratio": 4,
    "indexer_budget": 8, "vocab_size": 50, "num_experts": 8, "linear_num_key_heads": 4,
}
GLM_JSON = {
    "model_type": "glm5_next", "hidden_size": 24, "num_hidden_layers": 2, "index_layers": [1], "q_lora_rank": 12,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 8, "index_kpool": 4, "kv_lora_rank": 16,
}
VOCAB = 50


def _write_checkpoint(folder, config_json: dict, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _seeded_qwen_tensors(config: Qwen4ExpConfig) -> dict[str, torch.Tensor]:
    donor = Qwen4ExpSlice(config, VOCAB)
    seed_parameters(donor, 21)
    return slice_state(donor)


# ---------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------
def test_spec_real_models_in_sparsekv_form():
    qwen = load_config({"model_type": "qwen4_exp", "hidden_size": 2560, "num_hidden_layers": 48,
                        "num_attention_heads": 24, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 1e7,
                        "indexer_n_heads": 4, "indexer_head_dim": 128, "indexer_compress_ratio": 4,
                        "indexer_budget": 2048})
    assert qwen.rotary_dim == 64 and qwen.budget_blocks == 512 and qwen.indexer_kv_heads == 1
    assert qwen.qsa_layers == tuple(range(3, 48, 4))
    glm = load_config({"model_type": "glm5_next", "index_kpool": 4})  # SPEC 3's k-pool; the rest HF's defaults
    assert glm.index_layers == tuple(range(3, 45, 4)) and glm.topk_pools == 512


def test_config_json_with_huggingface_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_JSON))
    config = load_config(tmp_path)
    assert isinstance(config, Qwen4ExpConfig)
    assert config.qsa_layers == (1, 3)  # full_attention_interval 2 -> layers 1, 3
    assert config.rotary_dim == 8
    layer_types = dict(QWEN_JSON)
    del layer_types["full_attention_interval"]
    layer_types["layer_types"] = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    assert load_config(layer_types).qsa_layers == (1, 2)
    assert isinstance(load_config(GLM_JSON), Glm5NextConfig)


@pytest.mark.parametrize("key, value, message", [
    ("indexer_budjet", 8, "'indexer_budjet' is not a known qwen4_exp key"),
    ("partial_rotary_factor", 0.3, "head_dim \\* partial_rotary_factor"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("rope_scaling", {"type": "yarn"}, "rope_scaling"),
    ("qsa_layers", [1, 9], "qsa_layers"),
    ("head_dim", 0, "'head_dim'"),
])
def test_bad_config_keys_raise_naming_the_key(key, value, message):
    data = dict(QWEN_JSON, **{key: value})
    if key == "qsa_layers":
        del data["full_attention_interval"]
    with pytest.raises(ValueError, match=message):
        load_config(data)


def test_unknown_model_type_and_glm_key():
    with pytest.raises(ValueError, match="model_type"):
        load_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="'index_kpol' is not a known glm5_next key"):
        load_config(dict(GLM_JSON, index_kpol=4))
    with pytest.raises(ValueError, match="index_kpool_mode"):
        load_config(dict(GLM_JSON, index_kpool_mode="max"))


def test_interval_and_list_together_is_an_error():
    with pytest.raises(ValueError, match="either"):
        load_config(dict(QWEN_JSON, qsa_layer_interval=2))


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------
def _qsa_forward(model: Qwen4ExpSlice, tokens: torch.Tensor) -> torch.Tensor:
    config = model.config
    layers = len(config.qsa_layers)
    manager = PagedKVCacheManager(
        [CacheGroupSpec("main", 2, layers, config.num_key_value_heads, config.head_dim, torch.float32),
         CacheGroupSpec("index", 1, layers, 1, config.indexer_head_dim, torch.float32)],
        page_size=8, num_pages=16, enable_prefix_caching=False)
    manager.claim("r")
    manager.allocate("r", tokens.shape[0])
    batch = manager.prepare(["r"], [tokens.shape[0]])
    with torch.no_grad():
        hidden, _ = model(tokens, input_row_offsets=batch.input_row_offsets, kv_cache=batch.collection("main"),
                          index_cache=batch.collection("index"))
    return hidden


def test_qwen_checkpoint_round_trip(tmp_path):
    config = load_config(QWEN_JSON)
    tensors = _seeded_qwen_tensors(config)
    assert "model.layers.1.self_attn.indexer.index_qk_proj.weight" in tensors
    assert tensors["model.layers.3.self_attn.q_proj.weight"].shape == (4 * 2 * 16, 32)
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)  # other layers' weights are ignored
    _write_checkpoint(tmp_path / "ckpt", QWEN_JSON, tensors)

    loaded_config, reader = open_checkpoint(tmp_path / "ckpt")
    model = Qwen4ExpSlice(loaded_config, VOCAB)
    names = load_slice_weights(model, reader)
    assert set(names) == set(tensors) - {"model.layers.0.mlp.gate_proj.weight"}
    donor = Qwen4ExpSlice(config, VOCAB)
    seed_parameters(donor, 21)
    tokens = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_qsa_forward(model, tokens), _qsa_forward(donor, tokens))
    fresh = Qwen4ExpSlice(config, VOCAB)  # unloaded weights give other outputs: the comparison can fail
    assert not torch.equal(_qsa_forward(fresh, tokens), _qsa_forward(donor, tokens))


def test_glm_checkpoint_round_trip_keeps_ape_float32(tmp_path):
    config = load_config(GLM_JSON)
    donor = Glm5NextIndexerSlice(config, VOCAB)
    seed_parameters(donor, 5)
    tensors = slice_state(donor)
    assert set(tensors) >= {"model.layers.1.self_attn.indexer.wq_b.weight",
                            "model.layers.1.self_attn.indexer.index_kpool_compress_ape",
                            "model.layers.1.self_attn.indexer.weights_proj.weight",
                            "model.layers.1.self_attn.indexer.index_kpool_compress_gate",
                            "model.layers.1.self_attn.indexer.k_norm.bias", "model.layers.1.self_attn.q_a_proj.weight"}
    _write_checkpoint(tmp_path / "glm", GLM_JSON, tensors)
    model = Glm5NextIndexerSlice(config, VOCAB, dtype=torch.bfloat16)
    load_slice_weights(model, CheckpointReader(tmp_path / "glm"))
    indexer = model.layers[0].indexer
    assert indexer.index_kpool_compress_ape.dtype == torch.float32
    assert torch.equal(indexer.index_kpool_compress_ape, donor.layers[0].indexer.index_kpool_compress_ape)
    assert torch.equal(indexer.wk.weight, donor.layers[0].indexer.wk.weight.to(torch.bfloat16))


def test_missing_weight_names_it_and_its_shape(tmp_path):
    config = load_config(QWEN_JSON)
    tensors = _seeded_qwen_tensors(config)
    del tensors["model.layers.3.self_attn.indexer.k_layernorm.weight"]
    _write_checkpoint(tmp_path / "ckpt", QWEN_JSON, tensors)
    model = Qwen4ExpSlice(config, VOCAB)
    before = model.attentions[0].q_proj.weight.clone()
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.3\.self_attn\.indexer\.k_layernorm\.weight'"
                                         r" \(expected shape \(8,\)\); the checkpoint holds under "
                                         r"'model\.layers\.3\.self_attn\.indexer\.': index_qk_proj\.weight, "
                                         r"q_layernorm\.weight"):
        load_slice_weights(model, CheckpointReader(tmp_path / "ckpt"))
    assert torch.equal(model.attentions[0].q_proj.weight, before)  # nothing written


def test_wrong_shape_names_the_weight(tmp_path):
    config = load_config(QWEN_JSON)
    tensors = _seeded_qwen_tensors(config)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(32, 63)
    _write_checkpoint(tmp_path / "ckpt", QWEN_JSON, tensors)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight' has shape \(32, 63\), "
                                         r"expected \(32, 64\)"):
        load_slice_weights(Qwen4ExpSlice(config, VOCAB), CheckpointReader(tmp_path / "ckpt"))


def test_sharded_checkpoint_with_index(tmp_path):
    config = load_config(QWEN_JSON)
    tensors = _seeded_qwen_tensors(config)
    names = sorted(tensors)
    half = len(names) // 2
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_JSON))
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reader = CheckpointReader(folder)
    assert reader.names() == names
    model = Qwen4ExpSlice(config, VOCAB)
    load_slice_weights(model, reader)
    assert torch.equal(model.attentions[1].v_proj.weight, tensors["model.layers.3.self_attn.v_proj.weight"])


def test_module_loader_from_a_dict_and_missing_folder(tmp_path):
    config = load_config(QWEN_JSON)
    tensors = _seeded_qwen_tensors(config)
    model = Qwen4ExpSlice(config, VOCAB)
    load_module_weights(model.attentions[0], tensors, "model.layers.1.self_attn.")
    assert torch.equal(model.attentions[0].k_norm.weight, tensors["model.layers.1.self_attn.k_norm.weight"])
    with pytest.raises(FileNotFoundError):
        CheckpointReader(tmp_path / "nowhere")


def test_sparsekv_names_of_earlier_versions_are_named_in_the_error(tmp_path):
    config = load_config(GLM_JSON)
    donor = Glm5NextIndexerSlice(config, VOCAB)
    seed_parameters(donor, 5)
    tensors = slice_state(donor)
    prefix = "model.layers.1.self_attn.indexer."
    tensors[prefix + "ape"] = tensors.pop(prefix + "index_kpool_compress_ape")
    tensors[prefix + "gate_proj.weight"] = tensors.pop(prefix + "index_kpool_compress_gate")
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.1\.self_attn\.indexer\."
                                         r"index_kpool_compress_(ape|gate)' \(expected shape \((4, 8|8, 24)\)\); the "
                                         r"checkpoint holds under '.*indexer\.': ape, gate_proj\.weight"):
        load_slice_weights(Glm5NextIndexerSlice(config, VOCAB), tensors)


@pytest.mark.parametrize("root", ["model.language_model.", ""])
def test_checkpoint_roots_of_other_model_classes(root):
    config = load_config(GLM_JSON)
    donor = Glm5NextIndexerSlice(config, VOCAB)
    seed_parameters(donor, 5)
    tensors = {root + name.removeprefix("model."): value for name, value in slice_state(donor).items()}
    model = Glm5NextIndexerSlice(config, VOCAB)
    names = load_slice_weights(model, tensors)
    assert set(names) == set(tensors)
    assert torch.equal(model.layers[0].indexer.wk.weight, donor.layers[0].indexer.wk.weight)
