"""The ``sparsekv`` command end to end: ``demo`` (report, checks, exit codes) and ``bench``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from sparsekv import cli
from sparsekv.demo import seed_parameters
from sparsekv.layers import Glm5NextIndexerSlice, load_config, save_checkpoint, slice_state

SMALL_QWEN = {"model_type": "qwen4_exp", "hidden_size": 32, "num_hidden_layers": 2, "qsa_layers": [0, 1],
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5,
              "indexer_n_heads": 2, "indexer_head_dim": 8, "indexer_compress_ratio": 4, "indexer_budget": 8}
SMALL_GLM = {"model_type": "glm5_next", "hidden_size": 24, "num_hidden_layers": 1, "index_layers": [0],
             "q_lora_rank": 12, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 8, "index_kpool": 4}
SMALL_RUN = ["--requests", "3", "--context", "40", "--decode-tokens", "3", "--page-size", "8", "--step-tokens", "24",
             "--no-progress"]


@pytest.fixture(scope="module")
def small_configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    paths = []
    for name, data in (("qwen.json", SMALL_QWEN), ("glm.json", SMALL_GLM)):
        (folder / name).write_text(json.dumps(data))
        paths += ["--config", str(folder / name)]
    return paths


def _run_json(capsys, argv) -> tuple[int, dict]:
    code = cli.main(argv)
    out = capsys.readouterr().out
    return code, json.loads(out)


def _check_report(report: dict, requests: int, context: int, decode: int) -> None:
    tokens = report["tokens"]
    assert tokens["prompt"] == requests * context == tokens["prefix_hit"] + tokens["prefill_computed"]
    assert tokens["decode"] == requests * decode
    assert tokens["processed"] == tokens["prefill_computed"] + tokens["decode"]
    prefix = report["prefix_cache"]
    assert prefix["query_tokens"] == tokens["prompt"] and prefix["hit_tokens"] == tokens["prefix_hit"]
    assert prefix["hit_rate"] == pytest.approx(prefix["hit_tokens"] / prefix["query_tokens"])
    assert prefix["hit_tokens"] > 0  # the later requests reuse the shared system prompt's pages
    assert 0 < report["pages"]["peak_used"] <= report["pages"]["total"]
    throughput = report["throughput"]
    assert throughput["prefill_tokens_per_s"] > 0 and throughput["decode_tokens_per_s"] > 0
    reads = report["sparse_reads"]
    assert 0 < reads["kv_bytes_sparse"] <= reads["kv_bytes_dense"]
    assert reads["kv_fraction"] == pytest.approx(reads["kv_bytes_sparse"] / reads["kv_bytes_dense"])
    shares = [entry["share"] for entry in report["time_breakdown"]]
    assert all(entry["seconds"] >= 0 for entry in report["time_breakdown"]) and sum(shares) == pytest.approx(1.0)
    assert {"qsa.compress", "qsa.score", "qsa.select", "qsa.attention", "kpool.score"} <= {
        entry["stage"] for entry in report["time_breakdown"]}
    assert len(report["checks"]) == 6
    for check in report["checks"]:
        assert check["comparisons"] > 0 and check["failures"] == 0 and check["passed"], check
    assert report["checks_passed"] is True


def test_demo_json_small_model(capsys, small_configs):
    code, report = _run_json(capsys, ["demo", *small_configs, *SMALL_RUN, "--json"])
    assert code == 0
    _check_report(report, requests=3, context=40, decode=3)
    # budget 8 (window 11) against 40-token prompts: the sparse attention skipped tokens
    assert report["sparse_reads"]["kv_fraction"] < 0.8
    assert report["model"]["qwen4_exp"]["budget"] == 8


def test_demo_default_model_text_report(capsys):
    code = cli.main(["demo", "--requests", "2", "--context", "64", "--decode-tokens", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    for needle in ("tokens", "throughput", "pages", "prefix", "sparse attention read", "time by op",
                   "qsa_sparse_attention_paged", "[PASS] QSA selections equal brute-force top-k",
                   "all checks passed", "24 q / 2 kv heads x 256 (RoPE 64), indexer 4 x 128, R=4"):
        assert needle in out, needle
    assert "FAIL" not in out


def test_demo_entry_point_subprocess(tmp_path, small_configs):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    argv = ["demo", *small_configs, "--requests", "2", "--context", "24", "--decode-tokens", "1", "--page-size", "8",
            "--step-tokens", "16", "--no-progress", "--json"]
    proc = subprocess.run([sys.executable, "-m", "sparsekv.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_report(json.loads(proc.stdout), requests=2, context=24, decode=1)


def test_a_wrong_sparse_attention_fails_the_checks(capsys, small_configs, monkeypatch):
    import sparsekv.layers.qsa as qsa_layer

    real = qsa_layer.qsa_sparse_attention_paged

    def skewed(q, *args, **kwargs):  # drop a small amount from every output: the dense oracle must notice
        return real(q, *args, **kwargs) * 0.999

    monkeypatch.setattr(qsa_layer, "qsa_sparse_attention_paged", skewed)
    code, report = _run_json(capsys, ["demo", *small_configs, *SMALL_RUN, "--json"])
    assert code == 1
    failed = {c["name"] for c in report["checks"] if not c["passed"]}
    assert "sparse attention equals dense attention under the budget" in failed
    assert "sparse attention equals dense attention over the selected tokens" in failed
    assert report["checks_passed"] is False


def test_demo_with_a_checkpoint(capsys, tmp_path, small_configs):
    config = load_config(SMALL_GLM)
    donor = Glm5NextIndexerSlice(config, 64)
    seed_parameters(donor, 3)
    save_checkpoint(tmp_path / "glm", config, slice_state(donor))
    argv = ["demo", small_configs[0], small_configs[1], "--checkpoint", str(tmp_path / "glm"), "--requests", "2",
            "--context", "24", "--decode-tokens", "1", "--page-size", "8", "--step-tokens", "16", "--no-progress",
            "--json"]
    code, report = _run_json(capsys, argv)
    assert code == 0
    assert any("checkpoint" in source for source in report["model"]["sources"])


def test_demo_usage_errors(capsys, tmp_path):
    assert cli.main(["demo", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps(dict(SMALL_QWEN, indexer_budjet=3)))
    assert cli.main(["demo", "--config", str(tmp_path / "bad.json")]) == 2
    assert "'indexer_budjet'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(SMALL_GLM))
    save_checkpoint(tmp_path / "partial", load_config(SMALL_GLM), {"model.embed_tokens.weight": torch.zeros(8, 24)})
    assert cli.main(["demo", "--checkpoint", str(tmp_path / "partial")]) == 2
    assert "missing weight 'model.layers.0.input_layernorm.weight'" in capsys.readouterr().err
    assert cli.main(["demo", "--dtype", "int8"]) == 2
    assert "--dtype" in capsys.readouterr().err


def test_demo_plot_needs_matplotlib(capsys, tmp_path, small_configs):
    plot = tmp_path / "decode.png"
    code = cli.main(["demo", *small_configs, *SMALL_RUN, "--sweep-context", "64", "--plot", str(plot)])
    captured = capsys.readouterr()
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and not plot.exists()
        assert "--plot needs matplotlib" in captured.err
    else:
        assert code == 0 and plot.stat().st_size > 0
        assert "decode step time" in captured.out


def test_demo_sweep_times_both_modes(capsys, small_configs):
    code, report = _run_json(capsys, ["demo", *small_configs, *SMALL_RUN, "--sweep", "--sweep-context", "300",
                                      "--json"])
    assert code == 0
    contexts = [p["context"] for p in report["decode_sweep"]]
    assert contexts == [128, 256, 300]  # powers of two from 128 below --sweep-context, then --sweep-context
    assert all(p["sparse_ms"] > 0 and p["dense_ms"] > 0 for p in report["decode_sweep"])


def test_bench_quick_cache(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--only", "cache", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["op", "shape", "dtype"]
    rows = json.loads(out_json.read_text())
    assert rows and all(row["time_ms"] > 0 for row in rows)
    assert len(table.splitlines()) >= len(rows) + 2


def test_bench_unknown_family(capsys):
    assert cli.main(["bench", "--only", "qsa,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_bench_quick_kpool_reports_the_peak_peer_for_score(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--only", "kpool", "--json", str(out_json)]) == 0
    assert "xpeak" in capsys.readouterr().out.splitlines()[0].split()
    rows = {row["op"]: row for row in json.loads(out_json.read_text())}
    assert rows["mla_kpool_score"]["peers_ms"]["peak"] > 0  # the tile's multiply-adds were timed
    assert "peak" not in rows["mla_kpool_compress"]["peers_ms"]  # a memory-bound op has no such peer
