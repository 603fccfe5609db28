"""A Hugging Face model with indexed attention, unpatched (eager / sdpa) against sparsekv-patched: prefill and decode.

    python benchmarks/bench_hf.py [--family qwen4_exp|glm5_next|glm_moe_dsa|deepseek_v32]
                                  [--contexts 4096,16384] [--decode-steps 8] [--dtype fp32|bf16]
                                  [--impls eager,sdpa] [--eager-max-context N] [--hf-max-context N]
                                  [--layers N] [--heads N] [--threads N] [--clock wall|cpu] [--contention N]

A seeded model of ``--family`` with the published model's per-layer attention
shapes but few and narrow layers (``--layers``, ``--heads``, hidden size 512,
4 small experts), written with ``save_pretrained`` and loaded back with
``from_pretrained``:

- ``qwen4_exp``: QSA (head_dim 256, RoPE on 64 channels, 2 KV heads, indexer
  4 heads x 128, budget 2048 tokens, ratio 4); every second layer indexed
  (the last one always), the others linear attention.
- ``glm5_next`` (GLM-5-Next, Hugging Face's GLM-5.3-Flash defaults): NoPE MLA
  (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 256, v_head_dim
  256), k-pool indexer 32 heads x 128, top-k 2048 tokens in pools of 16
  (random k-pool compression weights: see :func:`seed_kpool_compression`);
  layers repeat (full indexer, shared selection, linear attention).
- ``glm_moe_dsa`` (GLM-5): MLA (q_lora_rank 2048, kv_lora_rank 512,
  qk_rope_head_dim 64, qk_nope_head_dim 192, v_head_dim 256), DSA indexer
  32 heads x 128, top-k 2048; every layer indexed, each runs its indexer.
- ``deepseek_v32`` (DeepSeek-V3.2): MLA (q_lora_rank 1536, kv_lora_rank 512,
  qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, YaRN RoPE),
  DSA indexer 64 heads x 128, top-k 2048; every layer indexed.

For each context length: one prefill of ``context`` random tokens into a
fresh ``DynamicCache`` (only the last position's logits), then
``--decode-steps`` single-token steps. The indexed-attention modules (the
``self_attn`` of the indexed layers, the module Hugging Face calls) are timed
separately with forward hooks (the same hooks on both models). ``x`` columns:
unpatched time / patched time. ``max|dlogit|``: the largest difference of the
last logits between the two models (a sanity check; the tests hold the exact
agreement), next to the largest logit in the footer.

The patched side also skips Hugging Face's dense ``[B, 1, T, past + T]``
masks where the family has them. Hugging Face's indexers score every query
against every key at once (QSA: a Python loop over the queries with dense
``[queries, keys]`` masks; DSA: float32 ``[queries, index heads, keys]``
scores, GLM-5-Next: the same over pools of 16 keys), and eager attention
materialises ``[heads, queries, keys]`` float32 weights: the unpatched model
is skipped above ``--hf-max-context`` and eager's prefill above
``--eager-max-context`` (eager's decode steps are still timed there, after a
prefill through sdpa into the same cache; memory; the defaults depend on the
family: the DSA indexers' scores make the unpatched prefill's peak about 6 GB
for ``glm_moe_dsa`` and 10 GB for ``deepseek_v32`` at 4096 tokens, four times
that at 8192), and long contexts take minutes unpatched. ``--impls ""`` times the patched model alone.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numba
import torch
import transformers
from transformers import DynamicCache

from sparsekv.bench.common import busy_processes
from sparsekv.integrations.transformers import end_generation, get_manager, patch_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: Settings every benchmark config shares: a small vocabulary, no special tokens, weights at a fixed scale.
COMMON = dict(vocab_size=2048, hidden_size=512, initializer_range=0.05, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)
#: A small MoE for the MLA families (the first layer dense, the others sparse).
SMALL_MOE = dict(intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, n_group=1, topk_group=1)


def qwen4_exp_config(layers: int, heads: int) -> transformers.Qwen4ExpTextConfig:
    """``layers`` decoder layers, every second one indexed attention (the last one always)."""
    types = ["indexed_attention" if (layers - 1 - i) % 2 == 0 else "linear_attention" for i in range(layers)]
    return transformers.Qwen4ExpTextConfig(
        **COMMON, num_hidden_layers=layers, layer_types=types,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, hc_count=2, hc_lowrank=32, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        max_position_embeddings=65536)


def glm5_next_config(layers: int, heads: int) -> transformers.Glm5NextConfig:
    """Layers repeat (indexed with its own indexer, indexed sharing that selection, linear attention).

    A shared layer reuses the selection of the layer right before it
    (Hugging Face passes it from one decoder layer to the next), so it
    follows a full one directly. The vision tower is a token one (text
    prompts never run it).
    """
    types = ["linear_attention" if i % 3 == 2 else "indexed_attention" for i in range(layers)]
    text = transformers.Glm5NextTextConfig(
        **COMMON, **SMALL_MOE, num_hidden_layers=layers, layer_types=types,
        indexer_types=["shared" if i % 3 == 1 else "full" for i in range(layers)],
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048, index_kpool=16, index_kpool_always_select_tail=True,
        linear_head_dim=64, linear_num_heads=4, hc_mult=2, max_position_embeddings=65536)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=512,
                  projection_intermediate_size=16, patch_size=2, image_size=8)
    return transformers.Glm5NextConfig(text_config=text.to_dict(), vision_config=vision)


def glm_moe_dsa_config(layers: int, heads: int) -> transformers.GlmMoeDsaConfig:
    """Every layer indexed attention with its own indexer."""
    return transformers.GlmMoeDsaConfig(
        **COMMON, **SMALL_MOE, num_hidden_layers=layers, first_k_dense_replace=1, indexer_types=["full"] * layers,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=2048, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=65536)


def deepseek_v32_config(layers: int, heads: int) -> transformers.DeepseekV32Config:
    """Every layer indexed attention (DeepSeek-V3.2 has no shared layers), with the published YaRN RoPE."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return transformers.DeepseekV32Config(
        **COMMON, **SMALL_MOE, num_hidden_layers=layers, first_k_dense_replace=1,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        index_n_heads=64, index_head_dim=128, index_topk=2048,
        rope_parameters=yarn, max_position_embeddings=163840)


def seed_kpool_compression(model: torch.nn.Module) -> None:
    """Random k-pool compression weights (GLM-5-Next), in place.

    Hugging Face initialises the gate ``[index_head_dim, hidden]`` to ones:
    every channel's gate logit is then the sum of the token's hidden state,
    large enough that each pool's softmax puts all its weight on one token,
    and pools holding the same token id get bit-identical keys. Their index
    scores tie exactly, which Hugging Face's ``topk`` breaks in no fixed
    order, and the two models' logits part for reasons unrelated to either.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("index_kpool_compress_gate"):
                param.copy_(torch.randn_like(param) * param.shape[-1] ** -0.5)
            elif name.endswith("index_kpool_compress_ape"):
                param.copy_(0.3 * torch.randn_like(param))


@dataclass(frozen=True)
class Family:
    """What the benchmark needs of one model family.

    ``decoder_layers(model)``: the ``nn.ModuleList`` of decoder layers, whose
    ``self_attn`` (on the ``"indexed_attention"`` entries of the text
    config's ``layer_types``) the timers hook. ``eager_max_context`` /
    ``hf_max_context``: defaults of the flags of the same names, sized so the
    unpatched model's dense score tensors fit in memory. ``seed``: applied to
    the freshly initialised model (before saving), where Hugging Face's
    initial values are unusable for a comparison.
    """

    build_config: Callable[[int, int], transformers.PreTrainedConfig]
    model_class: type
    decoder_layers: Callable[[torch.nn.Module], torch.nn.ModuleList]
    layers: int
    heads: int
    eager_max_context: int
    hf_max_context: int
    seed: Callable[[torch.nn.Module], None] | None = None


FAMILIES = {
    "qwen4_exp": Family(qwen4_exp_config, transformers.Qwen4ExpForCausalLM, lambda m: m.model.layers,
                        layers=2, heads=8, eager_max_context=8192, hf_max_context=16384),
    "glm5_next": Family(glm5_next_config, transformers.Glm5NextForConditionalGeneration,
                        lambda m: m.model.language_model.layers,
                        layers=3, heads=8, eager_max_context=8192, hf_max_context=16384,
                        seed=seed_kpool_compression),
    "glm_moe_dsa": Family(glm_moe_dsa_config, transformers.GlmMoeDsaForCausalLM, lambda m: m.model.layers,
                          layers=2, heads=8, eager_max_context=4096, hf_max_context=4096),
    "deepseek_v32": Family(deepseek_v32_config, transformers.DeepseekV32ForCausalLM, lambda m: m.model.layers,
                           layers=2, heads=8, eager_max_context=4096, hf_max_context=4096),
}


def indexed_layers(config: transformers.PreTrainedConfig) -> list[int]:
    """Ids of the layers with indexed attention (the text config's ``layer_types``)."""
    return [i for i, kind in enumerate(config.get_text_config().layer_types) if kind == "indexed_attention"]


def selection_width(config: transformers.PreTrainedConfig) -> int:
    """Tokens an indexed layer selects at most (Qwen4Exp's budget, the DSA top-k)."""
    text = config.get_text_config()
    return text.indexer_budget if hasattr(text, "indexer_budget") else text.index_topk


def describe(config: transformers.PreTrainedConfig) -> str:
    """The attention shapes of ``config``, one line."""
    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None) is None:
        return (f"QSA {text.num_attention_heads} query heads, {text.num_key_value_heads} KV heads x {text.head_dim}; "
                f"indexer {text.indexer_n_heads} heads x {text.indexer_head_dim}, budget {text.indexer_budget}, "
                f"ratio {text.indexer_compress_ratio}")
    kinds = getattr(text, "indexer_types", None) or ["full"] * text.num_hidden_layers  # DeepSeek-V3.2: no sharing
    kinds = ", ".join(f"{i}:{kinds[i]}" for i in indexed_layers(config))
    pool = f" in pools of {text.index_kpool}" if getattr(text, "index_kpool", 1) > 1 else ""
    return (f"MLA {text.num_attention_heads} heads, q_lora_rank {text.q_lora_rank}, kv_lora_rank "
            f"{text.kv_lora_rank}, qk {text.qk_nope_head_dim} nope + {text.qk_rope_head_dim} rope, v "
            f"{text.v_head_dim}; indexer {text.index_n_heads} heads x {text.index_head_dim}, top-k "
            f"{text.index_topk}{pool}; indexers {kinds}")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


class AttentionTimer:
    """Time spent inside the indexed-attention modules (forward pre-hook to forward hook), on ``clock``.

    The modules are the ``self_attn`` of ``layers`` (decoder layers) at the ids ``indexed``.
    """

    def __init__(self, layers: torch.nn.ModuleList, indexed: list[int]) -> None:
        self.total = 0.0
        self._start = 0.0
        self._handles = []
        for i in indexed:
            attention = layers[i].self_attn
            self._handles.append(attention.register_forward_pre_hook(self._enter))
            self._handles.append(attention.register_forward_hook(self._leave))

    def _enter(self, *_):
        self._start = clock()

    def _leave(self, *_):
        self.total += clock() - self._start

    def take(self) -> float:
        value, self.total = self.total, 0.0
        return value


def run_case(model, timer: AttentionTimer, ids: torch.Tensor, steps: torch.Tensor, *,
             prefill_impl: str | None = None) -> dict:
    """Prefill ``ids [B, T]``, then decode ``steps [B, S]``; seconds per phase and the last logits.

    ``prefill_impl``: run the prefill with this Hugging Face attention
    implementation instead (its time is then not reported), e.g. eager decode
    steps after an sdpa prefill where eager's prefill would not fit in memory.
    """
    cache = DynamicCache(config=model.config)
    timer.take()
    own_impl = model.config._attn_implementation
    with torch.no_grad():
        if prefill_impl is not None:
            model.set_attn_implementation(prefill_impl)
        try:
            start = clock()
            out = model(ids, past_key_values=cache, logits_to_keep=1)
            prefill = clock() - start
        finally:
            if prefill_impl is not None:
                model.set_attn_implementation(own_impl)
        prefill_attention = timer.take()
        decode = 0.0
        for i in range(steps.shape[1]):
            start = clock()
            out = model(steps[:, i:i + 1], past_key_values=cache, logits_to_keep=1)
            decode += clock() - start
    decode_attention = timer.take()
    report = {"prefill": prefill, "prefill_attn": prefill_attention, "decode": decode / steps.shape[1],
              "decode_attn": decode_attention / steps.shape[1], "logits": out.logits[:, -1].float()}
    if prefill_impl is not None:
        report["prefill"] = report["prefill_attn"] = None
    if getattr(model, "_sparsekv_patch", None) is not None:
        report["pages"] = get_manager(model).metrics().groups[model._sparsekv_patch.adapter.main_group].pages_used
        end_generation(cache)
    return report


def set_threads(threads: int | None) -> None:
    """Give torch (the unpatched model's attention) and numba (sparsekv's CPU kernels) the same thread count."""
    if threads:
        torch.set_num_threads(threads)
        numba.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen4_exp")
    parser.add_argument("--contexts", default="4096,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the family's, 2 or 3)")
    parser.add_argument("--heads", type=int, help="query heads of the attention (default 8; the real models: "
                                                  "qwen4_exp 24, GLM 64, DeepSeek 128)")
    parser.add_argument("--impls", default="eager,sdpa",
                        help="Hugging Face attention implementations to time (\"\": the patched model alone)")
    parser.add_argument("--eager-max-context", type=int, help="skip eager above this (default: the family's)")
    parser.add_argument("--hf-max-context", type=int,
                        help="skip the unpatched model above this (default: the family's)")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="run with N busy processes competing for the CPUs (stopped at the end)")
    parser.add_argument("--threads", type=int, help="torch and numba threads (default: their own)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the process's CPU time (with --threads 1: the work done, whatever "
                             "else the machine runs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    family = FAMILIES[args.family]
    layers = args.layers or family.layers
    heads = args.heads or family.heads
    eager_max = family.eager_max_context if args.eager_max_context is None else args.eager_max_context
    hf_max = family.hf_max_context if args.hf_max_context is None else args.hf_max_context
    global clock
    clock = CLOCKS[args.clock]
    set_threads(args.threads)
    dtype = DTYPES[args.dtype]
    contexts = [int(c) for c in args.contexts.split(",")]
    impls = [name for name in args.impls.split(",") if name]

    torch.manual_seed(args.seed)
    config = family.build_config(layers, heads)
    vocab = config.get_text_config().vocab_size
    indexed = indexed_layers(config)
    with tempfile.TemporaryDirectory() as path:
        model = family.model_class(config)
        if family.seed is not None:
            family.seed(model)
        model.save_pretrained(path)
        del model
        models = {name: family.model_class.from_pretrained(path, dtype=dtype, attn_implementation=name).eval()
                  for name in impls}
        selecting_prompt = selection_width(config) + 80  # the warm-up prompt past the selection width (below)
        patched = patch_model(family.model_class.from_pretrained(path, dtype=dtype).eval(), page_size=128,
                              num_pages=args.batch * (max(*contexts, selecting_prompt) + args.decode_steps) // 128 + 8)
    timers = {name: AttentionTimer(family.decoder_layers(model), indexed)
              for name, model in {**models, "sparsekv": patched}.items()}
    warm = torch.randint(0, vocab, (args.batch, 80))
    for name, model in {**models, "sparsekv": patched}.items():
        run_case(model, timers[name], warm[:, :64], warm[:, 64:66])  # first calls: kernel compiles, allocations
    # a prompt past the selection width: the patched indexers' compress, score and select kernels load too
    selecting = torch.randint(0, vocab, (args.batch, selecting_prompt))
    run_case(patched, timers["sparsekv"], selecting[:, :-2], selecting[:, -2:])
    set_threads(args.threads)

    rows = []
    largest_logit = 0.0
    with busy_processes(args.contention) as load:
        for context in contexts:
            gen = torch.Generator().manual_seed(args.seed + context)
            ids = torch.randint(0, vocab, (args.batch, context), generator=gen)
            steps = torch.randint(0, vocab, (args.batch, args.decode_steps), generator=gen)
            ours = run_case(patched, timers["sparsekv"], ids, steps)
            largest_logit = max(largest_logit, ours["logits"].abs().max().item())
            for name, model in models.items():
                peer = None
                if context <= (eager_max if name == "eager" else hf_max):
                    peer = run_case(model, timers[name], ids, steps)
                elif name == "eager" and context <= hf_max:  # eager decode steps after an sdpa prefill
                    peer = run_case(model, timers[name], ids, steps, prefill_impl="sdpa")
                for phase in ("prefill", "decode"):
                    rows.append((context, phase, name, ours, peer))
                if peer is not None:
                    ours["dlogit_" + name] = (peer["logits"] - ours["logits"]).abs().max().item()
            if not models:
                rows += [(context, phase, "-", ours, None) for phase in ("prefill", "decode")]
            print(f"context {context}: done", flush=True)

    header = ("context", "phase", "peer", "peer ms", "peer attn ms", "sparsekv ms", "sparsekv attn ms",
              "x attn", "x model", "max|dlogit|")
    table = [header]
    for context, phase, name, ours, peer in rows:
        scale = 1e3
        if peer is None or peer[phase] is None:
            cells = ("skipped" if models else "-", "-", f"{ours[phase] * scale:.1f}",
                     f"{ours[phase + '_attn'] * scale:.1f}", "-", "-", "-")
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
    print(f"{args.family}: batch {args.batch}, {args.dtype}, {layers} layers ({len(indexed)} indexed), hidden "
          f"{config.get_text_config().hidden_size}; {describe(config)}")
    limits = (f"; unpatched skipped above context {hf_max}, eager prefill above {eager_max} (eager decode "
              f"steps then follow an sdpa prefill)" if models else "")
    print(f"decode: ms per step over {args.decode_steps} steps after the prefill{limits}; largest |logit| "
          f"{largest_logit:.2f}")
    print(f"{args.clock} clock; torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()}; "
          f"{load.describe()}")


if __name__ == "__main__":
    main()
