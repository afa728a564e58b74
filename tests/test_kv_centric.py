"""KV-cache-centric scheduling without JAX (issue 30): the host KV tier (pdjax.scheduler.kv_tier), its block-manager
hooks and admission, the cache-aware routers (prefix_affinity, kv_centric), partial transfer, the simulator's
pricing and config validation. The real engine's checks are tests/test_kv_centric_engine.py."""
from __future__ import annotations

import pathlib
import random

import pytest

from pdjax.config.deployment import DeploymentConfig, deployment_from_dict
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler import block_manager as bm_module
from pdjax.scheduler.block_manager import BlockManager, extend_page_keys
from pdjax.scheduler.fake_runner import drive
from pdjax.scheduler.kv_tier import HostKVTier, attach_host_tiers, host_kv_blocks
from pdjax.scheduler.routing import InstanceRouter, predicted_ttft
from pdjax.sim.disagg import simulate_disaggregated
from pdjax.sim.kv_tier import HostLoadStepTime, host_link_bandwidth, prefill_cost
from pdjax.sim.simulator import SimInstance, simulate

PS = 4


def _cfg(**kw):
    base = dict(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=96, page_size=PS, num_pages=64,
                enable_prefix_caching=True, watermark=0.0)
    return SchedulerConfig(**{**base, **kw})


def _tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _req(rid, tokens, max_tokens=2, t=0.0):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), t)


def _with_tier(sched, capacity, eviction="lru", owner="i0"):
    sched.block_manager.host_tier = HostKVTier(capacity, eviction)
    sched.block_manager.tier_owner = owner
    return sched


# ----------------------------------------------------------------------------------------------- the tier
def test_tier_lru_evicts_least_recent_and_touches_on_hit():
    tier = HostKVTier(2)
    a, b, c = ("a",), ("b",), ("c",)
    assert tier.offload(a, "i0") == ("i0", 0) and tier.offload(b, "i1") == ("i1", 1)
    assert tier.offload(a, "i0") is None                     # held already: touched, nothing copied
    assert tier.lookup([b], 0, 1, owner="i0") == [("i1", 1)] and tier.num_remote_hits == 1
    slot = tier.offload(c, "i0")                             # a is the least recent now
    assert a not in tier and b in tier and c in tier and slot[1] == 0 and tier.num_evictions == 1


def test_tier_lfu_evicts_fewest_hits():
    tier = HostKVTier(2, "lfu")
    tier.offload("a", "i0")
    tier.offload("b", "i0")
    tier.lookup(["a"], 0, 1)
    tier.lookup(["a"], 0, 1)
    tier.offload("c", "i0")                                  # b has 0 hits, a has 2
    assert "a" in tier and "b" not in tier and "c" in tier


def test_tier_lookup_stops_at_the_first_miss_and_count_touches_nothing():
    tier = HostKVTier(8)
    for k in ("k0", "k1", "k3"):
        tier.offload(k, "i0")
    assert tier.count_prefix(["k0", "k1", "k2", "k3"], 0, 4) == 2 and tier.num_hits == 0
    assert tier.lookup(["k0", "k1", "k2", "k3"], 0, 4) == [("i0", 0), ("i0", 1)] and tier.num_hits == 2
    assert tier.owners(["k0", "k1"], 0, 2) == ["i0", "i0"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_tier_rejects_bad_capacity(bad):
    with pytest.raises(ValueError, match="capacity"):
        HostKVTier(bad)


def test_host_kv_blocks_from_gib():
    assert host_kv_blocks(7, 0.0, 100) == 7
    assert host_kv_blocks(0, 1.0, 2 ** 20) == 1024
    assert host_kv_blocks(0, 0.0, 100) == 0


# ----------------------------------------------------------------------------------------------- block manager
def test_eviction_offloads_and_load_registers_with_copies():
    bm = BlockManager(4, PS, enable_prefix_caching=True)
    bm.host_tier, bm.tier_owner = HostKVTier(8), "i0"
    keys = []
    toks = _tokens(0, 4 * PS)
    extend_page_keys(keys, toks, PS, 4)
    table = []
    bm.allocate(table, 4)
    bm.register(table, keys, 0, 4)
    bm.free(table)                                        # all four cached and free
    other = []
    bm.allocate(other, 3)                                 # evicts three cached pages: offloaded
    assert len(bm.pending_swap_out) == 3 and len(bm.host_tier) == 3
    offloaded = {p for _, p in bm.pending_swap_out}
    assert offloaded <= set(table)
    bm.free(other)
    hits = bm.match_prefix(keys, 4)                       # the tail was evicted first: the head is still here
    slots = bm.match_host(keys, len(hits), 4)
    assert len(hits) == 1 and len(slots) == 3
    new = []
    bm.take_cached(new, hits)
    bm.load_from_host(new, keys, slots)
    assert bm.pending_swap_in == list(zip(slots, new[1:])) and bm.num_host_hit_pages == 3
    assert bm.match_prefix(keys, 4) == new                 # registered: device hits from now on
    bm.check_invariants([new])


def test_admission_loads_host_pages_and_counts_them_cached():
    cfg = _cfg(num_pages=24)
    sched = _with_tier(make_scheduler(cfg), 64)
    shared = _tokens(1, 40)
    drive(sched, [(0.0, _req("a", shared + [5]))])
    # Unrelated requests push a's cached pages off the device (24 pages, 11 each).
    drive(sched, [(0.0, _req("x", _tokens(2, 40))), (0.0, _req("y", _tokens(3, 40)))])
    assert sched.block_manager.host_tier.num_offloads >= 5
    tables = []
    outs = drive(sched, [(0.0, _req("b", shared + [7, 8, 9]))],
                 on_step=lambda out, now: tables.append([list(t) for t in out.page_tables]))
    first = next(o for o in outs if o.req_ids)
    table = tables[outs.index(first)][0]
    (b,) = first.reqs
    assert b.num_cached_tokens == 40 and first.num_computed_tokens == [40]
    assert len(first.swap_in) == sched.block_manager.num_host_hit_pages > 0
    assert all(isinstance(slot, tuple) for slot, _ in first.swap_in)
    n = len(first.swap_in)
    device = 40 // PS - n
    assert [p for _, p in first.swap_in] == table[device:device + n]   # right after the device hits
    sched.block_manager.check_invariants([])


def test_a_hash_collision_alone_never_serves_another_prompts_kv(monkeypatch):
    """Every parent hash collides (hash() -> 0): keys still compare the page's token ids, so a prompt with
    different tokens gets no hit from the device cache or the host tier; the same tokens still hit."""
    monkeypatch.setattr(bm_module, "hash", lambda _: 0, raising=False)
    cfg = _cfg(num_pages=24)
    sched = _with_tier(make_scheduler(cfg), 64)
    a = _tokens(10, 40)
    drive(sched, [(0.0, _req("a", a + [1]))])
    drive(sched, [(0.0, _req("x", _tokens(11, 40))), (0.0, _req("y", _tokens(12, 40)))])
    b = [t + 1000 for t in a]                               # same shape, other ids in every page
    outs = drive(sched, [(0.0, _req("b", b + [1]))])
    assert next(o for o in outs if o.req_ids).reqs[0].num_cached_tokens == 0
    outs = drive(sched, [(0.0, _req("c", a + [2]))])
    assert next(o for o in outs if o.req_ids).reqs[0].num_cached_tokens == 40


# ----------------------------------------------------------------------------------------------- routers
class _Inst:
    def __init__(self, name, cfg, role="colocated"):
        self.name, self.role = name, role
        self.scheduler = make_scheduler(cfg)
        self.inbox = []


def _warm(inst, tokens):
    """inst's prefix cache holds `tokens` (a finished request)."""
    drive(inst.scheduler, [(0.0, _req(f"warm{inst.name}", tokens + [3]))])


def test_prefix_affinity_prefers_the_cached_prefix_then_balances():
    insts = [_Inst(f"i{i}", _cfg()) for i in range(3)]
    prompt = _tokens(20, 48)
    _warm(insts[2], prompt)
    router = InstanceRouter("prefix_affinity", insts, balance_abs=2, balance_rel=1.5, cache_threshold=0.5)
    assert router.pick(_req("r", prompt + [9])) is insts[2]
    for i in range(4):                                       # insts[2] now far more loaded: balance wins
        insts[2].scheduler.add_request(_req(f"q{i}", _tokens(30 + i, 8)))
    assert router.pick(_req("r2", prompt + [9])) is insts[0]
    # Below the cache threshold: the most free pages, not the (short) match.
    router.balance_abs = 100
    assert router.pick(_req("r3", prompt[:8] + _tokens(40, 40))) is insts[0]


def test_kv_centric_weighs_queue_against_cached_prefix():
    insts = [_Inst(f"i{i}", _cfg()) for i in range(2)]
    prompt = _tokens(50, 64)
    _warm(insts[1], prompt)
    router = InstanceRouter("kv_centric", insts)
    req = _req("r", prompt + [9])
    assert router.pick(req) is insts[1]                      # 64 cached tokens: 1 to prefill vs 65
    assert predicted_ttft(router, insts[1], req) < predicted_ttft(router, insts[0], req)
    insts[1].scheduler.add_request(_req("long", _tokens(51, 90)))    # 90 queued tokens outweigh the hit
    assert router.pick(_req("r2", prompt + [9])) is insts[0]


def test_kv_centric_decode_by_load_and_free_kv():
    cfg = _cfg(policy="decode_only")
    insts = [_Inst(f"d{i}", cfg, role="decode") for i in range(2)]
    table = []
    insts[0].scheduler.block_manager.allocate(table, 40)     # d0 has 24 pages free
    router = InstanceRouter("kv_centric", insts)
    assert router.pick(_req("r", _tokens(60, 20))) is insts[1]


def test_routers_without_a_request_pick_least_loaded():
    insts = [_Inst(f"i{i}", _cfg()) for i in range(2)]
    insts[0].scheduler.add_request(_req("q", _tokens(70, 30)))
    for policy in ("prefix_affinity", "kv_centric"):
        assert InstanceRouter(policy, insts).pick() is insts[1]


# ----------------------------------------------------------------------------------------------- simulator
def _conversation(n_conv=6, turns=4, seed=0, gap=0.05):
    """Multi-turn conversations: turn k's prompt is turn k-1's plus a new message; arrivals interleave."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    prompts = {c: _tokens(100 + c, rng.randint(20, 60)) for c in range(n_conv)}
    for k in range(turns):
        for c in range(n_conv):
            t += gap
            prompts[c] = prompts[c] + _tokens(1000 * k + c, rng.randint(8, 24))
            reqs.append(_req(f"c{c}t{k}", list(prompts[c]), max_tokens=rng.randint(2, 6), t=t))
    return reqs


def _step_time(out):
    return 1e-3 + 1e-5 * out.total_tokens


def _hit_pages(host_blocks, reqs, num_pages=72):
    inst = SimInstance("replica0", make_scheduler(_cfg(num_pages=num_pages, max_model_len=256)), _step_time)
    if host_blocks:
        _with_tier(inst.scheduler, host_blocks, owner="replica0")
    simulate(reqs, [inst])
    bm = inst.scheduler.block_manager
    return bm.num_cache_hit_pages + bm.num_host_hit_pages


def test_hit_ratio_never_drops_with_more_host_capacity():
    """A fixed trace on one instance (LRU host tier): more host pages never lower the hits."""
    reqs = _conversation(n_conv=8, turns=5, seed=3)
    hits = [_hit_pages(h, [_req(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_time) for r in reqs])
            for h in (0, 4, 16, 64, 256)]
    assert hits == sorted(hits) and hits[-1] > hits[0], hits


def test_shared_pool_serves_a_prefix_offloaded_by_another_instance():
    cfg = _cfg(num_pages=24)
    insts = [SimInstance(f"replica{i}", make_scheduler(cfg), _step_time) for i in range(2)]
    tier = HostKVTier(64)
    for inst in insts:
        inst.scheduler.block_manager.host_tier, inst.scheduler.block_manager.tier_owner = tier, inst.name
    shared = _tokens(200, 40)
    order = iter([0, 0, 0, 0, 1])                           # a, x, y, z on replica0; b on replica1
    reqs = [_req("a", shared + [1], t=0.0), _req("x", _tokens(201, 40), t=1.0), _req("y", _tokens(202, 40), t=2.0),
            _req("z", _tokens(203, 40), t=2.5), _req("b", shared + [2], t=3.0)]
    simulate(reqs, insts, router=lambda req, instances: instances[next(order)])
    bm1 = insts[1].scheduler.block_manager
    assert bm1.num_remote_hit_pages > 0 and tier.num_remote_hits == bm1.num_remote_hit_pages


def test_host_loads_are_priced_at_the_host_link():
    from pdjax.scheduler.output import SchedulerOutput
    from pdjax.sim.hardware import get_hardware_spec
    st = HostLoadStepTime(_step_time, "i0", local_s=2.0, remote_s=5.0)
    out = SchedulerOutput(step=1, swap_in=[(("i0", 0), 3), (("i1", 4), 5), (7, 8)])
    assert st(out) == pytest.approx(_step_time(out) + 2.0 + 5.0 + 2.0)
    assert host_link_bandwidth(get_hardware_spec("h100-sxm")) == 2 * host_link_bandwidth(
        get_hardware_spec("a100-80gb-sxm"))


def test_prefill_cost_grows_with_uncached_tokens():
    from pdjax.config.model_specs import get_model_spec
    from pdjax.sim.hardware import get_hardware_spec
    from pdjax.sim.step_cost import make_step_time
    st = make_step_time(get_model_spec("llama-2-70b"), get_hardware_spec("a100-80gb-sxm"), 4)
    cost = prefill_cost(st, 2048)
    assert 0 == cost(0, 100) < cost(512, 0) < cost(4096, 0) < cost(16384, 0)
    assert cost(4096, 8192) > cost(4096, 0)                  # attention over a longer cached context


def test_partial_transfer_moves_only_what_the_decode_side_lacks():
    p_cfg = _cfg(policy="prefill_only", max_model_len=256, num_pages=128)
    d_cfg = _cfg(policy="decode_only", max_model_len=256, num_pages=128)
    reqs = _conversation(n_conv=3, turns=3, seed=5, gap=0.5)

    def run(partial):
        p = [SimInstance("prefill0", make_scheduler(p_cfg), _step_time, role="prefill")]
        d = [SimInstance("decode0", make_scheduler(d_cfg), _step_time, role="decode")]
        d[0].scheduler.reuse_prefix = partial
        fresh = [_req(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_time) for r in reqs]
        return simulate_disaggregated(fresh, p, d, lambda s, t, n: 1e-4 * n, partial_transfer=partial)
    full, part = run(False), run(True)
    moved_full = {t.request_id: t.num_tokens for t in full.transfers}
    moved_part = {t.request_id: t.num_tokens for t in part.transfers}
    assert all(moved_part[r] <= moved_full[r] for r in moved_full)
    later = [r for r in moved_full if not r.endswith("t0")]
    assert sum(moved_part[r] for r in later) < sum(moved_full[r] for r in later)
    assert all(r.finish_reason == "length" for r in part.requests)
    assert [len(r.token_times) for r in part.requests] == [len(r.token_times) for r in full.requests]


def test_attach_host_tiers_local_and_shared():
    dep = deployment_from_dict({"kind": "colocated", "colocated": {"num_instances": 3, "host_kv_blocks": 5},
                                "host_kv_pool": "shared", "host_kv_eviction": "lfu"})
    insts = [_Inst(f"replica{i}", _cfg()) for i in range(3)]
    (tier,) = attach_host_tiers({"colocated": insts}, dep, 100)
    assert tier.capacity == 15 and tier.eviction == "lfu"
    assert all(i.scheduler.block_manager.host_tier is tier for i in insts)
    dep = deployment_from_dict({"kind": "colocated", "colocated": {"num_instances": 2, "host_kv_gib": 1.0}})
    insts = [_Inst(f"replica{i}", _cfg()) for i in range(2)]
    tiers = attach_host_tiers({"colocated": insts}, dep, 2 ** 20)
    assert [t.capacity for t in tiers] == [1024, 1024] and tiers[0] is not tiers[1]


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("d, match", [
    ({"partial_transfer": True}, "partial_transfer=True with deployment.kind='colocated'"),
    ({"kind": "disaggregated", "router": "kv_centric", "mixed": {"num_instances": 1}}, "with a mixed pool"),
    ({"colocated": {"host_kv_blocks": 4, "host_kv_gib": 1.0}}, "give the host KV tier's size one way"),
    ({"host_kv_pool": "global"}, "host_kv_pool"),
    ({"host_kv_eviction": "fifo"}, "host_kv_eviction"),
    ({"router": "prefix"}, "router"),
])
def test_bad_kv_keys_fail_in_one_line(d, match):
    with pytest.raises(ValueError, match=match) as e:
        deployment_from_dict(d)
    assert "\n" not in str(e.value)


def test_host_tier_needs_prefix_caching():
    from pdjax.config.serving import serve_config_from_dict
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        serve_config_from_dict({"backend": "sim", "model": {"checkpoint": "tiny-llama"},
                                "workload": {"prompt_len": {"kind": "fixed", "value": 8},
                                             "output_len": {"kind": "fixed", "value": 4}, "num_requests": 2},
                                "deployment": {"colocated": {"host_kv_blocks": 8}}})
    assert DeploymentConfig().host_kv_pool == "local" and not DeploymentConfig().partial_transfer


def test_simulator_records_no_offload_copies_and_loses_nothing():
    """The simulator's block managers record no host-tier copies (BlockManager.record_offloads: it prices none):
    4 replicas behind kv_centric with small device pools and host tiers simulate the same records, evictions,
    offloads and hits as with the copies recorded."""
    from pdjax.config.files import config_file
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim.build import build_pending_requests, build_setup
    from pdjax.sim.run import simulate_setup
    chat10k = pathlib.Path(__file__).resolve().parents[1] / "configs" / "sim" / "chat10k.py"
    c = config_file(str(chat10k), "chat10k.py", "replicas-kv_centric")
    c.workload.num_requests = 150
    c.deployment.colocated.update(num_pages=800, host_kv_gib=0.0, host_kv_blocks=400)
    cfg = serve_config_from_dict(c.to_dict())

    def run(record):
        held = {}

        def adjust(instances):
            held.update(instances)
            if record:
                for inst in instances["colocated"]:
                    assert not inst.scheduler.block_manager.record_offloads
                    inst.scheduler.block_manager.record_offloads = True
        result = simulate_setup(build_setup(cfg), build_pending_requests(cfg), adjust_instances=adjust)
        bms = [inst.scheduler.block_manager for inst in held["colocated"]]
        counts = [(b.num_evictions, b.num_dead_evictions, b.num_host_hit_pages, b.host_tier.num_offloads,
                   b.host_tier.num_evictions, b.host_tier.num_hits) for b in bms]
        return result.requests, result.iterations, counts
    off, on = run(False), run(True)
    assert off == on
    assert all(evictions and offloads for evictions, _, _, offloads, _, _ in off[2])
