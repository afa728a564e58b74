"""Hot-block replication in a shared host KV pool (issue 30 item 2, optional part; pdjax.scheduler.kv_tier module
docstring): an instance's N-th remote fetch of a page gives it a copy in its own part of the pool, served to it
first; copies take capacity and are evicted like any entry; off (the default) changes nothing. No JAX."""
from __future__ import annotations

import dataclasses
import random

import pytest

from pdjax.config.deployment import deployment_from_dict
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.block_manager import BlockManager
from pdjax.scheduler.kv_tier import HostKVTier, attach_host_tiers
from pdjax.scheduler.output import SchedulerOutput
from pdjax.sim.kv_tier import HostLoadStepTime
from pdjax.sim.simulator import SimInstance, simulate


def _fetch(tier, key, owner):
    """One admission's host lookup of `key` by `owner`, as the block manager does it: (slot, due for a copy)."""
    (slot,) = tier.lookup([key], 0, 1, owner)
    return slot, slot[0] != owner and tier.fetched_remote(key, owner)


def test_nth_remote_fetch_makes_a_copy_served_locally_to_its_owner_only():
    tier = HostKVTier(8, replicate_after=2)
    home = tier.offload("k", "a")
    assert _fetch(tier, "k", "b") == (home, False)
    assert _fetch(tier, "k", "b") == (home, True)          # the 2nd remote fetch by b: due
    assert _fetch(tier, "k", "c") == (home, False)         # c's count is its own
    copy = tier.replicate("k", "b")
    assert copy is not None and copy[0] == "b" and copy[1] != home[1]
    assert tier.replicate("k", "b") is None and tier.replicate("k", "a") is None   # held already
    remote_before = tier.num_remote_hits
    assert tier.lookup(["k"], 0, 1, "b") == [copy]          # b: its copy, a local hit
    assert tier.lookup(["k"], 0, 1, "c") == [home]          # c: the primary, remote
    assert tier.num_remote_hits == remote_before + 1 and tier.num_copy_hits == 1
    assert tier.num_replicas == 1 and len(tier) == 2 and tier.num_offloads == 1
    assert tier.count_prefix(["k"], 0, 1, "b") == 1 and tier.owners(["k"], 0, 1, "b") == ["b"]
    assert tier.owners(["k"], 0, 1, "c") == ["a"]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_copies_take_capacity_and_are_evicted_like_any_entry(eviction):
    tier = HostKVTier(2, eviction, replicate_after=1)
    tier.offload("k", "a")
    tier.offload("j", "a")
    tier.lookup(["k"], 0, 1, "b")
    assert tier.fetched_remote("k", "b")
    copy = tier.replicate("k", "b")                         # full: evicts an entry (lru: 'j', the least recent)
    assert copy is not None and tier.num_evictions == 1 and len(tier) == 2
    if eviction == "lru":
        assert "j" not in tier and "k" in tier
    tier.offload("m", "a")
    tier.offload("n", "a")                                   # two more: the copy goes too
    assert tier.num_evictions == 3 and len(tier) == 2
    assert copy not in [slot for _, slot in tier._slot.items()]
    assert tier.owners(["k"], 0, 1, "b") in ([], ["a"])      # lfu keeps the hit primary: b fetches it remotely


def test_a_copy_outlives_its_primary_for_its_owner_and_becomes_primary_on_offload():
    tier = HostKVTier(3, replicate_after=1)
    tier.offload("k", "a")
    tier.lookup(["k"], 0, 1, "b")
    tier.fetched_remote("k", "b")
    copy = tier.replicate("k", "b")
    tier.lookup(["k"], 0, 1, "b")                           # the copy is the more recent entry
    tier.offload("x", "a")
    tier.offload("y", "a")                                   # evicts the primary
    assert "k" not in tier and tier.lookup(["k"], 0, 1, "c") == []
    assert tier.lookup(["k"], 0, 1, "b") == [copy]
    assert tier.offload("k", "b") is None                    # b's device page evicted again: nothing copied
    assert "k" in tier and tier.lookup(["k"], 0, 1, "c") == [copy] and len(tier) == 3


def test_off_by_default_never_counts_or_copies():
    tier = HostKVTier(4)
    tier.offload("k", "a")
    for _ in range(5):
        tier.lookup(["k"], 0, 1, "b")
        assert not tier.fetched_remote("k", "b")
    assert tier.num_replicas == 0 and len(tier) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_tier_rejects_bad_replicate_after(bad):
    with pytest.raises(ValueError, match="replicate_after"):
        HostKVTier(4, replicate_after=bad)


def test_replicate_after_needs_a_shared_pool_in_one_line():
    with pytest.raises(ValueError, match=r"host_kv_replicate_after=2 with host_kv_pool='local'.*expected") as e:
        deployment_from_dict({"host_kv_replicate_after": 2, "colocated": {"host_kv_blocks": 8}})
    assert "\n" not in str(e.value)
    dep = deployment_from_dict({"host_kv_replicate_after": 2, "host_kv_pool": "shared",
                                "colocated": {"num_instances": 2, "host_kv_blocks": 8}})
    assert dep.host_kv_replicate_after == 2


def test_block_manager_copies_a_due_page_with_the_output_after_its_load():
    """The copy of a page loaded in output k is a device -> host copy of that page in output k+1 (its data is on the
    device only once output k's step ran); the slot is the fetcher's."""
    tier = HostKVTier(8, replicate_after=1)
    a, b = BlockManager(8, 4, True), BlockManager(8, 4, True)
    a.host_tier, a.tier_owner, b.host_tier, b.tier_owner = tier, "a", tier, "b"
    home = tier.offload("k0", "a")
    table: list = []
    b.load_from_host(table, ["k0"], b.match_host(["k0"], 0, 1))
    first, second = SchedulerOutput(step=1), SchedulerOutput(step=2)
    b.drain_tier_copies(first)
    assert first.swap_in == [(home, table[0])] and first.swap_out == []
    b.drain_tier_copies(second)
    assert second.swap_out == [(("b", second.swap_out[0][0][1]), table[0])] and second.swap_in == []
    assert tier.lookup(["k0"], 0, 1, "b") == [second.swap_out[0][0]]


def _tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _run_shared(replicate_after, explicit=True):
    """Two replicas over one shared pool; a common prefix served on replica0 is pushed off its device (offloaded by
    replica0) by unrelated prompts, then keeps being asked for on replica1 between unrelated prompts that push it
    off there too: replica1 fetches replica0's pages again and again."""
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=96, page_size=4,
                          num_pages=24, enable_prefix_caching=True, watermark=0.0)
    step = lambda out: 1e-3 + 1e-5 * out.total_tokens    # noqa: E731 (a one-line step time)
    insts = [SimInstance(f"replica{i}", make_scheduler(cfg), HostLoadStepTime(step, f"replica{i}", 1e-4, 1e-3))
             for i in range(2)]
    tier = HostKVTier(64, replicate_after=replicate_after) if explicit else HostKVTier(64)
    for inst in insts:
        inst.scheduler.block_manager.host_tier, inst.scheduler.block_manager.tier_owner = tier, inst.name
    shared = _tokens(200, 40)
    reqs, order, t = [], [], 0.0
    for k in range(6):
        reqs.append(Request(f"s{k}", shared + [k + 1], SamplingParams(max_tokens=2), t))
        order.append(0 if k == 0 else 1)
        for j in range(3):
            t += 0.5
            reqs.append(Request(f"u{k}{j}", _tokens(300 + 10 * k + j, 40), SamplingParams(max_tokens=2), t))
            order.append(0 if k == 0 else 1)
        t += 0.5
    picks = iter(order)
    result = simulate(reqs, insts, router=lambda req, instances: instances[next(picks)])
    records = [dataclasses.asdict(r) for r in result.requests]
    return records, tier, insts[1].scheduler.block_manager


def test_off_leaves_records_identical_and_on_turns_remote_fetches_local():
    base, tier0, bm0 = _run_shared(0, explicit=False)
    off, _, _ = _run_shared(0)
    assert off == base
    on, tier2, bm2 = _run_shared(2)
    assert tier0.num_replicas == 0 and bm0.num_remote_hit_pages >= 4 * 10
    assert tier2.num_replicas > 0 and tier2.num_copy_hits > 0
    assert bm2.num_remote_hit_pages < bm0.num_remote_hit_pages
    assert bm2.num_host_hit_pages == bm0.num_host_hit_pages          # the same hits, served locally
    ttft = lambda records: sum(r["first_token_time"] - r["arrival_time"] for r in records)   # noqa: E731
    assert on != off and ttft(on) < ttft(off)                         # local loads are priced cheaper


def test_attach_host_tiers_passes_replicate_after_to_the_shared_pool():
    class Inst:
        def __init__(self, name):
            self.name, self.scheduler = name, make_scheduler(SchedulerConfig(
                policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=96, page_size=4, num_pages=24,
                enable_prefix_caching=True))
    dep = deployment_from_dict({"host_kv_replicate_after": 3, "host_kv_pool": "shared",
                                "colocated": {"num_instances": 2, "host_kv_blocks": 8}})
    (tier,) = attach_host_tiers({"colocated": [Inst("r0"), Inst("r1")]}, dep, 1024)
    assert tier.replicate_after == 3 and tier.capacity == 16


def test_kv_cache_experiment_sets_replicate_after_only_when_on():
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.kv_cache import base_config
    off = base_config("conversation", host_blocks=8, host_pool="shared")
    assert "host_kv_replicate_after" not in off["deployment"]
    on = base_config("conversation", host_blocks=8, host_pool="shared", replicate_after=2)
    assert serve_config_from_dict(on).deployment.host_kv_replicate_after == 2
    on["deployment"].pop("host_kv_replicate_after")
    assert on == off
