"""The sparsekv side of a Hugging Face cache object: one generation's requests and its HF cache layer.

A :class:`Generation` is one batch of sequences driven through a patched
model: one :class:`~sparsekv.PagedKVCacheManager` request per batch row, the
padded length Hugging Face sees, and each row's real tokens (left padding is
never stored). :func:`plan_call` checks one forward call's padding mask and
positions against it, allocates the pages and builds the kernel inputs;
:meth:`Generation.commit` records the call once the forward has finished.

:class:`SparseKVCacheLayer` stands in for the Hugging Face cache layer of every
patched attention layer: it stores nothing itself (the pages live in the
manager), reports the padded length to Hugging Face's mask and position code,
and raises :class:`UnsupportedFeatureError` for what the paged cache cannot do
(beam reordering, cropping, batch reshuffles).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache.groups import BatchInputs
from ..cache.manager import PagedKVCacheManager
from ..cache.page_pool import InsufficientPagesError


class UnsupportedFeatureError(NotImplementedError):
    """A Hugging Face feature the sparsekv-patched attention does not support (raised when it is asked for)."""


_request_counter = itertools.count()


class Generation:
    """One batch of sequences in the manager, from its first forward to its release.

    Args:
        manager: the patched model's cache manager.
        owner: the object of the patched model that drives it (only the same
            owner may use it).

    Attributes: ``batch_size`` (``None`` until the first forward),
    ``seq_length`` (padded columns Hugging Face has seen), per row
    ``real_lengths`` (tokens stored), ``leading_pads`` (padding before the
    first real token), ``shifts`` (Hugging Face position minus request
    position, fixed by the row's first real token), ``adapter_scratch`` (the
    family adapter's per-generation state, e.g. open k-pool rings; emptied on
    release).
    """

    def __init__(self, manager: PagedKVCacheManager, owner: object) -> None:
        self.manager = manager
        self.owner = owner
        self.request_ids: list[tuple[str, int]] = []
        self.batch_size: int | None = None
        self.seq_length = 0
        self.real_lengths = np.zeros(0, dtype=np.int64)
        self.leading_pads = np.zeros(0, dtype=np.int64)
        self.shifts = np.zeros(0, dtype=np.int64)
        self.closed_reason: str | None = None
        self.broken_reason: str | None = None
        self.on_release: Callable[[Generation], None] | None = None
        self.adapter_scratch: dict = {}

    @property
    def started(self) -> np.ndarray:
        """``[B]`` bool: rows that hold at least one real token."""
        return self.real_lengths > 0

    def check_usable(self, owner: object) -> None:
        if self.owner is not owner:
            raise ValueError("past_key_values: this cache belongs to another sparsekv-patched model")
        if self.closed_reason is not None:
            raise ValueError(f"past_key_values: this cache was released ({self.closed_reason}); "
                             "its pages are gone, so start from a fresh cache (or none)")
        if self.broken_reason is not None:
            raise RuntimeError(f"past_key_values: {self.broken_reason}; its contents are inconsistent, "
                               "so start from a fresh cache (or none)")

    def claim(self, batch_size: int) -> None:
        """Claim one manager request per row (first forward)."""
        ids = [("hf", next(_request_counter)) for _ in range(batch_size)]
        for rid in ids:
            self.manager.claim(rid)
        self.request_ids = ids
        self.batch_size = batch_size

    def release(self) -> None:
        """Give every page back to the manager (idempotent); the generation can start again from empty."""
        for rid in self.request_ids:
            self.manager.release(rid)
        self.request_ids = []
        self.batch_size = None
        self.seq_length = 0
        self.real_lengths, self.leading_pads, self.shifts = (np.zeros(0, dtype=np.int64) for _ in range(3))
        self.broken_reason = None
        self.adapter_scratch = {}
        if self.on_release is not None:
            self.on_release(self)

    def close(self, reason: str) -> None:
        """Release and refuse any later use, naming ``reason`` (e.g. "generate() returned")."""
        if self.closed_reason is None:
            self.release()
            self.closed_reason = reason

    def commit(self, plan: CallPlan) -> None:
        """Record a finished forward call: the manager commits each row's real tokens."""
        for rid, count in zip(self.request_ids, plan.counts.tolist()):
            if count:
                self.manager.step(rid, range(count))
        unstarted = ~self.started
        self.leading_pads[unstarted] += plan.tokens - plan.counts[unstarted]
        self.shifts = plan.shifts.copy()
        self.real_lengths += plan.counts
        self.seq_length += plan.tokens


@dataclass(eq=False)
class CallPlan:
    """One forward call of a generation: kernel inputs and where the real tokens sit.

    ``counts [B]`` real tokens per row; ``row_index [N]`` int64 flat indices of
    the real tokens in the ``[B * T]`` padded rows (``None`` when every cell is
    real); ``batch`` the manager's kernel inputs for ``counts``; ``shifts [B]``
    the rows' Hugging Face position minus request position.
    """

    generation: Generation
    tokens: int
    counts: np.ndarray
    row_index: torch.Tensor | None
    batch: BatchInputs
    shifts: np.ndarray


def _padding_cells(generation: Generation, batch_size: int, tokens: int,
                   attention_mask: torch.Tensor | None) -> np.ndarray:
    """``[B, T]`` bool of the call's real tokens, after checking the mask holds left padding only."""
    seq = generation.seq_length
    if attention_mask is None:
        if bool((generation.leading_pads > 0).any()):
            raise ValueError("attention_mask: this cache's sequences are left-padded; pass the full "
                             f"[batch, {seq + tokens}] attention_mask with every call")
        return np.ones((batch_size, tokens), dtype=bool)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a 2-d tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise UnsupportedFeatureError(
            f"attention_mask: the sparsekv-patched attention takes a 2-d padding mask [batch, past + new]; got "
            f"shape {tuple(attention_mask.shape)} (custom 4-d masks are not supported)")
    if tuple(attention_mask.shape) != (batch_size, seq + tokens):
        raise ValueError(f"attention_mask: expected shape ({batch_size}, {seq + tokens}) (past {seq} + new "
                         f"{tokens} columns), got {tuple(attention_mask.shape)}")
    mask = (attention_mask != 0).cpu().numpy()
    if seq:
        columns = np.arange(seq)[None, :]
        pads = np.where(generation.started, generation.leading_pads, seq)[:, None]
        if not np.array_equal(mask[:, :seq], columns >= pads):
            raise ValueError("attention_mask: its past columns differ from the padding this cache was filled "
                             "with; the patched attention cannot re-mask tokens it already stored")
    new = mask[:, seq:]
    flags = np.concatenate([generation.started[:, None], new], axis=1)
    if bool((flags[:, 1:] < flags[:, :-1]).any()):
        row = int(np.nonzero((flags[:, 1:] < flags[:, :-1]).any(axis=1))[0][0])
        raise UnsupportedFeatureError(
            f"attention_mask: row {row} has a padding column after a real token; the sparsekv-patched "
            "attention supports left padding only (pad before each row's first token)")
    return new


def _rope_positions(position_ids: torch.Tensor | None, batch_size: int, tokens: int, seq: int) -> np.ndarray:
    """``[B, T]`` int64 positions Hugging Face rotates each cell at (its default when ``position_ids`` is None)."""
    if position_ids is None:
        return np.broadcast_to(np.arange(seq, seq + tokens, dtype=np.int64)[None, :], (batch_size, tokens))
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids: expected a tensor, got {type(position_ids).__name__}")
    positions = position_ids.detach().cpu().to(torch.int64)
    if positions.dim() == 3:
        planes = positions[1:] if positions.shape[0] == 4 else positions
        if not bool((planes == planes[:1]).all()):
            raise UnsupportedFeatureError("position_ids: multi-axis (vision) positions are not supported by the "
                                          "sparsekv-patched attention; text positions only")
        positions = planes[0]
    if positions.dim() != 2 or positions.shape[-1] != tokens or positions.shape[0] not in (1, batch_size):
        raise ValueError(f"position_ids: expected shape ({batch_size}, {tokens}), got {tuple(position_ids.shape)}")
    return np.broadcast_to(positions.numpy(), (batch_size, tokens))


def _check_shifts(generation: Generation, real: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Per row: Hugging Face position minus request position, one constant per row for its whole life.

    RoPE attention depends only on position differences, so a constant shift
    (left padding counted into the positions) gives the same result; anything
    else is refused.
    """
    request_positions = generation.real_lengths[:, None] + np.cumsum(real, axis=1) - 1
    diff = np.where(real, positions - request_positions, 0)
    shifts = generation.shifts.copy()
    for b in np.nonzero(real.any(axis=1))[0]:
        values = np.unique(diff[b][real[b]])
        expected = shifts[b] if generation.started[b] else values[0]
        if values.size != 1 or values[0] != expected:
            raise ValueError(
                f"position_ids: row {b} must place its real tokens at consecutive positions continuing its "
                f"earlier ones (offset {expected}); got offsets {values.tolist()[:8]}")
        shifts[b] = expected
    return shifts


def plan_call(generation: Generation, batch_size: int, tokens: int, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None, device: torch.device) -> CallPlan:
    """Check one forward call, allocate its pages and build its kernel inputs.

    Raises before changing anything when the mask or positions are not
    supported, or (``InsufficientPagesError``) when the manager lacks pages.
    """
    if generation.batch_size is not None and generation.batch_size != batch_size:
        raise ValueError(f"input batch: this cache holds {generation.batch_size} sequences, got a batch of "
                         f"{batch_size}")
    if generation.batch_size is None:
        generation.real_lengths = np.zeros(batch_size, dtype=np.int64)
        generation.leading_pads = np.zeros(batch_size, dtype=np.int64)
        generation.shifts = np.zeros(batch_size, dtype=np.int64)
    real = _padding_cells(generation, batch_size, tokens, attention_mask)
    shifts = _check_shifts(generation, real, _rope_positions(position_ids, batch_size, tokens,
                                                             generation.seq_length))
    counts = real.sum(axis=1).astype(np.int64)
    manager = generation.manager
    fresh = generation.batch_size is None
    if fresh:
        generation.claim(batch_size)
    needed = sum(manager.pages_needed(rid, int(n)) for rid, n in zip(generation.request_ids, counts))
    if needed > manager.num_available_pages:
        available = manager.num_available_pages
        if fresh:
            generation.release()
        raise InsufficientPagesError(needed, available,
                                     hint="end finished generations, or patch the model with more num_pages")
    for rid, n in zip(generation.request_ids, counts):
        manager.allocate(rid, int(n))
    batch = manager.prepare(generation.request_ids, counts)
    row_index = None
    if not real.all():
        row_index = torch.from_numpy(np.flatnonzero(real)).to(device)
    return CallPlan(generation, tokens, counts, row_index, batch, shifts)


def _unsupported(what: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{what} is not supported by the sparsekv-patched attention (its keys live "
                                   "in paged storage that this operation would have to rewrite)")


class SparseKVCacheLayer(CacheLayerMixin):
    """Hugging Face cache layer of a patched attention layer: lengths for HF, pages in the manager.

    ``get_seq_length`` / ``get_mask_sizes`` report the padded length HF's mask
    and position code expect. ``indexer_position_ids`` reads as ``None`` and
    ignores writes (the patched attention computes RoPE itself, so HF need not
    keep the whole position history). ``reset()`` releases the generation's
    pages; beam reordering, cropping and batch reshuffles raise
    :class:`UnsupportedFeatureError`.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, generation: Generation) -> None:
        super().__init__()
        self.generation = generation
        self.is_initialized = True

    @property
    def indexer_position_ids(self) -> None:
        return None

    @indexer_position_ids.setter
    def indexer_position_ids(self, _value: object) -> None:
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("this cache layer is driven by sparsekv: an attention module that is not patched "
                           "tried to write to it (was the model unpatched while the cache was in use?)")

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        return self.update(indexer_key_states, indexer_key_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.generation.seq_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.generation.seq_length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        if self.generation.closed_reason is None:
            self.generation.release()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _unsupported("reordering the cache (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise _unsupported("cropping the cache (assisted or speculative decoding, rollback)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1 and self.generation.seq_length:
            raise _unsupported("repeating the cache's batch rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.generation.seq_length:
            raise _unsupported("selecting batch rows of a filled cache")


__all__ = ["CallPlan", "Generation", "SparseKVCacheLayer", "UnsupportedFeatureError", "plan_call"]
