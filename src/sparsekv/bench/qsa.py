"""QSA benchmark cases at the Qwen4Exp shapes: compress, block score, selection, sparse attention.

Indexer: head dim 128, ratio 4, rotary dim 64, page size 128, one key head,
sequence ``b`` holding ``keys - b`` raw keys (so all but the first end in a
partial block), as ``benchmarks/max_peer.py`` builds them. Main attention:
24 query heads, 2 KV heads, head dim 256, budget 2048 tokens.

Every row times the public op (``SPARSEKV_BACKEND=auto``: the CPU path) and,
in the same run, its peers: the same op on one thread (``1thread``), the
reference backend (``reference``), a torch copy of the same number of bytes
(``copy``), for sparse attention dense SDPA over the whole history in the
faster of its two layouts, both timed in the same rounds (``sdpa(rows)``:
each KV head's query heads as the rows of one attention; ``sdpa(gqa)``:
``enable_gqa=True``, one row per query head, 7-20x slower on torch's CPU
path; the row's note gives both times), for block score and sparse attention
the same multiply-adds at the register tile's peak (``peak``, :mod:`.peak`;
its column is the fraction of the peak reached) and a read of the op's bytes
(``read``: a streamed sum for block score, the selected key and value rows
gathered where they lie for sparse attention, :func:`.common.gather_peer`;
with ``peak``, the ``xroof`` column of
:meth:`.common.BenchRow.ratios`) and, when a Python with
Modular MAX is given, MAX's own CPU kernel (``max``) on the compress and
decode block-score rows.

The ``max`` peer is ``benchmarks/max_peer.py --serve``, started once per row
in that Python (:class:`.remote.RemotePeer`): it builds MAX's graph and
inputs for the row's shape, and then takes its turn in every round of
:func:`.common.time_rounds` next to ours, timing its calls in its own
process, so both sides run at the same moments under the same load. It is
stopped when the row ends, also on an error. Its idle process is not quite
idle: MAX's runtime keeps a thread polling (a few percent of one core), which
runs during our turns too.

The paged block score's rows repeat one layer, whose keys stay in the
last-level cache up to 8192 blocks; its last row scores 16 layers' pages one
layer a call, as a model's step does, so that each call's keys come from
memory (against one thread, a read of that layer's pages where they lie,
:mod:`.page_read`, and the peak). The paged rows' ``read`` peer reads their
keys in the pages, page by page, where the contiguous rows read as many
bytes in one span. Page storage is allocated as the cache manager allocates it
(:func:`sparsekv.cache.allocate_pages`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache.layout import PagedKVCacheCollection
from ..cache.memory import allocate_pages
from ..cache.pooled import make_pooled_collection
from ..numerics import rope_freqs_cis
from ..ops.qsa import (plan_qsa_block_score_paged, qsa_block_score, qsa_block_score_paged, qsa_compress_keys_paged,
                       qsa_load_block_keys_paged, qsa_select_tokens, qsa_sparse_attention_paged,
                       qsa_store_block_keys_paged)
from .common import (DTYPE_NAMES, PAGE_SIZE, BenchRow, backend, copy_peer, gather_peer, layer_turns, one_thread,
                     random_paged_blocks, read_peer, threads_check, time_against_peers, time_layers_in_turn)
from .page_read import page_read_peer
from .peak import tile_peak_peer
from .remote import RemotePeer, RemotePeerError, python_env

HEAD_DIM, RATIO, ROTARY_DIM, THETA, EPS = 128, 4, 64, 1e7, 1e-6
INDEX_HEADS, ROWS_PER_SEQUENCE, BUDGET = 4, 4, 2048
MODEL_LAYERS = 16
"""Layers of the paged block score row scored one after another (134 MB of bf16 pages at 8192 blocks, past the
last-level cache): each call's keys come from memory, as in a model's step."""
Q_HEADS, KV_HEADS, MAIN_HEAD_DIM = 24, 2, 256
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the sparsekv package
MAX_PEER_SCRIPT = SOURCE_ROOT.parent / "benchmarks" / "max_peer.py"  # present in a source checkout only


def _time_with_peers(call, max_peer: RemotePeer | None = None, *, check_threads: bool = False,
                     reference_call=None, **peers) -> tuple[float, dict[str, float], dict[str, float]]:
    """Our time, each peer's and their paired ratios (:func:`.common.time_against_peers`); the ``reference`` peer
    is ``call`` itself (``reference_call`` where given: a plan keeps the backend it was made with) under
    ``SPARSEKV_BACKEND=reference``, the ``1thread`` peer ``call`` on one thread,
    the ``max`` peer ``max_peer`` when given (if it fails, the reason goes to stderr and the row is timed
    again without it). ``check_threads``: ours and ``1thread`` alone (:func:`.common.threads_check`)."""
    if check_threads:
        return threads_check(call)

    def reference():
        with backend("reference"):
            (reference_call or call)()

    calls = {"ours": call, "1thread": one_thread(call), "reference": reference, **peers}
    if max_peer is not None:
        try:
            return time_against_peers({**calls, "max": max_peer})
        except RemotePeerError as exc:
            print(f"bench_qsa: no MAX column for this row: {exc}", file=sys.stderr)
    return time_against_peers(calls)


@contextlib.contextmanager
def max_peer(max_python: str | None, op: str, batch: int, keys: int, dtype: torch.dtype,
             threads: int | None = None) -> Iterator[RemotePeer | None]:
    """MAX's kernel for the same case, served by ``benchmarks/max_peer.py --serve`` in ``max_python``
    for the block, or ``None`` (with the reason on stderr) when that is unavailable. The process is
    stopped when the block ends, also on an error."""
    if not max_python:
        yield None
        return
    if not MAX_PEER_SCRIPT.exists():
        print(f"bench_qsa: no MAX column: {MAX_PEER_SCRIPT} is absent", file=sys.stderr)
        yield None
        return
    command = [max_python, str(MAX_PEER_SCRIPT), "--serve", "--op", op, "--batch", str(batch), "--keys",
               str(keys), "--dtype", DTYPE_NAMES[dtype]] + (["--threads", str(threads)] if threads else [])
    try:
        # the server imports this same sparsekv (its shapes and RoPE table), not one installed there
        peer = RemotePeer(command, env=python_env(SOURCE_ROOT))
    except RemotePeerError as exc:
        print(f"bench_qsa: no MAX column for {op} {keys}: {exc}", file=sys.stderr)
        yield None
        return
    with peer:
        yield peer


def _max_note(peer: RemotePeer | None, peers: dict[str, float]) -> str:
    """What the ``max`` column measured: MAX's version and threads, and its time."""
    if peer is None or "max" not in peers:
        return ""
    return (f"max: MAX {peer.info.get('max_version', '?')} ({peer.info.get('threads', '?')} threads), "
            f"{peers['max']:.3f} ms, timed in its own process in the same rounds")


def bench_compress(batch: int, keys: int, dtype: torch.dtype, max_python: str | None,
                   threads: int | None = None, check_threads: bool = False) -> BenchRow:
    """One decode step that pools every complete block of every sequence."""
    generator = torch.Generator().manual_seed(0)
    key_counts = (keys - torch.arange(batch)).to(torch.int32)
    blocks, table = random_paged_blocks(batch, keys, 1, 1, HEAD_DIM, dtype, generator)
    cache = PagedKVCacheCollection(blocks, key_counts - 1, table, max_seq_length=1, max_cache_length=keys)
    gamma = (0.1 * torch.randn(HEAD_DIM, generator=generator)).to(dtype)
    freqs = rope_freqs_cis(keys, ROTARY_DIM, THETA)
    max_blocks = keys // RATIO
    out = torch.empty(batch * max_blocks, HEAD_DIM, dtype=dtype)

    def call():
        qsa_compress_keys_paged(gamma, freqs, key_counts, cache, 0, ratio=RATIO, eps=EPS, out=out)

    complete = int((key_counts // RATIO).sum())
    size = blocks.element_size()
    nbytes = (complete * RATIO * HEAD_DIM * size + out.numel() * size
              + complete * ROTARY_DIM * freqs.element_size() + HEAD_DIM * size)
    with max_peer(max_python, "compress", batch, keys, dtype, threads) as peer:
        ours, peers, paired = _time_with_peers(call, peer, check_threads=check_threads, copy=copy_peer(nbytes))
    return BenchRow("qsa_compress_keys_paged", f"B={batch} keys={keys}-b D=128 R=4 rot=64 page=128",
                    DTYPE_NAMES[dtype], "cpu", ours, nbytes, peers, _max_note(peer, peers), paired)


def bench_block_cache(batch: int, keys: int, dtype: torch.dtype, max_python: str | None,
                      threads: int | None = None, check_threads: bool = False) -> BenchRow:
    """The same decode step's block keys through a block-key cache: the blocks the step completes stored
    (sequence ``b`` holds ``keys - b`` tokens, so one in ``R`` completes one), every block read back in
    compress's layout. Peers: ``compress``, the same output pooled from every raw key (SPEC 2.2's way),
    and MAX's compress of the same step."""
    generator = torch.Generator().manual_seed(0)
    key_counts = (keys - torch.arange(batch)).to(torch.int32)
    blocks, table = random_paged_blocks(batch, keys, 1, 1, HEAD_DIM, dtype, generator)
    cache = PagedKVCacheCollection(blocks, key_counts - 1, table, max_seq_length=1, max_cache_length=keys)
    block_shape = (blocks.shape[0], 1, 1, PAGE_SIZE // RATIO, 1, HEAD_DIM)
    block_blocks = allocate_pages(block_shape, dtype, "cpu")  # as the cache manager allocates its pages
    block_blocks.copy_(torch.randn(block_shape, generator=generator))
    block_cache = make_pooled_collection(block_blocks, key_counts - 1, table, kpool=RATIO)
    gamma = (0.1 * torch.randn(HEAD_DIM, generator=generator)).to(dtype)
    freqs = rope_freqs_cis(keys, ROTARY_DIM, THETA)
    max_blocks = keys // RATIO
    out = torch.empty(batch * max_blocks, HEAD_DIM, dtype=dtype)
    pooled = torch.empty_like(out)

    def call():
        qsa_store_block_keys_paged(gamma, freqs, key_counts, cache, block_cache, 0, ratio=RATIO, eps=EPS)
        qsa_load_block_keys_paged(key_counts, block_cache, 0, ratio=RATIO, out=out)

    def compress():
        qsa_compress_keys_paged(gamma, freqs, key_counts, cache, 0, ratio=RATIO, eps=EPS, out=pooled)

    nbytes = 2 * out.numel() * out.element_size()  # the rows read back and written out
    with max_peer(max_python, "compress", batch, keys, dtype, threads) as peer:
        ours, peers, paired = _time_with_peers(call, peer, check_threads=check_threads, copy=copy_peer(nbytes),
                                               **({} if check_threads else {"compress": compress}))
    return BenchRow("qsa_store+load_block_keys", f"B={batch} keys={keys}-b D=128 R=4 rot=64 page=128",
                    DTYPE_NAMES[dtype], "cpu", ours, nbytes, peers, _max_note(peer, peers), paired)


def bench_block_score(batch: int, keys: int, rows_per_seq: int, dtype: torch.dtype,
                      max_python: str | None, threads: int | None = None, check_threads: bool = False,
                      paged: bool = False, layers: int = 1) -> BenchRow:
    """Rows at each sequence's last positions, 4 index heads, against its block keys; ``paged``: the same
    block keys in a block-key cache's pages (``PAGE_SIZE // RATIO`` per page, scattered), scored in place by
    ``qsa_block_score_paged``'s plan (``plan.run``, a layer's call; the one-shot op is the ``op`` peer), with
    the contiguous score as a peer (``contiguous``). ``layers`` > 1 (paged only): the cache holds that many
    layers, each call scores the next (a model's step: keys from memory once they pass the last-level
    cache), against one thread, a read of that layer's pages where they lie, and the peak."""
    if layers > 1 and not paged:
        raise ValueError(f"layers: expected 1 for the contiguous block score, got {layers}")
    generator = torch.Generator().manual_seed(1)
    max_blocks = keys // RATIO
    block_keys = torch.randn(batch * max_blocks, HEAD_DIM, generator=generator).to(dtype)
    q = torch.randn(batch * rows_per_seq, INDEX_HEADS, HEAD_DIM, generator=generator).to(dtype)
    positions = torch.cat([torch.arange(keys - b - rows_per_seq, keys - b) for b in range(batch)]).to(torch.int32)
    offsets = torch.arange(0, batch * rows_per_seq + 1, rows_per_seq, dtype=torch.int32)
    out = torch.empty(batch * rows_per_seq, max_blocks)

    def contiguous():
        qsa_block_score(q, block_keys, positions, offsets, ratio=RATIO, score_scale=math.sqrt(HEAD_DIM), out=out)

    call, extra_peers = contiguous, {}
    if paged:  # the same keys in pages, scored in place; the contiguous score becomes a peer
        per_page = PAGE_SIZE // RATIO
        pages_per_seq = -(-max_blocks // per_page)
        num_pages = batch * pages_per_seq + 1
        table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_seq].to(torch.int32)
        layer_pages = torch.zeros(num_pages, 1, 1, per_page, 1, HEAD_DIM, dtype=dtype)
        rows = layer_pages.view(num_pages * per_page, HEAD_DIM)
        for b in range(batch):
            for p in range(pages_per_seq):
                n = min(per_page, max_blocks - p * per_page)
                page = int(table[b * pages_per_seq + p])
                rows[page * per_page : page * per_page + n] = block_keys[b * max_blocks + p * per_page :][:n]
        # as the cache manager allocates its pages; every layer holds the same keys
        block_blocks = allocate_pages((num_pages, 1, layers, per_page, 1, HEAD_DIM), dtype, "cpu")
        block_blocks.copy_(layer_pages.expand_as(block_blocks))
        block_cache = make_pooled_collection(block_blocks, positions.new_full((batch,), keys), table.view(batch, -1),
                                             kpool=RATIO)
        scores = torch.empty_like(out)
        plan = plan_qsa_block_score_paged(block_cache, positions, offsets, ratio=RATIO,
                                          score_scale=math.sqrt(HEAD_DIM), out_cols=max_blocks)

        turns = layer_turns(layers)

        def planned_run():  # a layer's call: the step's plan is made once for every QSA layer
            plan.run(q, next(turns), out=scores)

        def one_shot():
            qsa_block_score_paged(q, block_cache, 0, positions, offsets, ratio=RATIO, score_scale=math.sqrt(HEAD_DIM),
                                  out=scores)

        call, extra_peers = planned_run, ({} if check_threads else {"contiguous": contiguous, "op": one_shot,
                                                                    "reference_call": one_shot})
        max_python = None

    visible = min(keys // RATIO, max_blocks)
    nbytes = q.numel() * q.element_size() + batch * visible * HEAD_DIM * block_keys.element_size() + out.numel() * 4
    seen = ((positions.long() + 1) // RATIO).clamp(0, max_blocks)  # blocks each row scores
    kind = "decode" if rows_per_seq <= ROWS_PER_SEQUENCE else "prefill chunk"
    read = peak = None  # --threads-check times ours and one thread only
    if not check_threads:
        read = (page_read_peer(block_blocks, table.view(batch, -1), seen.view(batch, -1).amax(1).tolist(), layers)
                if paged else read_peer(nbytes))  # paged: the keys each sequence's rows see, read where they lie
        peak = tile_peak_peer({dtype: int(seen.sum()) * INDEX_HEADS * HEAD_DIM})
    if rows_per_seq != ROWS_PER_SEQUENCE:  # max_peer.py runs the decode shape only
        max_python = None
    shape = f"{kind}: B={batch} rows={rows_per_seq}/seq heads=4 blocks={max_blocks}" + (" plan.run" if paged else "")
    if layers > 1:
        shape += f" {layers} layers in turn"
        ours, peers, paired = (threads_check(call) if check_threads
                               else time_layers_in_turn(call, read, peak))
        return BenchRow("qsa_block_score_paged", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes, peers,
                        f"each call the next of {layers} layers "
                        f"({block_blocks.numel() * block_blocks.element_size() / 1e6:.0f} MB of pages)", paired)
    with max_peer(max_python, "block_score", batch, keys, dtype, threads) as peer:
        ours, peers, paired = _time_with_peers(call, peer, check_threads=check_threads, copy=copy_peer(nbytes),
                                               read=read, peak=peak, **extra_peers)
    return BenchRow("qsa_block_score_paged" if paged else "qsa_block_score", shape, DTYPE_NAMES[dtype], "cpu", ours,
                    nbytes, peers, _max_note(peer, peers), paired)


def bench_select(batch: int, keys: int, check_threads: bool = False) -> BenchRow:
    generator = torch.Generator().manual_seed(2)
    rows = batch * ROWS_PER_SEQUENCE
    scores = torch.randn(rows, keys // RATIO, generator=generator)
    positions = torch.full((rows,), keys - 1, dtype=torch.int32)
    offsets = torch.arange(0, rows + 1, ROWS_PER_SEQUENCE, dtype=torch.int32)

    def call():
        qsa_select_tokens(scores, positions, offsets, ratio=RATIO, budget=BUDGET)

    nbytes = scores.numel() * 4 + rows * (BUDGET + RATIO - 1) * 4
    ours, peers, paired = _time_with_peers(call, check_threads=check_threads, copy=copy_peer(nbytes))
    return BenchRow("qsa_select_tokens", f"rows={rows} blocks={keys // RATIO} budget={BUDGET}", "fp32", "cpu",
                    ours, nbytes, peers, paired=paired)


def bench_sparse_attention(batch: int, cached: int, dtype: torch.dtype, check_threads: bool = False) -> BenchRow:
    """Decode: one new token per sequence after ``cached`` tokens, ``BUDGET + R - 1`` selected entries."""
    generator = torch.Generator().manual_seed(3)
    total = cached + 1
    blocks, table = random_paged_blocks(batch, total, 2, KV_HEADS, MAIN_HEAD_DIM, dtype, generator)
    cache = PagedKVCacheCollection(blocks, torch.full((batch,), cached, dtype=torch.int32), table,
                                   max_seq_length=1, max_cache_length=cached)
    q = torch.randn(batch, Q_HEADS, MAIN_HEAD_DIM, generator=generator).to(dtype)
    offsets = torch.arange(batch + 1, dtype=torch.int32)
    scores = torch.randn(batch, total // RATIO, generator=generator)
    positions = torch.full((batch,), cached, dtype=torch.int32)
    indices, counts = qsa_select_tokens(scores, positions, offsets, ratio=RATIO, budget=BUDGET)
    scale = MAIN_HEAD_DIM ** -0.5

    def call():
        qsa_sparse_attention_paged(q, cache, 0, indices, counts, offsets, scale=scale)

    # the dense peer: SDPA over every cached token, K/V already contiguous (its best case), in both layouts
    pages = table[:, : -(-total // PAGE_SIZE)].long()
    dense_k = blocks[pages, 0, 0].reshape(batch, -1, KV_HEADS, MAIN_HEAD_DIM)[:, :total].transpose(1, 2).contiguous()
    dense_v = blocks[pages, 1, 0].reshape(batch, -1, KV_HEADS, MAIN_HEAD_DIM)[:, :total].transpose(1, 2).contiguous()
    dense_peers = {
        # each KV head's query heads as the rows of one attention: [B, KV, Q/KV, D]
        "sdpa(rows)": lambda: F.scaled_dot_product_attention(
            q.reshape(batch, KV_HEADS, Q_HEADS // KV_HEADS, MAIN_HEAD_DIM), dense_k, dense_v, scale=scale),
        # one row per query head, KV heads shared by torch: [B, Q, 1, D]
        "sdpa(gqa)": lambda: F.scaled_dot_product_attention(q[:, :, None, :], dense_k, dense_v, scale=scale,
                                                            enable_gqa=True),
    }

    size = blocks.element_size()
    nbytes = int(counts.sum()) * KV_HEADS * MAIN_HEAD_DIM * 2 * size + 2 * q.numel() * size
    products = int(counts.sum()) * Q_HEADS * MAIN_HEAD_DIM  # for Q.K, and as many for P.V (float32)
    peak = tile_peak_peer({dtype: products, torch.float32: products} if dtype == torch.bfloat16
                          else {torch.float32: 2 * products})
    shape = f"decode B={batch} cached={cached} budget={BUDGET} q24/kv2 D=256"
    if check_threads:
        ours, peers, paired = threads_check(call)
        return BenchRow("qsa_sparse_attention_paged", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes, peers,
                        paired=paired)
    ours, peers, _ = _time_with_peers(call, **dense_peers, copy=copy_peer(nbytes),
                                      read=gather_peer(blocks, table, indices, counts), peak=peak)
    slower = max(dense_peers, key=peers.__getitem__)  # compare against the dense peer's faster layout only
    note = f"dense peer layouts: {', '.join(f'{name} {peers[name]:.3f} ms' for name in dense_peers)}"
    del peers[slower]
    return BenchRow("qsa_sparse_attention_paged", shape, DTYPE_NAMES[dtype], "cpu", ours, nbytes, peers, note)


OPS = ("compress", "block_cache", "block_score", "block_score_paged", "select", "sparse_attention")


def run(quick: bool = False, max_python: str | None = None, threads: int | None = None,
        ops: tuple[str, ...] | list[str] | None = None, check_threads: bool = False) -> list[BenchRow]:
    """All QSA rows; ``quick`` keeps one small shape per op (seconds, for smoke tests).

    Compress and decode block score run at 8k, 32k and 128k keys (1024 with ``quick``). ``threads``
    sets torch's and numba's thread counts (and MAX's) for the whole run. ``ops``, when given, keeps the
    rows of those ops only (names from ``OPS``). ``check_threads``: ours against the same op on one
    thread only (:func:`.common.threads_check`: no MAX, reference, copy or dense peers).
    """
    if check_threads:
        max_python = None
    ops = OPS if ops is None else tuple(ops)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops: expected names from {OPS}, got {unknown}")
    if threads:
        import numba

        torch.set_num_threads(threads)
        numba.set_num_threads(threads)
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float32]
    key_sizes = [1024] if quick else [8192, 32768, 131072]
    rows: list[BenchRow] = []
    if "compress" in ops:
        for dtype in dtypes:
            for keys in key_sizes:
                rows.append(bench_compress(4, keys, dtype, max_python, threads, check_threads))
    if "block_cache" in ops:
        for dtype in dtypes:
            for keys in key_sizes:
                rows.append(bench_block_cache(4, keys, dtype, max_python, threads, check_threads))
    if "block_score" in ops:
        for dtype in dtypes:
            for keys in key_sizes:
                rows.append(bench_block_score(4, keys, ROWS_PER_SEQUENCE, dtype, max_python, threads, check_threads))
            rows.append(bench_block_score(1, key_sizes[0], 64 if quick else 512, dtype, None, None, check_threads))
    if "block_score_paged" in ops:
        for dtype in dtypes:
            for keys in key_sizes:
                rows.append(bench_block_score(4, keys, ROWS_PER_SEQUENCE, dtype, None, threads, check_threads,
                                              paged=True))
        if not quick:  # a model's step: each layer's keys from memory
            rows.append(bench_block_score(4, key_sizes[1], ROWS_PER_SEQUENCE, torch.bfloat16, None, threads,
                                          check_threads, paged=True, layers=MODEL_LAYERS))
    if "select" in ops:
        rows.append(bench_select(4, 1024 if quick else 32768, check_threads))
    if "sparse_attention" in ops:
        for dtype in dtypes:
            rows.append(bench_sparse_attention(4 if not quick else 1, 4096 if quick else 32768, dtype, check_threads))
    return rows
