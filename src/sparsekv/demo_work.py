"""Estimated work of the demo's serving steps, in multiply-adds, for its progress bar.

Counting tokens makes a 512-row prefill step worth 64 times an 8-row decode
step, while on a CPU it takes 3 to 6 times as long: each step pays for its op
dispatches and sampled checks whatever its size. So the bar counts an
estimate of each step's cost instead, in multiply-adds:

* per row at position ``t``: the projections (every linear weight of both
  slices; MLA's ``kv_b_proj`` counts once per row, which is what absorbing it
  into the query and the output costs), QSA sparse attention over
  ``min(t + 1, budget + R - 1)`` tokens, MLA sparse attention over
  ``min(t + 1, index_topk + kpool - 1)`` latent rows, QSA block scores over
  ``(t + 1) // R`` blocks and k-pool scores over ``(t + 1) // kpool`` pools;
* per row: the QSA compress pooling its raw index key into a block key, once
  (the block-key cache keeps the blocks of earlier calls);
* per sequence in a step: the next-token logits;
* per step: a fixed cost, :data:`STEP_OVERHEAD_MACS`.

Example (``DEFAULT_QWEN``/``DEFAULT_GLM``): a 512-row prefill chunk at positions
1536..2047 is about 1.4e10 multiply-adds plus the step cost, an 8-row decode
step at position 2048 about 2.3e8 plus the step cost, so with the 3e9 step
cost the prefill step counts 5.2 decode steps instead of 64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

# The fixed cost of one serving step (op dispatch, scheduling, the checks of two sampled sequences) in
# multiply-adds at the rate the CPU path reaches. Fitting step time = fixed + rate * multiply-adds over the
# default demo's steps on a 2-core CPU gave 2e9 to 5e9 (the more loaded the machine, the larger): a 512-row
# prefill step took 3 to 6 times as long as an 8-row decode step.
STEP_OVERHEAD_MACS = 3.0e9


def _sum_min(first: int, last: int, cap: int) -> int:
    """``sum(min(u, cap) for u in range(first, last + 1))`` in closed form (0 when ``last < first``)."""
    if last < first:
        return 0
    below_last = min(last, cap)
    total = (below_last * (below_last + 1) - (first - 1) * first) // 2 if first <= cap else 0
    return total + cap * (last - max(first - 1, cap)) if last > cap else total


def _sum_floor_div(last: int, divisor: int) -> int:
    """``sum(u // divisor for u in range(1, last + 1))`` in closed form.

    Example: divisor 4, last 8: ``0+0+0+1+1+1+1+2 = 6 = 4 * 2 * 1 // 2 + 2 * (0 + 1)``.
    """
    if last <= 0:
        return 0
    whole, rest = divmod(last, divisor)
    return divisor * whole * (whole - 1) // 2 + whole * (rest + 1)


@dataclass(frozen=True)
class ServingWork:
    """Multiply-add estimates of the demo's steps (see the module docstring).

    Build it with :meth:`for_models`; all counts are per QSA or k-pool layer
    unless named ``total``.
    """

    projection_macs: int  # per row, all layers of both slices
    qsa_layers: int
    qsa_attention_macs: int  # per attended token: q.k and p.v over all query heads
    qsa_window: int  # budget + R - 1: the most tokens a row attends
    qsa_ratio: int
    qsa_score_macs: int  # per visible block: indexer heads x indexer head dim
    qsa_compress_macs: int  # per raw index key the compress pools (once: the block-key cache keeps the blocks)
    kpool_layers: int  # layers that run their own indexer
    kpool_score_macs: int  # per visible pool: index heads x index head dim
    kpool: int
    mla_layers: int
    mla_attention_macs: int  # per attended latent row: q.row and p.c over all heads
    mla_window: int  # index_topk + kpool - 1: the most latent rows a row attends
    logits_macs: int  # per sequence: hidden x vocab
    step_overhead_macs: float = STEP_OVERHEAD_MACS

    @classmethod
    def for_models(cls, qwen: nn.Module, mla: nn.Module, vocab: int,
                   step_overhead_macs: float = STEP_OVERHEAD_MACS) -> ServingWork:
        """From a ``Qwen4ExpSlice`` and an ``MlaSlice`` (their configs and linear weights)."""
        q, g = qwen.config, mla.config
        linear_weights = sum(module.weight.numel() for model in (qwen, mla) for module in model.modules()
                             if isinstance(module, nn.Linear))
        # the k-pool gate projection is a bare [index_head_dim, hidden] parameter, as HF names it
        linear_weights += sum(weight.numel() for name, weight in mla.named_parameters()
                              if name.endswith("index_kpool_compress_gate"))
        return cls(projection_macs=linear_weights, qsa_layers=len(q.qsa_layers),
                   qsa_attention_macs=2 * q.num_attention_heads * q.head_dim,
                   qsa_window=q.indexer_budget + q.indexer_compress_ratio - 1, qsa_ratio=q.indexer_compress_ratio,
                   qsa_score_macs=q.indexer_n_heads * q.indexer_head_dim, qsa_compress_macs=q.indexer_head_dim,
                   kpool_layers=len(g.full_index_layers), kpool_score_macs=g.index_n_heads * g.index_head_dim,
                   kpool=g.index_kpool, mla_layers=len(g.index_layers),
                   mla_attention_macs=g.num_attention_heads * (2 * g.kv_lora_rank + g.qk_rope_head_dim),
                   mla_window=g.index_topk + g.index_kpool - 1, logits_macs=q.hidden_size * vocab,
                   step_overhead_macs=step_overhead_macs)

    def rows(self, start: int, stop: int) -> float:
        """Rows at positions ``start .. stop - 1`` of one sequence: projections, attention, scores."""
        if stop <= start:
            return 0.0
        attended = _sum_min(start + 1, stop, self.qsa_window)
        latent_rows = _sum_min(start + 1, stop, self.mla_window)
        blocks = _sum_floor_div(stop, self.qsa_ratio) - _sum_floor_div(start, self.qsa_ratio)
        pools = _sum_floor_div(stop, self.kpool) - _sum_floor_div(start, self.kpool)
        return float((stop - start) * self.projection_macs
                     + self.qsa_layers * (attended * self.qsa_attention_macs + blocks * self.qsa_score_macs)
                     + self.kpool_layers * pools * self.kpool_score_macs
                     + self.mla_layers * latent_rows * self.mla_attention_macs)

    def chunk(self, start: int, rows: int) -> float:
        """One sequence's ``rows`` new tokens after ``start`` cached ones, in one step (the step cost apart)."""
        return self.rows(start, start + rows) + self.qsa_layers * rows * self.qsa_compress_macs + self.logits_macs

    def step(self, chunks: Iterable[tuple[int, int]]) -> float:
        """A step computing ``(start, rows)`` for each sequence of its batch."""
        return self.step_overhead_macs + sum(self.chunk(start, rows) for start, rows in chunks)

    def remaining(self, requests: Iterable[tuple[int, int, int]], step_tokens: int) -> float:
        """Work left for requests given as ``(computed, prompt_tokens, decode_steps_left)``.

        Prefill rows are counted once each (their per-chunk costs assume
        chunks of ``step_tokens``). The steps left follow the scheduler: the
        prefill rows share ``step_tokens`` per step, the last request to finish
        its prompt then decodes alone, and requests already decoding run side
        by side. Example: 2 requests of 20 prompt tokens and 3 decode steps, 16
        tokens per step: ``ceil(40 / 16) + 3 = 6`` steps.
        """
        work, rows_left, prefill_rows, decode_after_prefill, decoding = 0.0, 0, 0, 0, 0
        for computed, prompt, decode_left in requests:
            prefill = max(prompt - computed, 0)
            work += (self.rows(computed, prompt) + self.qsa_layers * prefill * self.qsa_compress_macs
                     + math.ceil(prefill / step_tokens) * self.logits_macs)
            first = max(computed, prompt)  # decode step i runs at position first + i
            work += (self.rows(first, first + decode_left) + self.qsa_layers * decode_left * self.qsa_compress_macs
                     + decode_left * self.logits_macs)
            rows_left += prefill + decode_left
            prefill_rows += prefill
            if prefill:
                decode_after_prefill = max(decode_after_prefill, decode_left)
            else:
                decoding = max(decoding, decode_left)
        steps = max(math.ceil(prefill_rows / step_tokens) + decode_after_prefill, decoding,
                    math.ceil(rows_left / step_tokens))
        return work + steps * self.step_overhead_macs


__all__ = ["STEP_OVERHEAD_MACS", "ServingWork"]
