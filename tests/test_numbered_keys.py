"""Numbered page keys (pdjax.scheduler.block_manager.numbered_key_bases / request_page_keys): a request whose first
page no other request has shares no page, so the simulator numbers its pages instead of hashing their tokens. The
caches must find, evict and offload exactly what content keys would: same records, same free lists and LRU order,
same counters, on workloads mixing shared prefixes, copies, unique and short prompts, with preemptions."""
from __future__ import annotations

import random

import pytest
from test_decode_runs import CONFIGS, cache_state, run_cached, shared_prefix_requests

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.base import PLACEHOLDER_TOKEN
from pdjax.scheduler.block_manager import numbered_key_bases, request_page_keys
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


def test_request_page_keys_numbers_from_the_base_and_extends_lazily():
    req = Request("r", list(range(50)), SamplingParams(max_tokens=4), 0.0)
    req.key_base = 3 << 32
    assert request_page_keys(req, PS, 2) == [3 << 32, (3 << 32) + 1]
    assert request_page_keys(req, PS, 3) == [(3 << 32) + i for i in range(3)]
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
        for req, base in zip(reqs, numbered_key_bases([r.prompt_token_ids for r in reqs], PS, PLACEHOLDER_TOKEN)):
            req.key_base = base
        return reqs
    return make


def keyless(state: list) -> list:
    """cache_state without the key values (numbers or bytes): which pages hold one, in which order, every count."""
    out = []
    for item in state[:-1]:
        if len(item) == 12:       # a block manager
            free, cached, key_to_page, page_key, *rest = item
            out.append((free, cached, sorted(key_to_page.values()), [k is not None for k in page_key], *rest))
        else:                     # a host tier
            slots, hits, heap, *rest = item
            out.append(([slot for _, slot in slots], sorted(hits.values()), [h[:2] for h in heap], *rest))
    out.append([(rid, len(keys), registered, cached) for rid, keys, registered, cached in state[-1]])
    return out


@pytest.mark.parametrize("policy,router,tier,eviction,num_pages", [
    ("sarathi", "round_robin", "none", "lru", 64), ("vllm_v1", "kv_centric", "local", "lru", 96),
    ("sarathi", "kv_centric", "shared", "lru", 80), ("sarathi", "prefix_affinity", "shared", "lfu", 80),
    ("vllm_v0", "least_loaded", "local", "lru", 64)])
def test_numbered_keys_cache_exactly_what_content_keys_cache(policy, router, tier, eviction, num_pages):
    params = dict(CONFIGS[policy], num_pages=num_pages)
    args = dict(instances=3, router=router, tier=tier, eviction=eviction, seed=3, n=120, rate=8.0)
    reference = run_cached(params, True, workload=mixed_requests, **args)
    got = run_cached(params, True, workload=numbered(mixed_requests), **args)
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert got[0].iterations == reference[0].iterations
    assert got[1] == reference[1]
    assert keyless(got[2]) == keyless(reference[2])
    numbered_ids = [rid for rid, keys, _, _ in got[2][-1] if keys and isinstance(keys[0], int)]
    assert numbered_ids and len(numbered_ids) < len(got[2][-1]), "the case is meant to mix numbered and content keys"
    assert got[3] > 0, "the case is meant to hit the prefix cache"


def test_numbered_keys_reuse_a_preempted_requests_own_pages():
    """A small pool: requests are preempted (recompute) and find their own cached pages again at re-admission."""
    params = dict(CONFIGS["vllm_v1"], num_pages=64)
    args = dict(instances=1, seed=5, n=60, rate=40.0)
    reference = run_cached(params, True, workload=mixed_requests, **args)
    got = run_cached(params, True, workload=numbered(mixed_requests), **args)
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert keyless(got[2]) == keyless(reference[2])
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
        return result, keyless(cache_state(p + d, reqs))
    reference, got = run(mixed_requests), run(numbered(mixed_requests))
    assert [r.__dict__ for r in got[0].requests] == [r.__dict__ for r in reference[0].requests]
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    assert got[1] == reference[1]
    assert sum(t.num_tokens for t in got[0].transfers) < sum(r.num_prompt_tokens for r in got[0].requests), \
        "the case is meant to transfer less than every prompt"
