"""PagedKVCacheManager: lifecycle, prefix caching, capacity, batch inputs, co-indexed groups.

The stateful test writes deterministic content for every committed token
(a value of the token, its position and every earlier token, as real K/V
would depend on the whole prefix) through the collections that ``prepare``
builds, and checks after every step that each live request reads back what
recomputing its tokens would write; a prefix hit therefore must return the
same cache contents as recomputation.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparsekv import (
    SENTINEL,
    CacheGroupSpec,
    InsufficientPagesError,
    PagedKVCacheCollection,
    PagedKVCacheManager,
)

PAGE = 4
POOL_R = 2  # tokens per entry of the pooled test group
GROUPS = (
    CacheGroupSpec("main", kv_planes=2, num_layers=2, num_heads=1, head_size=2, dtype=torch.float32),
    CacheGroupSpec("pool", kv_planes=1, num_layers=1, num_heads=1, head_size=2, dtype=torch.float32,
                   tokens_per_entry=POOL_R),
)
BASES = [[(7 * i + 3 * j) % 11 for j in range(14)] for i in range(3)]


def prefix_checksums(tokens):
    """Per position, a checksum of every token up to it (what K/V at that position depends on)."""
    out, acc = [], 0
    for t in tokens:
        acc = (acc * 31 + t + 1) % 1_000_003
        out.append(acc)
    return out


def main_rows(tokens, start, stop, layer, plane):
    """``[stop-start, 1, 2]`` float32 rows for positions ``start..stop-1`` (exact in fp32)."""
    sums = prefix_checksums(tokens)
    return torch.tensor([[[sums[t], t * 4 + layer * 2 + plane]] for t in range(start, stop)],
                        dtype=torch.float32).reshape(-1, 1, 2)


def pool_rows(tokens, first_entry, stop_entry):
    """Entry ``e`` summarises tokens ``e*R .. e*R+R-1``: the checksum at its last token."""
    sums = prefix_checksums(tokens)
    return torch.tensor([[[sums[e * POOL_R + POOL_R - 1], e]] for e in range(first_entry, stop_entry)],
                        dtype=torch.float32).reshape(-1, 1, 2)


def check_contents(mgr, rid, tokens):
    """Every committed token of ``rid`` reads back as recomputing ``tokens`` would write it."""
    batch = mgr.prepare([rid], [0])
    n = len(tokens)
    main = batch.collection("main")
    for layer in range(2):
        for plane, cache in ((0, main.get_key_cache(layer)), (1, main.get_value_cache(layer))):
            got = cache.load(0, torch.arange(n)) if n else torch.empty(0, 1, 2)
            assert torch.equal(got, main_rows(tokens, 0, n, layer, plane)), (rid, layer, plane)
    entries = n // POOL_R
    if entries:
        got = batch.collection("pool").get_key_cache(0).load(0, torch.arange(entries))
        assert torch.equal(got, pool_rows(tokens, 0, entries)), rid


def write_batch(mgr, ids, full_tokens, cached, new):
    """Write the new tokens' content of a batch through ``prepare``'s collections."""
    batch = mgr.prepare(ids, new)
    main = batch.collection("main")
    for layer in range(2):
        for plane, cache in ((0, main.get_key_cache(layer)), (1, main.get_value_cache(layer))):
            rows = [main_rows(full_tokens[i], cached[i], cached[i] + new[i], layer, plane) for i in range(len(ids))]
            cache.store(torch.cat(rows), batch.input_row_offsets)
    pooled = [pool_rows(full_tokens[i], cached[i] // POOL_R, (cached[i] + new[i]) // POOL_R)
              for i in range(len(ids))]
    batch.collection("pool").get_key_cache(0).store(torch.cat(pooled), batch.entry_row_offsets("pool"))
    return batch


def expected_batch(mgr, ids, new):
    """Independent per-request computation of prepare()'s index outputs."""
    rows = [mgr.pages_of(r) for r in ids]
    width = max(1, max(len(r) for r in rows))
    table = [r + [SENTINEL] * (width - len(r)) for r in rows]
    lengths = [mgr.cache_length(r) for r in ids]
    offsets = [0]
    for n in new:
        offsets.append(offsets[-1] + n)
    return table, lengths, offsets


def snapshot(mgr, ids):
    m = mgr.metrics().groups["main"]
    return ({r: (mgr.pages_of(r), mgr.cache_length(r)) for r in ids},
            (m.pages_used, m.pages_free, m.pages_evictable), mgr._pool.queue_order())


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(3, 10), caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_pages, caching):
        self.mgr = PagedKVCacheManager(GROUPS, page_size=PAGE, num_pages=num_pages, enable_prefix_caching=caching)
        self.caching = caching
        self.model = {}  # rid -> {"tokens": committed, "pending": prompt still to commit, "namespace": ...}
        self.history = []  # (committed tokens, namespace) of requests past one page
        self.next_id = 0

    @precondition(lambda self: len(self.model) < 5)
    @rule(base=st.integers(0, 2), keep=st.integers(1, 14), extra=st.lists(st.integers(0, 10), max_size=3),
          namespace=st.sampled_from([None, None, "lora-a"]))
    def claim(self, base, keep, extra, namespace):
        self.claim_prompt(BASES[base][:keep] + extra, namespace)

    @precondition(lambda self: len(self.model) < 5 and self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 10), max_size=2))
    def claim_known_prefix(self, data, extra):
        """Claim a prompt that starts like one committed earlier (a likely prefix hit)."""
        tokens, namespace = data.draw(st.sampled_from(self.history))
        keep = data.draw(st.integers(1, len(tokens)))
        self.claim_prompt(tokens[:keep] + extra, namespace)

    def claim_prompt(self, prompt, namespace):
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = self.mgr.metrics()
        hit = self.mgr.claim(rid, prompt, namespace=namespace)
        assert hit % PAGE == 0 and 0 <= hit <= len(prompt) - 1
        if not self.caching:
            assert hit == 0
        after = self.mgr.metrics()
        assert after.prefix_hit_tokens - before.prefix_hit_tokens == hit
        assert after.prefix_query_tokens - before.prefix_query_tokens == (len(prompt) if self.caching else 0)
        assert self.mgr.cache_length(rid) == hit and len(self.mgr.pages_of(rid)) == hit // PAGE
        self.model[rid] = {"tokens": prompt[:hit], "pending": prompt[hit:], "namespace": namespace}
        event(f"prefix hit of {hit // PAGE} page(s)")
        check_contents(self.mgr, rid, prompt[:hit])  # the hit pages hold the recomputed content

    @precondition(lambda self: self.model)
    @rule(data=st.data(), new=st.integers(0, 7), lookahead=st.integers(0, 3))
    def allocate(self, data, new, lookahead):
        self.try_allocate(data.draw(st.sampled_from(sorted(self.model))), new, lookahead)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def prefill(self, data):
        """Allocate for the whole pending prompt (when the pool allows) and commit it in one call."""
        rid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[rid]
        if not self.try_allocate(rid, len(entry["pending"]), 0):
            return
        cached, fresh = len(entry["tokens"]), entry["pending"]
        write_batch(self.mgr, [rid], [entry["tokens"] + fresh], [cached], [len(fresh)])
        self.mgr.step(rid, fresh)
        entry["tokens"], entry["pending"] = entry["tokens"] + fresh, []
        self.remember(entry)

    def try_allocate(self, rid, new, lookahead):
        held = self.mgr.pages_of(rid)
        needed = max(0, math.ceil((len(self.model[rid]["tokens"]) + new + lookahead) / PAGE) - len(held))
        available = self.mgr.num_available_pages
        before = snapshot(self.mgr, self.model)
        try:
            self.mgr.allocate(rid, new, lookahead)
        except InsufficientPagesError as exc:
            assert (exc.needed, exc.free) == (needed, available) and needed > available
            event("out of pages")
            assert snapshot(self.mgr, self.model) == before  # every request untouched
            return
        assert needed <= available
        pages = self.mgr.pages_of(rid)
        assert pages[:len(held)] == held and len(pages) == len(held) + needed
        others = {r: v for r, v in before[0].items() if r != rid}
        assert {r: v for r, v in snapshot(self.mgr, self.model)[0].items() if r != rid} == others
        return True

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def write_and_step(self, data):
        room = {r: len(self.mgr.pages_of(r)) * PAGE - self.mgr.cache_length(r) for r in self.model}
        candidates = sorted(r for r, free in room.items() if free > 0)
        if not candidates:
            return
        ids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
        new = [data.draw(st.integers(0, room[r])) for r in ids]
        full, cached = [], []
        for rid, n in zip(ids, new):
            entry = self.model[rid]
            fresh = entry["pending"][:n]
            fresh += data.draw(st.lists(st.integers(0, 10), min_size=n - len(fresh), max_size=n - len(fresh)))
            cached.append(len(entry["tokens"]))
            full.append(entry["tokens"] + fresh)
        table, lengths, offsets = expected_batch(self.mgr, ids, new)
        batch = write_batch(self.mgr, ids, full, cached, new)
        assert batch.lookup_table.dtype == batch.cache_lengths.dtype == batch.input_row_offsets.dtype == torch.int32
        assert batch.lookup_table.tolist() == table
        assert batch.cache_lengths.tolist() == lengths == cached
        assert batch.input_row_offsets.tolist() == offsets
        assert (batch.max_seq_length, batch.max_cache_length) == (max(new), max(cached))
        for rid, tokens, n in zip(ids, full, new):
            self.mgr.step(rid, tokens[len(tokens) - n:])
            self.model[rid]["pending"] = self.model[rid]["pending"][n:]
            self.model[rid]["tokens"] = tokens
            self.remember(self.model[rid])

    def remember(self, entry):
        if len(entry["tokens"]) > PAGE:
            self.history.append((entry["tokens"], entry["namespace"]))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        self.mgr.release(rid)
        del self.model[rid]
        with pytest.raises(ValueError, match="unknown request"):
            self.mgr.cache_length(rid)

    @rule(roll=st.integers(0, 3))
    def reset_prefix_cache(self, roll):
        if roll:  # reset rarely, so cached prefixes get a chance to be hit
            return
        if self.mgr.metrics().groups["main"].pages_used:
            before = snapshot(self.mgr, self.model)
            with pytest.raises(RuntimeError, match="held"):
                self.mgr.reset_prefix_cache()
            assert snapshot(self.mgr, self.model) == before
        else:
            assert self.mgr.reset_prefix_cache() is None
            event("prefix cache reset")
            assert self.mgr.metrics().groups["main"].pages_evictable == 0

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        for usage in self.mgr.metrics().groups.values():
            assert usage.pages_used + usage.pages_free + usage.pages_evictable == self.mgr.num_pages
        for rid, entry in self.model.items():
            assert self.mgr.cache_length(rid) == len(entry["tokens"])
            check_contents(self.mgr, rid, entry["tokens"])


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


# ---- deterministic scenarios ---------------------------------------------------------------------
def make(num_pages=8, **kw):
    return PagedKVCacheManager(GROUPS, page_size=PAGE, num_pages=num_pages, **kw)


def run_prompt(mgr, rid, prompt, namespace=None):
    """Claim, allocate, write and commit a whole prompt; returns the hit."""
    hit = mgr.claim(rid, prompt, namespace=namespace)
    mgr.allocate(rid, len(prompt) - hit)
    write_batch(mgr, [rid], [prompt], [hit], [len(prompt) - hit])
    mgr.step(rid, prompt[hit:])
    return hit


def test_prefix_hit_shares_pages_by_reference():
    mgr = make()
    prompt = list(range(1, 11))  # 2 full pages + 2 tokens
    assert run_prompt(mgr, "a", prompt) == 0
    assert mgr.claim("b", prompt + [99]) == 8
    assert mgr.pages_of("b") == mgr.pages_of("a")[:2]
    assert [mgr._pool.record(p).ref_count for p in mgr.pages_of("a")] == [2, 2, 1]
    assert mgr.claim("c", prompt[:8]) == 4  # at least the last prompt token is computed
    assert mgr.claim("d", prompt, namespace="other") == 0
    mgr.check_invariants()
    check_contents(mgr, "b", prompt[:8])
    m = mgr.metrics()
    assert (m.prefix_query_requests, m.prefix_hit_requests) == (4, 2)
    assert (m.prefix_query_tokens, m.prefix_hit_tokens) == (10 + 11 + 8 + 10, 12)
    assert m.prefix_hit_rate == pytest.approx(12 / 39)


def test_namespaces_keep_equal_prefixes_apart():
    mgr = make()
    prompt = list(range(30, 39))
    run_prompt(mgr, "salted", prompt, namespace="lora-a")
    assert mgr.claim("plain", prompt) == 0
    assert mgr.claim("other", prompt, namespace="lora-b") == 0
    assert mgr.claim("same", prompt, namespace="lora-a") == 8
    assert mgr.pages_of("same") == mgr.pages_of("salted")[:2]
    mgr.check_invariants()


def test_identical_pages_committed_twice_register_once():
    mgr = make()
    prompt = list(range(20, 29))
    assert mgr.claim("a", prompt) == 0 and mgr.claim("b", prompt) == 0
    for rid in ("a", "b"):
        mgr.allocate(rid, len(prompt))
        write_batch(mgr, [rid], [prompt], [0], [len(prompt)])
        mgr.step(rid, prompt)
    mgr.check_invariants()
    assert mgr._pool.num_cached == 2  # a's two full pages; b's copies stay unregistered
    mgr.release("a")
    mgr.release("b")
    m = mgr.metrics().groups["main"]
    assert (m.pages_used, m.pages_evictable, m.pages_free) == (0, 2, 6)
    a_pages = mgr._pool.queue_order()[-2:]
    assert mgr.claim("c", prompt) == 8 and sorted(mgr.pages_of("c")) == sorted(a_pages)


def test_filling_the_pool_raises_and_leaves_everyone_untouched():
    mgr = make(num_pages=5)
    run_prompt(mgr, "a", list(range(9)))  # 3 pages
    mgr.claim("b")
    mgr.allocate("b", 4)  # 1 page
    mgr.step("b", [5, 6, 7, 8])
    before = snapshot(mgr, ["a", "b"])
    with pytest.raises(InsufficientPagesError) as info:
        mgr.allocate("b", 4, lookahead=8)  # 16 tokens: 3 more pages, 1 left
    assert (info.value.needed, info.value.free) == (3, 1)
    assert isinstance(info.value, RuntimeError) and "'b'" in str(info.value) and "num_pages" in str(info.value)
    assert snapshot(mgr, ["a", "b"]) == before
    mgr.check_invariants()
    mgr.release("a")
    mgr.allocate("b", 4, lookahead=8)  # a's pages are reusable now
    assert len(mgr.pages_of("b")) == 4
    mgr.check_invariants()


def test_eviction_is_lru_and_deepest_pages_go_first():
    mgr = make(num_pages=6)
    first, second = list(range(1, 10)), list(range(50, 59))  # 2 full pages each
    run_prompt(mgr, "a", first)
    run_prompt(mgr, "b", second)
    a_pages, b_pages = mgr.pages_of("a"), mgr.pages_of("b")
    mgr.release("a")
    mgr.release("b")
    # plain free pages first, then a's pages (deep page first), then b's
    order = mgr._pool.queue_order()
    assert set(order[:2]) == {a_pages[2], b_pages[2]}
    assert order[2:] == [a_pages[1], a_pages[0], b_pages[1], b_pages[0]]
    mgr.claim("filler")
    mgr.allocate("filler", 3 * PAGE)  # 2 free pages + a's deep page
    assert mgr.claim("a2", first) == PAGE  # a's first page survived
    assert mgr.claim("b2", second) == 2 * PAGE
    mgr.check_invariants()


def test_a_prefix_hit_refreshes_lru_position():
    mgr = make(num_pages=4)
    run_prompt(mgr, "a", list(range(1, 6)))
    run_prompt(mgr, "b", list(range(60, 65)))
    mgr.release("a")
    mgr.release("b")
    assert mgr.claim("a2", list(range(1, 6))) == PAGE  # revive a's page
    mgr.release("a2")  # a's page is now the most recently freed
    mgr.claim("filler")
    mgr.allocate("filler", 3 * PAGE)  # 2 free pages + the oldest evictable one (b's)
    assert mgr.claim("b2", list(range(60, 65))) == 0
    assert mgr.claim("a3", list(range(1, 6))) == PAGE


def test_reset_prefix_cache_raises_while_pages_are_held():
    mgr = make()
    prompt = list(range(9))
    run_prompt(mgr, "a", prompt)
    with pytest.raises(RuntimeError, match="held"):
        mgr.reset_prefix_cache()
    assert mgr.claim("probe", prompt) == 8  # nothing was dropped
    mgr.release("probe")
    mgr.release("a")
    assert mgr.reset_prefix_cache() is None
    assert mgr.claim("b", prompt) == 0
    m = mgr.metrics().groups["main"]
    assert (m.pages_used, m.pages_evictable, m.pages_free) == (0, 0, 8)


def test_prefix_caching_disabled_never_hits_or_hashes():
    mgr = make(enable_prefix_caching=False)
    prompt = list(range(9))
    run_prompt(mgr, "a", prompt)
    mgr.release("a")
    assert mgr.claim("b", prompt) == 0
    m = mgr.metrics()
    assert m.groups["main"].pages_evictable == 0 and m.prefix_query_tokens == 0
    mgr.check_invariants()


def test_metrics_count_pages_and_bytes_per_group():
    mgr = make(num_pages=7)
    run_prompt(mgr, "a", list(range(9)))
    mgr.claim("b")
    mgr.allocate("b", 1)
    mgr.release("a")
    m = mgr.metrics()
    assert m.num_requests == 1 and m.num_pages == 7
    for name in ("main", "pool"):
        usage = m.groups[name]
        page_bytes = mgr.blocks(name)[0].numel() * mgr.blocks(name).element_size()
        assert (usage.pages_used, usage.pages_evictable, usage.pages_free) == (1, 2, 4)
        assert usage.page_bytes == page_bytes
        assert usage.bytes_used == page_bytes and usage.bytes_evictable == 2 * page_bytes
        assert usage.bytes_total == 7 * page_bytes == mgr.blocks(name).numel() * 4


def test_prepare_matches_a_per_request_computation():
    rng = np.random.default_rng(2024)
    mgr = PagedKVCacheManager(GROUPS, page_size=PAGE, num_pages=64)
    ids = [f"q{i}" for i in range(7)]
    for rid in ids:
        mgr.claim(rid)
        cached = int(rng.integers(0, 13))
        mgr.allocate(rid, cached, lookahead=int(rng.integers(0, 6)))
        mgr.step(rid, rng.integers(0, 100, cached).tolist())
    order = [ids[i] for i in rng.permutation(len(ids))[:5]]
    new = [int(rng.integers(0, len(mgr.pages_of(r)) * PAGE - mgr.cache_length(r) + 1)) for r in order]
    batch = mgr.prepare(order, new)
    table, lengths, offsets = expected_batch(mgr, order, new)
    assert batch.lookup_table.tolist() == table and batch.lookup_table.dtype == torch.int32
    assert batch.cache_lengths.tolist() == lengths and batch.input_row_offsets.tolist() == offsets
    assert batch.max_seq_length == max(new) and batch.max_cache_length == max(lengths)
    assert batch.request_ids == tuple(order) and batch.batch_size == 5
    coll = batch.collection("main")
    assert isinstance(coll, PagedKVCacheCollection) and coll.page_stride == mgr.blocks("main").stride(0)
    assert batch.collection("main") is coll  # built once
    # the pooled group counts entries: floor(c / R) cached, floor((c+n)/R) - floor(c/R) new
    pooled = batch.collection("pool")
    assert pooled.cache_lengths.tolist() == [c // POOL_R for c in lengths]
    completed = [(c + n) // POOL_R - c // POOL_R for c, n in zip(lengths, new)]
    assert batch.entry_row_offsets("pool").tolist() == np.concatenate([[0], np.cumsum(completed)]).tolist()
    assert pooled.max_seq_length == max(completed) and pooled.lookup_table is batch.lookup_table


def test_co_indexed_groups_share_page_ids_and_the_budget():
    groups = [
        CacheGroupSpec("main", 2, 2, 2, 16, torch.bfloat16),
        CacheGroupSpec("indexer", 1, 2, 1, 8, torch.bfloat16),
        CacheGroupSpec("kpool", 1, 2, 1, 8, torch.float32, tokens_per_entry=4),
    ]
    page = 8
    per_page = (2 * 2 * 8 * 2 * 16 * 2) + (1 * 2 * 8 * 1 * 8 * 2) + (1 * 2 * 2 * 1 * 8 * 4)
    mgr = PagedKVCacheManager(groups, page_size=page, memory_budget_bytes=per_page * 7 + per_page - 1)
    assert mgr.bytes_per_page == per_page and mgr.num_pages == 7
    assert mgr.blocks("kpool").shape == (7, 1, 2, 2, 1, 8) and mgr.blocks("main").shape == (7, 2, 2, 8, 2, 16)
    total = sum(mgr.blocks(g.name).numel() * mgr.blocks(g.name).element_size() for g in groups)
    assert total <= 8 * per_page and total == 7 * per_page
    mgr.claim("a")
    mgr.allocate("a", 21)
    batch = mgr.prepare(["a"], [21])
    kpool = batch.collection("kpool")
    assert kpool.page_size == 2 and kpool.lookup_table is batch.collection("indexer").lookup_table
    # 21 tokens complete 5 pooled entries; entry e lives in page table[e // 2], row e % 2,
    # which is the page that holds its tokens 4e .. 4e+3 in the token groups.
    values = torch.arange(5 * 8, dtype=torch.float32).reshape(5, 1, 8)
    kpool.get_key_cache(1).store(values, batch.entry_row_offsets("kpool"))
    table = mgr.pages_of("a")
    for e in range(5):
        assert table[e // 2] == table[(4 * e + 3) // page]
        assert torch.equal(mgr.blocks("kpool")[table[e // 2], 0, 1, e % 2], values[e])
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        PagedKVCacheManager(groups, page_size=page, memory_budget_bytes=per_page - 1)


def test_misuse_is_a_value_error_naming_the_problem():
    mgr = make()
    mgr.claim("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already claimed"):
        mgr.claim("a")
    with pytest.raises(ValueError, match="unknown request id 'zz'"):
        mgr.allocate("zz", 1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate("a", -1)
    with pytest.raises(ValueError, match="lookahead"):
        mgr.allocate("a", 1, lookahead=-2)
    mgr.allocate("a", 3)
    before = snapshot(mgr, ["a"])
    with pytest.raises(ValueError, match="allocate first"):
        mgr.step("a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="token ids"):
        mgr.step("a", [-1])
    with pytest.raises(TypeError, match="token ids"):
        mgr.step("a", [1.5])
    assert snapshot(mgr, ["a"]) == before
    with pytest.raises(ValueError, match="allocate first"):
        mgr.prepare(["a"], [5])
    with pytest.raises(ValueError, match="distinct"):
        mgr.prepare(["a", "a"], 0)
    with pytest.raises(ValueError, match="empty batch"):
        mgr.prepare([], 0)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.prepare(["a"], [-1])
    with pytest.raises(ValueError, match="unknown cache group"):
        mgr.blocks("nope")
    with pytest.raises(ValueError, match="unknown cache group"):
        mgr.prepare(["a"], 1).collection("nope")
    with pytest.raises(ValueError, match="exactly one"):
        PagedKVCacheManager(GROUPS, page_size=PAGE)
    with pytest.raises(ValueError, match="exactly one"):
        PagedKVCacheManager(GROUPS, page_size=PAGE, num_pages=4, memory_budget_bytes=10**6)
    with pytest.raises(ValueError, match="tokens_per_entry"):
        PagedKVCacheManager(GROUPS, page_size=3, num_pages=4)
    with pytest.raises(ValueError, match="unique names"):
        PagedKVCacheManager([GROUPS[0], GROUPS[0]], page_size=PAGE, num_pages=4)
    with pytest.raises(ValueError, match="kv_planes"):
        CacheGroupSpec("x", 3, 1, 1, 8, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        CacheGroupSpec("x", 1, 1, 1, 8, torch.int32)
    with pytest.raises(ValueError, match="tokens_per_entry"):
        CacheGroupSpec("x", 1, 1, 1, 8, torch.float32, tokens_per_entry=0)
    mgr.release("a")
    with pytest.raises(ValueError, match="unknown request"):
        mgr.release("a")
    mgr.check_invariants()


def test_wrong_types_are_type_errors_and_wrong_values_value_errors():
    from sparsekv.cache.groups import CacheGroupSpec

    with pytest.raises(TypeError, match="CacheGroupSpec.name: expected a str, got int 3"):
        CacheGroupSpec(3, 1, 1, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="CacheGroupSpec.name: expected a non-empty str"):
        CacheGroupSpec("", 1, 1, 1, 8, torch.float32)
    mgr = PagedKVCacheManager([CacheGroupSpec("kv", 2, 1, 1, 8, torch.float32)], page_size=4, num_pages=4)
    mgr.claim("a")
    mgr.claim("b")
    with pytest.raises(TypeError, match="num_new_tokens: expected an int or 2 ints"):
        mgr.prepare(["a", "b"], [1.5, 2.0])
    with pytest.raises(ValueError, match=r"num_new_tokens: expected an int or 2 ints \(one per request\)"):
        mgr.prepare(["a", "b"], [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens: expected values >= 0, got -3 for request 'b'"):
        mgr.prepare(["a", "b"], [0, -3])
    with pytest.raises(ValueError, match=r"prompt_token_ids: .*got 9223372036854775808"):
        mgr.claim("c", [1, 2**63])
    mgr.check_invariants()


def test_long_token_lists_convert_and_fail_like_short_ones():
    from sparsekv.cache.manager import _token_array

    ids = [(7 * t) % 50_000 for t in range(100)]  # past the length where lists are read through struct
    for given in (ids, tuple(ids), torch.tensor(ids), np.array(ids), range(100)):
        assert _token_array("ids", given).tolist() == list(given)
    with pytest.raises(TypeError, match=r"ids: expected integer token ids, got \[0, 7"):
        _token_array("ids", ids[:-1] + [1.5])
    with pytest.raises(ValueError, match="ids: expected token ids in \\[0, 2\\*\\*63\\), got 9223372036854775808"):
        _token_array("ids", ids[:-1] + [2**63])
    with pytest.raises(ValueError, match="ids: expected token ids >= 0, got -4"):
        _token_array("ids", ids[:-1] + [-4])
