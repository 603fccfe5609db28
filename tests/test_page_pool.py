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


def test_register_many_and_lookup_prefix_match_one_at_a_time():
    pool = PagePool(4)
    a, b, c = pool.allocate(3)
    pool.register_many([a, b, c], [H[0], H[1], H[0]])  # c's hash is taken: c stays unregistered
    assert (a.page_hash, b.page_hash, c.page_hash) == (H[0], H[1], None)
    assert pool.lookup_prefix(iter([H[0], H[1], H[2], H[0]])) == ([a, b], [H[0], H[1]])
    assert pool.lookup_prefix([H[3]]) == ([], [])
    with pytest.raises(RuntimeError, match="already registered"):
        pool.register_many([c, a], [H[4], H[5]])
    assert c.page_hash == H[4] and a.page_hash == H[0]
    pool.check_invariants({0: 1, 1: 1, 2: 1})


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


def test_a_failed_release_restores_queue_order_and_counts():
    pool = PagePool(5)
    a, b, c = pool.allocate(3)
    pool.register(a, H[0])
    before = (pool.queue_order(), pool.num_evictable, pool.num_free)
    with pytest.raises(RuntimeError, match="page 2: released more often"):
        pool.release([b, a, c, c])  # b and a reach zero and join the queue before c fails
    assert (pool.queue_order(), pool.num_evictable, pool.num_free) == before
    assert (a.ref_count, b.ref_count, c.ref_count) == (1, 1, 1)
    pool.check_invariants({0: 1, 1: 1, 2: 1})


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


def test_shared_hashed_pages_count_holders_and_become_evictable_in_lru_order():
    """Two requests share two hashed pages (a prefix hit), then release them; a third request reuses them."""
    pool = PagePool(6)
    first = pool.allocate(3)  # request A: a two-page prefix, then a private page
    pool.register(first[0], H[0])
    pool.register(first[1], H[1])
    holders = {0: 1, 1: 1, 2: 1}
    pool.check_invariants(holders)

    shared = [pool.lookup(H[0]), pool.lookup(H[1])]  # request B hits both prefix pages
    assert shared == first[:2]
    pool.acquire(shared)
    (private_b,) = pool.allocate(1)
    holders.update({0: 2, 1: 2, private_b.page_id: 1})
    assert [r.ref_count for r in shared] == [2, 2]
    pool.check_invariants(holders)

    pool.release([first[2], first[1], first[0]])  # A leaves, last page first
    holders.update({0: 1, 1: 1})
    del holders[2]
    assert [r.ref_count for r in shared] == [1, 1] and pool.num_evictable == 0  # B still holds them
    assert pool.lookup(H[0]) is shared[0] and pool.lookup(H[1]) is shared[1]
    pool.check_invariants(holders)

    pool.release([private_b, shared[1], shared[0]])  # B leaves: now nobody holds the prefix
    assert [r.ref_count for r in shared] == [0, 0] and pool.num_evictable == 2
    assert pool.queue_order()[-2:] == [1, 0]  # deepest prefix page evicted first, the root last
    pool.check_invariants({})

    hit = pool.lookup(H[0])  # request C: a prefix hit on the root page revives it
    assert hit is shared[0]
    pool.acquire([hit])
    assert hit.ref_count == 1 and pool.num_evictable == 1
    pool.check_invariants({0: 1})
    taken = pool.allocate(pool.num_free + 1)  # every free page, then the one evictable page (page 1)
    assert taken[-1] is shared[1] and shared[1].page_hash is None and pool.lookup(H[1]) is None
    assert pool.lookup(H[0]) is hit  # the held root page keeps its hash
    pool.check_invariants({0: 1, **{r.page_id: 1 for r in taken}})
    pool.release(taken + [hit])
    pool.check_invariants({})
    assert pool.num_evictable == 1 and pool.queue_order()[-1] == 0


def test_releasing_a_shared_page_more_often_than_held_changes_nothing():
    pool = PagePool(3)
    (page,) = pool.allocate(1)
    pool.register(page, H[0])
    pool.acquire([page])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([page, page, page])
    assert page.ref_count == 2
    pool.check_invariants({0: 2})
