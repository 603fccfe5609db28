"""GPU check: every Triton kernel against the reference on fresh random inputs, then timed at real shapes.

    python benchmarks/gpu_check.py [--quick] [--out gpu_check.json]
    python benchmarks/gpu_check.py --compile-for 90   # no GPU needed: build every kernel for sm_90

Shapes: QSA indexer ``D = 128, R = 4, rotary_dim = 64``, page 128; main
attention 24 query heads, 2 KV heads, ``D = 256``, budget 2048; k-pool
``D = 128, kpool = 4``, 32 heads, top-k 2048. Decode batches ``B = 64`` at 32k
tokens and ``B = 4`` at 128k; prefill ``B = 4`` chunks of 8k rows.
``--quick`` runs one small decode shape.

Peers, measured in the same run (CUDA events, median):

* ``copy``: ``dst.copy_(src)`` of the op's payload, the bandwidth ceiling. An
  op's payload is ``(bytes read + bytes written) / 2`` (a copy of ``n`` bytes
  reads and writes ``n``), so ``xcopy`` = fraction of copy bandwidth reached.
* ``ref``: the PyTorch reference on the GPU (not timed where it loops over
  thousands of rows).
* ``dense``: ``scaled_dot_product_attention`` over the whole context (decode).
* ``topk``: ``torch.topk`` + sort + expansion of the same scores.

Targets (the ``target`` column): memory-bound kernels >= 70% of copy
bandwidth; sparse decode attention at 32k tokens, budget 2048, >= 8x faster
than dense. The ``check`` column is the SPEC 4 comparison with the reference,
the same rule as the kernel tests (``tests/spec4.py``: fp32 within 1e-5
relative, bf16 at most one ulp apart and >= 99% equal, selections exact).
Exit status 1 when a check fails or a case errors.

``--compile-for CC`` needs no GPU: it runs every case at small shapes with the
real head sizes, in bf16, fp16 and fp32 (``--compile-dtypes``), but each
Triton launch only compiles the kernel for CUDA compute capability ``CC``
(Triton's full pipeline down to the cubin) and runs nothing. It fails when a
kernel does not build with the installed Triton; the interpreter, which the
tests use on a CPU, never runs that compiler.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparsekv.bench.common import BenchRow, copy_peer, format_table, time_call

REAL_SHAPES = {
    "qsa": {"dim": 128, "ratio": 4, "rotary": 64, "page": 128},
    "main": {"q_heads": 24, "kv_heads": 2, "dim": 256, "page": 128},
    "kpool": {"dim": 128, "kpool": 4, "heads": 32, "topk": 2048, "page": 128},
    "budget": 2048,
    "dense_target_ctx": 32768,
}
PROFILES = {
    # decode: (batch, context tokens) per decode case; prefill: (batch, new rows per sequence).
    "full": {**REAL_SHAPES, "decode": [(64, 32768), (4, 131072)], "prefill": (4, 8192), "repeat": 20},
    "quick": {**REAL_SHAPES, "decode": [(16, 32768)], "prefill": (1, 2048), "repeat": 5},
    # Compile-only: the real head sizes (which set the kernels' tile shapes), small batches and histories.
    "compile": {**REAL_SHAPES, "decode": [(2, 4096)], "prefill": (4, 64), "repeat": 1},
    # Tiny shapes for running the whole script in Triton's interpreter on a CPU.
    "smoke": {"qsa": {"dim": 32, "ratio": 4, "rotary": 16, "page": 16},
              "main": {"q_heads": 6, "kv_heads": 2, "dim": 32, "page": 16},
              "kpool": {"dim": 32, "kpool": 4, "heads": 4, "topk": 32, "page": 16},
              "budget": 32, "dense_target_ctx": 256, "decode": [(2, 256)], "prefill": (1, 16), "repeat": 1},
}
COPY_TARGET = 0.70
DENSE_TARGET = 8.0
ATTENTION_NOISE_FLOOR = 3e-5
REF_ROW_LIMIT = 256  # the reference loops over rows in Python: only check/time it on this many rows


@dataclass
class Result:
    row: BenchRow
    check: tuple[bool, str]
    target: tuple[str, bool] | None = None
    extra: dict = field(default_factory=dict)


# ---- comparison (SPEC 4) ------------------------------------------------------
def _load_spec4():
    """``tests/spec4.py``, the one definition of SPEC 4 agreement that the kernel tests use too."""
    path = Path(__file__).resolve().parents[1] / "tests" / "spec4.py"
    spec = importlib.util.spec_from_file_location("sparsekv_tests_spec4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPEC4 = _load_spec4()


def spec_check(actual: torch.Tensor, expected: torch.Tensor, *, noise_floor: float = 0.0,
               atol: float = 0.0) -> tuple[bool, str]:
    """SPEC 4 agreement as the kernel tests judge it (``tests/spec4.py``): float32 within 1e-5 relative
    plus 1e-5 of the largest value, 16-bit at most one ulp apart and 99% equal, integers exact."""
    return SPEC4.spec_close(actual, expected, scale_atol=1e-5, noise_floor=noise_floor, atol=atol)


def check_all(pairs, *, noise_floor: float = 0.0) -> tuple[bool, str]:
    results = [spec_check(a, e, noise_floor=noise_floor) for a, e in pairs]
    return all(ok for ok, _ in results), "; ".join(detail for _, detail in results)


def attention_check(actual, expected, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float) -> tuple[bool, str]:
    """SPEC 4 for an attention's ``(out, lse)``: ``out`` with the noise floor and an absolute slack of its
    logits' float32 rounding, ``lse`` as float32.

    A 16-bit output that cancels (1e-4 out of values near 1) moves by the
    rounding of its logits, up to ``2**-22 * scale * sum_d |q_d k_d|`` each,
    times the values it averages: on an H200 such outputs came out 2 bf16 ulps
    from the reference, and within 2 ulps of the float64 result, in the Triton
    kernel's float32 path too (docs/spec-notes.md).
    """
    slack = 2.0**-22 * scale * float(q.float().abs().sum(-1).max()) * float(keys.float().abs().max()) * float(
        values.float().abs().max())
    out_ok, out_detail = spec_check(actual[0], expected[0], noise_floor=ATTENTION_NOISE_FLOOR, atol=slack)
    lse_ok, lse_detail = spec_check(actual[1], expected[1])
    return out_ok and lse_ok, f"{out_detail}; {lse_detail}"


# ---- inputs -------------------------------------------------------------------
class Inputs:
    def __init__(self, device: torch.device, seed: int, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape, dtype=None, scale=1.0):
        x = torch.randn(shape, generator=self.gen, device=self.device) * scale
        return x.to(dtype or self.dtype)

    def paged(self, batch, tokens_per_seq, page, planes, heads, dim, spare=3):
        """Random blocks and a scattered lookup table holding ``tokens_per_seq`` tokens per sequence."""
        pages_per_seq = max(1, math.ceil(tokens_per_seq / page))
        num_pages = batch * pages_per_seq + spare
        blocks = self.randn(num_pages, planes, 1, page, heads, dim)
        perm = torch.randperm(num_pages, generator=self.gen, device=self.device)[: batch * pages_per_seq]
        table = perm.reshape(batch, pages_per_seq).to(torch.int32)
        return blocks, table

    def i32(self, values):
        return torch.as_tensor(values, dtype=torch.int32, device=self.device)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def payload(read: int, written: int) -> int:
    return (read + written) // 2


# ---- cases --------------------------------------------------------------------
class Checker:
    def __init__(self, profile: dict, device: torch.device) -> None:
        from sparsekv.kernels.reference import cache as ref_cache
        from sparsekv.kernels.reference import kpool as ref_kpool
        from sparsekv.kernels.reference import qsa as ref_qsa
        from sparsekv.kernels.reference import select as ref_select
        from sparsekv.kernels.triton import cache, kpool, qsa, select

        self.p, self.device = profile, device
        self.tri = {"cache": cache, "qsa": qsa, "select": select, "kpool": kpool}
        self.ref = {"cache": ref_cache, "qsa": ref_qsa, "select": ref_select, "kpool": ref_kpool}
        self.dtype = torch.bfloat16
        self.seed = 0
        self.compile_only = profile is PROFILES["compile"]

    def inputs(self) -> Inputs:
        self.seed += 1
        return Inputs(self.device, 1000 + self.seed, self.dtype)

    def timed(self, fn: Callable, *, ref: bool = False) -> float:
        if self.compile_only:  # one call builds the kernels; peers and references are not timed
            if not ref:
                fn()
            return float("nan")
        if ref:
            return time_call(fn, device=self.device, warmup=1, repeat=min(3, self.p["repeat"]))
        return time_call(fn, device=self.device, warmup=2 if self.p["repeat"] > 1 else 0, repeat=self.p["repeat"])

    def row(self, op, shape, ours, moved, peers, note="") -> BenchRow:
        return BenchRow(op=op, shape=shape, dtype=str(self.dtype).replace("torch.", ""), backend="triton",
                        time_ms=self.timed(ours), bytes_moved=moved, peers_ms=peers, note=note)

    def copy_target(self, row: BenchRow) -> tuple[str, bool]:
        ratio = row.ratio("copy")
        return f">={COPY_TARGET:.0%} copy: {ratio:.0%}", ratio >= COPY_TARGET

    # -- cache ----------------------------------------------------------------
    def paged_store(self) -> Result:
        batch, rows = self.p["prefill"]
        m = self.p["main"]
        x = self.inputs()
        blocks, table = x.paged(batch, rows, m["page"], 2, m["kv_heads"], m["dim"])
        values = x.randn(batch * rows, m["kv_heads"], m["dim"])
        lengths, offsets = x.i32([0] * batch), x.i32([i * rows for i in range(batch + 1)])
        args = (values, table, lengths, offsets, 1, 0)
        expected, actual = blocks.clone(), blocks.clone()
        self.ref["cache"].paged_store(expected, *args)
        self.tri["cache"].paged_store(actual, *args)
        check = (bool(torch.equal(actual, expected)), "exact" if torch.equal(actual, expected) else "differs")
        moved = nbytes(values)
        peers = {"copy": self.timed(copy_peer(moved, self.device)),
                 "ref": self.timed(lambda: self.ref["cache"].paged_store(expected, *args), ref=True)}
        row = self.row("paged_store", f"B={batch} rows={rows} H={m['kv_heads']} D={m['dim']}",
                       lambda: self.tri["cache"].paged_store(actual, *args), moved, peers)
        return Result(row, check, self.copy_target(row))

    # -- QSA ------------------------------------------------------------------
    def qsa_compress(self, batch: int, ctx: int) -> Result:
        from sparsekv import rope_freqs_cis

        q = self.p["qsa"]
        x = self.inputs()
        blocks, table = x.paged(batch, ctx, q["page"], 2, 1, q["dim"])
        key_counts = x.i32([ctx - b % q["ratio"] for b in range(batch)])  # some end in a partial block
        max_blocks = ctx // q["ratio"]
        gamma = x.randn(q["dim"], scale=0.2)
        freqs = rope_freqs_cis(ctx, q["rotary"], device=self.device)
        args = (gamma, freqs, key_counts, blocks, table, 0, q["ratio"], 1e-6)
        expected = torch.full((batch * max_blocks, q["dim"]), float("nan"), dtype=self.dtype, device=self.device)
        actual = expected.clone()
        self.ref["qsa"].qsa_compress_keys_paged(expected, *args)
        self.tri["qsa"].qsa_compress_keys_paged(actual, *args)
        moved = payload(batch * max_blocks * q["ratio"] * q["dim"] * 2, nbytes(actual))
        peers = {"copy": self.timed(copy_peer(moved, self.device)),
                 "ref": self.timed(lambda: self.ref["qsa"].qsa_compress_keys_paged(expected, *args), ref=True)}
        row = self.row("qsa_compress_keys_paged", f"B={batch} ctx={ctx} D={q['dim']} R={q['ratio']}",
                       lambda: self.tri["qsa"].qsa_compress_keys_paged(actual, *args), moved, peers)
        return Result(row, spec_check(actual, expected), self.copy_target(row))

    def qsa_block_cache(self, batch: int, ctx: int) -> Result:
        """A decode step with a block-key cache: the block each sequence completes stored (checked against the
        reference, bit for bit), then every block read back in compress's layout (timed, against a copy)."""
        from sparsekv import rope_freqs_cis

        q = self.p["qsa"]
        x = self.inputs()
        blocks, table = x.paged(batch, ctx, q["page"], 1, 1, q["dim"])
        per_page = q["page"] // q["ratio"]
        block_blocks = x.randn(blocks.shape[0], 1, 1, per_page, 1, q["dim"])
        key_counts = x.i32([ctx] * batch)
        first = x.i32([ctx // q["ratio"] - 1] * batch)
        freqs = rope_freqs_cis(ctx, q["rotary"], device=self.device)
        args = (x.randn(q["dim"], scale=0.2), freqs, key_counts, first, blocks, table, 0, q["ratio"], 1e-6, 1)
        expected, actual = block_blocks.clone(), block_blocks.clone()
        self.ref["qsa"].qsa_store_block_keys_paged(expected, *args)
        self.tri["qsa"].qsa_store_block_keys_paged(actual, *args)
        stored = bool(torch.equal(actual.view(torch.int16), expected.view(torch.int16)))
        max_blocks = ctx // q["ratio"]
        want = torch.empty(batch * max_blocks, q["dim"], dtype=self.dtype, device=self.device)
        got = torch.full_like(want, float("nan"))
        self.ref["qsa"].qsa_load_block_keys_paged(want, key_counts, expected, table, 0, q["ratio"])
        self.tri["qsa"].qsa_load_block_keys_paged(got, key_counts, actual, table, 0, q["ratio"])
        loaded = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        moved = payload(nbytes(want), nbytes(want))
        peers = {"copy": self.timed(copy_peer(moved, self.device)),
                 "ref": self.timed(lambda: self.ref["qsa"].qsa_load_block_keys_paged(want, key_counts, expected,
                                                                                      table, 0, q["ratio"]), ref=True)}
        row = self.row("qsa_load_block_keys_paged", f"B={batch} ctx={ctx} D={q['dim']} R={q['ratio']}",
                       lambda: self.tri["qsa"].qsa_load_block_keys_paged(got, key_counts, actual, table, 0,
                                                                         q["ratio"]), moved, peers)
        check = (stored and loaded,
                 f"store {'exact' if stored else 'differs'}, load {'exact' if loaded else 'differs'}")
        return Result(row, check, self.copy_target(row))

    def qsa_block_score(self, batch: int, ctx: int) -> Result:
        q = self.p["qsa"]
        x = self.inputs()
        max_blocks = ctx // q["ratio"]
        query = x.randn(batch, 4, q["dim"])
        keys = x.randn(batch * max_blocks, q["dim"])
        positions, offsets = x.i32([ctx - 1] * batch), x.i32(list(range(batch + 1)))
        args = (query, keys, positions, offsets, q["ratio"], q["dim"] ** 0.5)
        expected = torch.full((batch, max_blocks), float("nan"), device=self.device)
        actual = expected.clone()
        self.ref["qsa"].qsa_block_score(expected, *args)
        self.tri["qsa"].qsa_block_score(actual, *args)
        moved = payload(nbytes(query, keys), nbytes(actual))
        peers = {"copy": self.timed(copy_peer(moved, self.device)),
                 "ref": self.timed(lambda: self.ref["qsa"].qsa_block_score(expected, *args), ref=True)}
        row = self.row("qsa_block_score", f"B={batch} ctx={ctx} heads=4 D={q['dim']}",
                       lambda: self.tri["qsa"].qsa_block_score(actual, *args), moved, peers)
        return Result(row, spec_check(actual, expected), self.copy_target(row))

    def select(self, batch: int, ctx: int, ratio: int, budget: int, op: str) -> Result:
        x = self.inputs()
        cols = ctx // ratio
        scores = x.randn(batch, cols, dtype=torch.float32)
        positions = x.i32([ctx - 1 - b for b in range(batch)])
        width = budget + ratio - 1

        def outputs():
            return (torch.full((batch, width), -7, dtype=torch.int32, device=self.device),
                    torch.full((batch,), -7, dtype=torch.int32, device=self.device))

        expected, actual = outputs(), outputs()
        args = (scores, positions, ratio, budget, True)
        self.ref["select"].select_blocks_expand(*expected, *args)
        self.tri["select"].select_blocks_expand(*actual, *args)
        k = budget // ratio
        lanes = torch.arange(ratio, device=self.device)

        def topk_peer():
            chosen = torch.topk(scores, k, dim=1).indices.sort(dim=1).values
            return (chosen[:, :, None] * ratio + lanes).reshape(batch, -1)

        moved = payload(nbytes(scores), nbytes(*actual))
        peers = {"topk": self.timed(topk_peer),
                 "ref": self.timed(lambda: self.ref["select"].select_blocks_expand(*expected, *args), ref=True)}
        row = self.row(op, f"B={batch} ctx={ctx} blocks={cols} k={k}",
                       lambda: self.tri["select"].select_blocks_expand(*actual, *args), moved, peers)
        return Result(row, check_all(zip(actual, expected)))

    def attention_inputs(self, x: Inputs, batch: int, ctx: int, rows_per_seq: int):
        m, ratio, budget = self.p["main"], self.p["qsa"]["ratio"], self.p["budget"]
        blocks, table = x.paged(batch, ctx, m["page"], 2, m["kv_heads"], m["dim"])
        total = batch * rows_per_seq
        width = budget + ratio - 1
        # Each row: budget // ratio random blocks of its visible history, ascending, then -1.
        visible = ctx // ratio
        chosen = torch.rand(total, visible, generator=x.gen, device=self.device).topk(budget // ratio).indices
        tokens = (chosen.sort(dim=1).values[:, :, None] * ratio + torch.arange(ratio, device=self.device)).flatten(1)
        indices = torch.full((total, width), -1, dtype=torch.int32, device=self.device)
        indices[:, :budget] = tokens.to(torch.int32)
        counts = torch.full((total,), budget, dtype=torch.int32, device=self.device)
        q = x.randn(total, m["q_heads"], m["dim"])
        offsets = x.i32([i * rows_per_seq for i in range(batch + 1)])
        return q, blocks, table, indices, counts, offsets

    def sparse_attention(self, batch: int, ctx: int, rows_per_seq: int = 1) -> Result:
        m = self.p["main"]
        x = self.inputs()
        q, blocks, table, indices, counts, offsets = self.attention_inputs(x, batch, ctx, rows_per_seq)
        total, scale = q.shape[0], m["dim"] ** -0.5

        def run(module, out, lse, rows=None):
            if rows is None:
                return module.qsa_sparse_attention_paged(out, lse, q, blocks, table, indices, counts, offsets, 0,
                                                         scale, None)
            # The first ``rows`` rows, all of sequence 0 (rows_per_seq >= rows) or one row per sequence.
            sub_offsets = offsets.clamp(max=rows) if rows_per_seq > 1 else offsets[: rows + 1]
            sub_table = table if rows_per_seq > 1 else table[:rows]
            return module.qsa_sparse_attention_paged(out, lse, q[:rows], blocks, sub_table, indices[:rows],
                                                     counts[:rows], sub_offsets, 0, scale, None)

        def outputs(rows):
            return (torch.full((rows, m["q_heads"], m["dim"]), float("nan"), dtype=self.dtype, device=self.device),
                    torch.full((rows, m["q_heads"]), float("nan"), device=self.device))

        check_rows = min(total, REF_ROW_LIMIT)
        expected, actual = outputs(check_rows), outputs(check_rows)
        run(self.ref["qsa"], *expected, rows=check_rows)
        run(self.tri["qsa"], *actual, rows=check_rows)
        check = attention_check(actual, expected, q[:check_rows], blocks[:, 0], blocks[:, 1], scale)
        full = outputs(total)
        kv_bytes = total * self.p["budget"] * m["kv_heads"] * m["dim"] * 2 * 2
        moved = payload(kv_bytes + nbytes(q, indices), nbytes(full[0]))
        peers = {"copy": self.timed(copy_peer(moved, self.device))}
        if total <= REF_ROW_LIMIT:
            peers["ref"] = self.timed(lambda: run(self.ref["qsa"], *expected, rows=check_rows), ref=True)
        target = None
        if rows_per_seq == 1:
            peers["dense"] = self.dense_decode_ms(x, batch, ctx)
        row = self.row("qsa_sparse_attention_paged",
                       f"B={batch} rows={total} ctx={ctx} budget={self.p['budget']} {m['q_heads']}/{m['kv_heads']}"
                       f"x{m['dim']}", lambda: run(self.tri["qsa"], *full), moved, peers)
        if rows_per_seq == 1 and ctx == self.p["dense_target_ctx"]:
            speedup = row.ratio("dense")
            target = (f">={DENSE_TARGET:.0f}x dense: {speedup:.1f}x", speedup >= DENSE_TARGET)
        return Result(row, check, target)

    def dense_decode_ms(self, x: Inputs, batch: int, ctx: int) -> float:
        """Dense decode peer: flash SDPA of one query row per sequence over all ``ctx`` tokens."""
        m = self.p["main"]
        group = m["q_heads"] // m["kv_heads"]
        keys = x.randn(batch, m["kv_heads"], ctx, m["dim"])
        values = x.randn(batch, m["kv_heads"], ctx, m["dim"])
        # The group's query heads share a KV head: they are the query "rows" of that head.
        query = x.randn(batch, m["kv_heads"], group, m["dim"])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return self.timed(lambda: sdpa(query, keys, values, scale=m["dim"] ** -0.5))

    # -- k-pool -----------------------------------------------------------------
    def kpool_compress(self) -> Result:
        batch, rows = self.p["prefill"]
        kp = self.p["kpool"]
        x = self.inputs()
        k, gate = x.randn(batch * rows, kp["dim"]), x.randn(batch * rows, kp["dim"])
        ape = x.randn(kp["kpool"], kp["dim"], dtype=torch.float32)
        offsets, lengths = x.i32([i * rows for i in range(batch + 1)]), x.i32([0] * batch)
        pools = rows // kp["kpool"]
        pool_offsets = x.i32([i * pools for i in range(batch + 1)])
        args = (k, gate, ape, offsets, pool_offsets, lengths, kp["kpool"], "softmax")
        expected = torch.full((batch * pools, kp["dim"]), float("nan"), dtype=self.dtype, device=self.device)
        actual = expected.clone()
        self.ref["kpool"].mla_kpool_compress(expected, *args)
        self.tri["kpool"].mla_kpool_compress(actual, *args)
        moved = payload(nbytes(k, gate), nbytes(actual))
        peers = {"copy": self.timed(copy_peer(moved, self.device)),
                 "ref": self.timed(lambda: self.ref["kpool"].mla_kpool_compress(expected, *args), ref=True)}
        row = self.row("mla_kpool_compress", f"B={batch} rows={rows} D={kp['dim']} kpool={kp['kpool']}",
                       lambda: self.tri["kpool"].mla_kpool_compress(actual, *args), moved, peers)
        return Result(row, spec_check(actual, expected), self.copy_target(row))

    def kpool_ring(self, batch: int) -> list[Result]:
        kp = self.p["kpool"]
        x = self.inputs()
        kpool, dim = kp["kpool"], kp["dim"]
        k, gate = x.randn(batch, dim), x.randn(batch, dim)  # one decode row per sequence
        ape = x.randn(kpool, dim, dtype=torch.float32)
        offsets = x.i32(list(range(batch + 1)))
        lengths = x.i32([1000 + b for b in range(batch)])  # every phase of the pool grid
        ring = x.randn(batch + 2, 2, kpool, dim)
        slots = torch.randperm(batch + 2, generator=x.gen, device=self.device)[:batch].to(torch.int32)
        closed = [torch.full((batch, dim), float("nan"), dtype=self.dtype, device=self.device) for _ in range(2)]
        ids = [torch.full((batch,), -7, dtype=torch.int32, device=self.device) for _ in range(2)]
        close_args = (ring, slots, k, gate, ape, offsets, lengths, kpool, "softmax")
        self.ref["kpool"].mla_kpool_ring_close(closed[0], ids[0], *close_args)
        self.tri["kpool"].mla_kpool_ring_close(closed[1], ids[1], *close_args)
        rings = [ring.clone(), ring.clone()]
        self.ref["kpool"].mla_kpool_seed_tail(rings[0], slots, k, gate, offsets, lengths, kpool)
        self.tri["kpool"].mla_kpool_seed_tail(rings[1], slots, k, gate, offsets, lengths, kpool)
        results = []
        for op, fn, ref_fn, check, moved in [
            ("mla_kpool_ring_close", lambda: self.tri["kpool"].mla_kpool_ring_close(closed[1], ids[1], *close_args),
             lambda: self.ref["kpool"].mla_kpool_ring_close(closed[0], ids[0], *close_args),
             check_all([(closed[1], closed[0]), (ids[1], ids[0])]), payload(nbytes(k, gate) * kpool, nbytes(k))),
            ("mla_kpool_seed_tail",
             lambda: self.tri["kpool"].mla_kpool_seed_tail(rings[1], slots, k, gate, offsets, lengths, kpool),
             lambda: self.ref["kpool"].mla_kpool_seed_tail(rings[0], slots, k, gate, offsets, lengths, kpool),
             spec_check(rings[1], rings[0]), payload(nbytes(k, gate), nbytes(k, gate))),
        ]:
            peers = {"ref": self.timed(ref_fn, ref=True)}
            results.append(Result(self.row(op, f"B={batch} decode D={dim} kpool={kpool}", fn, moved, peers,
                                           note="latency-bound"), check))
        return results

    def kpool_score(self, batch: int, ctx: int) -> Result:
        kp = self.p["kpool"]
        x = self.inputs()
        pools = ctx // kp["kpool"]
        pools_per_page = kp["page"] // kp["kpool"]
        pooled, table = x.paged(batch, pools, pools_per_page, 1, 1, kp["dim"])
        query = x.randn(batch, kp["heads"], kp["dim"])
        weights = x.randn(batch, kp["heads"], dtype=torch.float32, scale=kp["heads"] ** -0.5)
        positions, offsets = x.i32([ctx - 1] * batch), x.i32(list(range(batch + 1)))
        args = (query, weights, pooled, table, positions, offsets, kp["kpool"], 0)
        expected = torch.full((batch, pools), float("nan"), device=self.device)
        actual = expected.clone()
        self.ref["kpool"].mla_kpool_score(expected, *args)
        self.tri["kpool"].mla_kpool_score(actual, *args)
        moved = payload(batch * pools * kp["dim"] * 2 + nbytes(query, weights), nbytes(actual))
        peers = {"copy": self.timed(copy_peer(moved, self.device)),
                 "ref": self.timed(lambda: self.ref["kpool"].mla_kpool_score(expected, *args), ref=True)}
        row = self.row("mla_kpool_score", f"B={batch} ctx={ctx} heads={kp['heads']} D={kp['dim']}",
                       lambda: self.tri["kpool"].mla_kpool_score(actual, *args), moved, peers)
        return Result(row, spec_check(actual, expected), self.copy_target(row))

    # -- all ----------------------------------------------------------------------
    def cases(self) -> list[tuple[str, Callable[[], Result | list[Result]]]]:
        p, ratio = self.p, self.p["qsa"]["ratio"]
        batch, rows = p["prefill"]
        out = [("paged_store", self.paged_store)]
        for b, ctx in p["decode"]:
            out += [(f"qsa_compress B={b} ctx={ctx}", lambda b=b, c=ctx: self.qsa_compress(b, c)),
                    (f"qsa_block_cache B={b} ctx={ctx}", lambda b=b, c=ctx: self.qsa_block_cache(b, c)),
                    (f"qsa_block_score B={b} ctx={ctx}", lambda b=b, c=ctx: self.qsa_block_score(b, c)),
                    (f"qsa_select B={b} ctx={ctx}",
                     lambda b=b, c=ctx: self.select(b, c, ratio, p["budget"], "qsa_select_tokens")),
                    (f"qsa_attention B={b} ctx={ctx}", lambda b=b, c=ctx: self.sparse_attention(b, c)),
                    (f"kpool_score B={b} ctx={ctx}", lambda b=b, c=ctx: self.kpool_score(b, c))]
        b0, ctx0 = p["decode"][0]
        kp = p["kpool"]
        out += [("qsa_attention prefill",
                 lambda: self.sparse_attention(batch, max(rows, p["budget"] * 2), rows_per_seq=min(rows, 512))),
                ("kpool_compress", self.kpool_compress),
                ("kpool_ring", lambda: self.kpool_ring(b0)),
                ("kpool_expand_topk", lambda: self.select(b0, ctx0, kp["kpool"], kp["topk"], "mla_kpool_expand_topk"))]
        out += mla_attention_cases(self)
        return out


# ---- sparse MLA attention (SPEC 3.4) ---------------------------------------------
# GLM-5 decode: 128 query heads over latent rows of kv_lora_rank 512 + rope 64, top-k 2048, page 64
# (FlashMLA's page size); tiny shapes when the interpreter runs the script on a CPU.
MLA_SHAPES = {"real": {"heads": 128, "rank": 512, "rope": 64, "topk": 2048, "page": 64, "qk_head_dim": 192},
              "smoke": {"heads": 8, "rank": 64, "rope": 16, "topk": 32, "page": 16, "qk_head_dim": 48}}


def mla_attention_cases(checker: Checker) -> list[tuple[str, Callable[[], Result]]]:
    """One sparse MLA decode case per decode shape of the profile: Triton against the reference (first
    ``REF_ROW_LIMIT`` rows), timed next to a copy of its payload and dense absorbed MLA over the whole history."""
    from sparsekv.kernels.reference import mla as ref_mla
    from sparsekv.kernels.triton import mla as tri_mla

    s = MLA_SHAPES["smoke" if checker.p is PROFILES["smoke"] else "real"]
    width = s["rank"] + s["rope"]

    def decode(batch: int, ctx: int) -> Result:
        x = checker.inputs()
        blocks, table = x.paged(batch, ctx, s["page"], 1, 1, width)
        chosen = torch.rand(batch, ctx, generator=x.gen, device=checker.device).topk(s["topk"]).indices
        indices = chosen.sort(dim=1).values.to(torch.int32)
        counts = torch.full((batch,), s["topk"], dtype=torch.int32, device=checker.device)
        q = x.randn(batch, s["heads"], width)
        offsets = x.i32(list(range(batch + 1)))
        scale = s["qk_head_dim"] ** -0.5

        def run(module, out, lse, rows=batch):
            module.mla_sparse_attention_paged(out, lse, q[:rows], blocks, table[:rows], indices[:rows],
                                              counts[:rows], offsets[: rows + 1], 0, scale)

        def outputs(rows):
            return (torch.full((rows, s["heads"], s["rank"]), float("nan"), dtype=checker.dtype,
                               device=checker.device),
                    torch.full((rows, s["heads"]), float("nan"), device=checker.device))

        check_rows = min(batch, REF_ROW_LIMIT)
        expected, actual = outputs(check_rows), outputs(check_rows)
        run(ref_mla, *expected, rows=check_rows)
        run(tri_mla, *actual, rows=check_rows)
        full = outputs(batch)
        moved = payload(batch * s["topk"] * width * 2 + nbytes(q, indices), nbytes(full[0]))
        latent = x.randn(batch, ctx, width)  # the dense peer's history, contiguous (its best case)
        q_lat = x.randn(batch, s["heads"], width)

        def dense():
            torch.softmax(q_lat @ latent.transpose(1, 2) * scale, dim=-1) @ latent[:, :, : s["rank"]]

        peers = {"copy": checker.timed(copy_peer(moved, checker.device)), "dense": checker.timed(dense)}
        if batch <= REF_ROW_LIMIT:
            peers["ref"] = checker.timed(lambda: run(ref_mla, *expected), ref=True)
        row = checker.row("mla_sparse_attention_paged",
                          f"B={batch} ctx={ctx} topk={s['topk']} heads={s['heads']} D={s['rank']}+{s['rope']}",
                          lambda: run(tri_mla, *full), moved, peers)
        target = None
        if ctx == checker.p["dense_target_ctx"]:
            speedup = row.ratio("dense")
            target = (f">={DENSE_TARGET:.0f}x dense: {speedup:.1f}x", speedup >= DENSE_TARGET)
        return Result(row, attention_check(actual, expected, q[:check_rows], blocks, blocks[..., : s["rank"]], scale),
                      target)

    return [(f"mla_attention B={b} ctx={ctx}", lambda b=b, c=ctx: decode(b, c)) for b, ctx in checker.p["decode"]]


def with_columns(table: str, extra: list[tuple[str, list[str]]]) -> str:
    """Append columns to a ``format_table`` table (header, rule, one line per row, legend)."""
    lines = table.splitlines()
    for name, cells in extra:
        width = max([len(name)] + [len(c) for c in cells])
        lines[0] += "  " + name.ljust(width)
        lines[1] += "  " + "-" * width
        for i, cell in enumerate(cells):
            lines[2 + i] += "  " + cell.ljust(width)
    return "\n".join(lines)


def compile_for(capability: int, dtypes: list[torch.dtype]) -> int:
    """Build (never launch) every kernel the cases call in each of ``dtypes``, for CUDA compute capability
    ``capability``.

    Triton's active driver is replaced by one that names that target and no
    device, and every launch becomes a compile-only warm-up, so inputs stay CPU
    tensors. Returns the exit status: 1 when any case raises.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_check: --compile-for needs TRITON_INTERPRET unset (the interpreter compiles nothing)")
        return 1
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

    built: set[str] = set()
    launch = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        built.add(f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}")
        return kernel

    from sparsekv.kernels.triton import _attention

    previous = getattr(driver, "_active", None)  # None: the default driver, made on first use
    sm_count = _attention._sm_count
    driver.set_active(CompileOnlyDriver())
    JITFunction.run = compile_instead
    _attention._sm_count = lambda device: 132  # an H100/H200's: few rows then split their entries, as there
    failures = []
    try:
        checker = Checker(PROFILES["compile"], torch.device("cpu"))
        cases = 0
        for dtype in dtypes:  # each builds its own kernels
            checker.dtype = dtype
            for name, case in checker.cases():
                cases += 1
                try:
                    case()
                except Exception as exc:  # noqa: BLE001 - report every kernel that does not build
                    failures.append(f"{name} {dtype}")
                    print(f"FAILED {name} {dtype}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        JITFunction.run = launch
        driver.set_active(previous)
        _attention._sm_count = sm_count
    import triton

    print(f"Triton {triton.__version__}, sm_{capability}: {len(built)} kernels built ({', '.join(sorted(built))}); "
          f"{len(failures)} of {cases} cases failed ({', '.join(str(d).replace('torch.', '') for d in dtypes)})")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small decode shape, fewer repeats")
    parser.add_argument("--out", default="gpu_check.json", help="JSON file for the full numbers")
    parser.add_argument("--compile-for", type=int, metavar="CC",
                        help="no GPU needed: build every kernel for CUDA compute capability CC (e.g. 90), run none")
    parser.add_argument("--compile-dtypes", default="bfloat16,float16,float32", metavar="LIST",
                        help="with --compile-for: the dtypes to build for (default: %(default)s)")
    parser.add_argument("--interpret-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_for is not None:
        names = [name.strip() for name in args.compile_dtypes.split(",") if name.strip()]
        if not names or any(name not in ("bfloat16", "float16", "float32") for name in names):
            parser.error(f"--compile-dtypes: expected names from bfloat16,float16,float32, got {args.compile_dtypes!r}")
        return compile_for(args.compile_for, [getattr(torch, name) for name in names])
    if args.interpret_smoke:
        # The interpreter must be on before any Triton kernel module is imported.
        os.environ["TRITON_INTERPRET"] = "1"
        device, profile_name = torch.device("cpu"), "smoke"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check. Run it on a machine with an NVIDIA GPU.")
        return 0
    else:
        device, profile_name = torch.device("cuda"), ("quick" if args.quick else "full")
    checker = Checker(PROFILES[profile_name], device)
    results: list[Result] = []
    failures: list[str] = []
    for name, case in checker.cases():
        try:
            produced = case()
        except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
            continue
        for result in produced if isinstance(produced, list) else [produced]:
            results.append(result)
            if not result.check[0]:
                failures.append(f"{result.row.op} {result.row.shape}: {result.check[1]}")
            print(f"  {result.row.op:28s} {result.row.shape:48s} {result.row.time_ms:9.3f} ms  "
                  f"check {'ok' if result.check[0] else 'FAIL'} ({result.check[1]})", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "profile": profile_name, "torch": torch.__version__,
        "rows": [dict(r.row.to_dict(), check={"ok": r.check[0], "detail": r.check[1]},
                      target=None if r.target is None else {"what": r.target[0], "met": r.target[1]})
                 for r in results],
        "errors": failures,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    targets = [r.target for r in results if r.target is not None]
    print(f"\n{len(results)} rows, {sum(r.check[0] for r in results)} checks ok, "
          f"{sum(met for _, met in targets)}/{len(targets)} targets met; numbers in {args.out}")
    for failure in failures:
        print(f"FAILED {failure}")
    if results:
        table = format_table([r.row for r in results])
        checks = [("ok" if r.check[0] else "FAIL") for r in results]
        verdicts = ["-" if r.target is None else f"{'PASS' if r.target[1] else 'FAIL'} {r.target[0]}"
                    for r in results]
        print(with_columns(table, [("check", checks), ("target", verdicts)]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
