"""The GPU check script's plumbing, run end to end in Triton's interpreter with tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from triton_support import require_triton

pytestmark = pytest.mark.triton
require_triton()

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter smoke run is for CPU-only machines")
def test_interpret_smoke_run_checks_every_kernel(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert load_script().main(["--interpret-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ops = {row["op"] for row in report["rows"]}
    assert ops >= {"paged_store", "qsa_compress_keys_paged", "qsa_block_score", "qsa_select_tokens",
                   "qsa_sparse_attention_paged", "mla_kpool_compress", "mla_kpool_ring_close",
                   "mla_kpool_seed_tail", "mla_kpool_score", "mla_kpool_expand_topk"}
    assert all(row["check"]["ok"] for row in report["rows"]) and not report["errors"]
    printed = capsys.readouterr().out
    assert "target" in printed.splitlines()[-len(report["rows"]) - 3]  # the table comes last


def test_without_cuda_exits_cleanly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_script().main(["--out", str(tmp_path / "unused.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "unused.json").exists()
