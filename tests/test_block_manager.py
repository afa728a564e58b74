"""Block manager: accounting, refcounts, prefix-cache keys, LRU eviction, swap slots."""
import random

import pytest

from pdjax.scheduler.block_manager import BlockManager, extend_page_keys, page_key_tokens


def test_allocate_and_free_keep_the_accounting():
    bm = BlockManager(10, 4)
    a, b = [], []
    bm.allocate(a, 3)
    bm.allocate(b, 5)
    assert len(set(a) | set(b)) == 8 and bm.num_free_pages == 2 and bm.num_used_pages == 8
    bm.check_invariants([a, b])
    bm.free(a)
    bm.check_invariants([b])
    assert bm.num_free_pages == 5
    with pytest.raises(RuntimeError, match="free pages"):
        bm.allocate([], 6)
    with pytest.raises(AssertionError):
        bm.check_invariants([a, b])   # a was freed: its pages are not held any more


def test_page_keys_chain_over_the_prefix():
    tokens = list(range(40))
    keys = []
    extend_page_keys(keys, tokens, 8, 3)
    assert len(keys) == 3 and page_key_tokens(keys[1]) == tuple(range(8, 16))
    again = []
    extend_page_keys(again, tokens, 8, 2)
    extend_page_keys(again, tokens, 8, 3)
    assert again == keys
    other = list(tokens)
    other[0] = 99     # same page 1 tokens, different prefix: different key
    okeys = []
    extend_page_keys(okeys, other, 8, 3)
    assert page_key_tokens(okeys[1]) == page_key_tokens(keys[1]) and okeys[1] != keys[1]


def test_prefix_cache_hit_share_and_lru_eviction():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    tokens = list(range(12))
    keys = []
    extend_page_keys(keys, tokens, 4, 3)
    a = []
    bm.allocate(a, 3)
    bm.register(a, keys, 0, 3)
    b = []
    hits = bm.match_prefix(keys, 2)
    assert hits == a[:2]
    assert bm.num_free_among(hits) == 0   # still held by a
    bm.take_cached(b, hits)
    assert [bm.ref_count[p] for p in a] == [2, 2, 1]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_pages == 6 and bm.num_cached_pages == 3
    # a new allocation uses the 3 uncached pages first, then evicts the least recently freed cached page:
    # pages were freed tail first, so the tail page a[2] goes before the head pages
    c = []
    bm.allocate(c, 4)
    assert a[2] in c and a[0] not in c and a[1] not in c
    assert bm.match_prefix(keys, 3) == a[:2]
    bm.check_invariants([c])


def test_referenced_cached_pages_are_never_handed_out():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    keys = []
    extend_page_keys(keys, list(range(8)), 2, 4)
    a = []
    bm.allocate(a, 4)
    bm.register(a, keys, 0, 4)
    other = []
    bm.allocate(other, 4)            # the whole rest of the pool
    assert not set(other) & set(a)
    with pytest.raises(RuntimeError):
        bm.allocate(other, 1)
    bm.check_invariants([a, other])


def test_duplicate_content_stays_unregistered():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    keys = []
    extend_page_keys(keys, [1, 2, 3, 4], 2, 2)
    a, b = [], []
    bm.allocate(a, 2)
    bm.allocate(b, 2)
    bm.register(a, keys, 0, 2)
    bm.register(b, keys, 0, 2)      # computed concurrently: a's pages keep the keys
    assert bm.match_prefix(keys, 2) == a
    assert all(bm.page_key[p] is None for p in b)
    bm.free(b)
    bm.free(a)
    bm.check_invariants([])
    assert bm.num_cached_pages == 2


def test_swap_out_and_in_round_trip():
    bm = BlockManager(6, 4, num_host_pages=4)
    a = []
    bm.allocate(a, 3)
    slots, copies = bm.swap_out(a)
    assert [p for _, p in copies] == a and len(set(slots)) == 3
    assert bm.num_free_pages == 6 and bm.num_free_host_pages == 1
    bm.check_invariants([], [slots])
    with pytest.raises(RuntimeError, match="host slots"):
        bm.swap_out([0, 1])
    new = []
    back = bm.swap_in(slots, new)
    assert [s for s, _ in back] == slots and [p for _, p in back] == new
    assert bm.num_free_host_pages == 4
    bm.check_invariants([new], [])


def test_random_operations_keep_invariants():
    rng = random.Random(0)
    bm = BlockManager(32, 4, enable_prefix_caching=True, num_host_pages=16)
    tables, swapped = {}, {}
    corpus = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            toks = rng.choice(corpus)[:rng.randint(4, 40)]
            keys = []
            extend_page_keys(keys, toks, 4, len(toks) // 4)
            hits = bm.match_prefix(keys, len(keys))
            need = -(-len(toks) // 4) - len(hits)
            if bm.num_free_pages - bm.num_free_among(hits) >= need:
                t = []
                bm.take_cached(t, hits)
                bm.allocate(t, need)
                bm.register(t, keys, len(hits), len(keys))
                tables[step] = t
        elif op < 0.7 and tables:
            bm.free(tables.pop(rng.choice(sorted(tables))))
        elif op < 0.85 and tables:
            k = rng.choice(sorted(tables))
            if bm.num_free_host_pages >= len(tables[k]):
                swapped[k] = bm.swap_out(tables.pop(k))[0]
        elif swapped:
            k = rng.choice(sorted(swapped))
            if bm.num_free_pages >= len(swapped[k]):
                t = []
                bm.swap_in(swapped.pop(k), t)
                tables[k] = t
        bm.check_invariants(tables.values(), swapped.values())
    for t in tables.values():
        bm.free(t)
    for s in swapped.values():
        bm.free_host(s)
    bm.check_invariants()
    assert bm.num_free_pages == 32 and bm.num_free_host_pages == 16


class OnePageAtATime:
    """The pool rules written one page at a time (pop a page, push a page), the reference for the block
    manager's batched allocate / allocate_each / allocate_one_each / free (no prefix caching)."""

    def __init__(self, bm: BlockManager):
        self.free, self.ref = list(bm._free), list(bm.ref_count)

    def allocate(self, table, n):
        for _ in range(n):
            p = self.free.pop()
            self.ref[p] = 1
            table.append(p)

    def release(self, table):
        for p in reversed(table):
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.free.append(p)


@pytest.mark.parametrize("seed", range(5))
def test_batched_allocation_and_free_hand_out_the_same_pages(seed):
    rng = random.Random(seed)
    bm = BlockManager(80, 4)
    rng.shuffle(bm._free)
    ref = OnePageAtATime(bm)
    tables, ref_tables = [[] for _ in range(6)], [[] for _ in range(6)]
    for _ in range(200):
        op = rng.random()
        if op < 0.3:
            i, n = rng.randrange(6), rng.randint(0, 6)
            if n <= bm.num_free_pages:
                bm.allocate(tables[i], n)
                ref.allocate(ref_tables[i], n)
        elif op < 0.5:
            idx = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
            if len(idx) <= bm.num_free_pages:
                bm.allocate_one_each([tables[i] for i in idx])
                for i in idx:
                    ref.allocate(ref_tables[i], 1)
        elif op < 0.7:
            grants = [(rng.randrange(6), rng.randint(0, 5)) for _ in range(rng.randint(0, 4))]
            if sum(n for _, n in grants) <= bm.num_free_pages:
                bm.allocate_each([(tables[i], n) for i, n in grants])
                for i, n in grants:
                    ref.allocate(ref_tables[i], n)
        else:
            i = rng.randrange(6)
            bm.free(tables[i])
            ref.release(ref_tables[i])
            tables[i], ref_tables[i] = [], []
        assert tables == ref_tables and bm._free == ref.free and bm.ref_count == ref.ref
        bm.check_invariants(tables)


def _cache_state(bm):
    tier = bm.host_tier
    return (list(bm._free), list(bm._free_cached), dict(bm._key_to_page), list(bm.page_key), list(bm.ref_count),
            bm.num_evictions, list(bm.pending_swap_out), list(tier._slot.items()), list(tier._free),
            tier.num_offloads, tier.num_evictions)


@pytest.mark.parametrize("seed", range(4))
def test_batched_allocation_evicts_as_one_page_at_a_time(seed):
    """With prefix caching and a host tier (LRU, and LFU through offload): allocate_each, allocate_one_each and
    allocate_each_evicting evict the same cached pages in the same order, with the same offloads, as allocate
    one grant at a time; allocate_each_evicting names each evicted key with the grant that evicted it."""
    from pdjax.scheduler.kv_tier import HostKVTier
    rng = random.Random(seed)
    bms = []
    for _ in range(2):
        bm = BlockManager(60, 2, enable_prefix_caching=True)
        bm.host_tier, bm.tier_owner = HostKVTier(20, "lru" if seed % 2 else "lfu"), "i0"
        bms.append(bm)
    tables = [[[] for _ in range(6)] for _ in bms]
    tokens = [[rng.randrange(3) for _ in range(64)] for _ in range(6)]    # few ids: keys repeat across tables
    evicting = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            grants = [(rng.randrange(6), rng.randint(0, 3)) for _ in range(rng.randint(0, 4))]
            if sum(n for _, n in grants) > bms[0].num_free_pages:
                continue
            fresh = [p for p in bms[1]._free]
            expected = []      # (grant, key) of the cached pages allocate will evict, oldest first
            cached = list(bms[1]._free_cached)
            for g, (_, n) in enumerate(grants):
                for _ in range(n):
                    if fresh:
                        fresh.pop()
                    else:
                        expected.append((g, bms[1].page_key[cached.pop(0)]))
            for i, n in grants:
                bms[0].allocate(tables[0][i], n)
            batch = [(tables[1][i], n) for i, n in grants]
            if op < 0.15 and all(n == 1 for _, n in grants):
                bms[1].allocate_one_each([t for t, _ in batch])
            elif op < 0.3:
                bms[1].allocate_each(batch)
            else:
                assert bms[1].allocate_each_evicting(batch) == expected
            evicting += bool(expected)
        elif op < 0.8:
            i = rng.randrange(6)
            keys = []
            extend_page_keys(keys, tokens[i], 2, len(tables[0][i]))
            for bm, t in zip(bms, tables):
                bm.register(t[i], keys, 0, len(t[i]))
        else:
            i = rng.randrange(6)
            for bm, t in zip(bms, tables):
                bm.free(t[i])
                t[i] = []
        assert tables[0] == tables[1] and _cache_state(bms[0]) == _cache_state(bms[1])
        bms[1].check_invariants(tables[1])
    assert evicting >= 10, "the case is meant to evict cached pages"
