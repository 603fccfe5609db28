"""A Hugging Face Qwen4Exp model, unpatched (eager / sdpa) against sparsekv-patched: prefill and decode.

    python benchmarks/bench_hf.py [--contexts 4096,16384] [--decode-steps 8] [--dtype fp32|bf16]
                                  [--impls eager,sdpa] [--eager-max-context 8192] [--threads N]
                                  [--clock wall|cpu]

The patched side also skips Hugging Face's dense ``[B, 1, T, past + T]``
mask, which the unpatched side builds for its indexer.

A seeded model with the real QSA attention shapes per layer (head_dim 256,
RoPE on 64 channels, 2 KV heads, indexer 4 heads x 128, budget 2048 tokens,
ratio 4) but few and narrow layers (``--layers``, ``--heads``), written with
``save_pretrained`` and loaded back with ``from_pretrained``. For each context
length: one prefill of ``context`` random tokens into a fresh ``DynamicCache``
(only the last position's logits), then ``--decode-steps`` single-token steps.
The indexed-attention modules are timed separately with forward hooks (the
same hooks on both models). ``x`` columns: unpatched time / patched time.
``max|dlogit|``: the largest difference of the last logits between the two
models (a sanity check; the tests hold the exact agreement).

Hugging Face's QSA indexer runs a Python loop over every query and builds
dense ``[queries, keys]`` masks, and eager attention materialises
``[heads, queries, keys]`` float32 weights: eager is skipped above
``--eager-max-context`` (memory), and long contexts take minutes unpatched.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numba
import torch
from transformers import DynamicCache, Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from sparsekv.integrations.transformers import end_generation, get_manager, patch_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench_config(layers: int, heads: int) -> Qwen4ExpTextConfig:
    """``layers`` decoder layers, every second one indexed attention (the last one always)."""
    types = ["indexed_attention" if (layers - 1 - i) % 2 == 0 else "linear_attention" for i in range(layers)]
    return Qwen4ExpTextConfig(
        vocab_size=2048, hidden_size=512, num_hidden_layers=layers, layer_types=types,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, hc_count=2, hc_lowrank=32, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        max_position_embeddings=65536, initializer_range=0.05, pad_token_id=None, bos_token_id=None,
        eos_token_id=None)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


class AttentionTimer:
    """Time spent inside the indexed-attention modules (forward pre-hook to forward hook), on ``clock``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self._start = 0.0
        self._handles = []
        for layer in model.model.layers:
            attention = getattr(layer, "self_attn", None)
            if attention is not None:
                self._handles.append(attention.register_forward_pre_hook(self._enter))
                self._handles.append(attention.register_forward_hook(self._leave))

    def _enter(self, *_):
        self._start = clock()

    def _leave(self, *_):
        self.total += clock() - self._start

    def take(self) -> float:
        value, self.total = self.total, 0.0
        return value


def run_case(model, timer: AttentionTimer, ids: torch.Tensor, steps: torch.Tensor) -> dict:
    """Prefill ``ids [B, T]``, then decode ``steps [B, S]``; seconds per phase and the last logits."""
    cache = DynamicCache(config=model.config)
    timer.take()
    with torch.no_grad():
        start = clock()
        out = model(ids, past_key_values=cache, logits_to_keep=1)
        prefill = clock() - start
        prefill_attention = timer.take()
        decode = 0.0
        for i in range(steps.shape[1]):
            start = clock()
            out = model(steps[:, i:i + 1], past_key_values=cache, logits_to_keep=1)
            decode += clock() - start
    decode_attention = timer.take()
    report = {"prefill": prefill, "prefill_attn": prefill_attention, "decode": decode / steps.shape[1],
              "decode_attn": decode_attention / steps.shape[1], "logits": out.logits[:, -1].float()}
    if getattr(model, "_sparsekv_patch", None) is not None:
        report["pages"] = get_manager(model).metrics().groups["main"].pages_used
        end_generation(cache)
    return report


def set_threads(threads: int | None) -> None:
    """Give torch (the unpatched model's attention) and numba (sparsekv's CPU kernels) the same thread count."""
    if threads:
        torch.set_num_threads(threads)
        numba.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="query heads of the attention (the real model: 24)")
    parser.add_argument("--impls", default="eager,sdpa", help="Hugging Face attention implementations to time")
    parser.add_argument("--eager-max-context", type=int, default=8192)
    parser.add_argument("--hf-max-context", type=int, default=16384, help="skip the unpatched model above this")
    parser.add_argument("--threads", type=int, help="torch and numba threads (default: their own)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the process's CPU time (with --threads 1: the work done, whatever "
                             "else the machine runs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    set_threads(args.threads)
    dtype = DTYPES[args.dtype]
    contexts = [int(c) for c in args.contexts.split(",")]
    impls = [name for name in args.impls.split(",") if name]
    load_before = os.getloadavg()

    torch.manual_seed(args.seed)
    config = bench_config(args.layers, args.heads)
    with tempfile.TemporaryDirectory() as path:
        Qwen4ExpForCausalLM(config).save_pretrained(path)
        models = {name: Qwen4ExpForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=name).eval()
                  for name in impls}
        patched = patch_model(Qwen4ExpForCausalLM.from_pretrained(path, dtype=dtype).eval(),
                              page_size=128, num_pages=args.batch * (max(contexts) + args.decode_steps) // 128 + 8)
    timers = {name: AttentionTimer(model) for name, model in {**models, "sparsekv": patched}.items()}
    warm = torch.randint(0, config.vocab_size, (args.batch, 80))
    for name, model in {**models, "sparsekv": patched}.items():
        run_case(model, timers[name], warm[:, :64], warm[:, 64:66])  # first calls: kernel compiles, allocations
    set_threads(args.threads)

    rows = []
    for context in contexts:
        gen = torch.Generator().manual_seed(args.seed + context)
        ids = torch.randint(0, config.vocab_size, (args.batch, context), generator=gen)
        steps = torch.randint(0, config.vocab_size, (args.batch, args.decode_steps), generator=gen)
        ours = run_case(patched, timers["sparsekv"], ids, steps)
        for name, model in models.items():
            limit = args.eager_max_context if name == "eager" else args.hf_max_context
            peer = run_case(model, timers[name], ids, steps) if context <= limit else None
            for phase in ("prefill", "decode"):
                rows.append((context, phase, name, ours, peer))
            if peer is not None:
                ours["dlogit_" + name] = (peer["logits"] - ours["logits"]).abs().max().item()
        print(f"context {context}: done", flush=True)

    header = ("context", "phase", "peer", "peer ms", "peer attn ms", "sparsekv ms", "sparsekv attn ms",
              "x attn", "x model", "max|dlogit|")
    table = [header]
    for context, phase, name, ours, peer in rows:
        scale = 1e3
        if peer is None:
            cells = ("skipped", "-", f"{ours[phase] * scale:.1f}", f"{ours[phase + '_attn'] * scale:.1f}", "-", "-", "-")
        else:
            cells = (f"{peer[phase] * scale:.1f}", f"{peer[phase + '_attn'] * scale:.1f}",
                     f"{ours[phase] * scale:.1f}", f"{ours[phase + '_attn'] * scale:.1f}",
                     f"{peer[phase + '_attn'] / ours[phase + '_attn']:.1f}", f"{peer[phase] / ours[phase]:.2f}",
                     f"{ours['dlogit_' + name]:.1e}")
        table.append((str(context), phase, name, *cells))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * width for width in widths))
    print(f"batch {args.batch}, {args.dtype}, {args.layers} layers ({sum(t == 'indexed_attention' for t in config.layer_types)} "
          f"indexed), {args.heads} query heads; decode: ms per step over {args.decode_steps} steps after the prefill")
    print(f"{args.clock} clock; torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()}; load average before {load_before[0]:.1f}, after "
          f"{os.getloadavg()[0]:.1f} (on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
