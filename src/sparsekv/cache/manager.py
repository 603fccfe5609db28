"""PagedKVCacheManager: request lifecycle, prefix caching and batch kernel inputs (SPEC 1.2).

NOTE (design): cache groups are *co-indexed*. There is one page pool of
``num_pages`` page ids, and every cache group (main attention K/V, a QSA
indexer cache, a k-pool pooled-key cache, ...) owns its own ``blocks`` tensor
``[num_pages, KV, num_layers, entries_per_page, num_heads, head_size]`` with
``entries_per_page = page_size // tokens_per_entry``. Page id ``p`` is page
``p`` in *every* group, so one lookup table per request serves all groups, and
logical page ``i`` of every group covers the same tokens
``[i*page_size, (i+1)*page_size)``. The memory budget counts every group:
one page id costs the sum of the groups' page bytes, and
``num_pages = memory_budget_bytes // bytes_per_page``.

NOTE (design): a group with ``tokens_per_entry = R > 1`` stores one entry per
``R`` tokens (a pooled key per k-pool). Its collection counts entries, not
tokens: ``cache_lengths = cache_length // R`` (complete entries before this
call) and this call completes ``(c + n) // R - c // R`` entries, stored at
entry positions ``c // R ..`` (``BatchInputs.entry_row_offsets``).

NOTE (design): a prefix hit is at most ``len(prompt) - 1`` tokens, rounded
down to whole pages, so at least one prompt token is always computed (its
logits are needed). Only full pages are hashed and shared, so a request never
writes into a shared page and no copy-on-write is needed.

NOTE (design): under tensor parallelism each rank runs its own manager,
driven with the same calls in the same order, and gets the same page tables
and prefix hits without communicating: every decision depends only on the
sequence of calls (SHA-256 page hashes with no per-process seed, free queue
and LRU order, table rows), never on clocks, addresses or set order. A
rank's groups may differ in head counts (its share of the KV heads); page
decisions never read them (``docs/scale-out.md``, ``layers/tensor_parallel.py``).

Lifecycle (page size 16; 40 cached tokens would be 2 full pages + 8)::

    mgr = PagedKVCacheManager([CacheGroupSpec("main", 2, 4, 2, 256, torch.bfloat16),
                               CacheGroupSpec("indexer", 1, 4, 1, 128, torch.bfloat16)],
                              page_size=16, num_pages=64)
    hit = mgr.claim("r0", prompt)              # tokens already cached (a multiple of 16)
    mgr.allocate("r0", len(prompt) - hit)      # pages for the rest (InsufficientPagesError if none)
    batch = mgr.prepare(["r0"], [len(prompt) - hit])
    # ... kernels write K/V through batch.collection("main") / ("indexer") ...
    mgr.step("r0", prompt[hit:])               # commit; pages that became full join the prefix cache
    mgr.release("r0")                          # hashed pages become evictable (LRU)
"""

from __future__ import annotations

import struct
from array import array
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._checks import check_int
from .groups import BatchInputs, CacheGroupSpec, CacheMetrics, GroupUsage
from .hashing import chained_page_hash_list, chained_page_hashes, encode_namespace, token_bytes
from .layout import SENTINEL
from .memory import allocate_pages
from .page_pool import InsufficientPagesError, PagePool, PageRecord


@dataclass(slots=True, eq=False)
class _Request:
    slot: int
    namespace: bytes
    pages: list[PageRecord] = field(default_factory=list)
    cache_length: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # one per full page, logical order
    tail_tokens: array = field(default_factory=lambda: array("q"))  # committed tokens of the partial page


def _token_array(name: str, token_ids: object) -> array:
    """Token ids as an ``array('q')`` of non-negative ints (from a list, tuple, range, tensor or array)."""
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        if token_ids.ndim != 1:
            raise ValueError(f"{name}: expected a 1-d sequence of token ids, got shape {tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    elif not isinstance(token_ids, (list, tuple, range, array)):
        raise TypeError(f"{name}: expected a list, tuple, range or 1-d integer tensor, got {type(token_ids).__name__}")
    tokens = None
    if len(token_ids) > 32 and isinstance(token_ids, (list, tuple)):
        # NOTE: struct reads a list of ints 2-4x faster than array("q", ...); anything
        # it rejects goes through array() below, which names the offending id.
        tokens = array("q")
        try:
            tokens.frombytes(struct.pack(f"{len(token_ids)}q", *token_ids))
        except struct.error:
            tokens = None
    if tokens is None:
        try:
            tokens = array("q", token_ids)
        except TypeError:
            raise TypeError(f"{name}: expected integer token ids, got {token_ids!r:.80}") from None
        except OverflowError:
            too_large = next(t for t in token_ids if not -(2**63) <= t < 2**63)
            raise ValueError(f"{name}: expected token ids in [0, 2**63), got {too_large}") from None
    if tokens:
        smallest = int(np.frombuffer(tokens, dtype=np.int64).min())  # 40x faster than min() over the array
        if smallest < 0:
            raise ValueError(f"{name}: expected token ids >= 0, got {smallest}")
    return tokens


class PagedKVCacheManager:
    """Pages, requests and prefix cache of one device's paged KV cache.

    Args:
        groups: one or more :class:`CacheGroupSpec` with unique names (co-indexed, see module NOTE).
        page_size: tokens per page; a multiple of every group's ``tokens_per_entry``.
        num_pages: page ids in the pool; or
        memory_budget_bytes: total bytes for all groups' blocks
            (``num_pages = budget // bytes_per_page``). Give exactly one.
        device: where the blocks and the batch index tensors live.
        enable_prefix_caching: hash full pages and reuse them across requests.

    Every group's blocks start as zeros (on Linux CPUs in 2 MiB pages where
    the kernel allows: :func:`.memory.allocate_pages`). Misuse (unknown or duplicate request
    ids, negative counts, committing unallocated tokens) raises ``ValueError``;
    running out of pages raises :class:`InsufficientPagesError` and changes nothing.
    """

    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        *,
        page_size: int,
        num_pages: int | None = None,
        memory_budget_bytes: int | None = None,
        device: torch.device | str = "cpu",
        enable_prefix_caching: bool = True,
    ) -> None:
        groups = tuple(groups)
        if not groups:
            raise ValueError("groups: expected at least one CacheGroupSpec")
        for spec in groups:
            if not isinstance(spec, CacheGroupSpec):
                raise TypeError(f"groups: expected CacheGroupSpec items, got {type(spec).__name__}")
        names = [spec.name for spec in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"groups: expected unique names, got {names}")
        check_int("page_size", page_size, minimum=1)
        for spec in groups:
            if page_size % spec.tokens_per_entry:
                raise ValueError(f"page_size: {page_size} is not a multiple of group {spec.name!r}'s "
                                 f"tokens_per_entry {spec.tokens_per_entry}")
        self.groups = groups
        self.page_size = page_size
        self.bytes_per_page = sum(spec.page_bytes(page_size) for spec in groups)
        if (num_pages is None) == (memory_budget_bytes is None):
            raise ValueError("expected exactly one of num_pages and memory_budget_bytes")
        if memory_budget_bytes is not None:
            check_int("memory_budget_bytes", memory_budget_bytes, minimum=0)
            num_pages = memory_budget_bytes // self.bytes_per_page
            if num_pages < 1:
                raise ValueError(f"memory_budget_bytes: {memory_budget_bytes} bytes hold no page; one page id "
                                 f"costs {self.bytes_per_page} bytes over all groups")
        check_int("num_pages", num_pages, minimum=1)
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._blocks = {
            spec.name: allocate_pages((num_pages, spec.kv_planes, spec.num_layers, spec.entries_per_page(page_size),
                                       spec.num_heads, spec.head_size), spec.dtype, self.device)
            for spec in groups
        }
        self._specs = {spec.name: spec for spec in groups}
        self._pool = PagePool(num_pages)
        self._requests: dict[Hashable, _Request] = {}
        # NOTE: each request owns one row ("slot") of a host page table that
        # grows by doubling; prepare() gathers rows with one numpy index.
        self._table = np.full((8, 8), SENTINEL, dtype=np.int32)
        self._free_slots: list[int] = list(range(7, -1, -1))
        self._query_tokens = self._hit_tokens = self._query_requests = self._hit_requests = 0

    # ---- lookups ---------------------------------------------------------
    def _request(self, request_id: Hashable, what: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"{what}: unknown request id {request_id!r} (not claimed, or already released)") from None
        except TypeError:
            raise TypeError(f"{what}: request id must be hashable, got {type(request_id).__name__}") from None

    def cache_length(self, request_id: Hashable) -> int:
        """Tokens committed (cached) for the request."""
        return self._request(request_id, "cache_length").cache_length

    def pages_of(self, request_id: Hashable) -> list[int]:
        """The request's physical page ids in logical order (its lookup-table row)."""
        return [r.page_id for r in self._request(request_id, "pages_of").pages]

    def blocks(self, group_name: str) -> torch.Tensor:
        """The group's ``[num_pages, KV, num_layers, entries_per_page, num_heads, head_size]`` tensor."""
        try:
            return self._blocks[group_name]
        except (KeyError, TypeError):
            raise ValueError(f"group_name: unknown cache group {group_name!r}; groups are "
                             f"{list(self._blocks)}") from None

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation may take now (free plus evictable)."""
        return self._pool.num_available

    def pages_needed(self, request_id: Hashable, num_new_tokens: int, lookahead: int = 0) -> int:
        """New pages :meth:`allocate` would take for these counts (0 when the request already has room)."""
        request = self._request(request_id, "pages_needed")
        check_int("num_new_tokens", num_new_tokens, minimum=0)
        check_int("lookahead", lookahead, minimum=0)
        total = request.cache_length + num_new_tokens + lookahead
        return max(0, -(-total // self.page_size) - len(request.pages))

    # ---- lifecycle -------------------------------------------------------
    def claim(self, request_id: Hashable, prompt_token_ids: object = None, namespace: object = None) -> int:
        """Start a request; return how many prompt tokens are already cached.

        With a prompt and prefix caching on, the longest run of leading full
        pages found in the prefix cache (same tokens, same earlier pages, same
        ``namespace``) is shared by reference; the returned count is a multiple
        of ``page_size`` and at most ``len(prompt) - 1``. The request starts
        with that cache length; commit the rest of the prompt with :meth:`step`.

        Example (page size 4, "r0" committed tokens 1..9 earlier)::

            mgr.claim("r1", [1, 2, 3, 4, 5, 6, 7, 8, 9])   # -> 8: pages [1..4], [5..8] shared
            mgr.claim("r2", [1, 2, 3, 4, 5, 6, 7, 8])      # -> 4: the last token must be computed
        """
        try:
            if request_id in self._requests:
                raise ValueError(f"claim: request id {request_id!r} is already claimed; release it first")
        except TypeError:
            raise TypeError(f"claim: request id must be hashable, got {type(request_id).__name__}") from None
        namespace_bytes = encode_namespace(namespace)
        tokens = array("q") if prompt_token_ids is None else _token_array("prompt_token_ids", prompt_token_ids)
        hits: list[PageRecord] = []
        hashes: list[bytes] = []
        if self.enable_prefix_caching and tokens:
            shareable = (len(tokens) - 1) // self.page_size * self.page_size  # at least one token is computed
            hits, hashes = self._pool.lookup_prefix(
                chained_page_hashes(None, token_bytes(tokens[:shareable]), self.page_size, namespace_bytes))
            self._query_tokens += len(tokens)
            self._query_requests += 1
            self._hit_tokens += len(hits) * self.page_size
            self._hit_requests += bool(hits)
            self._pool.acquire(hits)
        request = _Request(slot=self._take_slot(), namespace=namespace_bytes, pages=hits,
                           cache_length=len(hits) * self.page_size, page_hashes=hashes)
        self._requests[request_id] = request
        self._write_row(request, 0)
        return request.cache_length

    def allocate(self, request_id: Hashable, num_new_tokens: int, lookahead: int = 0) -> None:
        """Make sure the request has pages for ``cache_length + num_new_tokens + lookahead`` tokens.

        Raises :class:`InsufficientPagesError` (``needed`` new pages, ``free``
        free + evictable pages) and changes nothing, for this request or any other.
        """
        needed = self.pages_needed(request_id, num_new_tokens, lookahead)
        if needed == 0:
            return
        if needed > self._pool.num_available:
            raise InsufficientPagesError(
                needed, self._pool.num_available,
                hint=f"request {request_id!r} asked for {num_new_tokens} + {lookahead} lookahead tokens; release "
                     "finished requests, or build the manager with more num_pages / memory_budget_bytes",
            )
        request = self._requests[request_id]
        first_new = len(request.pages)
        request.pages.extend(self._pool.allocate(needed))
        self._write_row(request, first_new)

    def step(self, request_id: Hashable, token_ids: object) -> None:
        """Commit the tokens just written to the cache (``cache_length += len(token_ids)``).

        Pages that became full are hashed and registered in the prefix cache
        (a page whose hash is already cached elsewhere stays unregistered).
        Committing past the allocated pages is a ``ValueError``.
        """
        request = self._request(request_id, "step")
        tokens = _token_array("token_ids", token_ids)
        capacity = len(request.pages) * self.page_size
        if request.cache_length + len(tokens) > capacity:
            raise ValueError(
                f"step: request {request_id!r} would cache {request.cache_length + len(tokens)} tokens but has "
                f"pages for {capacity}; call allocate first"
            )
        request.cache_length += len(tokens)
        if not self.enable_prefix_caching:
            return
        tail = request.tail_tokens
        tail.extend(tokens)
        full = len(tail) // self.page_size
        if not full:
            return
        hashes = request.page_hashes
        done = len(hashes)
        digests = chained_page_hash_list(hashes[-1] if hashes else None, token_bytes(tail[:full * self.page_size]),
                                         self.page_size, request.namespace)
        self._pool.register_many(request.pages[done:done + full], digests)
        hashes.extend(digests)
        del tail[:full * self.page_size]

    def release(self, request_id: Hashable) -> None:
        """End a request: drop its page references (hashed pages become evictable, LRU)."""
        request = self._request(request_id, "release")
        del self._requests[request_id]
        self._pool.release(request.pages[::-1])
        self._table[request.slot, :len(request.pages)] = SENTINEL
        self._free_slots.append(request.slot)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page hash.

        Raises ``RuntimeError`` (changing nothing) while any request holds pages.
        """
        self._pool.reset_hashes()

    # ---- batch inputs ----------------------------------------------------
    def prepare(self, request_ids: Sequence[Hashable], num_new_tokens: int | Sequence[int]) -> BatchInputs:
        """Kernel inputs for writing/reading ``num_new_tokens[b]`` new tokens of each request.

        Args:
            request_ids: ``B >= 1`` distinct claimed requests, in batch order.
            num_new_tokens: one int for all, or ``B`` ints; the pages for
                ``cache_length + num_new_tokens[b]`` tokens must be allocated.

        Returns a :class:`BatchInputs` (int32 index tensors on the manager's
        device; lookup-table rows hold every allocated page, padded with -1).
        Nothing changes; call :meth:`step` after the kernels have written.

        Example (page size 4): cache lengths ``[5, 0]``, new ``[1, 3]``, pages
        ``[[7, 2], [4]]`` give offsets ``[0, 1, 4]`` and table ``[[7, 2], [4, -1]]``.
        """
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise TypeError(f"request_ids: expected a sequence of request ids, got {type(request_ids).__name__}")
        batch = len(request_ids)
        if batch == 0:
            raise ValueError("request_ids: expected at least one request (empty batch)")
        requests = [self._request(rid, "prepare") for rid in request_ids]
        if len({id(r) for r in requests}) != batch:
            raise ValueError(f"request_ids: expected distinct requests, got duplicates in {list(request_ids)}")
        if isinstance(num_new_tokens, (int, np.integer)) and not isinstance(num_new_tokens, bool):
            new = np.full(batch, num_new_tokens, dtype=np.int64)
        else:
            new = np.asarray(num_new_tokens)
            if new.dtype.kind not in "iu":
                raise TypeError(f"num_new_tokens: expected an int or {batch} ints, got {num_new_tokens!r:.80}")
            if new.shape != (batch,):
                raise ValueError(f"num_new_tokens: expected an int or {batch} ints (one per request), "
                                 f"got shape {new.shape}")
            new = new.astype(np.int64)
        if batch and int(new.min()) < 0:
            b = int(np.argmax(new < 0))
            raise ValueError(f"num_new_tokens: expected values >= 0, got {int(new[b])} for request {request_ids[b]!r}")
        cache = np.fromiter((r.cache_length for r in requests), dtype=np.int64, count=batch)
        page_counts = np.fromiter((len(r.pages) for r in requests), dtype=np.int64, count=batch)
        short = np.nonzero(cache + new > page_counts * self.page_size)[0]
        if short.size:
            b = int(short[0])
            raise ValueError(
                f"prepare: request {request_ids[b]!r} (batch row {b}) needs pages for "
                f"{int(cache[b] + new[b])} tokens but has {int(page_counts[b]) * self.page_size}; call allocate first"
            )
        if int((cache + new).max()) >= 2**31:
            raise ValueError("prepare: token counts must stay below 2**31")
        slots = np.fromiter((r.slot for r in requests), dtype=np.intp, count=batch)
        width = max(1, int(page_counts.max()))
        # One int32 buffer [offsets | cache lengths | table] -> one host-to-device copy.
        packed = np.empty(2 * batch + 1 + batch * width, dtype=np.int32)
        packed[0] = 0
        np.cumsum(new, out=packed[1:batch + 1], dtype=np.int32)
        packed[batch + 1:2 * batch + 1] = cache
        packed[2 * batch + 1:].reshape(batch, width)[:] = self._table[slots, :width]
        on_device = torch.from_numpy(packed).to(self.device)
        return BatchInputs(
            request_ids=tuple(request_ids),
            input_row_offsets=on_device[:batch + 1],
            cache_lengths=on_device[batch + 1:2 * batch + 1],
            lookup_table=on_device[2 * batch + 1:].view(batch, width),
            max_seq_length=int(new.max()),
            max_cache_length=int(cache.max()),
            host_cache_lengths=cache,
            host_new_tokens=new,
            groups=self._specs,
            blocks=self._blocks,
        )

    # ---- checks and metrics ----------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant of the pool or a request."""
        holders: Counter[int] = Counter()
        slots = set()
        for rid, request in self._requests.items():
            ids = [r.page_id for r in request.pages]
            if len(set(ids)) != len(ids):
                raise RuntimeError(f"request {rid!r} holds a page twice: {ids}")
            holders.update(ids)
            if request.cache_length > len(ids) * self.page_size:
                raise RuntimeError(f"request {rid!r} caches {request.cache_length} tokens in {len(ids)} pages")
            if request.slot in slots:
                raise RuntimeError(f"request {rid!r} shares table row {request.slot}")
            slots.add(request.slot)
            row = self._table[request.slot]
            if row[:len(ids)].tolist() != ids or bool((row[len(ids):] != SENTINEL).any()):
                raise RuntimeError(f"request {rid!r}: table row {row.tolist()} does not match pages {ids}")
            if self.enable_prefix_caching:
                full, rest = divmod(request.cache_length, self.page_size)
                if len(request.page_hashes) != full or len(request.tail_tokens) != rest:
                    raise RuntimeError(f"request {rid!r}: {len(request.page_hashes)} page hashes and "
                                       f"{len(request.tail_tokens)} tail tokens for {request.cache_length} tokens")
                for record, digest in zip(request.pages, request.page_hashes):
                    if record.page_hash is not None and record.page_hash != digest:
                        raise RuntimeError(f"request {rid!r}: page {record.page_id} is cached under another hash")
        free_rows = set(self._free_slots)
        if free_rows & slots or len(free_rows) != len(self._free_slots):
            raise RuntimeError("a table row is both free and in use (or freed twice)")
        if bool((np.delete(self._table, sorted(slots), axis=0) != SENTINEL).any()):
            raise RuntimeError("a free table row still names pages")
        self._pool.check_invariants(holders)

    def metrics(self) -> CacheMetrics:
        """Pages used/free/evictable (and bytes) per group, prefix queries and hits."""
        pool = self._pool
        usage = {
            spec.name: GroupUsage(pool.num_used, pool.num_free, pool.num_evictable, spec.page_bytes(self.page_size))
            for spec in self.groups
        }
        return CacheMetrics(self.num_pages, len(self._requests), usage, self._query_tokens, self._hit_tokens,
                            self._query_requests, self._hit_requests)

    # ---- host page table -------------------------------------------------
    def _take_slot(self) -> int:
        if not self._free_slots:
            rows = self._table.shape[0]
            grown = np.full((2 * rows, self._table.shape[1]), SENTINEL, dtype=np.int32)
            grown[:rows] = self._table
            self._table = grown
            self._free_slots.extend(range(2 * rows - 1, rows - 1, -1))
        return self._free_slots.pop()

    def _write_row(self, request: _Request, first: int) -> None:
        count = len(request.pages)
        if count > self._table.shape[1]:
            cols = self._table.shape[1]
            while cols < count:
                cols *= 2
            grown = np.full((self._table.shape[0], cols), SENTINEL, dtype=np.int32)
            grown[:, :self._table.shape[1]] = self._table
            self._table = grown
        self._table[request.slot, first:count] = [r.page_id for r in request.pages[first:]]
