"""Numbered page keys (pdjax.scheduler.block_manager.numbered_key_bases / request_page_keys): a request whose first
page no other request has shares no page, so the simulator numbers its pages instead of hashing their tokens. The
caches must find, evict and offload exactly what content keys would: same records, same free lists and LRU order,
same counters, on workloads mixing shared prefixes, copies, unique and short prompts, with preemptions."""
from __future__ import annotations

import random

import pytest
from test_decode_runs import CONFIGS, cached_replicas, shared_prefix_requests

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.base import PLACEHOLDER_TOKEN
from pdjax.scheduler.block_manager import BlockManager, numbered_key_bases, numbered_keys, request_page_keys
from pdjax.scheduler.kv_tier import HostKVTier
from pdjax.sim.disagg import simulate_disaggregated
from pdjax.sim.simulator import SimInstance

PS = 16


def test_numbered_key_bases_number_only_requests_that_share_no_first_page():
    unique, shared = list(range(1, 40)), list(range(100, 120))
    short = [7, 8, 9]
    prompts = [unique, shared + [1], shared + [2, 3], short, short + [PLACEHOLDER_TOKEN] * (PS - 3) + [5],
               [7, 8], [500] * PS]
    bases = numbered_key_bases(prompts, PS, PLACEHOLDER_TOKEN)
    # a short prompt's first page is completed with placeholders: [7, 8, 9] decodes into the next prompt's first page
    assert bases == [0, None, None, None, None, 5 << 32, 6 << 32]


def test_numbered_keys_number_the_pages_a_request_shares_with_no_other():
    a = list(range(1, 40))                        # pages 0, 1 shared with b, page 2 shared with nobody
    b = a[:2 * PS] + [900] * 20
    c = [5] * 40                                  # unique from its first page
    d, e = [7, 8, 9], [7, 8, 9] + [PLACEHOLDER_TOKEN] * (PS - 3) + [5]   # d decodes into e's first page
    copy1, copy2 = [3] * 20, [3] * 20             # the same pages forever (placeholders after the prompts)
    bases, shared = numbered_keys([a, b, c, d, e, copy1, copy2], PS, PLACEHOLDER_TOKEN)
    assert bases == [0, 1 << 32, 2 << 32, 3 << 32, 4 << 32, None, None]
    assert shared == [2, 2, 0, 1, 1, 0, 0]
    assert numbered_key_bases([a, b, c, d, e, copy1, copy2], PS, PLACEHOLDER_TOKEN) == [
        None, None, 2 << 32, None, None, None, None]
    req = Request("a", a, SamplingParams(max_tokens=4), 0.0)
    req.key_base, req.content_key_pages = 0, 2
    content = Request("c", a, SamplingParams(max_tokens=4), 0.0)
    assert list(request_page_keys(req, PS, 2)) == list(request_page_keys(content, PS, 2))
    assert list(request_page_keys(req, PS, 4)) == list(request_page_keys(content, PS, 2)) + [2, 3]


@pytest.mark.parametrize("seed", range(40))
def test_numbered_keys_match_pairwise_prefix_comparison(seed):
    """numbered_keys' grouping (pages compared k at a time) against the definition, request against request: L is
    the most leading pages it shares with any other (its ids then placeholders, page by page); one that shares
    them all with another keeps content keys. Prompts from a few heads over a 3-id alphabet, copies, and copies
    extended with placeholders (decoding into each other's pages)."""
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4, PS])
    heads = [[rng.randrange(0, 3) for _ in range(rng.randint(0, 70))] for _ in range(4)]
    prompts = []
    for _ in range(rng.randint(1, 25)):
        prompt = list(rng.choice(heads)) + [rng.randrange(0, 3) for _ in range(rng.randint(0, 40))]
        if prompts and rng.random() < 0.3:
            prompt = list(rng.choice(prompts)) + [PLACEHOLDER_TOKEN] * rng.randint(0, 40) * (rng.random() < 0.5)
        prompts.append(prompt)
    depth = max(len(p) for p in prompts) // ps + 2      # past every prompt: placeholders only

    def page(p, d):
        ids = p[d * ps:(d + 1) * ps]
        return ids + [PLACEHOLDER_TOKEN] * (ps - len(ids))

    expected_bases, expected_shared = [], []
    for i, p in enumerate(prompts):
        most = 0
        for j, q in enumerate(prompts):
            if j != i:
                most = max(most, next((d for d in range(depth) if page(p, d) != page(q, d)), depth))
        expected_bases.append(None if most == depth else i << 32)
        expected_shared.append(0 if most == depth else most)
    assert numbered_keys(prompts, ps, PLACEHOLDER_TOKEN) == (expected_bases, expected_shared)


def test_request_page_keys_numbers_from_the_base_or_extends_content_keys():
    req = Request("r", list(range(50)), SamplingParams(max_tokens=4), 0.0)
    req.key_base = 3 << 32
    assert list(request_page_keys(req, PS, 2)) == [3 << 32, (3 << 32) + 1]
    assert list(request_page_keys(req, PS, 3)) == [(3 << 32) + i for i in range(3)] and not req.page_keys
    content = Request("c", list(range(50)), SamplingParams(max_tokens=4), 0.0)
    assert [len(k) for k in request_page_keys(content, PS, 3)] == [8 + 4 * PS] * 3


def mixed_requests(n: int, seed: int, rate: float) -> list:
    """shared_prefix_requests (shared prefixes, exact copies) interleaved with unique prompts of 1-300 tokens, short
    prompts of a few heads (1-15 tokens: their first pages fill with placeholders as they decode), and short unique
    prompts each followed later by one whose first page is the page the short one decodes into."""
    shared = shared_prefix_requests(n // 2, seed, rate)
    rng = random.Random(seed + 7)
    heads = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 15))] for _ in range(3)]
    end = shared[-1].arrival_time
    others = []
    for i in range(n - len(shared)):
        prompt = (list(rng.choice(heads)) if i % 4 == 0 else
                  [rng.randrange(1, 500) for _ in range(rng.randint(1, 300))])
        others.append(Request(f"u{i:03d}", prompt, SamplingParams(max_tokens=rng.randint(8, 100)),
                              rng.uniform(0, end)))
        if i % 6 == 1:
            head, t = [rng.randrange(1, 500) for _ in range(rng.randint(3, 12))], rng.uniform(0, end)
            follower = head + [PLACEHOLDER_TOKEN] * (PS - len(head)) + [rng.randrange(1, 500) for _ in range(40)]
            others += [Request(f"h{i:03d}", head, SamplingParams(max_tokens=30), t),
                       Request(f"f{i:03d}", follower, SamplingParams(max_tokens=8), t + 0.5)]
    return sorted(shared + others, key=lambda r: r.arrival_time)


def numbered(workload):
    def make(n, seed, rate):
        reqs = workload(n, seed, rate)
        bases, shared = numbered_keys([r.prompt_token_ids for r in reqs], PS, PLACEHOLDER_TOKEN)
        for req, base, pages in zip(reqs, bases, shared):
            req.key_base, req.content_key_pages = base, pages
        return reqs
    return make


def cache_view(insts, requests) -> list:
    """What prefix caching leaves behind, without key values (numbers or bytes) or how dead pages are held
    (BlockManager.free_dead): per instance the free stack, the LRU of cached free pages (a dead segment's pages in
    their places), which pages hold a cache entry, refcounts (a dead page's 1 read as the 0 it stands for) and
    counters; per host tier its slots in LRU order,
    free slots and counters; per request its registered pages and cached tokens."""
    out, tiers = [], []
    for inst in insts:
        bm = inst.scheduler.block_manager
        lru = [q for p, seg in bm._free_cached.items() for q in ([p] if seg is None else seg[::-1])]
        dead = {q for seg in bm._free_cached.values() if seg is not None for q in seg}
        out.append((list(bm._free), lru, sorted([*bm._key_to_page.values(), *dead]),
                    [k is not None or p in dead for p, k in enumerate(bm.page_key)],
                    [0 if p in dead else r for p, r in enumerate(bm.ref_count)],
                    bm.num_free_pages, bm.num_evictions, bm.num_cache_hit_pages, bm.num_query_pages,
                    bm.num_host_hit_pages, bm.num_remote_hit_pages, list(bm.pending_swap_out),
                    list(bm.pending_swap_in)))
        tier = bm.host_tier
        if tier is not None and all(tier is not t for t in tiers):
            tiers.append(tier)
            slots = [s for owner, index in tier._slot.values()
                     for s in ([(owner, index)] if index.__class__ is not list else [(owner, i) for i in index[::-1]])]
            out.append((slots, len(tier), sorted(tier._hits.values()), list(tier._free), tier.num_offloads,
                        tier.num_hits, tier.num_remote_hits, tier.num_evictions))
    out.append([(r.request_id, r.num_registered_pages, r.num_cached_tokens) for r in requests])
    return out


def run_mixed(params: dict, numbered_keys: bool, instances: int = 1, router: str = "round_robin",
              tier: str = "none", seed: int = 0, n: int = 120, eviction: str = "lru", rate: float = 8.0,
              decode_runs: bool = True):
    """mixed_requests as test_decode_runs.run_cached runs its workload (3 replicas behind `router`, host tiers
    'none' / 'local' / 'shared'), keys numbered or not: (result, scheduler counters, cache_view, pages hit,
    dead segments made on devices and host tiers)."""
    from pdjax.scheduler.routing import InstanceRouter
    from pdjax.sim.simulator import simulate
    insts = cached_replicas(params, instances, tier, eviction)
    reqs = (numbered(mixed_requests) if numbered_keys else mixed_requests)(n, seed, rate)
    result = simulate(reqs, insts, InstanceRouter(router, insts, role="colocated"), decode_runs=decode_runs)
    counters = [(i.scheduler.step, i.scheduler.num_preemptions, i.scheduler.num_swaps) for i in insts]
    hits = sum(i.scheduler.block_manager.num_cache_hit_pages + i.scheduler.block_manager.num_host_hit_pages
               for i in insts)
    bms = [i.scheduler.block_manager for i in insts]
    for bm in bms:
        bm.check_invariants()        # every request finished: no page held
    tiers = {id(b.host_tier): b.host_tier for b in bms if b.host_tier is not None}.values()
    dead = (-sum(b._segment for b in bms), -sum(t._segment for t in tiers))
    return result, counters, cache_view(insts, reqs), hits, dead


@pytest.mark.parametrize("policy,router,tier,eviction,num_pages,decode_runs", [
    ("sarathi", "round_robin", "none", "lru", 64, True), ("vllm_v1", "kv_centric", "local", "lru", 96, True),
    ("sarathi", "kv_centric", "shared", "lru", 80, True), ("sarathi", "prefix_affinity", "shared", "lfu", 80, True),
    ("vllm_v0", "least_loaded", "local", "lru", 64, True), ("sarathi", "kv_centric", "local", "lru", 64, False),
    ("vllm_v1", "round_robin", "shared", "lru", 72, False)])
def test_numbered_keys_cache_exactly_what_content_keys_cache(policy, router, tier, eviction, num_pages, decode_runs):
    """Records, caches and host tiers equal with numbered and content keys: finished numbered requests' pages as dead
    segments (BlockManager.free_dead, HostKVTier.offload_dead, except with an LFU tier), the decode runs' bulk
    registration and the steps' one at a time (decode_runs False)."""
    params = dict(CONFIGS[policy], num_pages=num_pages)
    args = dict(instances=3, router=router, tier=tier, eviction=eviction, seed=3, decode_runs=decode_runs)
    reference, got = run_mixed(params, False, **args), run_mixed(params, True, **args)
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert got[0].iterations == reference[0].iterations
    assert got[1:4] == reference[1:4]
    assert got[3] > 0, "the case is meant to hit the prefix cache"
    assert reference[4] == (0, 0) and (got[4][0] > 0) == (eviction == "lru"), "dead segments (but with an LFU tier)"
    assert (got[4][1] > 0) == (tier != "none" and eviction == "lru"), "dead segments offloaded to an LRU tier"


@pytest.mark.parametrize("policy,router,tier,num_pages", [
    ("sarathi", "round_robin", "none", 64), ("sarathi", "kv_centric", "shared", 80),
    ("sarathi", "kv_centric", "local", 64), ("vllm_v1", "prefix_affinity", "local", 96)])
def test_numbered_suffixes_in_decode_runs_as_one_step_at_a_time(policy, router, tier, num_pages, monkeypatch):
    """Requests whose first pages are shared and the rest numbered (numbered_keys) through decode runs, admitted
    by a run's first step when nothing holds their first page (Scheduler._plan_admissions) and registering their
    shared pages with keys inside runs (DecodeRun._registrations): records and caches equal every step through
    schedule() and update()."""
    from pdjax.scheduler import runs as runs_module
    admitted = []
    admit = runs_module.DecodeRun._admit_fresh

    def counting(self, now):
        admitted.extend(req.content_key_pages for req, _, _ in self._fresh)
        admit(self, now)

    monkeypatch.setattr(runs_module.DecodeRun, "_admit_fresh", counting)
    params = dict(CONFIGS[policy], num_pages=num_pages)
    args = dict(instances=3, router=router, tier=tier, seed=3)
    reference = run_mixed(params, True, decode_runs=False, **args)
    got = run_mixed(params, True, decode_runs=True, **args)
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert got[0].iterations == reference[0].iterations
    assert got[1:4] == reference[1:4]        # (a run offloads its evictions as fewer dead segments: same slots)
    assert policy != "sarathi" or any(admitted), "the case is meant to admit numbered suffixes inside runs"


def test_numbered_keys_reuse_a_preempted_requests_own_pages():
    """A small pool: requests are preempted (recompute) and find their own cached pages again at re-admission."""
    params = dict(CONFIGS["vllm_v1"], num_pages=64)
    args = dict(instances=1, seed=5, n=60, rate=40.0)
    reference, got = run_mixed(params, False, **args), run_mixed(params, True, **args)
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert got[1:4] == reference[1:4]
    assert sum(r.num_preemptions for r in got[0].requests) > 0, "the case is meant to preempt"


def test_numbered_keys_in_a_disaggregated_run_with_partial_transfer_and_a_shared_tier():
    """Decode instances reuse the prefix they hold (partial transfer), found in their cache or the shared host pool
    the prefill side offloads into: a numbered request finds its own pages there as a content-keyed one would."""
    def run(workload):
        base = dict(token_budget=128, max_num_seqs=8, max_model_len=1024, page_size=PS, enable_prefix_caching=True,
                    watermark=0.0)
        tier = HostKVTier(96)
        p = [SimInstance("prefill0", make_scheduler(SchedulerConfig(policy="prefill_only", num_pages=72, **base)),
                         lambda out: 1e-3 + 1e-5 * out.total_tokens, role="prefill")]
        d = [SimInstance(f"decode{i}", make_scheduler(SchedulerConfig(policy="decode_only", num_pages=80, **base)),
                         lambda out: 1e-3 + 1e-5 * out.total_tokens, role="decode") for i in range(2)]
        for inst in p + d:
            inst.scheduler.block_manager.host_tier, inst.scheduler.block_manager.tier_owner = tier, inst.name
        for inst in d:
            inst.scheduler.reuse_prefix = True
        reqs = workload(50, 9, 10.0)
        result = simulate_disaggregated(reqs, p, d, lambda src, dst, n: 1e-4 + 2e-6 * n, partial_transfer=True)
        return result, cache_view(p + d, reqs)
    reference, got = run(mixed_requests), run(numbered(mixed_requests))
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    assert got[1] == reference[1]
    assert sum(t.num_tokens for t in got[0].transfers) < sum(r.num_prompt_tokens for r in got[0].requests), \
        "the case is meant to transfer less than every prompt"


def one_by_one(tier: HostKVTier, keys, owner: str) -> list:
    """offload_many's reference: HostKVTier.offload of each key in turn."""
    return [tier.offload(key, owner) for key in keys]


def tier_view(tier: HostKVTier) -> tuple:
    """A tier's slots in LRU order (a dead entry's page by page), free slots and counters."""
    slots = [(key if key.__class__ is not int else "dead", owner, index) for key, (owner, index) in tier._slot.items()]
    return slots, list(tier._free), len(tier), tier.num_offloads, tier.num_evictions, tier.num_hits


@pytest.mark.parametrize("capacity,filled,dead_before,n", [(8, 3, 0, 2), (8, 5, 3, 5), (8, 2, 4, 13), (4, 0, 0, 11),
                                                          (6, 1, 5, 3)])
def test_offload_dead_takes_slots_as_new_keys_would(capacity, filled, dead_before, n):
    """HostKVTier.offload_dead(n) against n offloads of new keys: the same slots (free ones, then the least recent
    entries', then, past the capacity, its own pages'), counters and length, and later offloads evict the same
    slots in the same order (a dead entry taken page by page from its oldest)."""
    tier, reference = HostKVTier(capacity), HostKVTier(capacity)
    for t in (tier, reference):
        one_by_one(t, [("old", i) for i in range(filled)], "a")
    if dead_before:
        assert tier.offload_dead(dead_before, "a") == one_by_one(
            reference, [("dead", i) for i in range(dead_before)], "a")
    assert tier.offload_dead(n, "b") == one_by_one(reference, [("new", i) for i in range(n)], "b")
    later = [("later", i) for i in range(capacity + 2)]
    for keys in (later[:1], later[1:3], later[3:]):
        assert tier.offload_many(keys, "c") == one_by_one(reference, keys, "c")
        assert (len(tier), tier.num_offloads, tier.num_evictions, tier._free) == \
            (len(reference), reference.num_offloads, reference.num_evictions, reference._free)


@pytest.mark.parametrize("sizes", [(3, 5, 2), (2, 2, 2, 5, 6, 3), (7, 1, 7, 4, 4)])
def test_dead_entries_hand_their_slots_on_as_new_keys_would(sizes):
    """offload_dead on a full tier whose least recent entries are dead (HostKVTier._dead_slots: the entries it
    fills, whole, and part of the next, in one pass; sizes below the capacity) against offloads of new keys: the
    same slots, length and counters after each, and later offloads evict the same slots in the same order."""
    capacity = 8
    tier, reference = HostKVTier(capacity), HostKVTier(capacity)
    for step, n in enumerate((capacity, *sizes)):
        assert tier.offload_dead(n, "a") == one_by_one(reference, [(step, i) for i in range(n)], "a")
        assert (len(tier), tier.num_offloads, tier.num_evictions, tier._free) == \
            (len(reference), reference.num_offloads, reference.num_evictions, reference._free)
    keys = [("later", i) for i in range(capacity)]
    assert tier.offload_many(keys, "c") == one_by_one(reference, keys, "c")
    assert tier.num_evictions == reference.num_evictions


def dead_block_manager() -> BlockManager:
    """A block manager whose LRU holds three dead segments of 4 pages (free_dead), its host tier (capacity 6) full
    of two dead entries, recording its offloads."""
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    bm.host_tier, bm.tier_owner = HostKVTier(6), "i0"
    bm.host_tier.offload_dead(3, "i0")
    bm.host_tier.offload_dead(3, "i0")
    tables = [[] for _ in range(3)]
    for table in tables:
        bm.allocate(table, 5)
    for table in tables:
        assert bm.free_dead(table, 4)
    return bm


@pytest.mark.parametrize("n", [1, 3, 4, 6, 8, 11, 12])
def test_evicting_dead_pages_in_one_pass_is_the_general_eviction(n):
    """BlockManager._evict_dead (the oldest cached pages all dead: whole segments and part of the next in one pass)
    against _evict, the general path (_pop_with_segments, HostKVTier.offload_runs): the same pages in the same
    order, and the same LRU, counters, host tier and recorded copies after."""
    def state(bm):
        tier = bm.host_tier
        return (list(bm._free_cached.items()), bm._dead_extra, bm._num_segments, bm.num_evictions,
                bm.num_dead_evictions, bm.num_free_pages, list(bm.pending_swap_out), list(tier._slot.items()),
                len(tier), tier.num_offloads, tier.num_dead_offloads, tier.num_evictions)
    one_pass, general = dead_block_manager(), dead_block_manager()
    pages = one_pass._evict_dead(n, True)
    assert pages == general._evict(n, True)[0] and len(pages) == n
    assert state(one_pass) == state(general)
    assert len(one_pass.pending_swap_out) == n


@pytest.mark.parametrize("seed", range(40))
def test_offload_many_is_offload_one_by_one(seed):
    """HostKVTier.offload_many (new distinct keys in one pass, else key by key) against offload() of each key, over
    random batches (new keys, held keys, repeats, more than the capacity) between dead entries and lookups: the
    same slots, LRU order, free slots and counters after every operation."""
    rng = random.Random(seed)
    capacity = rng.randint(1, 12)
    tier, reference = HostKVTier(capacity), HostKVTier(capacity)
    for _ in range(30):
        op = rng.random()
        if op < 0.55:
            keys = [rng.randrange(30) for _ in range(rng.randint(0, 2 * capacity))]
            if rng.random() < 0.7:
                keys = list(dict.fromkeys(keys))
            assert tier.offload_many(keys, "x") == one_by_one(reference, keys, "x")
        elif op < 0.8:
            n = rng.randint(1, capacity + 2)
            assert tier.offload_dead(n, "x") == reference.offload_dead(n, "x")
        else:
            keys = [rng.randrange(30) for _ in range(4)]
            assert tier.lookup(keys, 0, 4, "x") == reference.lookup(keys, 0, 4, "x")
        assert tier_view(tier) == tier_view(reference)
