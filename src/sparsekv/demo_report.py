"""The ``sparsekv demo`` report: a JSON-ready dict and its text form."""

from __future__ import annotations

import torch

from .demo_sweep import DENSE_LABEL, SPARSE_LABEL

#: Published names of the MLA slice's families.
MLA_NAMES = {"glm5_next": "GLM-5-Next", "glm_moe_dsa": "GLM-5", "deepseek_v32": "DeepSeek-V3.2"}

STAGE_LABELS = {
    "embed": "embedding lookup",
    "qsa.project": "QSA q/k/v/gate + indexer projections",
    "qsa.norm_rope": "q/k norms + RoPE",
    "cache.store": "paged store (K, V, raw indexer keys, MLA latent rows)",
    "qsa.store_blocks": "qsa_store_block_keys_paged (the blocks a call completes)",
    "qsa.compress": "qsa_compress_keys_paged (a layer without a block-key cache)",
    "qsa.score": "qsa_block_score",
    "qsa.select": "qsa_select_tokens",
    "qsa.attention": "qsa_sparse_attention_paged",
    "qsa.o_proj": "QSA o_proj",
    "mla.project": "MLA q/kv LoRA projections + norms (+ RoPE)",
    "mla.attention": "mla_sparse_attention_paged (+ W_uk/W_uv absorption)",
    "mla.o_proj": "MLA o_proj",
    "kpool.project": "k-pool indexer projections (q, k, gate, weights)",
    "kpool.pool_store": "k-pool ring close/compress/seed tail + store",
    "kpool.score": "mla_kpool_score",
    "kpool.select": "mla_kpool_expand_topk",
    "next_token": "next token (tied embedding argmax)",
    "manager": "cache manager (claim/allocate/prepare/step/release)",
}


def build_report(server, options, sources: list[str], dtype: torch.dtype, wall_seconds: float,
                 sweep: list[dict] | None) -> dict:
    """Everything the demo measured and checked, as plain JSON-ready values.

    ``server`` is the ``DemoServer`` that served the workload; ``options`` its
    ``DemoOptions`` with ``shared_prefix`` resolved to a token count.
    """
    q, g = server.qwen.config, server.mla.config
    t = server.totals
    metrics = server.manager.metrics()
    attention_usage = metrics.groups["attention"]
    stage_total = sum(server.timer.totals.values())
    serving_seconds = t.prefill_seconds + t.decode_seconds
    breakdown = [
        {"stage": stage, "label": STAGE_LABELS.get(stage, stage), "seconds": seconds,
         "calls": server.timer.calls[stage], "share": seconds / stage_total if stage_total else 0.0}
        for stage, seconds in sorted(server.timer.totals.items(), key=lambda item: -item[1])
    ]
    prompt_tokens = metrics.prefix_query_tokens
    report = {
        "model": {
            "qwen4_exp": {"qsa_layers": list(q.qsa_layers), "hidden_size": q.hidden_size,
                          "heads": q.num_attention_heads, "kv_heads": q.num_key_value_heads,
                          "head_dim": q.head_dim, "rotary_dim": q.rotary_dim,
                          "indexer_heads": q.indexer_n_heads, "indexer_head_dim": q.indexer_head_dim,
                          "ratio": q.indexer_compress_ratio, "budget": q.indexer_budget},
            "mla": {"family": g.model_type, "index_layers": list(g.index_layers),
                    "full_index_layers": list(g.full_index_layers), "hidden_size": g.hidden_size,
                    "heads": g.num_attention_heads, "q_lora_rank": g.q_lora_rank, "kv_lora_rank": g.kv_lora_rank,
                    "qk_nope_head_dim": g.qk_nope_head_dim, "qk_rope_head_dim": g.qk_rope_head_dim,
                    "v_head_dim": g.v_head_dim, "index_heads": g.index_n_heads, "index_head_dim": g.index_head_dim,
                    "kpool": g.index_kpool, "topk": g.index_topk, "mode": g.index_kpool_mode,
                    "select_tail": g.index_kpool > 1 and g.index_kpool_always_select_tail},
            "sources": sources,
        },
        "workload": {"device": str(server.device), "dtype": str(dtype).replace("torch.", ""),
                     "requests": options.requests, "context": options.context,
                     "shared_prefix": options.shared_prefix,
                     "decode_tokens": options.decode_tokens, "step_tokens": options.step_tokens,
                     "page_size": options.page_size, "seed": options.seed},
        "tokens": {"prompt": prompt_tokens, "prefix_hit": metrics.prefix_hit_tokens,
                   "prefill_computed": t.prefill_tokens, "decode": t.decode_tokens,
                   "processed": t.prefill_tokens + t.decode_tokens},
        "throughput": {
            "prefill_tokens_per_s": t.prefill_tokens / t.prefill_seconds if t.prefill_seconds else 0.0,
            "decode_tokens_per_s": t.decode_tokens / t.decode_seconds if t.decode_seconds else 0.0,
            "serving_seconds": serving_seconds, "check_seconds": server.check_seconds,
            "wall_seconds": wall_seconds, "steps": t.steps},
        "pages": {"peak_used": t.peak_pages, "total": metrics.num_pages,
                  "bytes_per_page": server.manager.bytes_per_page,
                  "attention_bytes_per_page": attention_usage.page_bytes},
        "prefix_cache": {"hit_rate": metrics.prefix_hit_rate, "hit_tokens": metrics.prefix_hit_tokens,
                         "query_tokens": metrics.prefix_query_tokens,
                         "requests_hit": metrics.prefix_hit_requests,
                         "requests": metrics.prefix_query_requests},
        "sparse_reads": {
            "kv_bytes_sparse": t.sparse_bytes, "kv_bytes_dense": t.dense_bytes,
            "kv_fraction": t.sparse_bytes / t.dense_bytes if t.dense_bytes else 0.0,
            "decode_kv_fraction": t.decode_sparse_bytes / t.decode_dense_bytes if t.decode_dense_bytes else 0.0,
            "indexer_bytes": t.indexer_bytes,
            "indexer_fraction": t.indexer_bytes / t.dense_bytes if t.dense_bytes else 0.0,
            "mla_latent_bytes_sparse": t.mla_sparse_bytes, "mla_latent_bytes_dense": t.mla_dense_bytes,
            "mla_latent_fraction": t.mla_sparse_bytes / t.mla_dense_bytes if t.mla_dense_bytes else 0.0},
        "time_breakdown": breakdown,
        "checks": [r.to_dict() for r in server.checks.results.values()],
        "checks_passed": server.checks.all_passed,
    }
    if sweep is not None:
        report["decode_sweep"] = sweep
    return report


def _fmt_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_report(report: dict) -> str:
    """The report as text (what ``sparsekv demo`` prints)."""
    m, w, tok = report["model"], report["workload"], report["tokens"]
    q, g = m["qwen4_exp"], m["mla"]
    shared = [layer for layer in g["index_layers"] if layer not in g["full_index_layers"]]
    thr, pages, prefix, reads = report["throughput"], report["pages"], report["prefix_cache"], report["sparse_reads"]
    lines = [
        "sparsekv demo",
        f"  model      Qwen4Exp QSA layers {q['qsa_layers']}: {q['heads']} q / {q['kv_heads']} kv heads x "
        f"{q['head_dim']} (RoPE {q['rotary_dim']}), indexer {q['indexer_heads']} x {q['indexer_head_dim']}, "
        f"R={q['ratio']}, budget {q['budget']}",
        f"             {MLA_NAMES.get(g['family'], g['family'])} MLA layers {g['index_layers']}"
        f"{f' ({shared} shared)' if shared else ''}: {g['heads']} heads, latent {g['kv_lora_rank']} + RoPE "
        f"{g['qk_rope_head_dim']}, nope {g['qk_nope_head_dim']}, v {g['v_head_dim']};",
        f"             indexer {g['index_heads']} x {g['index_head_dim']}, kpool {g['kpool']}"
        f"{' (' + g['mode'] + ')' if g['kpool'] > 1 else ''}"
        f"{', tail' if g['select_tail'] else ''}, topk {g['topk']}",
        *[f"             {source}" for source in m["sources"]],
        f"  workload   {w['requests']} requests x {w['context']} prompt tokens ({w['shared_prefix']} shared) + "
        f"{w['decode_tokens']} decode tokens; {w['step_tokens']} tokens/step, page size {w['page_size']}; "
        f"{w['device']} {w['dtype']}",
        "",
        f"  tokens     prompt {tok['prompt']} = {tok['prefix_hit']} prefix-cache hits + {tok['prefill_computed']} "
        f"computed; decode {tok['decode']}; processed {tok['processed']}",
        f"  throughput prefill {thr['prefill_tokens_per_s']:.0f} tok/s, decode {thr['decode_tokens_per_s']:.1f} tok/s "
        f"({thr['steps']} steps, {thr['serving_seconds']:.1f} s serving + {thr['check_seconds']:.1f} s checks, "
        f"{thr['wall_seconds']:.1f} s wall)",
        f"  pages      peak {pages['peak_used']} / {pages['total']} used ({_fmt_bytes(pages['bytes_per_page'])} "
        f"per page id over all cache groups)",
        f"  prefix     hit rate {prefix['hit_rate']:.1%} ({prefix['hit_tokens']} of {prefix['query_tokens']} prompt "
        f"tokens; {prefix['requests_hit']} of {prefix['requests']} requests hit)",
        f"  sparsity   QSA read {reads['kv_fraction']:.1%} of the dense KV bytes "
        f"({_fmt_bytes(reads['kv_bytes_sparse'])} of {_fmt_bytes(reads['kv_bytes_dense'])}); decode rows "
        f"{reads['decode_kv_fraction']:.1%}; indexer reads add {reads['indexer_fraction']:.1%}",
        f"             MLA read {reads['mla_latent_fraction']:.1%} of the dense latent bytes "
        f"({_fmt_bytes(reads['mla_latent_bytes_sparse'])} of {_fmt_bytes(reads['mla_latent_bytes_dense'])})",
        "",
        "  time by op (serving; checks excluded)",
    ]
    for entry in report["time_breakdown"]:
        lines.append(f"    {entry['label']:<52} {entry['seconds'] * 1e3:9.1f} ms  {entry['share']:6.1%}  "
                     f"({entry['calls']} calls)")
    if "decode_sweep" in report:
        lines += ["", "  attention time of one decode token against context (QSA layers summed, one request)",
                  f"    sparse = {SPARSE_LABEL.removeprefix('sparse: ')}",
                  f"    dense  = {DENSE_LABEL.removeprefix('dense: ')}",
                  "    context   sparse ms   dense ms   dense/sparse   dense layout"]
        for point in report["decode_sweep"]:
            ratio = point["dense_ms"] / point["sparse_ms"] if point["sparse_ms"] else float("nan")
            lines.append(f"    {point['context']:7d}   {point['sparse_ms']:9.2f}   {point['dense_ms']:8.2f}   "
                         f"{ratio:12.2f}   {point['dense_layout']}")
    lines += ["", "  checks"]
    for check in report["checks"]:
        mark = "PASS" if check["passed"] else "FAIL"
        detail = f"{check['comparisons']} comparisons, {check['items']} items"
        if check["max_error"]:
            detail += f", max error {check['max_error']:.2g}"
        if check["failures"]:
            detail += f", {check['failures']} failed: {check['first_failure']}"
        elif not check["comparisons"]:
            detail += " (nothing was compared)"
        lines.append(f"    [{mark}] {check['name']} ({detail})")
    lines.append("  all checks passed" if report["checks_passed"] else "  SOME CHECKS FAILED")
    return "\n".join(lines)


__all__ = ["STAGE_LABELS", "build_report", "format_report"]
