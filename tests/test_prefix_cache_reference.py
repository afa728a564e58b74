"""Prefix caching and the host KV tier against a plain reference: random operation sequences (allocate, the batched
allocations, free, register, prefix match, host-tier loads) on BlockManager + HostKVTier and on the one-page-at-a-time
implementation below must leave the same state after every operation: tables, the uncached free stack and the
cached free list in order, the key -> page map, page keys, reference counts, the host tier's entries in order, its
free slots, every counter and the recorded copies. Local and shared tiers, LRU and LFU, several page sizes.
Also: equal prefix <=> equal page key, and a key holds its page's token ids."""
import random
from collections import OrderedDict

import pytest

from pdjax.scheduler.block_manager import BlockManager, extend_page_keys, page_key_tokens
from pdjax.scheduler.kv_tier import HostKVTier


# ----------------------------------------------------------------------------------------------- the reference
class RefTier:
    """HostKVTier's rules one key at a time: LRU (an OrderedDict in recency order) or LFU (fewest hits, ties least
    recent: entries (hits, tick, key) taken smallest first, skipped unless they still describe a held key)."""

    def __init__(self, capacity, eviction):
        self.eviction = eviction
        self.slot = OrderedDict()
        self.hits, self.entries, self.tick = {}, [], 0
        self.free = list(range(capacity - 1, -1, -1))
        self.offloads = self.num_hits = self.remote = self.evictions = 0

    def _push(self, key):
        self.entries.append((self.hits[key], self.tick, key))
        self.tick += 1

    def _touch(self, key):
        if self.eviction == "lru":
            self.slot.move_to_end(key)
        else:
            self.hits[key] += 1
            self._push(key)

    def _evict_one(self):
        self.evictions += 1
        if self.eviction == "lru":
            key = next(iter(self.slot))
        else:
            while True:
                self.entries.sort(key=lambda e: e[:2])
                hits, _, key = self.entries.pop(0)
                if key in self.slot and self.hits[key] == hits:
                    break
            del self.hits[key]
        return self.slot.pop(key)[1]

    def offload(self, key, owner):
        if key in self.slot:
            self._touch(key)
            return None
        index = self.free.pop() if self.free else self._evict_one()
        self.slot[key] = (owner, index)
        if self.eviction == "lfu":
            self.hits[key] = 0
            self._push(key)
        self.offloads += 1
        return self.slot[key]

    def lookup(self, keys, start, stop, owner):
        slots = []
        for i in range(start, min(stop, len(keys))):
            if keys[i] not in self.slot:
                break
            self._touch(keys[i])
            slots.append(self.slot[keys[i]])
            self.remote += slots[-1][0] != owner
        self.num_hits += len(slots)
        return slots

    def state(self):
        return list(self.slot.items()), list(self.free), (self.offloads, self.num_hits, self.remote, self.evictions)


class RefBlocks:
    """BlockManager's prefix caching one page at a time: a cached free list in LRU order (a plain list)."""

    def __init__(self, num_pages, tier=None, owner=""):
        self.ref, self.key = [0] * num_pages, [None] * num_pages
        self.free, self.cached, self.k2p = list(range(num_pages - 1, -1, -1)), [], {}
        self.tier, self.owner = tier, owner
        self.evictions = self.cache_hits = self.host_hits = self.remote_hits = 0
        self.swap_out, self.swap_in = [], []

    def allocate(self, table, n):
        """Returns the keys of the cached pages it evicts, in order."""
        evicted = []
        for _ in range(n):
            if self.free:
                p = self.free.pop()
            else:
                p = self.cached.pop(0)
                k = self.key[p]
                del self.k2p[k]
                evicted.append(k)
                if self.tier is not None:
                    slot = self.tier.offload(k, self.owner)
                    if slot is not None:
                        self.swap_out.append((slot, p))
                self.key[p] = None
                self.evictions += 1
            self.ref[p] = 1
            table.append(p)
        return evicted

    def free_table(self, table):
        for p in reversed(table):
            self.ref[p] -= 1
            if self.ref[p] == 0:
                (self.free if self.key[p] is None else self.cached).append(p)

    def register(self, table, keys, start, stop):
        for i in range(start, stop):
            p = table[i]
            if self.key[p] is None and keys[i] not in self.k2p:
                self.k2p[keys[i]] = p
                self.key[p] = keys[i]

    def match_prefix(self, keys, max_pages):
        hits = []
        for k in keys[:max_pages]:
            if k not in self.k2p:
                break
            hits.append(self.k2p[k])
        return hits

    def take_cached(self, table, pages):
        for p in pages:
            if self.ref[p] == 0:
                self.cached.remove(p)
            self.ref[p] += 1
            table.append(p)
        self.cache_hits += len(pages)

    def load_from_host(self, table, keys, slots):
        start = len(table)
        self.allocate(table, len(slots))
        self.register(table, keys, start, start + len(slots))
        self.swap_in += zip(slots, table[start:])
        self.host_hits += len(slots)
        self.remote_hits += sum(1 for s in slots if s[0] != self.owner)

    def state(self):
        return (list(self.free), list(self.cached), dict(self.k2p), list(self.key), list(self.ref),
                (self.evictions, self.cache_hits, self.host_hits, self.remote_hits),
                list(self.swap_out), list(self.swap_in))


def _bm_state(bm):
    return (list(bm._free), list(bm._free_cached), dict(bm._key_to_page), list(bm.page_key), list(bm.ref_count),
            (bm.num_evictions, bm.num_cache_hit_pages, bm.num_host_hit_pages, bm.num_remote_hit_pages),
            list(bm.pending_swap_out), list(bm.pending_swap_in))


def _tier_state(tier):
    return (list(tier._slot.items()), list(tier._free),
            (tier.num_offloads, tier.num_hits, tier.num_remote_hits, tier.num_evictions))


# ----------------------------------------------------------------------------------------------- the driver
def _prompts(rng, n, page_size):
    """Token sequences from a few shared prefixes and a small alphabet (keys repeat within and across them)."""
    stems = [[rng.randrange(4) for _ in range(page_size * rng.randint(1, 4))] for _ in range(3)]
    return [rng.choice(stems) + [rng.randrange(4) for _ in range(page_size * rng.randint(0, 5) + rng.randrange(3))]
            for _ in range(n)]


class _Pair:
    """One instance twice: the real block manager and the reference, the same tables and prompts."""

    def __init__(self, num_pages, page_size, tier, ref_tier, owner, prompts):
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=True)
        if tier is not None:
            self.bm.host_tier, self.bm.tier_owner = tier, owner
        self.ref = RefBlocks(num_pages, ref_tier, owner)
        self.ps, self.prompts = page_size, prompts
        self.tables = [[] for _ in prompts]
        self.ref_tables = [[] for _ in prompts]
        self.keys = [[] for _ in prompts]

    def full_keys(self, i, pages):
        extend_page_keys(self.keys[i], self.prompts[i], self.ps, min(pages, len(self.prompts[i]) // self.ps))
        return self.keys[i]

    def check(self):
        assert self.tables == self.ref_tables
        assert _bm_state(self.bm) == self.ref.state()
        self.bm.check_invariants(self.tables)


def _grants(rng, pair):
    grants = [(rng.randrange(len(pair.tables)), rng.randint(0, 4)) for _ in range(rng.randint(1, 5))]
    return grants if sum(n for _, n in grants) <= pair.bm.num_free_pages else []


def _op_allocate(rng, pair):
    grants = _grants(rng, pair)
    if not grants:
        return 0
    expected = []
    for g, (i, n) in enumerate(grants):
        expected += [(g, k) for k in pair.ref.allocate(pair.ref_tables[i], n)]
    batch = [(pair.tables[i], n) for i, n in grants]
    how = rng.randrange(4)
    if how == 0:
        for table, n in batch:
            pair.bm.allocate(table, n)
    elif how == 1:
        pair.bm.allocate_each(batch)
    elif how == 2 and all(n == 1 for _, n in grants):
        pair.bm.allocate_one_each([t for t, _ in batch])
    else:
        assert pair.bm.allocate_each_evicting(batch) == expected
    return len(expected)


def _op_register(rng, pair):
    i = rng.randrange(len(pair.tables))
    full = min(len(pair.tables[i]), len(pair.prompts[i]) // pair.ps)
    if full:
        start = rng.randrange(full)
        keys = pair.full_keys(i, full)
        pair.bm.register(pair.tables[i], keys, start, full)
        pair.ref.register(pair.ref_tables[i], keys, start, full)


def _op_free(rng, pair):
    i = rng.randrange(len(pair.tables))
    pair.bm.free(pair.tables[i])
    pair.ref.free_table(pair.ref_tables[i])
    pair.tables[i], pair.ref_tables[i] = [], []


def _op_admit(rng, pair):
    """An empty table takes its prompt's device prefix hits, then the host tier's run after them."""
    empty = [i for i, t in enumerate(pair.tables) if not t]
    if not empty:
        return
    i = rng.choice(empty)
    keys = pair.full_keys(i, len(pair.prompts[i]) // pair.ps)
    hits = pair.bm.match_prefix(keys, len(keys))
    assert hits == pair.ref.match_prefix(keys, len(keys))
    pair.bm.take_cached(pair.tables[i], hits)
    pair.ref.take_cached(pair.ref_tables[i], hits)
    if pair.bm.host_tier is None:
        return
    n = min(pair.bm.host_tier.count_prefix(keys, len(hits), len(keys)), pair.bm.num_free_pages)
    slots = pair.bm.match_host(keys, len(hits), len(hits) + n)
    assert slots == (pair.ref.tier.lookup(keys, len(hits), len(hits) + n, pair.ref.owner) if n else [])
    pair.bm.load_from_host(pair.tables[i], keys, slots)
    pair.ref.load_from_host(pair.ref_tables[i], keys, slots)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tier", [None, "lru", "lfu", "shared-lru", "shared-lfu"])
def test_block_manager_and_host_tier_match_the_reference(tier, seed):
    rng = random.Random(seed)
    page_size = (1, 2, 4)[seed]
    instances = 2 if tier and tier.startswith("shared") else 1
    eviction = tier.rsplit("-", 1)[-1] if tier else None
    shared = (HostKVTier(12, eviction), RefTier(12, eviction)) if instances == 2 else None
    pairs = []
    for k in range(instances):
        if shared or not tier:
            tiers = shared or (None, None)
        else:
            capacity = rng.randint(3, 12)
            tiers = (HostKVTier(capacity, eviction), RefTier(capacity, eviction))
        pairs.append(_Pair(40, page_size, tiers[0], tiers[1], f"i{k}", _prompts(rng, 6, page_size)))
    evictions = host_hits = 0
    for _ in range(600):
        pair = rng.choice(pairs)
        op = rng.random()
        if op < 0.35:
            evictions += _op_allocate(rng, pair)
        elif op < 0.6:
            _op_register(rng, pair)
        elif op < 0.8:
            _op_free(rng, pair)
        else:
            _op_admit(rng, pair)
        pair.check()
        if pair.bm.host_tier is not None:
            assert _tier_state(pair.bm.host_tier) == pair.ref.tier.state()
            host_hits = pair.bm.host_tier.num_hits
            if rng.random() < 0.3:         # the runner takes the copies (drain_tier_copies)
                pair.bm.pending_swap_out, pair.bm.pending_swap_in = [], []
                pair.ref.swap_out, pair.ref.swap_in = [], []
    assert evictions >= 20, "the case is meant to evict cached pages"
    assert sum(p.bm.num_cache_hit_pages for p in pairs) >= 10, "the case is meant to hit the device cache"
    if tier:
        assert host_hits > 0, "the case is meant to hit the host tier"


def test_page_keys_equal_exactly_for_equal_prefixes():
    """Over random short sequences of a 3-token alphabet: keys of page i equal <=> the first i + 1 pages equal; each
    key holds its page's token ids (short last pages included)."""
    rng = random.Random(0)
    for page_size in (1, 3, 4):
        seqs = [[rng.randrange(3) for _ in range(page_size * rng.randint(1, 4) + rng.randrange(2))] for _ in range(60)]
        keys = []
        for s in seqs:
            k = []
            extend_page_keys(k, s, page_size, -(-len(s) // page_size))
            assert [page_key_tokens(x) for x in k] == [tuple(s[i:i + page_size]) for i in range(0, len(s), page_size)]
            keys.append(k)
        for a, ka in zip(seqs, keys):
            for b, kb in zip(seqs, keys):
                for i in range(min(len(ka), len(kb))):
                    same = a[:(i + 1) * page_size] == b[:(i + 1) * page_size]
                    assert (ka[i] == kb[i]) == same, (a, b, i)


def test_page_keys_of_token_ids_outside_int32_hold_them_and_differ():
    """Ids past int32 take 8-byte keys (odd length): the ids survive, and no such key equals a 4-byte one."""
    big = [2 ** 40, -2 ** 35, 7, 2 ** 63 - 1]
    small = [0, 256, 0, 0] + [7, 0, 0, 0]        # the low/high int32 halves of big's first id, then 7 ...
    for page_size in (2, 4):
        kb, ks = [], []
        extend_page_keys(kb, big, page_size, len(big) // page_size)
        extend_page_keys(ks, small, page_size, len(small) // page_size)
        assert [page_key_tokens(k) for k in kb] == [tuple(big[i:i + page_size]) for i in range(0, 4, page_size)]
        assert all(len(k) % 2 for k in kb) and not any(len(k) % 2 for k in ks)
        assert not set(kb) & set(ks)
