"""Built-in checks of ``sparsekv demo``: each recomputes a result in plain PyTorch and compares.

The oracles here are written from the SPEC, not from the kernels: whole
histories are read back from the paged caches with ``PagedKVCache.load`` and
scored / attended / pooled with dense tensor code. A :class:`CheckLog`
collects, per named check, how many comparisons ran, how many failed and the
largest error seen; any failure makes the demo exit non-zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .cache.layout import PagedKVCacheCollection
from .layers.dsa import apply_rope, rope_cos_sin
from .layers.qsa import dense_causal_attention
from .numerics import apply_rope_neox, rms_norm_zero_centred
from .ops.kpool import mla_kpool_compress

# Relative closeness of two results that sum the same terms in different orders.
_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 2e-3), torch.bfloat16: (4e-2, 1e-2)}


@dataclass
class CheckResult:
    name: str
    comparisons: int = 0
    items: int = 0  # rows, pools or selections compared, over all comparisons
    failures: int = 0
    max_error: float = 0.0
    first_failure: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.comparisons > 0 and self.failures == 0

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "comparisons": self.comparisons, "items": self.items,
                "failures": self.failures, "max_error": self.max_error, "first_failure": self.first_failure}


class CheckLog:
    """Named check results, in the order they were first recorded."""

    def __init__(self, names: list[str]) -> None:
        self.results = {name: CheckResult(name) for name in names}

    def record(self, name: str, ok: bool, error: float = 0.0, detail: str = "", items: int = 1) -> None:
        result = self.results[name]
        result.comparisons += 1
        result.items += items
        result.max_error = max(result.max_error, float(error))
        if not ok:
            result.failures += 1
            if not result.first_failure:
                result.first_failure = detail or "mismatch"

    @property
    def all_passed(self) -> bool:
        return all(r.passed for r in self.results.values())


def _close(actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    rtol, atol = _TOLERANCE[actual.dtype]
    a, e = actual.float(), expected.float()
    if bool(torch.isnan(a).any()) or bool(torch.isnan(e).any()):
        return False, float("nan")
    if a.numel() == 0:
        return True, 0.0
    error = float((a - e).abs().max())
    scale = max(1.0, float(e.abs().max()))
    return bool(torch.allclose(a, e, rtol=rtol, atol=atol * scale)), error


# ---------------------------------------------------------------------------
# QSA
# ---------------------------------------------------------------------------
def check_sparse_equals_dense(log: CheckLog, name: str, attention: torch.Tensor, query: torch.Tensor,
                              gate: torch.Tensor, kv_cache: PagedKVCacheCollection, cache_layer: int,
                              input_row_offsets: torch.Tensor, positions: torch.Tensor, *, scale: float,
                              full_window: int) -> int:
    """Rows with ``t + 1 <= full_window`` (``budget + R - 1``) select every causal token, so the
    sparse output must equal plain causal attention. Returns the rows compared."""
    rows = torch.nonzero(positions.cpu() + 1 <= full_window).flatten()
    if rows.numel() == 0:
        return 0
    dense = dense_causal_attention(query, kv_cache, cache_layer, input_row_offsets, scale=scale, gate=gate, rows=rows)
    rows_dev = rows.to(attention.device)
    ok, error = _close(attention[rows_dev], dense[rows_dev])
    log.record(name, ok, error, f"layer {cache_layer}: max |sparse - dense| = {error:.3g} on {rows.numel()} rows",
               items=rows.numel())
    return rows.numel()


def _seq_of_row(input_row_offsets: torch.Tensor, row: int) -> int:
    offsets = input_row_offsets.cpu()
    return int(torch.searchsorted(offsets, torch.tensor([row]), right=True)[0]) - 1


def check_attention_over_selection(log: CheckLog, name: str, attention: torch.Tensor, query: torch.Tensor,
                                   gate: torch.Tensor, kv_cache: PagedKVCacheCollection, cache_layer: int,
                                   input_row_offsets: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor,
                                   rows: list[int], *, scale: float) -> None:
    """Sparse attention of ``rows`` equals softmax attention over exactly the tokens they selected."""
    kv_heads = kv_cache.num_heads
    group = query.shape[1] // kv_heads
    for row in rows:
        b = _seq_of_row(input_row_offsets, row)
        count = int(counts[row])
        selected = indices[row, :count].long()
        keys = kv_cache.get_key_cache(cache_layer).load(b, selected).float()  # [n, kv_heads, D]
        values = kv_cache.get_value_cache(cache_layer).load(b, selected).float()
        q_grouped = query[row].float().reshape(kv_heads, group, -1)  # head h uses KV head h // group
        logits = torch.einsum("kgd,nkd->kgn", q_grouped, keys) * scale
        expected = torch.einsum("kgn,nkd->kgd", torch.softmax(logits, dim=-1), values).reshape(query.shape[1], -1)
        expected = (expected * torch.sigmoid(gate[row].float())).to(attention.dtype)
        ok, error = _close(attention[row], expected)
        log.record(name, ok, error, f"layer {cache_layer}, row {row}: max error {error:.3g} over {count} tokens")


def brute_force_qsa_blocks(index_q_row: torch.Tensor, index_cache: PagedKVCacheCollection, cache_layer: int,
                           seq: int, position: int, gamma: torch.Tensor, freqs_cis: torch.Tensor, *, ratio: int,
                           eps: float) -> torch.Tensor:
    """fp32 scores of every block visible at ``position`` (SPEC 2.2-2.3 written densely): ``[visible]``."""
    visible = (position + 1) // ratio
    if visible == 0:
        return torch.zeros(0)
    raw = index_cache.get_key_cache(cache_layer).load(seq, torch.arange(visible * ratio, device=index_q_row.device))
    raw = raw[:, 0].reshape(visible, ratio, -1)
    total = raw[:, 0].float()
    for i in range(1, ratio):  # the SPEC's summation order, so that bf16 rounding matches
        total = total + raw[:, i].float()
    mean = (total / ratio).to(raw.dtype)
    starts = torch.arange(visible, device=raw.device) * ratio
    block_keys = apply_rope_neox(rms_norm_zero_centred(mean, gamma, eps), freqs_cis[starts], freqs_cis.shape[1])
    per_head = index_q_row.float() @ block_keys.float().T  # [heads, visible]
    return per_head.clamp_min(0).sum(dim=0).cpu() / math.sqrt(index_q_row.shape[-1])


# Relative score gap under which two blocks count as tied (SPEC 4: selections exact where not tied): the
# kernels may round a 16-bit block key one ulp away from the oracle's (a different sum-of-squares order).
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def compare_topk(log: CheckLog, name: str, scores: torch.Tensor, selected_row: torch.Tensor, count: int,
                 position: int, *, ratio: int, budget: int, where: str, tie_tolerance: float,
                 select_tail: bool = True) -> None:
    """The row's selection must be the top ``budget // ratio`` of ``scores`` (ties: lower id), then the tail.

    ``select_tail``: whether the selection ends with the open tail (the tokens after
    the last complete block or pool); GLM-5-Next without
    ``index_kpool_always_select_tail`` selects whole pools only.

    A difference is accepted only where the brute-force scores of the swapped
    blocks lie within ``tie_tolerance`` (relative) of the cut-off score.
    """
    visible = scores.shape[0]
    keep = budget // ratio
    if visible <= keep:
        expected_blocks = torch.arange(visible)
    else:
        order = torch.sort(scores, descending=True, stable=True).indices
        expected_blocks = torch.sort(order[:keep]).values
    whole = ratio * ((position + 1) // ratio)
    tail = torch.arange(whole, position + 1 if select_tail else whole)
    expected = torch.cat([(expected_blocks[:, None] * ratio + torch.arange(ratio)).reshape(-1), tail])
    got = selected_row[:count].long().cpu()
    if count == expected.numel() and torch.equal(got, expected):
        log.record(name, True)
        return
    ok = False
    if count == expected.numel() and visible > keep:
        got_blocks = got[: keep * ratio: ratio] // ratio
        differing = set(got_blocks.tolist()) ^ set(expected_blocks.tolist())
        cutoff = float(torch.sort(scores, descending=True).values[keep - 1])
        spread = max(abs(float(scores[g]) - cutoff) for g in differing) if differing else 0.0
        ok = spread <= tie_tolerance * max(1.0, abs(cutoff)) and torch.equal(got[keep * ratio:], tail)
    log.record(name, ok, 0.0, f"{where}: selected {got.tolist()[:12]}... expected {expected.tolist()[:12]}...")


# ---------------------------------------------------------------------------
# k-pool
# ---------------------------------------------------------------------------
def check_pooled_keys(log: CheckLog, name: str, keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                      first_position: int, pooled_cache: PagedKVCacheCollection, cache_layer: int, seq: int, *,
                      kpool: int, mode: str, where: str) -> None:
    """Pooled keys written call by call must equal one compress over the request's rows, bit for bit.

    ``keys``/``gates`` are the request's rows at positions ``first_position ..``
    (a multiple of ``kpool``: prefix hits are whole pages).
    """
    n = keys.shape[0]
    offsets = torch.tensor([0, n], dtype=torch.int32, device=keys.device)
    start = torch.tensor([first_position], dtype=torch.int32, device=keys.device)
    oneshot = mla_kpool_compress(keys, gates, ape, offsets, None, start, kpool=kpool, mode=mode)
    pool_ids = torch.arange(first_position // kpool, (first_position + n) // kpool, device=keys.device)
    stored = pooled_cache.get_key_cache(cache_layer).load(seq, pool_ids)[:, 0]
    equal = stored.shape == oneshot.shape and torch.equal(stored, oneshot)
    error = float((stored.float() - oneshot.float()).abs().max()) if stored.shape == oneshot.shape and n else 0.0
    log.record(name, equal, error, f"{where}: {pool_ids.numel()} pools, max difference {error:.3g}",
               items=pool_ids.numel())


def brute_force_kpool_scores(q_row: torch.Tensor, weights_row: torch.Tensor, pooled_cache: PagedKVCacheCollection,
                             cache_layer: int, seq: int, position: int, *, kpool: int) -> torch.Tensor:
    """``sum_h w[h] * relu(q[h] . K_p)`` for every pool visible at ``position``: ``[visible]`` fp32."""
    visible = (position + 1) // kpool
    if visible == 0:
        return torch.zeros(0)
    pooled = pooled_cache.get_key_cache(cache_layer).load(seq, torch.arange(visible, device=q_row.device))[:, 0]
    per_head = (q_row.float() @ pooled.float().T).clamp_min(0)  # [heads, visible]
    return (weights_row.float()[:, None] * per_head).sum(dim=0).cpu()


# ---------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------
def mla_queries(attention: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head queries of an ``MlaSparseAttention`` layer for its inputs ``x [n, hidden]`` at ``positions [n]``.

    HF's order: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` split into ``q_nope
    [n, H, qk_nope_head_dim]`` and ``q_rope [n, H, qk_rope_head_dim]``, the
    latter rotated (interleaved RoPE) at each row's position; in ``x``'s dtype.
    """
    nope, rope = attention.nope_dim, attention.rope_dim
    q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(x))).reshape(x.shape[0], -1, nope + rope)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    if rope:
        cos, sin = rope_cos_sin(positions, attention.rope_inv_freq, attention.rope_attention_factor, q.dtype)
        q_rope = apply_rope(q_rope, cos, sin, "interleave")
    return q_nope, q_rope


def _kv_b_halves(kv_b_weight: torch.Tensor, heads: int, nope: int, kv_lora_rank: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_uk [H, nope, r], W_uv [H, v, r])`` float32 of ``kv_b_proj.weight [H * (nope + v), r]``."""
    weight = kv_b_weight.float().reshape(heads, -1, kv_lora_rank)
    return weight[:, :nope], weight[:, nope:]


def check_mla_equals_dense(log: CheckLog, name: str, attended: torch.Tensor, q_nope: torch.Tensor,
                           q_rope: torch.Tensor, rows: list[int], seqs: list[int],
                           latent_cache: PagedKVCacheCollection, cache_layer: int, kv_b_weight: torch.Tensor, *,
                           visible_end: list[int], scale: float, where: str) -> None:
    """Dense MLA in HF's expanded form over each row's whole visible history equals the layer's output.

    For rows whose selection holds every visible token (everything fits the
    budget). ``attended [T, H, v]`` is the layer's per-head output; ``q_nope``,
    ``q_rope`` the queries of ``rows`` (:func:`mla_queries`); row ``i`` of
    sequence ``seqs[i]`` sees tokens ``0 .. visible_end[i] - 1`` (its
    position + 1, or the complete pools only without the tail; none gives a
    zero row). Keys ``[c @ W_uk^T, rope key]`` and values ``c @ W_uv^T``
    of every cached latent row, float32.
    """
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    latent = latent_cache.get_key_cache(cache_layer)
    kv_lora_rank = kv_b_weight.shape[1]
    kv_b = kv_b_weight.float().cpu()
    expected = torch.zeros(len(rows), heads, kv_b.shape[0] // heads - nope)
    for seq in sorted(set(seqs)):
        members = torch.tensor([i for i, s in enumerate(seqs) if s == seq and visible_end[i] > 0], dtype=torch.long)
        if members.numel() == 0:
            continue
        ends = torch.tensor(visible_end)[members]
        held = int(ends.max())
        history = latent.load(seq, torch.arange(held, device=q_nope.device))[:, 0].float().cpu()
        c, k_rope = history[:, :kv_lora_rank], history[:, kv_lora_rank:]
        kv = (c @ kv_b.T).reshape(held, heads, -1)  # HF's kv_b_proj on every cached row
        keys_nope, values = kv[..., :nope], kv[..., nope:]
        logits = (torch.einsum("rhd,nhd->rhn", q_nope[members].float().cpu(), keys_nope)
                  + torch.einsum("rhd,nd->rhn", q_rope[members].float().cpu(), k_rope)) * scale
        hidden_tokens = torch.arange(held)[None, :] >= ends[:, None]  # [rows, held]
        logits = logits.masked_fill(hidden_tokens[:, None, :], float("-inf"))
        expected[members] = torch.einsum("rhn,nhv->rhv", torch.softmax(logits, dim=-1), values)
    actual = attended[torch.tensor(rows, device=attended.device)].cpu()
    ok, error = _close(actual, expected.to(actual.dtype))
    log.record(name, ok, error, f"{where}: max |sparse - dense| = {error:.3g} on {len(rows)} rows", items=len(rows))


def check_mla_over_selection(log: CheckLog, name: str, attended: torch.Tensor, q_nope: torch.Tensor,
                             q_rope: torch.Tensor, rows: list[int], seqs: list[int],
                             latent_cache: PagedKVCacheCollection, cache_layer: int, indices: torch.Tensor,
                             counts: torch.Tensor, kv_b_weight: torch.Tensor, *, scale: float, where: str) -> None:
    """The layer's output of each of ``rows`` equals MLA over exactly the latent rows it selected.

    Written in the absorbed form (``q_nope @ W_uk`` against the cached
    ``kv_a_layernorm`` rows, values the same rows, then ``W_uv``), float32.
    """
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    latent = latent_cache.get_key_cache(cache_layer)
    kv_lora_rank = kv_b_weight.shape[1]
    w_uk, w_uv = _kv_b_halves(kv_b_weight, heads, nope, kv_lora_rank)
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        count = int(counts[row])
        selected = latent.load(seq, indices[row, :count].long())[:, 0].float()
        c, k_rope = selected[:, :kv_lora_rank], selected[:, kv_lora_rank:]
        q_absorbed = torch.einsum("hd,hdr->hr", q_nope[i].float(), w_uk)
        logits = (q_absorbed @ c.T + q_rope[i].float() @ k_rope.T) * scale
        o_latent = torch.softmax(logits, dim=-1) @ c if count else torch.zeros(heads, kv_lora_rank, device=c.device)
        expected = torch.einsum("hr,hvr->hv", o_latent, w_uv).to(attended.dtype)
        ok, error = _close(attended[row], expected)
        log.record(name, ok, error, f"{where}, row {row}: max error {error:.3g} over {count} tokens")


__all__ = ["TIE_TOLERANCE", "CheckLog", "CheckResult", "brute_force_kpool_scores", "brute_force_qsa_blocks",
           "check_attention_over_selection", "check_mla_equals_dense", "check_mla_over_selection", "check_pooled_keys",
           "check_sparse_equals_dense", "compare_topk", "mla_queries"]
