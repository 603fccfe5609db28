"""Patched Hugging Face models under a tensor-parallel plan (``tp_plan``).

Qwen4Exp, 2 ranks launched by torchrun over gloo: Hugging Face's plan leaves
the attention's ``q/k/v/o_proj`` whole on every rank and row-shards the
indexer's ``index_qk_proj`` (its forward all-gathers the output), so the
patched model runs replicated attention; greedy tokens must equal the
single-process unpatched model's on every rank. Transformers needs
``accelerate`` for any ``tp_plan``: without it that test skips.

The MLA families' plans split ``q_b_proj``, ``kv_b_proj`` and ``o_proj`` by
heads, which the patched attention does not take: ``patch_model`` refuses
(checked in one process with a weight split as a plan splits it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen4ExpForCausalLM  # noqa: E402

from sparsekv.integrations.transformers import get_manager, patch_model  # noqa: E402
from test_hf_integration import SEED, VOCAB, tiny_config  # noqa: E402
from test_hf_integration_mla import build_model  # noqa: E402

WORKER = Path(__file__).resolve().parent / "hf_tp_worker.py"
NEW_TOKENS = 12
DEADLINE_S = 240


def test_patched_model_under_hf_tp_plan_generates_the_single_process_tokens(tmp_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate for tp_plan")
    torch.manual_seed(SEED)
    model = Qwen4ExpForCausalLM(tiny_config()).eval()
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    model.save_pretrained(checkpoint)
    out.mkdir()
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():  # longer than the indexer budget (8): the patched layers select
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               str(checkpoint), json.dumps(prompt), str(NEW_TOKENS), str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        _, stderr = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:  # SIGTERM: torchrun stops its ranks (each in a session of its own), then exits
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in range(2)]
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    for report in reports:
        assert report["unpatched"] == want and report["patched"] == want
        assert report["sparsekv_cached_tokens"] == len(prompt) + NEW_TOKENS - 1  # the patched run went through sparsekv
        assert report["q_proj"] == ["Parameter", [128, 32]]  # 4 heads x (query + gate) x 16: whole on each rank
        assert report["index_qk_proj"] == ["DTensor", ["Shard(dim=0)"], [72, 32]]  # half of 144 rows per rank


@pytest.mark.parametrize("family, name, dim", [("glm_moe_dsa", "kv_b_proj", 0), ("qwen4_exp", "o_proj", 1)])
def test_patch_refuses_attention_weights_a_tp_plan_split(tmp_path, family, name, dim):
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    torch.manual_seed(SEED)
    model = (build_model(family) if family != "qwen4_exp" else Qwen4ExpForCausalLM(tiny_config())).eval()
    attention = model.model.layers[0].self_attn
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:  # a group of one: the placement, not the rank count, says the weight is split
        shard = distribute_tensor(getattr(attention, name).weight.detach(), DeviceMesh("cpu", [0]), [Shard(dim)])
        getattr(attention, name).weight = nn.Parameter(shard, requires_grad=False)
        with pytest.raises(NotImplementedError, match=f"layer 0's {name} are split over ranks by a tensor-parallel "
                                                      "plan"):
            patch_model(model, page_size=8, num_pages=64)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="is not patched by sparsekv"):  # nothing was patched
        get_manager(model)
