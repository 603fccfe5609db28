"""The ``sparsekv`` command end to end: ``demo`` (report, checks, exit codes) and ``bench``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from sparsekv import cli
from sparsekv.demo import (CHECK_NAMES, DEFAULT_GLM, DEFAULT_QWEN, DemoOptions, DemoServer, build_models,
                           make_workload, seed_parameters)
from sparsekv.demo_sweep import DENSE_LAYOUTS, sdpa_decode_attention
from sparsekv.demo_work import ServingWork, _sum_floor_div, _sum_min
from sparsekv.layers import MlaSlice, Qwen4ExpSlice, load_config, save_checkpoint, slice_state

SMALL_QWEN = {"model_type": "qwen4_exp", "hidden_size": 32, "num_hidden_layers": 2, "qsa_layers": [0, 1],
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5,
              "indexer_n_heads": 2, "indexer_head_dim": 8, "indexer_compress_ratio": 4, "indexer_budget": 8}
SMALL_GLM = {"model_type": "glm5_next", "hidden_size": 24, "num_hidden_layers": 2, "index_layers": [0, 1],
             "indexer_types": ["full", "shared"], "num_attention_heads": 2, "num_key_value_heads": 2,
             "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8, "index_n_heads": 2,
             "index_head_dim": 8, "index_topk": 8, "index_kpool": 4}
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
    assert {"qsa.store_blocks", "qsa.score", "qsa.select", "qsa.attention", "kpool.score", "mla.attention"} <= {
        entry["stage"] for entry in report["time_breakdown"]}
    assert [check["name"] for check in report["checks"]] == CHECK_NAMES
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
    code = cli.main(["demo", "--requests", "2", "--context", "64", "--decode-tokens", "2", "--page-size", "16",
                     "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    for needle in ("tokens", "throughput", "pages", "prefix", "QSA read", "MLA read", "time by op",
                   "qsa_sparse_attention_paged", "mla_sparse_attention_paged",
                   "[PASS] QSA selections equal brute-force top-k",
                   "[PASS] MLA sparse attention equals dense MLA under the budget",
                   "all checks passed", "24 q / 2 kv heads x 256 (RoPE 64), indexer 4 x 128, R=4",
                   "GLM-5-Next MLA layers [3, 7] ([7] shared): 8 heads, latent 512"):
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
    assert "QSA sparse attention equals dense attention under the budget" in failed
    assert "QSA sparse attention equals dense attention over the selected tokens" in failed
    assert report["checks_passed"] is False


def test_a_wrong_mla_attention_fails_the_checks(capsys, small_configs, monkeypatch):
    import sparsekv.layers.mla as mla_layer

    real = mla_layer.mla_sparse_attention_paged

    def skewed(q, *args, **kwargs):  # drop a small amount from every output: both MLA oracles must notice
        return real(q, *args, **kwargs) * 0.999

    monkeypatch.setattr(mla_layer, "mla_sparse_attention_paged", skewed)
    code, report = _run_json(capsys, ["demo", *small_configs, *SMALL_RUN, "--json"])
    assert code == 1
    failed = {c["name"] for c in report["checks"] if not c["passed"]}
    assert failed == {"MLA sparse attention equals dense MLA under the budget",
                      "MLA sparse attention equals MLA over the selected tokens"}


SMALL_DSA = dict(SMALL_GLM, model_type="glm_moe_dsa", qk_rope_head_dim=4)
del SMALL_DSA["index_kpool"]


@pytest.mark.parametrize("family", ["glm5_next", "glm_moe_dsa"])
def test_demo_with_a_checkpoint(capsys, tmp_path, small_configs, family):
    config = load_config(SMALL_GLM if family == "glm5_next" else SMALL_DSA)
    donor = MlaSlice(config, 64)
    seed_parameters(donor, 3)
    save_checkpoint(tmp_path / "glm", config, slice_state(donor))
    argv = ["demo", small_configs[0], small_configs[1], "--checkpoint", str(tmp_path / "glm"), "--requests", "2",
            "--context", "24", "--decode-tokens", "1", "--page-size", "8", "--step-tokens", "16", "--no-progress",
            "--json"]
    code, report = _run_json(capsys, argv)
    assert code == 0 and report["model"]["mla"]["family"] == family
    assert report["model"]["sources"][1] == f"{family}: checkpoint {tmp_path / 'glm'}"


HF_MLA = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
              qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=16,
              num_hidden_layers=2)


def _hf_config(transformers, family: str):
    """A tiny config of ``family`` built by HF's own config class (both MLA layers indexed, the second shared)."""
    if family == "qwen4_exp":
        return transformers.Qwen4ExpTextConfig(
            hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4)
    if family == "glm5_next":
        return transformers.Glm5NextTextConfig(**HF_MLA, layer_types=["indexed_attention"] * 2,
                                               indexer_types=["full", "shared"], index_kpool=4)
    if family == "glm_moe_dsa":
        return transformers.GlmMoeDsaConfig(**HF_MLA, qk_rope_head_dim=8, indexer_types=["full", "shared"])
    return transformers.DeepseekV32Config(**HF_MLA, qk_rope_head_dim=8)


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next", "glm_moe_dsa", "deepseek_v32"])
def test_demo_takes_the_config_hf_writes_for_each_family(capsys, tmp_path, family):
    transformers = pytest.importorskip("transformers")
    _hf_config(transformers, family).save_pretrained(tmp_path)
    code, report = _run_json(capsys, ["demo", "--config", str(tmp_path / "config.json"), "--requests", "2",
                                      "--context", "64", "--decode-tokens", "2", "--page-size", "16",
                                      "--no-progress", "--json"])
    assert code == 0
    assert [check["name"] for check in report["checks"] if check["passed"]] == CHECK_NAMES
    qsa, mla, sources = report["model"]["qwen4_exp"], report["model"]["mla"], report["model"]["sources"]
    reads = report["sparse_reads"]
    if family == "qwen4_exp":  # the MLA slice keeps its embedded default
        assert (qsa["budget"], qsa["qsa_layers"], mla["family"], mla["heads"]) == (16, [3], "glm5_next", 8)
        assert reads["kv_fraction"] < 0.7
        assert "config" in sources[0] and "embedded default" in sources[1]
    else:
        assert (mla["family"], mla["heads"], mla["index_layers"], mla["full_index_layers"]) == (
            family, 2, [0, 1], [0, 1] if family == "deepseek_v32" else [0])
        assert mla["kpool"] == (4 if family == "glm5_next" else 1)
        assert qsa["heads"] == 24 and reads["mla_latent_fraction"] < 0.7
        assert "embedded default" in sources[0] and "config" in sources[1]


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
    (tmp_path / "glm.json").write_text(json.dumps(SMALL_GLM))
    assert cli.main(["demo", "--config", str(tmp_path / "glm.json"), "--config", str(tmp_path / "glm.json")]) == 2
    assert "the MLA slice is already set by --config" in capsys.readouterr().err


def test_demo_plot(capsys, tmp_path, small_configs):
    plot = tmp_path / "decode.png"
    code = cli.main(["demo", *small_configs, *SMALL_RUN, "--sweep-context", "64", "--plot", str(plot)])
    captured = capsys.readouterr()
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and not plot.exists()
        assert "--plot needs matplotlib" in captured.err
    else:
        assert code == 0 and plot.stat().st_size > 0
        assert "attention time of one decode token" in captured.out


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if the demo starts: a bad output path or ``--tp`` must stop the command first. (``bench``
    prints "running ..." before each benchmark module; the tests check stderr for it.)"""
    import sparsekv.demo

    def refuse(*args, **kwargs):
        raise AssertionError("the demo ran although an argument is unusable")

    monkeypatch.setattr(sparsekv.demo, "run_demo", refuse)


def _with_matplotlib(monkeypatch, present: bool) -> None:
    """Make ``import matplotlib`` succeed (a stand-in module: nothing is plotted) or fail."""
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib") if present else None)


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_bad_plot_paths_fail_before_running(capsys, tmp_path, monkeypatch, no_run, command):
    _with_matplotlib(monkeypatch, True)
    (tmp_path / "a_file").write_text("")
    cases = {
        str(tmp_path / "missing" / "x.png"): "does not exist",
        str(tmp_path / "a_file" / "x.png"): "does not exist",
        str(tmp_path / "plot.txt"): "ending in .png, .svg, .pdf",
        str(tmp_path / "plot"): "ending in .png",
        "/proc/sparsekv-plot.png": "cannot write",
    }
    (tmp_path / "folder.png").mkdir()
    cases[str(tmp_path / "folder.png")] = "expected a file name, got the folder"
    for path, reason in cases.items():
        assert cli.main([command, "--plot", path]) == 2, path
        err = capsys.readouterr().err
        assert f"sparsekv {command}: error: --plot" in err and reason in err and path in err, err
        assert "running" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder.png"]  # no probe file left behind


def test_plot_without_matplotlib_fails_before_running(capsys, tmp_path, monkeypatch, no_run):
    _with_matplotlib(monkeypatch, False)
    for command in ("demo", "bench"):
        assert cli.main([command, "--plot", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert "--plot needs matplotlib" in err and "running" not in err


def test_bench_json_path_fails_before_running(capsys, tmp_path, no_run):
    assert cli.main(["bench", "--quick", "--json", str(tmp_path / "missing" / "rows.json")]) == 2
    err = capsys.readouterr().err
    assert "--json: the folder" in err and "running" not in err
    assert cli.main(["bench", "--quick", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--json: expected a file name, got the folder" in err and "running" not in err


def test_output_path_accepts_new_and_existing_files(tmp_path):
    assert cli.output_path_problem("--plot", str(tmp_path / "new.PNG"), cli.PLOT_SUFFIXES) is None
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    assert cli.output_path_problem("--json", str(existing)) is None
    assert existing.read_text() == "keep" and not (tmp_path / "new.PNG").exists()


def test_demo_sweep_times_sparse_and_dense_sdpa(capsys, small_configs):
    code, report = _run_json(capsys, ["demo", *small_configs, *SMALL_RUN, "--sweep", "--sweep-context", "300",
                                      "--json"])
    assert code == 0
    contexts = [p["context"] for p in report["decode_sweep"]]
    assert contexts == [128, 256, 300]  # powers of two from 128 below --sweep-context, then --sweep-context
    assert all(p["sparse_ms"] > 0 and p["dense_ms"] > 0 and p["dense_layout"] in DENSE_LAYOUTS
               for p in report["decode_sweep"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sdpa_decode_attention_layouts_equal_the_formula(dtype):
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed {seed}")
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, n, head_dim, scale = 6, 2, 37, 20, 0.3
    query, gate = (torch.randn(heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    keys, values = (torch.randn(1, kv_heads, n, head_dim, generator=generator).to(dtype) for _ in range(2))
    kv_of_head = torch.arange(heads) // (heads // kv_heads)
    logits = torch.einsum("hd,hnd->hn", query.float(), keys[0, kv_of_head].float()) * scale
    expected = torch.einsum("hn,hnd->hd", torch.softmax(logits, dim=-1), values[0, kv_of_head].float())
    expected = expected * torch.sigmoid(gate.float())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for layout in DENSE_LAYOUTS:
        got = sdpa_decode_attention(query, keys, values, gate, scale=scale, layout=layout)
        assert got.dtype == dtype and not got.isnan().any()
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="layout"):
        sdpa_decode_attention(query, keys, values, gate, scale=scale, layout="columns")


# ---------------------------------------------------------------------------
# progress bar units
# ---------------------------------------------------------------------------
def test_work_closed_forms_equal_the_sums():
    for first in range(0, 9):
        for last in range(first - 1, 23):
            for cap in (1, 4, 11):
                assert _sum_min(first, last, cap) == sum(min(u, cap) for u in range(first, last + 1))
    for last in range(-1, 30):
        for divisor in (1, 3, 4):
            assert _sum_floor_div(last, divisor) == sum(u // divisor for u in range(1, last + 1))


def _default_work() -> ServingWork:
    qwen = Qwen4ExpSlice(DEFAULT_QWEN, 4096, device="meta")
    mla = MlaSlice(DEFAULT_GLM, 4096, device="meta")
    return ServingWork.for_models(qwen, mla, 4096)


def test_work_counts_the_models_projections():
    q, g, hidden = DEFAULT_QWEN, DEFAULT_GLM, 256
    per_qsa_layer = (hidden * q.num_attention_heads * 2 * q.head_dim + 2 * hidden * q.num_key_value_heads * q.head_dim
                     + q.num_attention_heads * q.head_dim * hidden + hidden * (q.indexer_n_heads + 1) * q.indexer_head_dim)
    per_indexer = (g.q_lora_rank * g.index_n_heads * g.index_head_dim + 2 * hidden * g.index_head_dim
                   + hidden * g.index_n_heads)
    heads, latent = g.num_attention_heads, g.kv_lora_rank
    per_mla_layer = (hidden * g.q_lora_rank + g.q_lora_rank * heads * g.qk_nope_head_dim + hidden * latent
                     + latent * heads * (g.qk_nope_head_dim + g.v_head_dim) + heads * g.v_head_dim * hidden)
    work = _default_work()
    assert work.projection_macs == 2 * per_qsa_layer + 2 * per_mla_layer + per_indexer  # layer 7 is shared
    assert work.qsa_window == 259 and work.mla_window == 259 and work.logits_macs == hidden * 4096
    assert (work.mla_layers, work.kpool_layers, work.mla_attention_macs) == (2, 1, 8 * 1024)


def test_work_makes_prefill_and_decode_steps_comparable():
    work = _default_work()
    prefill = work.step([(1536, 512)])  # one 512-token chunk of a 2048-token prompt
    decode = work.step([(2048, 1)] * 8)  # eight requests decoding at 2048
    # Tokens would say 64; the fixed step cost keeps a prefill step at a few decode steps, as measured.
    assert 3 < prefill / decode < 8
    # Sparse attention reads at most budget + R - 1 tokens, so a decode row costs little more at 32k than at 2k.
    assert work.step([(32768, 1)]) / work.step([(2048, 1)]) < 1.1
    # Rows cost the same split in any chunking, apart from per-chunk and per-step costs.
    assert work.rows(0, 100) == pytest.approx(work.rows(0, 37) + work.rows(37, 100))
    assert work.rows(5, 5) == 0.0


def test_work_remaining_matches_the_steps_of_a_schedule():
    work = ServingWork(projection_macs=1000, qsa_layers=2, qsa_attention_macs=10, qsa_window=11, qsa_ratio=4,
                       qsa_score_macs=3, qsa_compress_macs=2, kpool_layers=1, kpool_score_macs=5, kpool=4,
                       mla_layers=2, mla_attention_macs=6, mla_window=11, logits_macs=7, step_overhead_macs=5000)
    # Two requests of 20 prompt tokens and 3 decode steps each, 16 tokens per step: prefill 16 | 4 + 12 |
    # 1 + 8 (decode of the first, rest of the second), then decodes side by side.
    steps = [[(0, 16)], [(16, 4), (0, 12)], [(20, 1), (12, 8)], [(21, 1), (20, 1)], [(22, 1), (21, 1)],
             [(22, 1)]]
    done = sum(work.step(chunks) for chunks in steps)
    estimate = work.remaining([(0, 20, 3), (0, 20, 3)], step_tokens=16)
    assert estimate == pytest.approx(done, rel=0.02)
    # After the schedule's first three steps (both prompts done, the first request decoded once), the estimate of
    # what is left is exact here.
    assert work.remaining([(21, 20, 2), (20, 20, 3)], step_tokens=16) == pytest.approx(
        sum(work.step(chunks) for chunks in steps[3:]))
    assert work.remaining([], step_tokens=16) == 0.0


class _RecordingBar:
    """The part of a tqdm bar that ``DemoServer.serve`` uses, recording (n, total) after each update."""

    def __init__(self) -> None:
        self.n, self.total, self.history = 0.0, None, []

    def refresh(self) -> None:
        pass

    def update(self, amount: float) -> None:
        self.n += amount
        self.history.append((self.n, self.total))


def test_progress_counts_work_and_ends_full(small_configs):
    options = DemoOptions(configs=[small_configs[1], small_configs[3]], requests=3, context=40, decode_tokens=3,
                          page_size=8, step_tokens=24, shared_prefix=24, progress=False)
    qwen, glm, vocab, _ = build_models(options, torch.device("cpu"), torch.float32)
    server = DemoServer(qwen, glm, options, torch.device("cpu"), torch.float32, num_pages=3 * 6)
    bar = _RecordingBar()
    first_total = None

    def record_first(self_bar=bar):
        nonlocal first_total
        if first_total is None:
            first_total = self_bar.total

    bar.refresh = record_first
    server.serve(make_workload(3, 40, 24, vocab, 0), bar)
    assert len(bar.history) == server.totals.steps
    assert all(n <= total * (1 + 1e-12) for n, total in bar.history)
    assert bar.history[-1][0] == pytest.approx(bar.history[-1][1])  # the bar ends full
    assert [n for n, _ in bar.history] == sorted(n for n, _ in bar.history)
    # The first estimate (prefix hits foreseen) is within a step's cost of the end: 6 steps estimated, 7 run.
    assert first_total == pytest.approx(bar.n, rel=0.2)


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


def test_bench_quick_mla_times_every_peer(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--only", "mla", "--json", str(out_json)]) == 0
    assert "xdense" in capsys.readouterr().out.splitlines()[0].split()
    rows = json.loads(out_json.read_text())
    assert [row["op"] for row in rows] == ["mla_sparse_attention_paged"]
    assert rows[0]["time_ms"] > 0 and set(rows[0]["peers_ms"]) == {"1thread", "reference", "dense", "sdpa", "peak"}


def test_demo_tensor_parallel_check(capsys, small_configs):
    """``--tp 2`` adds the sharded-equals-single-process check to the report and its verdict."""
    code, report = _run_json(capsys, ["demo", *small_configs, *SMALL_RUN, "--json", "--tp", "2"])
    assert code == 0
    tp = report["tensor_parallel"]
    assert tp["tp"] == 2 and tp["passed"] and report["checks_passed"]
    # each rank holds half the main KV heads; the indexer cache is replicated
    assert tp["kv_bytes_per_rank"]["main"] * 2 == tp["kv_bytes_single"]["main"]
    assert tp["kv_bytes_per_rank"]["index"] == tp["kv_bytes_single"]["index"] and tp["all_reduce_calls"] > 0


@pytest.mark.parametrize("tp, message", [("5", "num_attention_heads: 24 heads do not split evenly"),
                                         ("0", "tp: expected a number of ranks >= 1, got 0")])
def test_demo_tensor_parallel_refuses_a_bad_count_before_the_demo_runs(capsys, no_run, tp, message):
    assert cli.main(["demo", "--requests", "2", "--context", "64", "--no-progress", "--tp", tp]) == 2
    err = capsys.readouterr().err
    assert f"--tp {tp}: " in err and message in err
