"""Tensor parallelism by attention heads over ``torch.distributed``.

A layer built with a process group (``torch.distributed.ProcessGroup``, or
``None`` for one process) keeps only its rank's heads:

* column-parallel projections (``q_proj``, ``k_proj``, ``v_proj``; the output
  gate rides in ``q_proj``): rank ``r`` of ``W`` ranks holds the rows of its
  contiguous slice of heads, so it computes its heads' queries, gates, keys
  and values with no communication;
* attention runs on those heads only, and the main KV cache of each rank
  holds only its KV heads (a cache group of ``num_key_value_heads / W`` heads);
* row-parallel ``o_proj``: each rank multiplies its heads' columns, one
  ``all_reduce`` (sum) gives every rank the full output, the bias is added once
  after it;
* the indexers are replicated: every rank projects the same indexer queries
  and keys from the same (replicated) hidden states and therefore makes the
  same selection without exchanging anything.

KV heads: when ``num_key_value_heads`` divides by ``W`` each rank holds
``num_key_value_heads / W`` of them; when ``W`` divides by it (more ranks than
KV heads: 2 KV heads at TP 8) each KV head is replicated on ``W /
num_key_value_heads`` consecutive ranks, one per rank, and those ranks' query
heads all belong to its group. Anything else is a ``ValueError``, as is a
query head count that does not divide by ``W``.

Example (24 query heads, 2 KV heads of 256 channels, TP 2, rank 1)::

    head_range(24, rank=1, world_size=2)               # range(12, 24)
    kv_head_range(2, 24, rank=1, world_size=2)         # range(1, 2)
    # q_proj rows 12*512 .. 24*512 (query + gate per head), k/v rows 256 .. 512,
    # o_proj columns 12*256 .. 24*256.

NOTE (design): the cache manager is *replicated*, not broadcast. Every rank
runs its own :class:`~sparsekv.cache.manager.PagedKVCacheManager` and feeds it
the same requests in the same order (``claim``, ``allocate``, ``step``,
``release``); the manager is deterministic (page hashes are SHA-256 with no
per-process seed, free queue and LRU order depend only on the operations, no
clocks or set iteration order), so the page tables and prefix-cache hits are
identical on every rank without any communication on the step path. The
engine above owns the one broadcast it needs anyway: the incoming requests
(scheduling decisions made from replicated state are replicated too).
Per-rank groups differ only in the main group's head count, which does not
enter any page decision. :meth:`TensorParallelGroup.check_identical` compares
a digest of any state across ranks (one small all-gather) for debugging and
tests.

Checkpoints: :func:`load_tensor_parallel_weights` loads a model's weights
(HF names, unsharded checkpoint) reading only the rank's slice of each
sharded tensor (safetensors slices are read lazily).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._checks import check_int
from ._common import StageTimerLike, no_timer
from .checkpoint import CheckpointReader, TensorSource, load_slice_weights


def head_range(num_heads: int, rank: int, world_size: int, *, name: str = "num_attention_heads") -> range:
    """The heads rank ``rank`` of ``world_size`` owns: ``range(rank*n, (rank+1)*n)``, ``n = num_heads / world_size``.

    Raises ``ValueError`` when ``num_heads`` does not divide by ``world_size``.
    """
    check_int(name, num_heads, minimum=1)
    _check_rank(rank, world_size)
    if num_heads % world_size:
        raise ValueError(f"{name}: {num_heads} heads do not split evenly over a tensor-parallel group of "
                         f"{world_size} ranks; use a group size that divides {num_heads}")
    per_rank = num_heads // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def kv_head_range(num_kv_heads: int, num_heads: int, rank: int, world_size: int) -> range:
    """The KV heads rank ``rank`` stores: its slice, or its one replicated head (``world_size`` a multiple of them).

    Raises ``ValueError`` when neither count divides the other, or when the
    query heads do not divide by the world size.
    """
    check_int("num_key_value_heads", num_kv_heads, minimum=1)
    queries = head_range(num_heads, rank, world_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads {num_heads}")
    if num_kv_heads % world_size == 0:
        return head_range(num_kv_heads, rank, world_size, name="num_key_value_heads")
    if world_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} KV heads neither split over nor replicate evenly "
                         f"across a tensor-parallel group of {world_size} ranks")
    kv_head = queries.start // (num_heads // num_kv_heads)  # the group of this rank's first query head
    return range(kv_head, kv_head + 1)


def _check_rank(rank: int, world_size: int) -> None:
    check_int("world_size", world_size, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank: expected a rank in [0, {world_size}), got {rank}")


class WeightSlice(NamedTuple):
    """The part of a checkpoint tensor one rank holds: ``start:stop`` along ``dim`` (of ``full_size``)."""

    dim: int
    start: int
    stop: int
    full_size: int


def head_slice(heads: range, rows_per_head: int, total_heads: int, *, dim: int = 0) -> WeightSlice:
    """The rows (``dim=0``, column-parallel) or columns (``dim=1``, row-parallel) of ``heads``."""
    return WeightSlice(dim, heads.start * rows_per_head, heads.stop * rows_per_head, total_heads * rows_per_head)


class TensorParallelGroup:
    """A layer's view of its process group: rank, world size and the one collective the layers need.

    Args:
        process_group: a ``torch.distributed.ProcessGroup`` (initialised), or
            ``None`` for a single process (rank 0 of 1, no communication).

    ``all_reduce_calls`` and ``all_reduce_bytes`` count this rank's
    all-reduces (time them with the layer's stage timer, stage ``"tp.all_reduce"``).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group: expected a torch.distributed.ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        self.process_group = process_group
        if process_group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        self.all_reduce_calls = 0
        self.all_reduce_bytes = 0

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, world_size={self.world_size})"

    def heads(self, num_heads: int) -> range:
        """This rank's query heads (:func:`head_range`)."""
        return head_range(num_heads, self.rank, self.world_size)

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> range:
        """This rank's KV heads (:func:`kv_head_range`)."""
        return kv_head_range(num_kv_heads, num_heads, self.rank, self.world_size)

    def partial_linear(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The row-parallel part of ``linear`` over this rank's input columns: ``x @ W_rank^T``.

        With one rank this is ``linear(x)`` (bias included); with more, the bias
        is left to :meth:`all_reduce_sum`, which adds it once.
        """
        return linear(x) if self.world_size == 1 else F.linear(x, linear.weight)

    def all_reduce_sum(self, partial: torch.Tensor, bias: torch.Tensor | None = None,
                       timer: StageTimerLike = no_timer) -> torch.Tensor:
        """Sum ``partial`` (from :meth:`partial_linear`) over the ranks in place, then add ``bias``.

        Returns ``partial`` unchanged with one rank (its bias is already in).
        """
        if self.world_size == 1:
            return partial
        with timer("tp.all_reduce"):
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.process_group)
        self.all_reduce_calls += 1
        self.all_reduce_bytes += partial.numel() * partial.element_size()
        return partial if bias is None else partial + bias

    def check_identical(self, what: str, value: object) -> None:
        """Raise ``RuntimeError`` on every rank unless ``value`` pickles to the same bytes on all ranks.

        One all-gather of a 32-byte digest; ``what`` names the value in the error.
        """
        if self.world_size == 1:
            return
        digest = hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest()
        digests: list[str | None] = [None] * self.world_size
        dist.all_gather_object(digests, digest, group=self.process_group)
        if len(set(digests)) != 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RuntimeError(f"{what}: differs across tensor-parallel ranks (ranks {differing} differ from rank 0)")


class RankSliceReader(CheckpointReader):
    """An unsharded checkpoint seen as one rank's weights: each sharded tensor narrowed to the rank's slice.

    Args:
        source: a :class:`CheckpointReader` (only the slice is read from the
            file) or a dict of full tensors.
        slices: ``{name: WeightSlice}``; a name is matched from its
            ``layers.`` part on, so any checkpoint root (``model.``,
            ``model.language_model.``) finds it. Other names read through whole.

    A checkpoint tensor whose size along the sliced dim is not ``full_size``
    raises ``ValueError`` naming it (before anything is loaded).
    """

    def __init__(self, source: TensorSource, slices: Mapping[str, WeightSlice]) -> None:
        # No files of its own: every read goes through to ``source``, so the base initialiser is not called.
        self._source = source
        self._slices = {_layer_key(name): value for name, value in slices.items()}

    def _slice_of(self, name: str) -> WeightSlice | None:
        return self._slices.get(_layer_key(name))

    def names(self) -> list[str]:
        return self._source.names() if isinstance(self._source, CheckpointReader) else sorted(self._source)

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _full_shape(self, name: str) -> tuple[int, ...]:
        if isinstance(self._source, CheckpointReader):
            return self._source.shape(name)
        return tuple(self._source[name].shape)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._full_shape(name)
        part = self._slice_of(name)
        if part is None:
            return shape
        if len(shape) <= part.dim or shape[part.dim] != part.full_size:
            raise ValueError(f"checkpoint: weight {name!r} has shape {shape}, expected {part.full_size} entries "
                             f"along dim {part.dim} to take rows {part.start}:{part.stop} of")
        return shape[:part.dim] + (part.stop - part.start,) + shape[part.dim + 1:]

    def get(self, name: str) -> torch.Tensor:
        part = self._slice_of(name)
        if part is None:
            return self._source.get(name) if isinstance(self._source, CheckpointReader) else self._source[name]
        self.shape(name)  # checks the full size
        if isinstance(self._source, CheckpointReader):
            return self._source.get_slice(name, part.dim, part.start, part.stop)
        return self._source[name].narrow(part.dim, part.start, part.stop - part.start)


def _layer_key(name: str) -> str:
    index = name.find("layers.")
    return name if index < 0 else name[index:]


def tensor_parallel_slices(model: nn.Module) -> dict[str, WeightSlice]:
    """``{checkpoint name: WeightSlice}`` of every sharded weight of ``model.checkpoint_modules()``.

    A module shards when it has a ``tensor_parallel_slices()`` method (names
    relative to the module); the rest is replicated.
    """
    slices: dict[str, WeightSlice] = {}
    for module, prefix in model.checkpoint_modules():
        for sub_name, sub in module.named_modules():
            method = getattr(sub, "tensor_parallel_slices", None)
            if method is None:
                continue
            inner = f"{prefix}{sub_name}." if sub_name else prefix
            slices.update({inner + name: value for name, value in method().items()})
    return slices


def load_tensor_parallel_weights(model: nn.Module, source: TensorSource) -> list[str]:
    """:func:`~sparsekv.layers.checkpoint.load_slice_weights` for a model built with a process group.

    ``source`` is the unsharded checkpoint (or a dict of full tensors, e.g. a
    single-process model's ``slice_state``); each rank reads only its slices.
    Every weight is checked before the first is written.
    """
    return load_slice_weights(model, RankSliceReader(source, tensor_parallel_slices(model)))


__all__ = ["RankSliceReader", "TensorParallelGroup", "WeightSlice", "head_range", "head_slice", "kv_head_range",
           "load_tensor_parallel_weights", "tensor_parallel_slices"]
