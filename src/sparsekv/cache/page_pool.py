"""Page pool: the mechanism under the paged KV cache manager (SPEC 1.2).

The pool knows page ids, reference counts and page hashes; it knows nothing
about requests, tokens or tensors (that policy lives in ``manager.py``).

Every page is in exactly one state:

* **used**: held by at least one request (``ref_count > 0``);
* **evictable**: ``ref_count == 0`` but it still holds a hash, so its content
  can serve a prefix hit until the page is needed for something else;
* **free**: ``ref_count == 0`` and no hash.

Free and evictable pages wait in one queue; allocation takes from the front.
NOTE: a page whose last reference is dropped goes to the *front* when it holds
no hash (nothing worth keeping) and to the *back* when it does, so plain free
pages are used first and cached prefixes are evicted least-recently-freed
first (lazy LRU). Taking an evictable page drops its hash at that moment.
The queue is an ``OrderedDict`` keyed by page id: O(1) removal from the
middle when a prefix hit revives an evictable page.

Example (3 pages)::

    pool = PagePool(3)
    a, b = pool.allocate(2)          # pages 0 and 1, ref_count 1
    pool.register(a, h0)             # page 0 now cached under hash h0
    pool.release([b, a])             # 1 -> front (free), 0 -> back (evictable)
    pool.lookup(h0) is a             # True: a prefix hit can still use page 0
    pool.allocate(2)                 # takes page 1, then 2; page 0 survives
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .._checks import check_int


class InsufficientPagesError(RuntimeError):
    """Not enough free + evictable pages for an allocation; nothing was changed.

    An expected outcome under load: a scheduler catches it and waits, preempts
    or shrinks the batch. ``needed`` and ``free`` are page counts (``free``
    counts free and evictable pages).
    """

    def __init__(self, needed: int, free: int, hint: str | None = None) -> None:
        self.needed = needed
        self.free = free
        self.hint = hint
        advice = hint or (
            "release finished requests, allocate fewer tokens (or less lookahead), "
            "or build the manager with more num_pages / a larger memory_budget_bytes"
        )
        super().__init__(f"out of KV cache pages: need {needed}, only {free} free (free + evictable); {advice}")

    def __reduce__(self):
        return (type(self), (self.needed, self.free, self.hint))


@dataclass(slots=True, eq=False)
class PageRecord:
    """Book-keeping of one physical page: its id, holders and prefix-cache hash."""

    page_id: int
    ref_count: int = 0
    page_hash: bytes | None = None


class PagePool:
    """``num_pages`` page ids with reference counts, a free queue and a hash map."""

    def __init__(self, num_pages: int) -> None:
        check_int("num_pages", num_pages, minimum=1)
        self.num_pages = num_pages
        self._records = [PageRecord(page_id) for page_id in range(num_pages)]
        self._queue: OrderedDict[int, PageRecord] = OrderedDict((r.page_id, r) for r in self._records)
        self._cached: dict[bytes, PageRecord] = {}
        self._num_evictable = 0

    # ---- counts ----------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Pages an allocation may take: free plus evictable."""
        return len(self._queue)

    @property
    def num_free(self) -> int:
        return len(self._queue) - self._num_evictable

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._queue)

    @property
    def num_cached(self) -> int:
        """Pages that hold a hash (used or evictable)."""
        return len(self._cached)

    def record(self, page_id: int) -> PageRecord:
        return self._records[page_id]

    def queue_order(self) -> list[int]:
        """Page ids in the order allocation would take them (front first)."""
        return list(self._queue)

    # ---- transitions -----------------------------------------------------
    def allocate(self, count: int) -> list[PageRecord]:
        """Take ``count`` pages from the front of the queue, each with ``ref_count`` 1.

        Raises :class:`InsufficientPagesError` (changing nothing) when fewer
        than ``count`` pages are free or evictable.
        """
        check_int("count", count, minimum=0)
        if count > len(self._queue):
            raise InsufficientPagesError(count, len(self._queue))
        taken = []
        for _ in range(count):
            _, record = self._queue.popitem(last=False)
            if record.page_hash is not None:
                del self._cached[record.page_hash]
                record.page_hash = None
                self._num_evictable -= 1
            record.ref_count = 1
            taken.append(record)
        return taken

    def lookup(self, page_hash: bytes) -> PageRecord | None:
        """The page cached under ``page_hash`` (used or evictable), or ``None``."""
        return self._cached.get(page_hash)

    def lookup_prefix(self, page_hashes: Iterable[bytes]) -> tuple[list[PageRecord], list[bytes]]:
        """The cached pages of the leading ``page_hashes`` up to the first one not cached, and those hashes.

        ``page_hashes`` is read no further than that first miss (a lazy chain stops being hashed there).
        """
        records: list[PageRecord] = []
        hashes: list[bytes] = []
        get = self._cached.get
        for page_hash in page_hashes:
            record = get(page_hash)
            if record is None:
                break
            records.append(record)
            hashes.append(page_hash)
        return records, hashes

    def acquire(self, records: Iterable[PageRecord]) -> None:
        """Take one more reference on each cached page (a prefix hit); revives evictable pages."""
        for record in records:
            if record.ref_count == 0:
                del self._queue[record.page_id]
                if record.page_hash is not None:
                    self._num_evictable -= 1
            record.ref_count += 1

    def release(self, records: list[PageRecord]) -> None:
        """Drop one reference on each page, in the order given.

        A page whose count reaches zero joins the queue: at the back when it
        holds a hash (so pass a request's pages last-first: its deepest
        prefix pages are then evicted before the shallow ones every other
        prefix shares), at the front otherwise.
        """
        queue = self._queue
        for done, record in enumerate(records):
            if record.ref_count <= 0:
                self._undo_release(records[:done])
                raise RuntimeError(f"page {record.page_id}: released more often than it was acquired")
            record.ref_count -= 1
            if record.ref_count == 0:
                queue[record.page_id] = record
                if record.page_hash is not None:
                    self._num_evictable += 1
                else:
                    queue.move_to_end(record.page_id, last=False)

    def _undo_release(self, records: list[PageRecord]) -> None:
        """Take back :meth:`release` of ``records`` (its first pages, before one it could not release)."""
        for record in reversed(records):
            if record.ref_count == 0:
                del self._queue[record.page_id]
                if record.page_hash is not None:
                    self._num_evictable -= 1
            record.ref_count += 1

    def register(self, record: PageRecord, page_hash: bytes) -> bool:
        """Cache a full, held page under ``page_hash``.

        Returns ``False`` and changes nothing when another page already holds
        that hash (the existing mapping is kept: no double registration).
        """
        if record.ref_count <= 0:
            raise RuntimeError(f"page {record.page_id}: only a held page can be registered")
        if record.page_hash is not None:
            raise RuntimeError(f"page {record.page_id}: already registered")
        if page_hash in self._cached:
            return False
        self._cached[page_hash] = record
        record.page_hash = page_hash
        return True

    def register_many(self, records: Sequence[PageRecord], page_hashes: Sequence[bytes]) -> None:
        """:meth:`register` each record under its hash, in order (``zip`` of the two)."""
        cached = self._cached
        for record, page_hash in zip(records, page_hashes):
            if record.ref_count <= 0 or record.page_hash is not None:
                self.register(record, page_hash)  # raises the error naming the page
            if page_hash not in cached:
                cached[page_hash] = record
                record.page_hash = page_hash

    def reset_hashes(self) -> None:
        """Forget every hash; evictable pages become free.

        Raises ``RuntimeError`` while any page is held: a held page's hash may
        still be shared, and resetting around it would leave a half-empty cache.
        """
        if self.num_used:
            raise RuntimeError(
                f"reset_prefix_cache: {self.num_used} page(s) are held by requests; release every "
                "request first"
            )
        for record in self._cached.values():
            record.page_hash = None
        self._cached.clear()
        self._num_evictable = 0

    # ---- checking --------------------------------------------------------
    def check_invariants(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Raise ``RuntimeError`` naming the first broken invariant.

        ``expected_refs`` maps page id -> number of holders (pages not in it
        must have no holder); omit it to skip that comparison.
        """
        def fail(why: str) -> None:
            raise RuntimeError(f"page pool invariant broken: {why}")

        evictable = used = 0
        for page_id, record in enumerate(self._records):
            if record.page_id != page_id:
                fail(f"record {page_id} names page {record.page_id}")
            if record.ref_count < 0:
                fail(f"page {page_id} has ref_count {record.ref_count}")
            queued = page_id in self._queue
            if queued != (record.ref_count == 0):
                fail(f"page {page_id} has ref_count {record.ref_count} but queued={queued}")
            if queued and self._queue[page_id] is not record:
                fail(f"page {page_id} is queued under a foreign record")
            if record.page_hash is not None and self._cached.get(record.page_hash) is not record:
                fail(f"page {page_id} holds a hash that does not map back to it")
            if expected_refs is not None and record.ref_count != expected_refs.get(page_id, 0):
                fail(f"page {page_id} has ref_count {record.ref_count}, "
                     f"{expected_refs.get(page_id, 0)} holder(s) expected")
            used += record.ref_count > 0
            evictable += queued and record.page_hash is not None
        for page_hash, record in self._cached.items():
            if record.page_hash != page_hash:
                fail(f"hash map entry points at page {record.page_id}, which holds another hash")
        if evictable != self._num_evictable:
            fail(f"{evictable} evictable pages counted, {self._num_evictable} recorded")
        if self.num_free + evictable + used != self.num_pages:
            fail(f"free {self.num_free} + evictable {evictable} + used {used} != {self.num_pages}")
        if expected_refs is not None:
            unknown = [p for p in expected_refs if not 0 <= p < self.num_pages]
            if unknown:
                fail(f"holders name unknown pages {unknown}")
