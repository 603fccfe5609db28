"""Decode step time and all-reduce share of head-sharded QSA attention at TP 1 and 2 (CPU processes over gloo).

A Qwen4Exp QSA slice with the real head geometry (24 query / 2 KV heads of
256 channels, indexer 4 x 128, R = 4) over a narrower residual stream
(``--hidden``) serves ``--batch`` requests: one prefill of ``--context``
tokens each (not timed), then ``--steps`` decode steps, each timed from a
barrier to the end of the slice's forward. Every configuration runs in the
same invocation, through the same launcher (a gloo group of 1 for TP 1):

* TP 1 on 1 thread and on 2 threads (the cores TP 2 uses);
* TP 2, one thread per rank.

The all-reduce column is the stage timer's ``tp.all_reduce`` per step (one
``[batch, hidden]`` float32 all-reduce per layer). Run on a shared machine,
the figures are only comparable within one run.

    python benchmarks/bench_tp.py [--hidden 1024] [--batch 4] [--context 512] [--steps 20] [--contention N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsekv.bench.common import busy_processes
from sparsekv.cache.manager import PagedKVCacheManager
from sparsekv.demo import StageTimer, seed_parameters
from sparsekv.demo_tp import cache_groups, launch
from sparsekv.layers import Qwen4ExpConfig, Qwen4ExpSlice
from sparsekv.layers.checkpoint import open_checkpoint, save_checkpoint, slice_state
from sparsekv.layers.tensor_parallel import load_tensor_parallel_weights

VOCAB = 1024


@dataclass(frozen=True)
class Case:
    hidden: int
    batch: int
    context: int
    steps: int
    page_size: int = 64


def config_for(hidden: int) -> Qwen4ExpConfig:
    return Qwen4ExpConfig(hidden_size=hidden, num_hidden_layers=8, qsa_layers=(3, 7), num_attention_heads=24,
                          num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, rope_theta=1e7,
                          indexer_n_heads=4, indexer_head_dim=128, indexer_compress_ratio=4, indexer_budget=256)


def decode_rank(process_group: dist.ProcessGroup, checkpoint: str, case: Case) -> dict:
    """One rank: load its slices, prefill, time ``case.steps`` decode steps."""
    config, reader = open_checkpoint(checkpoint)
    model = Qwen4ExpSlice(config, VOCAB, process_group=process_group)
    load_tensor_parallel_weights(model, reader)
    pages = case.batch * (-(-(case.context + case.steps + 4) // case.page_size))
    manager = PagedKVCacheManager(cache_groups(model, torch.float32, case.page_size), page_size=case.page_size,
                                  num_pages=pages)
    generator = torch.Generator().manual_seed(1)
    rids = [f"r{i}" for i in range(case.batch)]
    for rid in rids:
        manager.claim(rid)

    def step(tokens_per_request: int, timer) -> None:
        for rid in rids:
            manager.allocate(rid, tokens_per_request)
        batch = manager.prepare(rids, tokens_per_request)
        token_ids = torch.randint(0, VOCAB, (case.batch * tokens_per_request,), generator=generator)
        with torch.no_grad():
            model(token_ids, input_row_offsets=batch.input_row_offsets, kv_cache=batch.collection("main"),
                  index_cache=batch.collection("index"), timer=timer,
                  block_cache=batch.collection("index_blocks") if "index_blocks" in batch.groups else None)
        for rid in rids:
            manager.step(rid, [0] * tokens_per_request)

    step(case.context, StageTimer(torch.device("cpu")))
    step(1, StageTimer(torch.device("cpu")))  # warm-up
    timer = StageTimer(torch.device("cpu"))
    times = []
    for _ in range(case.steps):
        dist.barrier(group=process_group)
        started = time.perf_counter()
        step(1, timer)
        times.append(time.perf_counter() - started)
    main_bytes = manager.blocks("main").numel() * manager.blocks("main").element_size()
    return {"step_s": statistics.median(times), "all_reduce_s": timer.totals.get("tp.all_reduce", 0.0) / case.steps,
            "main_kv_bytes": main_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    args = parser.parse_args()
    case = Case(args.hidden, args.batch, args.context, args.steps)
    config = config_for(case.hidden)
    full = Qwen4ExpSlice(config, VOCAB)
    seed_parameters(full, 0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparsekv-bench-tp-") as checkpoint, \
            busy_processes(args.contention) as load:
        save_checkpoint(checkpoint, config, slice_state(full))
        for ranks, threads in ((1, 1), (1, 2), (2, 1)):
            results = launch(decode_rank, ranks, checkpoint, case, timeout_s=900, threads_per_rank=threads)
            step_s = max(r["step_s"] for r in results)
            all_reduce_s = max(r["all_reduce_s"] for r in results)
            rows.append((ranks, threads, step_s, all_reduce_s, results[0]["main_kv_bytes"]))
    base = rows[0][2]
    print(f"QSA slice: 2 layers, 24 q / 2 kv heads x 256, hidden {case.hidden}, batch {case.batch}, "
          f"context {case.context}, {case.steps} decode steps, float32, gloo; cpu count {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f} (shared machine: compare rows of this run only)")
    print(f"{'TP':>3} {'threads/rank':>12} {'step ms':>9} {'all-reduce ms':>14} {'share':>6} "
          f"{'main KV MiB/rank':>17} {'TP1x1 / this':>13}")
    for ranks, threads, step_s, all_reduce_s, kv_bytes in rows:
        print(f"{ranks:>3} {threads:>12} {step_s * 1e3:>9.2f} {all_reduce_s * 1e3:>14.3f} "
              f"{all_reduce_s / step_s:>6.1%} {kv_bytes / 2**20:>17.2f} {base / step_s:>13.2f}")
    print(load.describe())


if __name__ == "__main__":
    main()
