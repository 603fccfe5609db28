"""The demo's decode sweep: attention time of one decode token, QSA against dense torch SDPA, and its plot.

At each context ``c`` the QSA layers see one decode token at position ``c``;
two things are timed per layer (the best of 7 calls) and summed over the
QSA layers:

* **sparse (QSA)**: what sparse attention costs in full, read from the paged
  cache: ``qsa_compress_keys_paged`` + ``qsa_block_score`` +
  ``qsa_select_tokens`` + ``qsa_sparse_attention_paged`` (output gate included);
* **dense (torch SDPA)**: ``torch.nn.functional.scaled_dot_product_attention``
  over all ``c + 1`` tokens of the same history, times the same gate. Its K/V
  are gathered from the pages into contiguous tensors beforehand and that
  gather is not timed, so the dense side is measured at its best.

SDPA has two ways to run grouped-query attention; both are timed at each
point and the faster one is kept (``dense_layout``): ``"rows"`` lays the query
heads sharing a KV head out as the rows of one query matrix
(``[1, kv_heads, heads / kv_heads, D]`` against ``[1, kv_heads, n, D]``);
``"enable_gqa"`` passes ``[1, heads, 1, D]`` with ``enable_gqa=True``. On a
loaded 2-core CPU (torch 2.13, 24 query / 2 KV heads of 256, float32 and
bfloat16, 1024 and 8192 tokens, one or two threads) ``"rows"`` was the faster
every time, by 3x to 30x at 8192 tokens.

The readable dense oracle the demo's checks use (``dense_causal_attention``)
is not timed here: it is written for clarity, not speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .ops.qsa import qsa_sparse_attention_paged

DENSE_LAYOUTS = ("rows", "enable_gqa")
SPARSE_LABEL = "sparse: QSA compress + score + select + sparse attention (paged)"
DENSE_LABEL = "dense: torch SDPA over the whole history (contiguous K/V, faster GQA layout)"


def sweep_contexts(context: int) -> list[int]:
    """Powers of two from 128 below ``context``, then ``context``: ``sweep_contexts(300) == [128, 256, 300]``."""
    points, c = [], 128
    while c < context:
        points.append(c)
        c *= 2
    return points + [context]


def best_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """The shortest wall time of ``fn()`` over ``repeats`` calls after one warm-up call, in ms.

    The minimum rather than the median: on a shared machine the slower calls
    measure the other processes as much as ``fn``.
    """
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def sdpa_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gate: torch.Tensor, *,
                          scale: float, layout: str) -> torch.Tensor:
    """One decode row's gated attention over a contiguous history with torch SDPA.

    Args:
        query: ``[heads, D]``; head ``h`` reads KV head ``h // (heads / kv_heads)``.
        keys, values: ``[1, kv_heads, n, D]`` contiguous, same dtype as ``query``.
        gate: ``[heads, D]`` output gate logits.
        scale: softmax scale.
        layout: ``"rows"`` or ``"enable_gqa"`` (see the module docstring).

    Returns ``[heads, D]`` in ``query``'s dtype: ``softmax(q K^T * scale) V * sigmoid(gate)``.
    """
    heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    if layout == "rows":
        attended = F.scaled_dot_product_attention(query.reshape(1, kv_heads, heads // kv_heads, head_dim), keys,
                                                  values, scale=scale)
    elif layout == "enable_gqa":
        attended = F.scaled_dot_product_attention(query.reshape(1, heads, 1, head_dim), keys, values, scale=scale,
                                                  enable_gqa=True)
    else:
        raise ValueError(f"layout: expected one of {DENSE_LAYOUTS}, got {layout!r}")
    return attended.reshape(heads, head_dim) * torch.sigmoid(gate.float()).to(query.dtype)


def run_decode_sweep(server, vocab: int, contexts: list[int]) -> list[dict]:
    """Attention time of one decode token, QSA against dense SDPA, at each context of ``contexts``.

    ``server`` is the demo's ``DemoServer`` (its manager, Qwen4Exp slice,
    options and device). A fresh request in its own prefix-cache namespace is
    prefilled chunk by chunk up to each context ``c``; one decode token then
    runs through the slice (storing its keys at position ``c``), and both
    attentions of that row are timed without committing it (the next chunk
    overwrites position ``c``). Returns one dict per context: ``context``,
    ``sparse_ms``, ``dense_ms``, ``dense_layout``.
    """
    mgr, qwen, device, step_tokens = server.manager, server.qwen, server.device, server.options.step_tokens
    generator = torch.Generator().manual_seed(server.options.seed + 99)
    prompt = torch.randint(0, vocab, (contexts[-1] + 1,), generator=generator).tolist()
    rid = "decode-sweep"
    mgr.claim(rid, prompt, namespace="decode-sweep")
    computed, points = 0, []

    def synchronized(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    try:
        for target in contexts:
            while computed < target:
                n = min(step_tokens, target - computed)
                mgr.allocate(rid, n)
                batch = mgr.prepare([rid], [n])
                with torch.no_grad():
                    qwen(torch.tensor(prompt[computed:computed + n], device=device),
                         input_row_offsets=batch.input_row_offsets, kv_cache=batch.collection("attention"),
                         index_cache=batch.collection("qsa_indexer"))
                mgr.step(rid, prompt[computed:computed + n])
                computed += n
            mgr.allocate(rid, 1)
            batch = mgr.prepare([rid], [1])
            kv_cache, index_cache = batch.collection("attention"), batch.collection("qsa_indexer")
            offsets = batch.input_row_offsets
            with torch.no_grad():
                _, results = qwen(torch.tensor(prompt[computed:computed + 1], device=device),
                                  input_row_offsets=offsets, kv_cache=kv_cache, index_cache=index_cache)
            history = torch.arange(target + 1, device=device)
            sparse_calls, dense_inputs = [], []
            for layer, (attention, result) in enumerate(zip(qwen.attentions, results)):
                freqs_cis = attention.rotary.table(kv_cache.max_cache_length + kv_cache.max_seq_length)

                def sparse(attention=attention, result=result, layer=layer, freqs_cis=freqs_cis) -> None:
                    indices, counts = attention.indexer.select(result.index_q, index_cache, layer, result.positions,
                                                               offsets, freqs_cis)
                    qsa_sparse_attention_paged(result.query, kv_cache, layer, indices, counts, offsets,
                                               scale=attention.scale, gate=result.gate)

                sparse_calls.append(sparse)
                keys = kv_cache.get_key_cache(layer).load(0, history).transpose(0, 1)[None].contiguous()
                values = kv_cache.get_value_cache(layer).load(0, history).transpose(0, 1)[None].contiguous()
                dense_inputs.append((result.query[0], keys, values, result.gate[0], attention.scale))

            def dense(layout: str) -> None:
                for query, keys, values, gate, scale in dense_inputs:
                    sdpa_decode_attention(query, keys, values, gate, scale=scale, layout=layout)

            sparse_ms = best_ms(synchronized(lambda: [call() for call in sparse_calls]))
            dense_ms = {}
            for layout in DENSE_LAYOUTS:
                try:
                    dense_ms[layout] = best_ms(synchronized(lambda layout=layout: dense(layout)))
                except TypeError:  # enable_gqa needs torch >= 2.5
                    continue
            layout = min(dense_ms, key=dense_ms.get)
            points.append({"context": target, "sparse_ms": sparse_ms, "dense_ms": dense_ms[layout],
                           "dense_layout": layout})
    finally:
        mgr.release(rid)
    return points


def write_plot(points: list[dict], path: str, title: str) -> None:
    """The sweep as a PNG/SVG/PDF (chosen by ``path``'s suffix; needs matplotlib): time against context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [p["context"] for p in points]
    layouts = sorted({p["dense_layout"] for p in points})
    figure, axes = plt.subplots(figsize=(7, 5))
    axes.plot(contexts, [p["sparse_ms"] for p in points], marker="o", label=SPARSE_LABEL)
    axes.plot(contexts, [p["dense_ms"] for p in points], marker="s",
              label=f"{DENSE_LABEL}; used: {', '.join(layouts)}")
    axes.set_xscale("log", base=2)
    axes.set_xticks(contexts, [str(c) for c in contexts])
    axes.set_yscale("log")
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("attention time per decode token (ms, best of 7)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


__all__ = ["DENSE_LABEL", "DENSE_LAYOUTS", "SPARSE_LABEL", "best_ms", "run_decode_sweep", "sdpa_decode_attention",
           "sweep_contexts", "write_plot"]
