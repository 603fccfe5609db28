"""Page pool mechanism: queue order, lazy eviction, references, invariants."""

import pickle

import pytest

from sparsekv.cache.hashing import page_hash
from sparsekv.cache.page_pool import InsufficientPagesError, PagePool

H = [page_hash(None, [i]) for i in range(8)]


def test_allocate_takes_from_the_front_and_counts():
    pool = PagePool(5)
    taken = pool.allocate(3)
    assert [r.page_id for r in taken] == [0, 1, 2]
    assert all(r.ref_count == 1 for r in taken)
    assert (pool.num_used, pool.num_free, pool.num_evictable, pool.num_available) == (3, 2, 0, 2)
    pool.check_invariants({0: 1, 1: 1, 2: 1})


def test_release_puts_hashed_pages_at_the_back_plain_pages_at_the_front():
    pool = PagePool(5)
    a, b, c = pool.allocate(3)
    pool.register(a, H[0])
    pool.register(b, H[1])
    pool.release([c, b, a])  # last-first, as the manager does
    assert pool.queue_order() == [2, 3, 4, 1, 0]
    assert (pool.num_free, pool.num_evictable) == (3, 2)
    pool.check_invariants({})


def test_lazy_eviction_drops_the_hash_only_when_the_page_is_taken():
    pool = PagePool(3)
    a, b, c = pool.allocate(3)
    pool.register(a, H[0])
    pool.register(b, H[1])
    pool.release([b, a, c])
    assert pool.lookup(H[0]) is a and pool.lookup(H[1]) is b
    (first,) = pool.allocate(1)
    assert first is c and pool.lookup(H[1]) is b  # the plain page goes first
    (second,) = pool.allocate(1)
    assert second is b and b.page_hash is None and pool.lookup(H[1]) is None
    assert pool.lookup(H[0]) is a and pool.num_evictable == 1
    pool.check_invariants({1: 1, 2: 1})


def test_acquire_revives_an_evictable_page_and_release_makes_it_most_recent():
    pool = PagePool(4)
    a, b = pool.allocate(2)
    pool.register(a, H[0])
    pool.register(b, H[1])
    pool.release([a])
    pool.release([b])
    assert pool.queue_order() == [2, 3, 0, 1]
    pool.acquire([a])
    assert a.ref_count == 1 and pool.num_evictable == 1
    pool.check_invariants({0: 1})
    pool.release([a])
    assert pool.queue_order() == [2, 3, 1, 0]  # a now evicted after b


def test_register_keeps_an_existing_mapping():
    pool = PagePool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, H[0]) is True
    assert pool.register(b, H[0]) is False
    assert b.page_hash is None and pool.lookup(H[0]) is a
    with pytest.raises(RuntimeError, match="already registered"):
        pool.register(a, H[2])
    pool.check_invariants({0: 1, 1: 1})


def test_insufficient_pages_is_atomic_and_typed():
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(InsufficientPagesError) as info:
        pool.allocate(2)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert "need 2" in str(info.value) and "num_pages" in str(info.value)
    assert pool.num_available == 1
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.needed, copy.free) == (2, 1)
    pool.check_invariants({0: 1, 1: 1, 2: 1})


def test_reset_hashes_refuses_while_pages_are_held():
    pool = PagePool(3)
    (a,) = pool.allocate(1)
    pool.register(a, H[0])
    with pytest.raises(RuntimeError, match="held"):
        pool.reset_hashes()
    assert pool.lookup(H[0]) is a
    pool.release([a])
    pool.reset_hashes()
    assert pool.lookup(H[0]) is None and pool.num_evictable == 0 and pool.num_free == 3
    pool.check_invariants({})


def test_release_more_than_acquired_raises_without_changes():
    pool = PagePool(2)
    (a,) = pool.allocate(1)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a, a])
    assert a.ref_count == 1


def test_check_invariants_detects_corruption():
    pool = PagePool(3)
    a, _ = pool.allocate(2)
    with pytest.raises(RuntimeError, match="holder"):
        pool.check_invariants({0: 2, 1: 1})
    a.ref_count = 0  # queued state no longer matches
    with pytest.raises(RuntimeError, match="queued"):
        pool.check_invariants()
    a.ref_count = 1
    a.page_hash = H[3]  # a hash without a map entry
    with pytest.raises(RuntimeError, match="map back"):
        pool.check_invariants()
