"""One torchrun rank of ``test_hf_tp.py``: a Qwen4Exp checkpoint under ``tp_plan="auto"``, then patched.

    torchrun --standalone --nproc-per-node 2 tests/hf_tp_worker.py CHECKPOINT PROMPT_JSON NEW_TOKENS OUT_DIR

Greedy-generates ``NEW_TOKENS`` tokens from the prompt twice, with Hugging
Face's attention and then through sparsekv (``patch_model``), and writes
``OUT_DIR/rank<r>.json``: both token lists and how the attention weights are held.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen4ExpForCausalLM

from sparsekv.integrations.transformers import get_manager, patch_model


def main() -> None:
    checkpoint, prompt, new_tokens, out_dir = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    model = Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, tp_plan="auto").eval()
    ids = torch.tensor([prompt])

    def generate() -> list[int]:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    unpatched = generate()
    patch_model(model)
    manager, stored = get_manager(model), []
    step = manager.step
    manager.step = lambda rid, tokens: (stored.append(len(tokens)), step(rid, tokens))[1]
    attention = model.model.layers[0].self_attn
    index_proj = attention.indexer.index_qk_proj.weight
    report = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "unpatched": unpatched,
        "patched": generate(),
        "sparsekv_cached_tokens": sum(stored),  # tokens the patched layers stored in sparsekv's pages
        "q_proj": [type(attention.q_proj.weight).__name__, list(attention.q_proj.weight.shape)],
        "index_qk_proj": [type(index_proj).__name__, [repr(p) for p in getattr(index_proj, "placements", ())],
                          list(index_proj.to_local().shape) if hasattr(index_proj, "to_local") else None],
    }
    (Path(out_dir) / f"rank{report['rank']}.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    try:
        main()
    finally:  # a rank that exits with gloo's threads still up aborts ("terminate called without an active exception")
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
