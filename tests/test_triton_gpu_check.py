"""The GPU check script's plumbing, run end to end in Triton's interpreter with tiny shapes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import script_support
from triton_support import require_triton

pytestmark = pytest.mark.triton
require_triton()


def load_script():
    return script_support.load_script("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter smoke run is for CPU-only machines")
def test_interpret_smoke_run_checks_every_kernel(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert load_script().main(["--interpret-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    ops = {row["op"] for row in report["rows"]}
    assert ops >= {"paged_store", "qsa_compress_keys_paged", "qsa_load_block_keys_paged", "qsa_block_score",
                   "qsa_select_tokens", "qsa_sparse_attention_paged", "mla_kpool_compress", "mla_kpool_ring_close",
                   "mla_kpool_seed_tail", "mla_kpool_score", "mla_kpool_expand_topk", "mla_sparse_attention_paged"}
    assert all(row["check"]["ok"] for row in report["rows"]) and not report["errors"]
    printed = capsys.readouterr().out
    assert "target" in printed.splitlines()[-len(report["rows"]) - 3]  # the table comes last


def test_without_cuda_exits_cleanly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_script().main(["--out", str(tmp_path / "unused.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "unused.json").exists()


def test_check_uses_the_tests_spec4_rule():
    import spec4

    script = load_script()
    expected = torch.linspace(-1.0, 1.0, 300).to(torch.bfloat16)
    two_ulps = expected.clone().view(torch.int16)
    two_ulps[7] += 2
    for actual in (expected.clone(), two_ulps.view(torch.bfloat16), torch.full_like(expected, float("nan"))):
        assert script.spec_check(actual, expected) == spec4.spec_close(actual, expected, scale_atol=1e-5)
    assert script.spec_check(two_ulps.view(torch.bfloat16), expected) == (False, "2 ulps apart")
    unwritten = torch.full((4,), float("nan"))  # NaN in both: still an unwritten output
    assert not script.spec_check(unwritten, unwritten.clone())[0]
    assert script.check_all([(torch.tensor([1, 2]), torch.tensor([1, 3]))]) == (False, "1 entries differ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the kernels themselves")
def test_every_kernel_builds_for_hopper_with_the_installed_triton(tmp_path):
    """Triton's whole compiler (not the interpreter the other tests use) down to an sm_90 cubin, into an empty
    cache: a kernel that only fails to build on a GPU fails here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    # bf16 only here (about 20 s); CI builds every dtype on the oldest supported Triton (.ci/run)
    done = subprocess.run([sys.executable, str(script), "--compile-for", "90", "--compile-dtypes", "bfloat16"],
                          env=env, capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, summary
    assert re.search(r" 0 of \d+ cases failed", summary), summary
    assert "kpool._compress_kernel" in summary and "merge_kernel" in summary, summary


def test_compile_dtypes_are_checked(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(["--compile-for", "90", "--compile-dtypes", "bfloat16,int8"])
    assert exit_info.value.code == 2
    refusal = "--compile-dtypes: expected names from bfloat16,float16,float32, got 'bfloat16,int8'"
    assert refusal in capsys.readouterr().err
