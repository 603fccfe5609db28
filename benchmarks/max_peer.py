"""Peer benchmark: Modular MAX's own CPU kernels for QSA key compression and block scoring.

Times MAX's graph ops ``mo.qsa.compress_keys.paged`` (SPEC 2.2) and
``qsa_block_score`` (SPEC 2.3) on the CPU, at the real QSA shapes, so that
sparsekv's numbers can be read next to them. MAX is never a dependency of
sparsekv: this script runs only in the separate environment that
``benchmarks/setup_max_peer.sh`` builds (``.venv-max``)::

    bash benchmarks/setup_max_peer.sh
    .venv-max/bin/python benchmarks/max_peer.py --op compress --batch 4 --keys 8192 --dtype bf16 --json --check

Shapes (fixed, those of the Qwen4Exp indexer): head dim ``D = 128``, ratio
``R = 4``, ``rotary_dim = 64``, RoPE theta ``1e7`` (``sparsekv.rope_freqs_cis``),
RMSNorm eps ``1e-6``, page size 128, one key head, one layer, pages scattered
at random through a pool with spare pages. Sequence ``b`` holds
``keys - b`` raw keys, so sequences after the first end in a partial block.

* ``compress``: one decode step (``cache_lengths = key_counts - 1``,
  ``max_prompt_length = 1``) that pools every complete block of every
  sequence; ``max_blocks = keys // 4`` rows per sequence.
* ``block_score``: decode-like rows, 4 query rows per sequence at the
  sequence's last 4 positions, 4 index heads, against random unit-scale block
  keys (``max_blocks = keys // 4``, ``out_cols = max_blocks``), score scale
  ``sqrt(128)``.

The graph is compiled once (not timed; MAX caches compiled graphs on disk, so
a repeated configuration compiles in seconds). ``median_ms`` and ``min_ms``
are the median and fastest wall time of ``model.execute`` over ``--repeat``
calls after two warm-up calls. Inputs are MAX buffers that alias the torch
tensors, so no input copy is timed; the output is allocated by MAX inside
each call. MAX chooses its own number of worker threads from the CPUs the
process may use; ``--threads N`` pins the process to N CPUs first (MAX's own
``num_threads`` setting aborts the process in 26.7). ``load_1min`` (the
machine's load average) says how busy the CPU was around the run.

``bytes_moved`` is the least traffic the op needs: compress reads the raw keys
of every complete block, the ``freqs_cis`` rows of the block starts and
``gamma``, and writes every block-key row; block score reads ``q``, each
sequence's visible block keys once, and writes the float32 scores.

``--check`` runs sparsekv's reference (``SPARSEKV_BACKEND=reference``, or the
backend named by ``--against``) on the same inputs and reports, for MAX's
first output: the largest absolute and relative differences, the largest
difference relative to the output's scale, the largest distance in units in
the last place, whether the outputs agree bit for bit, and whether they meet
SPEC 4's tolerance for the output dtype (block scores are float32 for every
input dtype). It also compares every later call's output with the first, bit
for bit, and reports any call that differs.

``--serve`` builds the graph and inputs once, makes two warm-up calls, and
then times calls on request, so that a benchmark can time MAX in the same
rounds as its own calls (``sparsekv.bench.remote``): it prints
``{"ready": true, ...}`` (the case: op, shape, ``bytes_moved``, MAX's
version, ``compile_s``), then answers each stdin line ``{"calls": n,
"warmup": w}`` with ``{"calls": n, "seconds": s}``, the wall time of ``n``
``model.execute`` calls after ``w`` untimed ones, until stdin ends. Anything
else the process prints goes to stderr::

    echo '{"calls": 5, "warmup": 1}' | .venv-max/bin/python benchmarks/max_peer.py --op compress --serve
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

try:
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
except ImportError as exc:  # pragma: no cover - depends on the environment
    sys.exit(f"max_peer: Modular MAX is not importable here ({exc}); build the separate environment with "
             "`bash benchmarks/setup_max_peer.sh` and run this script with `.venv-max/bin/python`.")

import sparsekv

HEAD_DIM = 128
RATIO = 4
ROTARY_DIM = 64
PAGE_SIZE = 128
ROPE_THETA = 1e7
RMS_EPS = 1e-6
INDEX_HEADS = 4
ROWS_PER_SEQUENCE = 4
SCORE_SCALE = math.sqrt(HEAD_DIM)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MAX_DTYPES = {torch.bfloat16: DType.bfloat16, torch.float32: DType.float32}
# Same-width integer views, to compare floats bit for bit and count ulps.
INT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@dataclass
class Case:
    """One benchmark input set: the MAX graph's input types, its argument
    buffers (aliasing torch tensors), a closure computing the sparsekv output
    for ``--check``, and which output rows MAX defines (compress leaves the
    rows past a sequence's complete blocks unwritten; SPEC 2.2 zeroes them)."""

    input_types: list
    max_args: list
    sparsekv_output: Callable[[], torch.Tensor]
    defined_rows: torch.Tensor  # bool [output rows]
    bytes_moved: int
    extra: dict


def key_counts_for(batch: int, keys: int) -> torch.Tensor:
    """Raw keys per sequence: ``keys - b`` for sequence ``b`` (int32 ``[batch]``)."""
    return (keys - torch.arange(batch, dtype=torch.int64)).to(torch.int32)


def scattered_lookup_table(batch: int, pages_per_seq: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """An int32 ``[batch, pages_per_seq + 1]`` table of distinct random pages, last column unassigned.

    The pool has one spare page per eight used ones, so page ids are spread
    over a larger range than the batch needs. Returns the table and the
    number of pages in the pool.
    """
    used = batch * pages_per_seq
    num_pages = used + used // 8 + 1
    pages = torch.randperm(num_pages, generator=generator)[:used].to(torch.int32).reshape(batch, pages_per_seq)
    sentinel = torch.full((batch, 1), sparsekv.SENTINEL, dtype=torch.int32)
    return torch.cat([pages, sentinel], dim=1), num_pages


def uint32(t: torch.Tensor) -> np.ndarray:
    """An int32 index tensor as the uint32 array MAX's KV ops take (``-1`` becomes ``0xFFFFFFFF``)."""
    return np.array(t.to(torch.int32).numpy(), copy=True).view(np.uint32)  # owns its memory


def as_buffer(value: torch.Tensor | np.ndarray) -> Buffer:
    """A MAX buffer aliasing ``value`` (no copy)."""
    if isinstance(value, np.ndarray):
        return Buffer.from_numpy(value)
    return Buffer.from_dlpack(value.contiguous())


def make_compress_case(batch: int, keys: int, dtype: torch.dtype, seed: int) -> Case:
    """A decode step of the indexer cache: sequence ``b`` holds ``keys - b`` raw keys, one just written.

    Example: ``batch = 2, keys = 1024``: key counts ``[1024, 1023]``, 256 block
    rows per sequence (the second sequence's last row is zero: 1023 // 4 = 255),
    8 + 1 lookup columns per sequence (1024 / 128 pages, plus an unassigned one).
    """
    generator = torch.Generator().manual_seed(seed)
    key_counts = key_counts_for(batch, keys)
    cache_lengths = key_counts - 1
    max_blocks = keys // RATIO
    pages_per_seq = -(-keys // PAGE_SIZE)
    lookup_table, num_pages = scattered_lookup_table(batch, pages_per_seq, generator)
    blocks = torch.zeros(num_pages, 2, 1, PAGE_SIZE, 1, HEAD_DIM, dtype=dtype)
    blocks[:, 0] = torch.randn(num_pages, 1, PAGE_SIZE, 1, HEAD_DIM, generator=generator).to(dtype)
    gamma = (0.1 * torch.randn(HEAD_DIM, generator=generator)).to(dtype)
    freqs_cis = sparsekv.rope_freqs_cis(keys, ROTARY_DIM, ROPE_THETA)

    max_dtype = MAX_DTYPES[dtype]
    cpu = DeviceRef.CPU()
    input_types = [
        TensorType(max_dtype, [HEAD_DIM], cpu),
        TensorType(DType.float32, list(freqs_cis.shape), cpu),
        TensorType(DType.int32, [batch], cpu),
        BufferType(max_dtype, list(blocks.shape), cpu),
        TensorType(DType.int64, [1], cpu),
        TensorType(DType.uint32, [batch], cpu),
        TensorType(DType.uint32, list(lookup_table.shape), cpu),
        TensorType(DType.uint32, [1], cpu),
        TensorType(DType.uint32, [1], cpu),
    ]
    max_args = [
        as_buffer(gamma),
        as_buffer(freqs_cis),
        as_buffer(key_counts),
        as_buffer(blocks),
        as_buffer(np.array([-1], dtype=np.int64)),  # packed pages
        as_buffer(uint32(cache_lengths)),
        as_buffer(uint32(lookup_table)),
        as_buffer(np.array([1], dtype=np.uint32)),  # one new token per sequence
        as_buffer(np.array([int(cache_lengths.max())], dtype=np.uint32)),
    ]

    def sparsekv_output() -> torch.Tensor:
        collection = sparsekv.PagedKVCacheCollection(blocks, cache_lengths, lookup_table, max_seq_length=1,
                                                     max_cache_length=int(cache_lengths.max()))
        return sparsekv.qsa_compress_keys_paged(gamma, freqs_cis, key_counts, collection, 0, ratio=RATIO,
                                                eps=RMS_EPS, max_blocks=max_blocks)

    element = blocks.element_size()
    complete_blocks = torch.clamp(key_counts.long() // RATIO, max=max_blocks)
    bytes_moved = (int(complete_blocks.sum()) * RATIO * HEAD_DIM * element  # raw keys read
                   + batch * max_blocks * HEAD_DIM * element  # block keys written
                   + int(complete_blocks.max()) * ROTARY_DIM * freqs_cis.element_size()  # rope rows
                   + HEAD_DIM * element)  # gamma
    extra = {"max_blocks": max_blocks, "key_counts": "keys - b for sequence b", "step": "decode (1 new token)",
             "pages": num_pages, "layout": "pages scattered at random"}
    defined_rows = (torch.arange(max_blocks)[None, :] < complete_blocks[:, None]).reshape(-1)
    return Case(input_types, max_args, sparsekv_output, defined_rows, bytes_moved, extra)


def make_block_score_case(batch: int, keys: int, dtype: torch.dtype, seed: int) -> Case:
    """Decode-like scoring: 4 rows per sequence at its last 4 positions, 4 heads, ``keys // 4`` block keys each.

    Example: ``batch = 2, keys = 1024``: positions ``[1020..1023, 1019..1022]``;
    row 0 sees 255 blocks (1021 // 4), row 3 all 256, the rest of each row is ``-inf``.
    """
    generator = torch.Generator().manual_seed(seed)
    key_counts = key_counts_for(batch, keys)
    max_blocks = keys // RATIO
    total_q = batch * ROWS_PER_SEQUENCE
    q = torch.randn(total_q, INDEX_HEADS, HEAD_DIM, generator=generator).to(dtype)
    block_keys = torch.randn(batch * max_blocks, HEAD_DIM, generator=generator).to(dtype)
    # Each sequence's last ROWS_PER_SEQUENCE positions, as in a multi-token decode step.
    last = key_counts.long()[:, None] - ROWS_PER_SEQUENCE + torch.arange(ROWS_PER_SEQUENCE)[None, :]
    query_positions = last.reshape(-1).to(torch.int32)
    input_row_offsets = (torch.arange(batch + 1) * ROWS_PER_SEQUENCE).to(torch.int32)
    out_cols = max_blocks

    max_dtype = MAX_DTYPES[dtype]
    cpu = DeviceRef.CPU()
    input_types = [
        TensorType(max_dtype, list(q.shape), cpu),
        TensorType(max_dtype, list(block_keys.shape), cpu),
        TensorType(DType.int32, [total_q], cpu),
        TensorType(DType.uint32, [batch + 1], cpu),
    ]
    max_args = [as_buffer(q), as_buffer(block_keys), as_buffer(query_positions), as_buffer(uint32(input_row_offsets))]

    def sparsekv_output() -> torch.Tensor:
        return sparsekv.qsa_block_score(q, block_keys, query_positions, input_row_offsets, ratio=RATIO,
                                        score_scale=SCORE_SCALE, out_cols=out_cols)

    element = q.element_size()
    visible = torch.clamp((query_positions.long() + 1) // RATIO, max=max_blocks)
    keys_read = int(visible.reshape(batch, ROWS_PER_SEQUENCE).max(dim=1).values.sum())
    bytes_moved = q.numel() * element + keys_read * HEAD_DIM * element + total_q * out_cols * 4
    extra = {"max_blocks": max_blocks, "out_cols": out_cols, "heads": INDEX_HEADS,
             "rows": f"decode-like: {ROWS_PER_SEQUENCE} query rows per sequence at its last "
                     f"{ROWS_PER_SEQUENCE} positions (key_counts[b] - {ROWS_PER_SEQUENCE} .. key_counts[b] - 1)",
             "key_counts": "keys - b for sequence b", "score_scale": SCORE_SCALE}
    defined_rows = torch.ones(total_q, dtype=torch.bool)
    return Case(input_types, max_args, sparsekv_output, defined_rows, bytes_moved, extra)


def build_graph(op: str, batch: int, keys: int, dtype: torch.dtype, input_types: list) -> Graph:
    """The one-op MAX graph for ``op`` on the CPU."""
    cpu = DeviceRef.CPU()
    max_dtype = MAX_DTYPES[dtype]
    max_blocks = keys // RATIO
    with Graph(f"qsa_{op}", input_types=input_types) as graph:
        if op == "compress":
            gamma, freqs, counts, blocks, page_stride, cache_lengths, lookup, max_prompt, max_cache = graph.inputs
            layer_idx = ops.constant(0, DType.uint32, device=cpu)
            (block_keys,) = ops.inplace_custom(
                "mo.qsa.compress_keys.paged",
                device=cpu,
                values=[gamma.tensor, freqs.tensor, counts.tensor, blocks.buffer, page_stride.tensor,
                        cache_lengths.tensor, lookup.tensor, max_prompt.tensor, max_cache.tensor, layer_idx],
                out_types=[TensorType(max_dtype, [batch * max_blocks, HEAD_DIM], cpu)],
                # MAX 26.7 takes eps as a float parameter (older docs describe a string).
                parameters={"head_dim": HEAD_DIM, "rotary_dim": ROTARY_DIM, "ratio": RATIO, "eps": RMS_EPS},
            )
            graph.output(block_keys)
        else:
            q, block_keys, positions, offsets = graph.inputs
            (scores,) = ops.custom(
                "qsa_block_score",
                device=cpu,
                values=[q.tensor, block_keys.tensor, positions.tensor, offsets.tensor],
                out_types=[TensorType(DType.float32, [batch * ROWS_PER_SEQUENCE, max_blocks], cpu)],
                parameters={"num_heads": INDEX_HEADS, "head_dim": HEAD_DIM, "ratio": RATIO,
                            "score_scale": SCORE_SCALE},
            )
            graph.output(scores)
    return graph


def time_ms(fn, *, warmup: int, repeat: int, after=None) -> tuple[float, float]:
    """Median and minimum wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls.

    ``after()``, when given, runs after every call (warm-up and timed) outside the timed region.
    """
    samples = []
    for call in range(warmup + repeat):
        start = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - start) * 1e3
        if call >= warmup:
            samples.append(elapsed)
        if after is not None:
            after()
    return statistics.median(samples), min(samples)


class RunComparer:
    """Compares every call's defined output rows with the first call's, bit for bit (MAX's
    kernels are deterministic on fixed inputs, so any difference is a fault worth reporting)."""

    def __init__(self, outputs: list, defined_rows: torch.Tensor) -> None:
        self.outputs = outputs
        self.defined_rows = defined_rows
        self.first: torch.Tensor | None = None
        self.calls = 0
        self.differing_calls: list[int] = []
        self.differing_rows: set[int] = set()

    def __call__(self) -> None:
        current = torch.from_dlpack(self.outputs[0])[self.defined_rows]
        if self.first is None:
            self.first = current.clone()
        else:
            bits = INT_VIEWS[current.dtype]
            same = current.view(bits) == self.first.view(bits)
            if not bool(same.all()):
                self.differing_calls.append(self.calls)
                self.differing_rows.update(torch.nonzero(~same.all(dim=1)).flatten()[:16].tolist())
        self.calls += 1

    def report(self) -> dict:
        return {"calls_compared": self.calls, "calls_differing_from_first": len(self.differing_calls),
                "differing_rows": sorted(self.differing_rows)[:16]}


def unwritten_rows(model, max_args: list, defined_rows: torch.Tensor, calls: int = 6) -> dict:
    """Output rows MAX leaves unwritten, found by poisoning.

    Each call's output is filled with NaN before it is released, so a later
    call that gets the same memory back from MAX's allocator shows NaN in
    every row it did not write. Reuse is up to the allocator: zero counts
    mean nothing unwritten was seen, not a proof.
    """
    worst_defined = worst_other = 0
    for _ in range(calls):
        (out,) = model.execute(*max_args)
        view = torch.from_dlpack(out)
        nan_rows = view.isnan().reshape(view.shape[0], -1).any(dim=1)
        worst_defined = max(worst_defined, int((nan_rows & defined_rows).sum()))
        worst_other = max(worst_other, int((nan_rows & ~defined_rows).sum()))
        view.fill_(float("nan"))
        del view, out
    return {"poisoned_calls": calls, "defined_rows_unwritten": worst_defined,
            "other_rows": int((~defined_rows).sum()), "other_rows_unwritten": worst_other}


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers that order like the floats in ``t``, one apart per ulp (``-0.0`` and ``0.0`` both 0)."""
    bits = t.contiguous().view(INT_VIEWS[t.dtype]).to(torch.int64)
    magnitude_mask = (1 << (8 * t.element_size() - 1)) - 1
    return torch.where(bits < 0, -(bits & magnitude_mask), bits)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How far MAX's output ``got`` is from sparsekv's ``want`` (same shape and dtype)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"error": f"MAX gave {tuple(got.shape)} {got.dtype}, sparsekv {tuple(want.shape)} {want.dtype}"}
    same_bits = got.contiguous().view(INT_VIEWS[got.dtype]) == want.contiguous().view(INT_VIEWS[want.dtype])
    both_finite = torch.isfinite(got) & torch.isfinite(want)
    nonfinite_agree = bool(((got == want) | both_finite).all()) and not bool((got.isnan() | want.isnan()).any())
    diff = torch.where(both_finite, (got.float() - want.float()).abs(), torch.zeros((), dtype=torch.float32))
    magnitude = torch.where(both_finite, want.float().abs(), torch.ones((), dtype=torch.float32))
    rel = diff / magnitude.clamp_min(torch.finfo(torch.float32).tiny)
    ulps = torch.where(both_finite, (ordered_bits(got) - ordered_bits(want)).abs(), torch.zeros((), dtype=torch.int64))
    elements = got.numel()
    mismatched = elements - int(same_bits.sum())
    scale = float(want.float()[both_finite].abs().max()) if bool(both_finite.any()) else 0.0
    if got.dtype == torch.float32:
        # SPEC 4 for float32, read as the tests read it: 1e-5 of each value plus 1e-7 of the output's scale.
        within = bool((diff <= 1e-5 * (want.float().abs().nan_to_num(posinf=0.0, neginf=0.0) + 1e-2 * scale)).all())
    else:
        within = (int(ulps.max()) if elements else 0) <= 1 and mismatched <= 0.01 * elements
    return {
        "output_dtype": str(got.dtype).replace("torch.", ""),
        "bitwise_equal": mismatched == 0,
        "mismatched": mismatched,
        "elements": elements,
        "max_abs_diff": float(diff.max()) if elements else 0.0,
        "max_rel_diff": float(rel.max()) if elements else 0.0,
        "max_abs_diff_over_scale": float(diff.max()) / scale if elements and scale > 0 else 0.0,
        "max_ulp": int(ulps.max()) if elements else 0,
        "nonfinite_agree": nonfinite_agree,
        "within_spec4": within and nonfinite_agree,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=("compress", "block_score"), required=True)
    parser.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    parser.add_argument("--keys", type=int, default=8192,
                        help="raw keys of the longest sequence; sequence b holds keys - b (default 8192)")
    parser.add_argument("--dtype", choices=tuple(TORCH_DTYPES), default="bf16")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls (default 20)")
    parser.add_argument("--threads", type=int, default=None,
                        help="pin the process to this many CPUs before MAX starts (default: MAX's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--check", action="store_true", help="also compare with sparsekv on the same inputs")
    parser.add_argument("--against", choices=("reference", "cpu"), default="reference",
                        help="sparsekv backend --check compares with (default reference)")
    parser.add_argument("--quick", action="store_true", help="tiny run: batch 2, 1024 keys, 3 repeats")
    parser.add_argument("--serve", action="store_true",
                        help="build once, then time calls on request (JSON lines on stdin and stdout)")
    args = parser.parse_args(argv)
    if args.serve and (args.check or args.json):
        parser.error("--serve: cannot be combined with --check or --json (it answers in JSON lines itself)")
    if args.quick:
        args.batch, args.keys, args.repeat = 2, 1024, 3
    if args.batch < 1:
        parser.error(f"--batch: expected >= 1, got {args.batch}")
    if args.keys < max(args.batch - 1 + ROWS_PER_SEQUENCE, RATIO):
        parser.error(f"--keys: expected >= {max(args.batch - 1 + ROWS_PER_SEQUENCE, RATIO)} for batch "
                     f"{args.batch}, got {args.keys}")
    if args.repeat < 1:
        parser.error(f"--repeat: expected >= 1, got {args.repeat}")
    if args.threads is not None and not 1 <= args.threads <= len(os.sched_getaffinity(0)):
        parser.error(f"--threads: expected 1 .. {len(os.sched_getaffinity(0))} (the CPUs this process may use), "
                     f"got {args.threads}")
    return args


def load_case(args: argparse.Namespace):
    """The inputs and the compiled MAX model of ``args``' op and shape: ``(case, model, compile_s)``.

    MAX sizes its worker pool from the CPUs the process may use, so ``--threads``
    pins the process first. (Its own knob, ``InferenceSession(num_threads=...)``,
    aborts the process in 26.7: "getOrCreateCPUDevice called requesting
    different options".) torch gets the same count for the ``--check`` reference.
    """
    dtype = TORCH_DTYPES[args.dtype]
    if args.threads is not None:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
        torch.set_num_threads(args.threads)
    session = InferenceSession(devices=[CPU()])
    make_case = make_compress_case if args.op == "compress" else make_block_score_case
    case = make_case(args.batch, args.keys, dtype, args.seed)
    graph = build_graph(args.op, args.batch, args.keys, dtype, case.input_types)
    started = time.perf_counter()
    model = session.load(graph)
    return case, model, time.perf_counter() - started


def serve(args: argparse.Namespace) -> int:
    """``--serve``: build the case once, then answer timing requests (``sparsekv.bench.remote``)."""
    from sparsekv.bench.remote import serve as serve_requests

    # The protocol owns the real stdout; whatever MAX or torch print goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def write(line: str) -> None:
        protocol.write(line)
        protocol.flush()

    try:
        case, model, compile_s = load_case(args)
        for _ in range(2):
            model.execute(*case.max_args)
    except Exception as exc:
        write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1

    def run() -> None:
        model.execute(*case.max_args)

    ready = {"op": args.op, "batch": args.batch, "keys": args.keys, "dtype": args.dtype,
             "bytes_moved": case.bytes_moved, "max_version": importlib.metadata.version("max"),
             "threads": args.threads if args.threads is not None else "max-default",
             "compile_s": round(compile_s, 2), **case.extra}
    serve_requests(run, sys.stdin, write, ready=ready)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    case, model, compile_s = load_case(args)

    outputs: list = []

    def run() -> None:
        outputs[:] = model.execute(*case.max_args)

    comparer = RunComparer(outputs, case.defined_rows) if args.check else None
    median, fastest = time_ms(run, warmup=2, repeat=args.repeat, after=comparer)
    result = {
        "op": args.op, "batch": args.batch, "keys": args.keys, "dtype": args.dtype,
        "median_ms": round(median, 4), "min_ms": round(fastest, 4), "bytes_moved": case.bytes_moved,
        "gb_per_s": round(case.bytes_moved / (median * 1e-3) / 1e9, 3),
        "max_version": importlib.metadata.version("max"),
        "device": "cpu", "threads": args.threads if args.threads is not None else "max-default",
        "repeat": args.repeat, "compile_s": round(compile_s, 2),
        "load_1min": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), **case.extra,
    }
    if args.check:
        got = comparer.first  # defined rows only
        previous = os.environ.get("SPARSEKV_BACKEND")
        os.environ["SPARSEKV_BACKEND"] = args.against
        try:
            want = case.sparsekv_output()
        finally:
            if previous is None:
                os.environ.pop("SPARSEKV_BACKEND")
            else:
                os.environ["SPARSEKV_BACKEND"] = previous
        defined = case.defined_rows
        result["check"] = {"against": f"sparsekv {args.against}", "rows_compared": int(defined.sum()),
                           **compare(got, want[defined]), **comparer.report(),
                           **unwritten_rows(model, case.max_args, defined)}
        if not bool(defined.all()):
            result["check"]["sparsekv_other_rows_zero"] = bool((want[~defined] == 0).all())

    if args.json:
        print(json.dumps(result))
    else:
        print(f"MAX {result['max_version']} {args.op} batch={args.batch} keys={args.keys} {args.dtype}: "
              f"{median:.3f} ms median of {args.repeat}, {result['gb_per_s']} GB/s "
              f"({case.bytes_moved / 1e6:.1f} MB; compile {compile_s:.1f} s)")
        if args.check:
            print("check:", json.dumps(result["check"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
