"""Tensor parallelism by heads over torch.distributed: 2 CPU processes over gloo, spawned by the tests.

The sharded runs are compared with a single-process run of the same seeded
weights and workload (``sparsekv.demo_tp.serve``): outputs within float32
rounding, selections, page tables and prefix-cache hits exactly. Every launch
has a hard deadline and reaps its processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from sparsekv.demo import seed_parameters
from sparsekv.demo_tp import (RankError, TPCheckOptions, compare_records, format_tp_report, launch, summarize,
                               tp_records)
from sparsekv.cache.manager import PagedKVCacheManager
from sparsekv.layers import QSAAttention, Qwen4ExpConfig
from sparsekv.layers.checkpoint import CheckpointReader, module_state, save_checkpoint, slice_state
from sparsekv.layers.config import GlmMoeDsaConfig
from sparsekv.layers.dsa import mla_cache_groups
from sparsekv.layers.mla import MlaSlice
from sparsekv.layers.tensor_parallel import (RankSliceReader, TensorParallelGroup, head_range, kv_head_range,
                                             load_tensor_parallel_weights)

TINY = Qwen4ExpConfig(hidden_size=48, num_hidden_layers=2, qsa_layers=(0, 1), num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, rope_theta=1e4,
                      indexer_n_heads=2, indexer_head_dim=16, indexer_compress_ratio=4, indexer_budget=8,
                      attention_bias=True)
TINY_ONE_KV_HEAD = replace(TINY, num_key_value_heads=1, attention_bias=False)  # the KV head sits on both ranks
DEADLINE_S = 90.0


# ---------------------------------------------------------------------------
# head split and sharded loading (no processes)
# ---------------------------------------------------------------------------
def test_head_ranges_split_query_heads_and_split_or_replicate_kv_heads():
    assert [head_range(24, rank, 2) for rank in range(2)] == [range(0, 12), range(12, 24)]
    assert [kv_head_range(2, 24, rank, 2) for rank in range(2)] == [range(0, 1), range(1, 2)]
    # TP 8 with 2 KV heads: ranks 0-3 hold KV head 0, ranks 4-7 KV head 1, each the group of its 3 query heads.
    assert [kv_head_range(2, 24, rank, 8).start for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [head_range(24, rank, 8).start // 12 for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert kv_head_range(4, 8, 1, 2) == range(2, 4)


@pytest.mark.parametrize("heads, kv_heads, world, match", [
    (24, 2, 5, "num_attention_heads: 24 heads do not split evenly over a tensor-parallel group of 5"),
    (12, 3, 2, "num_key_value_heads: 3 KV heads neither split over nor replicate"),
    (12, 5, 2, "num_key_value_heads: 5 does not divide num_attention_heads 12"),
])
def test_head_split_errors_name_the_counts(heads, kv_heads, world, match):
    with pytest.raises(ValueError, match=match):
        kv_head_range(kv_heads, heads, 0, world)
    with pytest.raises(ValueError, match="rank: expected a rank in"):
        head_range(4, 2, 2)


def test_tp_check_refuses_a_head_split_before_starting_processes():
    with pytest.raises(ValueError, match="num_key_value_heads: 2 KV heads neither split over nor replicate"):
        tp_records([TPCheckOptions(tp=3, config=replace(TINY, num_attention_heads=6))])
    with pytest.raises(ValueError, match="num_attention_heads: 4 heads do not split evenly"):
        tp_records([TPCheckOptions(tp=3, config=TINY)])


def test_tp_check_refuses_more_cuda_ranks_than_devices_before_starting_processes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tp: 2 ranks over NCCL need one CUDA device each, found 1"):
        tp_records([TPCheckOptions(tp=2, config=TINY, device="cuda")])


def test_layer_without_process_group_is_one_rank_and_rejects_other_groups():
    layer = QSAAttention(TINY)
    assert (layer.tensor_parallel.rank, layer.tensor_parallel.world_size) == (0, 1)
    assert (layer.num_heads, layer.num_kv_heads) == (4, 2)
    with pytest.raises(TypeError, match="process_group: expected a torch.distributed.ProcessGroup or None"):
        TensorParallelGroup("gloo")


def test_rank_slice_reader_narrows_sharded_weights_and_checks_their_full_size(tmp_path):
    layer = QSAAttention(TINY)
    seed_parameters(layer, 3)
    prefix = "model.layers.0.self_attn."
    state = module_state(layer, prefix)
    save_checkpoint(tmp_path, TINY, state)
    slices = {prefix + name: value for name, value in layer.tensor_parallel_slices().items()}
    for name, part in list(slices.items()):  # what rank 1 of 2 holds
        half = (part.stop - part.start) // 2
        slices[name] = part._replace(start=half, stop=2 * half)
    for source in (CheckpointReader(tmp_path), state):
        reader = RankSliceReader(source, slices)
        q_rows = reader.get(prefix + "q_proj.weight")
        assert torch.equal(q_rows, state[prefix + "q_proj.weight"][64:128])  # heads 2, 3: 2 x 2 x 16 rows
        assert reader.shape(prefix + "o_proj.weight") == (48, 32)
        assert torch.equal(reader.get(prefix + "o_proj.weight"), state[prefix + "o_proj.weight"][:, 32:])
        assert torch.equal(reader.get(prefix + "o_proj.bias"), state[prefix + "o_proj.bias"])  # replicated
    wrong = dict(state, **{prefix + "k_proj.weight": torch.zeros(48, 48)})
    with pytest.raises(ValueError, match="k_proj.weight' has shape \\(48, 48\\), expected 32 entries along dim 0"):
        RankSliceReader(wrong, slices).shape(prefix + "k_proj.weight")


# ---------------------------------------------------------------------------
# 2 ranks over gloo against one process
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs():
    options = [TPCheckOptions(tp=2, config=config, vocab=97, page_size=8, num_pages=40, requests=3,
                              prompt_tokens=45, shared_tokens=24, decode_tokens=3, seed=seed,
                              timeout_s=DEADLINE_S, threads_per_rank=1)
               for config, seed in ((TINY, 5), (TINY_ONE_KV_HEAD, 6))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the single-process runs too: tiny matmuls, cores shared with the ranks
    try:
        return list(zip(options, tp_records(options)))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("which", ["kv heads split", "kv head replicated"])
def test_two_ranks_equal_one_process(runs, which):
    options, (single, ranks) = runs[["kv heads split", "kv head replicated"].index(which)]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert single["world_size"] == 1
    for record in ranks:
        assert len(record["outputs"]) == len(single["outputs"]) == 2 + options.decode_tokens + 1
        for got, want in zip(record["outputs"], single["outputs"]):
            assert not torch.isnan(got).any()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for got_step, want_step in zip(record["selections"], single["selections"], strict=True):
            for (got_idx, got_cnt), (want_idx, want_cnt) in zip(got_step, want_step, strict=True):
                assert torch.equal(got_idx, want_idx) and torch.equal(got_cnt, want_cnt)
        for (got_table, got_len), (want_table, want_len) in zip(record["tables"], single["tables"], strict=True):
            assert torch.equal(got_table, want_table) and torch.equal(got_len, want_len)
        assert record["hits"] == single["hits"]
        assert record["prefix_hit_tokens"] == single["prefix_hit_tokens"]
        # one all-reduce per layer and step, of [T, hidden] float32
        assert record["all_reduce_calls"] == len(options.config.qsa_layers) * len(single["outputs"])
        tokens = sum(out.shape[0] for out in single["outputs"])
        assert record["all_reduce_bytes"] == len(options.config.qsa_layers) * tokens * options.config.hidden_size * 4
    # the workload exercises what it claims: sparse selections, prefix hits for the later requests
    counts = torch.cat([cnt for step in single["selections"] for _, cnt in step])
    assert int(counts.max()) <= options.config.indexer_budget + options.config.indexer_compress_ratio - 1
    assert int(counts.max()) < options.prompt_tokens
    hits = dict(single["hits"])
    assert hits["r0"] == 0 and hits["r1"] == hits["r2"] == hits["late"] == options.shared_tokens
    assert single["prefix_hit_tokens"] == 3 * options.shared_tokens
    # each rank's main cache holds its KV heads; the indexer cache is replicated
    kv_heads = options.config.num_key_value_heads
    assert ranks[0]["kv_bytes"]["main"] * (2 if kv_heads == 2 else 1) == single["kv_bytes"]["main"]
    assert ranks[0]["kv_bytes"]["index"] == single["kv_bytes"]["index"]


def test_compare_records_flags_a_diverging_rank(runs):
    _, (single, ranks) = runs[0]
    assert all(value for name, value in compare_records(single, ranks).items() if name != "max_abs_diff")
    broken = dict(ranks[1], hits=[("r0", 8)] + ranks[1]["hits"][1:],
                  outputs=[out + 1e-3 for out in ranks[1]["outputs"]])
    checks = compare_records(single, [ranks[0], broken])
    assert not checks["outputs equal the single-process run"]
    assert not checks["prefix-cache hits equal on every rank and to the single-process run"]
    assert checks["selections equal on every rank and to the single-process run"]


def test_report_states_tp_kv_bytes_per_rank_and_all_reduce(runs):
    options, (single, ranks) = runs[0]
    report = summarize(options, single, ranks)
    assert report["passed"] and report["tp"] == 2 and report["backend"] == "gloo"
    assert report["kv_bytes_per_rank"]["main"] * 2 == report["kv_bytes_single"]["main"]
    assert len(report["all_reduce_seconds"]) == 2 and report["all_reduce_calls"] == ranks[0]["all_reduce_calls"]
    json.dumps(report)  # what --json prints
    text = format_tp_report(report)
    assert text.startswith("tensor parallel: tp=2 over gloo: passed")
    assert "main 80.0 KiB (single process 160.0 KiB), index 40.0 KiB (replicated)" in text
    assert f"all-reduce: {report['all_reduce_calls']} calls" in text


# ---------------------------------------------------------------------------
# failures: a raising rank ends the run with its error
# ---------------------------------------------------------------------------
def _rank_one_raises(process_group):
    if dist.get_rank(process_group) == 1:
        raise ValueError("bad shard on rank 1")
    dist.all_reduce(torch.ones(4), group=process_group)  # would wait for rank 1 forever
    return "unreachable"


def test_a_raising_rank_fails_the_run_fast_with_its_error():
    started = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1 failed.*ValueError: bad shard on rank 1") as caught:
        launch(_rank_one_raises, 2, timeout_s=DEADLINE_S, threads_per_rank=1)
    assert caught.value.rank == 1
    assert time.monotonic() - started < DEADLINE_S / 2
    assert multiprocessing.active_children() == []


def _rank_one_dies(process_group):
    if dist.get_rank(process_group) == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(4), group=process_group)
    return "unreachable"


def test_a_rank_that_dies_without_reporting_fails_the_run():
    with pytest.raises(RankError, match="(?s)rank 1 failed.*exited without reporting") as caught:
        launch(_rank_one_dies, 2, timeout_s=DEADLINE_S, threads_per_rank=1)
    assert caught.value.rank == 1



def _ranks_disagree(process_group):
    group = TensorParallelGroup(process_group)
    group.check_identical("same on both", [1, 2, 3])
    group.check_identical("page tables", [[0, 1], [2, 3 + group.rank]])
    return "unreachable"


def test_check_identical_raises_when_ranks_diverge():
    with pytest.raises(RankError, match="page tables: differs across tensor-parallel ranks \\(ranks \\[1\\]"):
        launch(_ranks_disagree, 2, timeout_s=DEADLINE_S, threads_per_rank=1)


# ---------------------------------------------------------------------------
# MLA: heads of q_b_proj / kv_b_proj / o_proj sharded, latent cache replicated
# ---------------------------------------------------------------------------
def _mla_run(model, config, tokens, chunks, mode):
    manager = PagedKVCacheManager(mla_cache_groups(config, torch.float32), page_size=8, num_pages=16)
    manager.claim("r")
    done, outputs, selections = 0, [], []
    for n in chunks:
        manager.allocate("r", n)
        batch = manager.prepare(["r"], [n])
        with torch.no_grad():
            hidden, per_layer = model(tokens[done:done + n], input_row_offsets=batch.input_row_offsets,
                                      latent_cache=batch.collection("latent"),
                                      index_cache=batch.collection("indexer"), mode=mode)
        manager.step("r", [0] * n)
        outputs.append(hidden)
        selections.append([(r.indices, r.counts) for r in per_layer])
        done += n
    return torch.cat(outputs), selections, manager.blocks("latent").numel()


def _mla_rank(process_group, config):
    single = MlaSlice(config, 50)
    seed_parameters(single, 6)
    sharded = MlaSlice(config, 50, process_group=process_group)
    load_tensor_parallel_weights(sharded, slice_state(single))
    tokens = torch.randint(0, 50, (29,), generator=torch.Generator().manual_seed(4))
    report = {"heads": sharded.attentions[0].num_heads, "q_b_rows": sharded.attentions[0].q_b_proj.weight.shape[0]}
    for mode in ("absorbed", "expanded"):
        want, want_sel, want_latent = _mla_run(single, config, tokens, [13, 1, 1, 14], mode)
        got, got_sel, got_latent = _mla_run(sharded, config, tokens, [13, 1, 1, 14], mode)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for got_step, want_step in zip(got_sel, want_sel, strict=True):
            for (gi, gc), (wi, wc) in zip(got_step, want_step, strict=True):
                assert torch.equal(gi, wi) and torch.equal(gc, wc)
        assert got_latent == want_latent  # the latent cache is per token: replicated, not split
    return report


def test_mla_two_ranks_equal_one_process():
    config = GlmMoeDsaConfig(hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             q_lora_rank=24, kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12,
                             v_head_dim=10, index_n_heads=4, index_head_dim=16, index_topk=9,
                             indexer_types=("full", "shared"), attention_bias=True)
    reports = launch(_mla_rank, 2, config, timeout_s=DEADLINE_S, threads_per_rank=1)
    assert reports == [{"heads": 2, "q_b_rows": 2 * (12 + 8)}] * 2
