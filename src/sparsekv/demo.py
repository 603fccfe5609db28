"""``sparsekv demo``: serve a small workload through the paged cache manager with sparse attention.

The model is two slices with seeded weights (no download), each over a
256-wide residual stream: two Qwen4Exp QSA layers with the real head geometry
(24 query / 2 KV heads of 256, RoPE over 64 channels, indexer 4 heads x 128,
R = 4), and two GLM-5-Next MLA attention layers (8 heads, the real latent of
512 channels, NoPE; the first runs the k-pool indexer with its real 32 heads x
128, kpool 4, the second is a "shared" layer reusing that selection). Budgets
are 256 tokens, so sparsity shows at a few thousand tokens of context.
``--config`` / ``--checkpoint`` replace either slice: a ``qwen4_exp`` config
the QSA slice, a ``glm5_next``, ``glm_moe_dsa`` (GLM-5) or ``deepseek_v32``
(DeepSeek-V3.2, both ``kpool = 1``) config the MLA slice.

The workload: ``--requests`` prompts of ``--context`` tokens that share a
system prompt (3/4 of the context in whole pages, ``--shared-prefix``), served by a continuous-batching
loop with chunked prefill (a token budget per step, decodes first) and prefix
caching; each request then decodes ``--decode-tokens`` tokens, the next token
being the argmax of the last hidden state against the (tied) embedding table.

Every step is checked against dense PyTorch oracles (``sparsekv.demo_checks``);
a failed check makes the command exit with status 1. The report lists
tokens, throughput, pages, prefix-cache hits, the share of KV bytes the
sparse attention read, a per-op time breakdown and the checks.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from .cache.manager import InsufficientPagesError, PagedKVCacheManager
from .demo_checks import (TIE_TOLERANCE, CheckLog, brute_force_kpool_scores, brute_force_qsa_blocks,
                          check_attention_over_selection, check_mla_equals_dense, check_mla_over_selection,
                          check_pooled_keys, check_sparse_equals_dense, compare_topk, mla_queries)
from .demo_report import build_report
from .demo_sweep import run_decode_sweep, sweep_contexts
from .demo_work import ServingWork
from .layers.checkpoint import CHECKPOINT_ROOTS, load_slice_weights, open_checkpoint
from .layers.config import Glm5NextConfig, Qwen4ExpConfig, load_config
from .layers.dsa import mla_cache_groups
from .layers.kpool import RMSNorm
from .layers.mla import MlaSlice
from .layers.qsa import Qwen4ExpSlice, qsa_cache_groups

DEFAULT_QWEN = Qwen4ExpConfig(
    hidden_size=256, num_hidden_layers=8, qsa_layers=(3, 7), num_attention_heads=24, num_key_value_heads=2,
    head_dim=256, partial_rotary_factor=0.25, rope_theta=1e7, rms_norm_eps=1e-6, indexer_n_heads=4,
    indexer_head_dim=128, indexer_compress_ratio=4, indexer_budget=256)
DEFAULT_GLM = Glm5NextConfig(
    hidden_size=256, num_hidden_layers=8, index_layers=(3, 7), indexer_types=("full",) * 7 + ("shared",),
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
    v_head_dim=128, index_n_heads=32, index_head_dim=128, index_topk=256, index_kpool=4)
DEFAULT_VOCAB = 4096

QSA_DENSE, QSA_SELECTED, QSA_TOPK, MLA_DENSE, MLA_SELECTED, KPOOL_POOLS, KPOOL_TOPK, MANAGER = CHECK_NAMES = [
    "QSA sparse attention equals dense attention under the budget",
    "QSA sparse attention equals dense attention over the selected tokens",
    "QSA selections equal brute-force top-k",
    "MLA sparse attention equals dense MLA under the budget",
    "MLA sparse attention equals MLA over the selected tokens",
    "k-pool pooled keys equal the one-shot result (bit for bit)",
    "k-pool selections equal brute-force top-k",
    "cache manager invariants hold after every step",
]


class DemoError(Exception):
    """A usage or setup problem (bad option, config or checkpoint); the CLI exits with status 2."""


@dataclass
class DemoOptions:
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on GPUs
    configs: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    requests: int = 8
    context: int = 2048
    decode_tokens: int = 32
    shared_prefix: int | None = None  # default: 3/4 of the context, whole pages
    step_tokens: int = 512
    page_size: int = 64
    seed: int = 0
    sweep: bool = False
    sweep_context: int | None = None  # default: max(context, 8192)
    progress: bool = True


class StageTimer:
    """Wall time per named stage (synchronising CUDA around each), for the per-op breakdown."""

    def __init__(self, device: torch.device) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._cuda = device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self._cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.totals[stage] += time.perf_counter() - start
            self.calls[stage] += 1


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------
def seed_parameters(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights, independent of torch's global RNG: one generator per parameter name.

    Linear weights (and the k-pool gate projection, a bare
    ``index_kpool_compress_gate [D, hidden]``) ``N(0, 1/fan_in)``; embeddings
    and the k-pool ``index_kpool_compress_ape`` ``N(0, 1)``; norm weights
    ``N(neutral, 0.1^2)`` around their neutral value (0 for zero-centred norms,
    1 for RMSNorm/LayerNorm); biases ``N(0, 0.1^2)``.
    """
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}"
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                if (isinstance(module, torch.nn.Linear) and param_name == "weight"
                        or param_name == "index_kpool_compress_gate"):
                    values = values / param.shape[1] ** 0.5
                elif isinstance(module, torch.nn.Embedding) or param_name == "index_kpool_compress_ape":
                    pass
                elif isinstance(module, (RMSNorm, torch.nn.LayerNorm)) and param_name == "weight":
                    values = 1.0 + 0.1 * values
                else:  # zero-centred norm weights, biases
                    values = 0.1 * values
                param.copy_(values.to(param.dtype))


def _resolve_dtype(options: DemoOptions, device: torch.device) -> torch.dtype:
    name = options.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise DemoError(f"--dtype: expected one of float32, bfloat16, float16, got {name!r}")
    return dtypes[name]


def _slot(config) -> str:
    """Which slice a config drives: ``"qsa"`` (Qwen4Exp) or ``"mla"`` (the three MLA + DSA families)."""
    return "qsa" if isinstance(config, Qwen4ExpConfig) else "mla"


def build_models(options: DemoOptions, device: torch.device, dtype: torch.dtype
                 ) -> tuple[Qwen4ExpSlice, MlaSlice, int, list[str]]:
    """The QSA and MLA slices (configs and weights from the options, else the embedded defaults).

    A ``qwen4_exp`` config or checkpoint replaces the QSA slice's, a
    ``glm5_next``, ``glm_moe_dsa`` or ``deepseek_v32`` one the MLA slice's; naming one slice twice is a
    :class:`DemoError`.
    """
    configs: dict[str, object] = {"qsa": DEFAULT_QWEN, "mla": DEFAULT_GLM}
    readers: dict[str, object] = {}
    sources = {"qsa": "qwen4_exp: embedded default, seeded weights",
               "mla": "glm5_next: embedded default, seeded weights"}
    given: dict[str, str] = {}

    def take(config, source: str) -> str:
        slot = _slot(config)
        if slot in given:
            raise DemoError(f"{source}: the {slot.upper()} slice is already set by {given[slot]}")
        given[slot] = source
        configs[slot] = config
        return slot

    try:
        for path in options.configs:
            slot = take(load_config(path), f"--config {path}")
            sources[slot] = f"{configs[slot].model_type}: config {path}, seeded weights"
        for path in options.checkpoints:
            config, reader = open_checkpoint(path)
            slot = take(config, f"--checkpoint {path}")
            readers[slot] = reader
            sources[slot] = f"{config.model_type}: checkpoint {path}"
    except (OSError, ValueError, TypeError) as err:
        raise DemoError(str(err)) from None
    vocab = {}
    for slot, reader in readers.items():
        embedding = next((root + "embed_tokens.weight" for root in CHECKPOINT_ROOTS
                          if root + "embed_tokens.weight" in reader), None)
        if embedding is None:
            raise DemoError(f"checkpoint for {configs[slot].model_type}: missing weight 'model.embed_tokens.weight'")
        vocab[slot] = reader.shape(embedding)[0]
    qwen = Qwen4ExpSlice(configs["qsa"], vocab.get("qsa", DEFAULT_VOCAB), dtype=dtype, device=device)
    mla = MlaSlice(configs["mla"], vocab.get("mla", DEFAULT_VOCAB), dtype=dtype, device=device)
    for slot, model in (("qsa", qwen), ("mla", mla)):
        if slot in readers:
            try:
                load_slice_weights(model, readers[slot])
            except ValueError as err:
                raise DemoError(str(err)) from None
        else:
            seed_parameters(model, options.seed)
    return qwen, mla, min(qwen.embed_tokens.num_embeddings, mla.embed_tokens.num_embeddings), [
        sources["qsa"], sources["mla"]]


# ---------------------------------------------------------------------------
# serving loop
# ---------------------------------------------------------------------------
@dataclass
class _Request:
    rid: str
    prompt: list[int]
    slot: int = -1
    computed: int = 0  # tokens in the cache (prefix hits included)
    hit: int = 0
    generated: list[int] = field(default_factory=list)
    keys: list[list[torch.Tensor]] = field(default_factory=list)  # per indexer layer, rows this request computed
    gates: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass
class _Totals:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    peak_pages: int = 0
    sparse_bytes: float = 0.0
    dense_bytes: float = 0.0
    decode_sparse_bytes: float = 0.0
    decode_dense_bytes: float = 0.0
    indexer_bytes: float = 0.0
    mla_sparse_bytes: float = 0.0
    mla_dense_bytes: float = 0.0


def shared_prefix_tokens(options: DemoOptions) -> int:
    """The system prompt's length: ``--shared-prefix``, else 3/4 of the context in whole pages."""
    if options.shared_prefix is not None:
        return options.shared_prefix
    return (options.context * 3 // 4) // options.page_size * options.page_size


def sweep_limit(options: DemoOptions) -> int:
    """The longest context of the decode sweep: ``--sweep-context``, else ``max(context, 8192)``."""
    return options.sweep_context if options.sweep_context is not None else max(options.context, 8192)


def make_workload(requests: int, context: int, shared: int, vocab: int, seed: int) -> list[list[int]]:
    """``requests`` prompts of ``context`` tokens whose first ``shared`` tokens (the system prompt) are equal."""
    generator = torch.Generator().manual_seed(seed + 17)
    system = torch.randint(0, vocab, (shared,), generator=generator).tolist()
    return [system + torch.randint(0, vocab, (context - shared,), generator=generator).tolist()
            for _ in range(requests)]


class DemoServer:
    """Continuous batching over a :class:`PagedKVCacheManager` with five co-indexed cache groups.

    ``attention`` (K/V), ``qsa_indexer`` (raw indexer keys) and ``qsa_blocks``
    (the indexers' block keys, each pooled once) of the QSA slice;
    ``mla_latent`` (latent rows) and ``kpool_indexer`` (pooled indexer keys,
    ``sparsekv.layers.mla_cache_groups``) of the MLA slice.
    """

    CHECKED_SEQUENCES_PER_STEP = 2

    def __init__(self, qwen: Qwen4ExpSlice, mla: MlaSlice, options: DemoOptions, device: torch.device,
                 dtype: torch.dtype, num_pages: int) -> None:
        self.qwen, self.mla, self.options, self.device = qwen, mla, options, device
        q = qwen.config
        self.manager = PagedKVCacheManager(
            [*qsa_cache_groups(q, dtype, options.page_size, main="attention", indexer="qsa_indexer",
                               blocks="qsa_blocks"),
             *mla_cache_groups(mla.config, dtype, latent="mla_latent", indexer="kpool_indexer")],
            page_size=options.page_size, num_pages=num_pages, device=device, enable_prefix_caching=True)
        self.max_slots = options.requests + 1
        self.rings = mla.new_rings(self.max_slots)
        self.indexers = [attention.indexer for attention in mla.attentions if attention.indexer is not None]
        self.free_slots = list(range(self.max_slots - 1, -1, -1))
        self.timer = StageTimer(device)
        self.checks = CheckLog(CHECK_NAMES)
        self.totals = _Totals()
        self.check_seconds = 0.0
        self.dtype_size = torch.empty(0, dtype=dtype).element_size()
        self.vocab = min(qwen.embed_tokens.num_embeddings, mla.embed_tokens.num_embeddings)
        self.work = ServingWork.for_models(qwen, mla, self.vocab)

    # ---- one step --------------------------------------------------------
    def run_step(self, plan: list[tuple[_Request, int]]) -> None:
        """Compute ``n`` new tokens of each planned request (prefill chunks and decodes), then commit."""
        timer, mgr = self.timer, self.manager
        started = time.perf_counter()
        is_prefill = [request.prefilling for request, _ in plan]
        inputs = [request.prompt[request.computed:request.computed + n] if prefill else request.generated[-1:]
                  for (request, n), prefill in zip(plan, is_prefill)]
        with timer("manager"):
            for request, n in plan:
                mgr.allocate(request.rid, n)
            batch = mgr.prepare([r.rid for r, _ in plan], [n for _, n in plan])
        token_ids = torch.tensor([t for chunk in inputs for t in chunk], dtype=torch.int64, device=self.device)
        kv_cache = batch.collection("attention")
        index_cache = batch.collection("qsa_indexer")
        latent_cache = batch.collection("mla_latent")
        pooled_cache = batch.collection("kpool_indexer")
        slot_ids = torch.tensor([r.slot for r, _ in plan], dtype=torch.int32, device=self.device)
        offsets = batch.input_row_offsets.tolist()
        with torch.no_grad():
            hidden, qsa_results = self.qwen(token_ids, input_row_offsets=batch.input_row_offsets, kv_cache=kv_cache,
                                            index_cache=index_cache, timer=timer,
                                            block_cache=batch.collection("qsa_blocks"))
            _, mla_results = self.mla(token_ids, input_row_offsets=batch.input_row_offsets, latent_cache=latent_cache,
                                      index_cache=pooled_cache, rings=self.rings, slot_ids=slot_ids, timer=timer)
            kpool_results = [result.indexer for result in mla_results if result.indexer is not None]
            with timer("next_token"):
                last_rows = torch.tensor([end - 1 for end in offsets[1:]], device=self.device)
                logits = hidden[last_rows].float() @ self.qwen.embed_tokens.weight[:self.vocab].float().T
                next_tokens = logits.argmax(dim=-1).tolist()
        model_seconds = time.perf_counter() - started

        check_started = time.perf_counter()
        with torch.no_grad():
            self._check_step(plan, batch, token_ids, kv_cache, index_cache, latent_cache, pooled_cache, qsa_results,
                             mla_results, kpool_results)
        self.check_seconds += time.perf_counter() - check_started

        commit_started = time.perf_counter()
        with timer("manager"):
            for b, ((request, n), chunk) in enumerate(zip(plan, inputs)):
                mgr.step(request.rid, chunk)
                request.computed += n
                if not request.prefilling:
                    request.generated.append(int(next_tokens[b]))
            self.totals.peak_pages = max(self.totals.peak_pages, mgr.metrics().groups["attention"].pages_used)
        for b in range(len(plan)):  # kept for the pooled-key check at release
            for layer, result in enumerate(kpool_results):
                plan[b][0].keys[layer].append(result.keys[offsets[b]:offsets[b + 1]].clone())
                plan[b][0].gates[layer].append(result.gates[offsets[b]:offsets[b + 1]].clone())
        seconds = model_seconds + time.perf_counter() - commit_started
        self._account(plan, is_prefill, qsa_results, mla_results, seconds)

    def _account(self, plan, is_prefill: list[bool], qsa_results, mla_results, seconds: float) -> None:
        """Token counts, time (a mixed step is split by token share) and bytes read."""
        t, q = self.totals, self.qwen.config
        prefill = sum(n for (_, n), flag in zip(plan, is_prefill) if flag)
        decode = sum(n for (_, n), flag in zip(plan, is_prefill) if not flag)
        t.prefill_tokens += prefill
        t.decode_tokens += decode
        t.prefill_seconds += seconds * prefill / (prefill + decode)
        t.decode_seconds += seconds * decode / (prefill + decode)
        t.steps += 1
        token_bytes = 2 * q.num_key_value_heads * q.head_dim * self.dtype_size  # K and V of one token
        block_bytes = q.indexer_head_dim * self.dtype_size
        ratio = q.indexer_compress_ratio
        decode_rows = torch.tensor([not flag for (_, n), flag in zip(plan, is_prefill) for _ in range(n)])
        key_counts = [(request.computed - n, request.computed) for request, n in plan]  # before, after this step
        for result in qsa_results:
            counts, causal = result.counts.cpu().double(), result.positions.cpu().double() + 1
            t.sparse_bytes += float(counts.sum()) * token_bytes
            t.dense_bytes += float(causal.sum()) * token_bytes
            t.decode_sparse_bytes += float(counts[decode_rows].sum()) * token_bytes
            t.decode_dense_bytes += float(causal[decode_rows].sum()) * token_bytes
            # the block store reads the raw keys of the blocks this step completes (the block-key cache keeps
            # the others); the score reads each row's visible block keys
            pooled_keys = sum((after // ratio - before // ratio) * ratio for before, after in key_counts)
            t.indexer_bytes += pooled_keys * block_bytes
            t.indexer_bytes += float(torch.div(causal, ratio, rounding_mode="floor").sum()) * block_bytes
        latent_bytes = self.mla.config.latent_dim * self.dtype_size
        for result in mla_results:
            t.mla_sparse_bytes += float(result.counts.cpu().double().sum()) * latent_bytes
            t.mla_dense_bytes += float((result.positions.cpu().double() + 1).sum()) * latent_bytes

    # ---- checks ----------------------------------------------------------
    def _check_step(self, plan, batch, token_ids, kv_cache, index_cache, latent_cache, pooled_cache, qsa_results,
                    mla_results, kpool_results) -> None:
        q, g = self.qwen.config, self.mla.config
        offsets = batch.input_row_offsets
        # The last row of a few sequences per step, rotating through the batch, keeps the oracles' cost bounded.
        stride = max(1, -(-len(plan) // self.CHECKED_SEQUENCES_PER_STEP))
        sampled = [b for b in range(len(plan)) if (b + self.totals.steps) % stride == 0]
        last_rows = [int(offsets[b + 1]) - 1 for b in sampled]
        for cache_layer, (attention, result) in enumerate(zip(self.qwen.attentions, qsa_results)):
            check_sparse_equals_dense(self.checks, QSA_DENSE, result.attention, result.query, result.gate,
                                      kv_cache, cache_layer, offsets, result.positions, scale=attention.scale,
                                      full_window=q.indexer_budget + q.indexer_compress_ratio - 1)
            check_attention_over_selection(self.checks, QSA_SELECTED, result.attention, result.query, result.gate,
                                           kv_cache, cache_layer, offsets, result.indices, result.counts, last_rows,
                                           scale=attention.scale)
            freqs = attention.rotary.table(kv_cache.max_cache_length + kv_cache.max_seq_length)
            for b, row in zip(sampled, last_rows):
                position = int(result.positions[row])
                scores = brute_force_qsa_blocks(result.index_q[row], index_cache, cache_layer, b, position,
                                                attention.indexer.k_layernorm.weight, freqs,
                                                ratio=q.indexer_compress_ratio, eps=q.rms_norm_eps)
                compare_topk(self.checks, QSA_TOPK, scores, result.indices[row], int(result.counts[row]),
                             position, ratio=q.indexer_compress_ratio, budget=q.indexer_budget,
                             where=f"QSA layer {cache_layer}, {plan[b][0].rid} at position {position}",
                             tie_tolerance=TIE_TOLERANCE[index_cache.dtype])
        self._check_mla(plan, offsets, token_ids, latent_cache, mla_results, sampled, last_rows)
        select_tail = g.index_kpool > 1 and g.index_kpool_always_select_tail
        for cache_layer, result in enumerate(kpool_results):
            for b, row in zip(sampled, last_rows):
                position = int(result.positions[row])
                scores = brute_force_kpool_scores(result.q[row], result.head_weights[row], pooled_cache, cache_layer,
                                                  b, position, kpool=g.index_kpool)
                compare_topk(self.checks, KPOOL_TOPK, scores, result.indices[row], int(result.counts[row]),
                             position, ratio=g.index_kpool, budget=g.index_topk,
                             where=f"k-pool layer {cache_layer}, {plan[b][0].rid} at position {position}",
                             tie_tolerance=TIE_TOLERANCE[pooled_cache.dtype], select_tail=select_tail)
        try:
            self.manager.check_invariants()
            self.checks.record(MANAGER, True)
        except RuntimeError as err:
            self.checks.record(MANAGER, False, 0.0, str(err))

    def _check_mla(self, plan, offsets: torch.Tensor, token_ids: torch.Tensor, latent_cache, mla_results,
                   sampled: list[int], last_rows: list[int]) -> None:
        """MLA against dense MLA on every row whose selection holds its whole visible history, and against
        MLA over exactly the selected tokens on the sampled last rows."""
        g = self.mla.config
        kpool = g.index_kpool
        select_tail = kpool == 1 or g.index_kpool_always_select_tail
        host_offsets = offsets.cpu()
        seq_of_row = torch.repeat_interleave(torch.arange(len(plan)), host_offsets.diff()).tolist()
        hidden = self.mla.embed_tokens(token_ids)  # each layer's input, rebuilt from the residual stream
        for cache_layer, (norm, attention, result) in enumerate(zip(self.mla.input_layernorms, self.mla.attentions,
                                                                    mla_results)):
            layer_input = norm(hidden)
            hidden = hidden + result.output
            positions = result.positions.cpu()
            visible = positions + 1 if select_tail else (positions + 1) // kpool * kpool
            # every visible pool fits the budget: the selection is the whole visible history
            full = torch.nonzero((positions + 1) // kpool <= g.topk_pools).flatten().tolist()
            where = f"MLA layer {g.index_layers[cache_layer]}"
            kv_b = attention.kv_b_proj.weight
            if full:
                q_nope, q_rope = mla_queries(attention, layer_input[full], result.positions[full])
                check_mla_equals_dense(self.checks, MLA_DENSE, result.attention, q_nope, q_rope, full,
                                       [seq_of_row[r] for r in full], latent_cache, cache_layer, kv_b,
                                       visible_end=visible[full].tolist(), scale=attention.scale, where=where)
            q_nope, q_rope = mla_queries(attention, layer_input[last_rows], result.positions[last_rows])
            check_mla_over_selection(self.checks, MLA_SELECTED, result.attention, q_nope, q_rope, last_rows,
                                     sampled, latent_cache, cache_layer, result.indices, result.counts, kv_b,
                                     scale=attention.scale, where=where)

    def check_request_pools(self, request: _Request) -> None:
        """Before release: the request's pooled keys against one compress over all its rows."""
        g = self.mla.config
        pooled_cache = self.manager.prepare([request.rid], [0]).collection("kpool_indexer")
        for layer_idx, indexer in enumerate(self.indexers):
            check_pooled_keys(self.checks, KPOOL_POOLS, torch.cat(request.keys[layer_idx]),
                              torch.cat(request.gates[layer_idx]), indexer.ape, request.hit, pooled_cache,
                              layer_idx, 0, kpool=g.index_kpool, mode=g.index_kpool_mode,
                              where=f"{request.rid}, k-pool layer {layer_idx}")

    # ---- scheduling --------------------------------------------------------
    def new_request(self, rid: str, prompt: list[int]) -> _Request:
        layers = len(self.indexers)
        return _Request(rid, prompt, keys=[[] for _ in range(layers)], gates=[[] for _ in range(layers)])

    def work_left(self, running: list[_Request], waiting: list[_Request]) -> float:
        """Estimated multiply-adds (:class:`ServingWork`) to finish the ``running`` and ``waiting`` requests.

        A waiting request is expected to find the shared system prompt's whole
        pages in the prefix cache, unless no request has run yet and it is the
        first (it computes them).
        """
        options = self.options
        decode_tokens = options.decode_tokens
        shared_pages = shared_prefix_tokens(options) // options.page_size * options.page_size
        requests = [(r.computed, len(r.prompt), decode_tokens + 1 - max(len(r.generated), 1)) for r in running]
        for i, request in enumerate(waiting):
            computes_prefix = i == 0 and not running and self.totals.steps == 0
            hit = 0 if computes_prefix else min(shared_pages, len(request.prompt) - 1)
            requests.append((hit, len(request.prompt), decode_tokens))
        return self.work.remaining(requests, options.step_tokens)

    def serve(self, prompts: list[list[int]], progress) -> None:
        """Serve every prompt to completion: decodes first, then prefill chunks, then admissions.

        ``progress`` (a ``tqdm`` bar) counts estimated work, not tokens: each
        step adds its :meth:`ServingWork.step` and the total is re-estimated
        after it (:meth:`work_left`), so the rate and the ETA hold from
        prefill through decode.
        """
        mgr, decode_tokens = self.manager, self.options.decode_tokens
        waiting = deque(self.new_request(f"req{i}", prompt) for i, prompt in enumerate(prompts))
        running: list[_Request] = []
        progress.total = self.work_left(running, list(waiting))
        progress.refresh()
        while waiting or running:
            plan: list[tuple[_Request, int]] = []
            left = self.options.step_tokens
            for request in running:
                if not request.prefilling and left > 0:
                    plan.append((request, 1))
                    left -= 1
            for request in running:
                if request.prefilling and left > 0:
                    n = min(len(request.prompt) - request.computed, left)
                    plan.append((request, n))
                    left -= n
            reserved = sum(mgr.pages_needed(r.rid, n) for r, n in plan)
            while waiting and left > 0 and self.free_slots:
                request = waiting[0]
                with self.timer("manager"):
                    hit = mgr.claim(request.rid, request.prompt)
                n = min(len(request.prompt) - hit, left)
                need = mgr.pages_needed(request.rid, n)
                if reserved + need > mgr.num_available_pages:
                    mgr.release(request.rid)  # not enough room now: retry after others finish
                    break
                waiting.popleft()
                reserved += need
                request.hit = request.computed = hit
                request.slot = self.free_slots.pop()
                running.append(request)
                plan.append((request, n))
                left -= n
            if not plan:
                raise InsufficientPagesError(reserved, mgr.num_available_pages,
                                             hint="the demo's page pool cannot hold even one request")
            step_work = self.work.step([(request.computed, n) for request, n in plan])
            self.run_step(plan)
            for request in [r for r in running if not r.prefilling and len(r.generated) > decode_tokens]:
                check_started = time.perf_counter()
                with torch.no_grad():
                    self.check_request_pools(request)
                self.check_seconds += time.perf_counter() - check_started
                with self.timer("manager"):
                    mgr.release(request.rid)
                self.free_slots.append(request.slot)
                running.remove(request)
            progress.total = progress.n + step_work + self.work_left(running, list(waiting))
            progress.update(step_work)


# ---------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------
def _check_options(options: DemoOptions) -> torch.device:
    for name, minimum in (("requests", 1), ("context", 2), ("decode_tokens", 0), ("step_tokens", 1),
                          ("page_size", 1)):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise DemoError(f"--{name.replace('_', '-')}: expected an integer >= {minimum}, got {value!r}")
    try:
        device = torch.device(options.device)
    except RuntimeError as err:
        raise DemoError(f"--device: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError(f"--device {options.device}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise DemoError(f"--device: expected cpu or cuda[:N], got {options.device!r}")
    shared = options.shared_prefix
    if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int)
                               or not 0 <= shared <= options.context):
        raise DemoError(f"--shared-prefix: expected an integer in [0, --context = {options.context}], got {shared!r}")
    if options.sweep_context is not None and (isinstance(options.sweep_context, bool)
                                              or not isinstance(options.sweep_context, int)
                                              or options.sweep_context < 1):
        raise DemoError(f"--sweep-context: expected an integer >= 1, got {options.sweep_context!r}")
    return device


def _warm_up(qwen, mla, options: DemoOptions, device: torch.device, dtype: torch.dtype, vocab: int) -> None:
    """Serve a tiny throwaway workload first, so that one-time costs (compiling
    the CPU kernels on a first run, the custom-op machinery's imports) are not
    billed to the timed stages of the real one."""
    # an odd context and a few decode steps, so that pools close both in compress and through the ring
    tiny = replace(options, requests=2, context=2 * options.page_size + 3, decode_tokens=6,
                   shared_prefix=options.page_size, progress=False)
    prompts = make_workload(tiny.requests, tiny.context, tiny.shared_prefix, vocab, tiny.seed)
    with tqdm(disable=True) as no_progress:
        DemoServer(qwen, mla, tiny, device, dtype, num_pages=2 * 4).serve(prompts, no_progress)


def run_demo(options: DemoOptions) -> dict:
    """Serve the workload, run the checks, return the report (see :func:`sparsekv.demo_report.format_report`)."""
    device = _check_options(options)
    options = replace(options, shared_prefix=shared_prefix_tokens(options), sweep_context=sweep_limit(options))
    dtype = _resolve_dtype(options, device)
    qwen, mla, vocab, sources = build_models(options, device, dtype)
    for name, tokens in (("index_kpool", mla.config.index_kpool),
                         ("indexer_compress_ratio", qwen.config.indexer_compress_ratio)):
        if options.page_size % tokens:
            raise DemoError(f"--page-size: {options.page_size} must be a multiple of {name} ({tokens})")
    prompts = make_workload(options.requests, options.context, options.shared_prefix, vocab, options.seed)
    pages_per_request = -(-(options.context + options.decode_tokens) // options.page_size)
    num_pages = options.requests * pages_per_request
    if options.sweep:
        num_pages += -(-(options.sweep_context + 1) // options.page_size)
    server = DemoServer(qwen, mla, options, device, dtype, num_pages)
    _warm_up(qwen, mla, options, device, dtype, vocab)
    started = time.perf_counter()
    # unit: estimated multiply-adds of the serving steps (sparsekv.demo_work), shown as e.g. "12.3G/98.1G"
    with tqdm(unit="MAC", unit_scale=True, desc="sparsekv demo", disable=not options.progress,
              dynamic_ncols=True, leave=False) as progress:
        server.serve(prompts, progress)
    wall = time.perf_counter() - started
    sweep = run_decode_sweep(server, vocab, sweep_contexts(options.sweep_context)) if options.sweep else None
    return build_report(server, options, sources, dtype, wall, sweep)


__all__ = ["CHECK_NAMES", "DEFAULT_GLM", "DEFAULT_QWEN", "DemoError", "DemoOptions", "DemoServer", "StageTimer",
           "build_models", "make_workload", "run_demo", "seed_parameters"]
