"""KV-cache-centric scheduling on the real engines (issue 30, item 7): tiny-llama with dummy weights on 2-3 CPU
devices (tests/conftest.py forces 8). The cache-aware routers, the host KV tier (device evictions offloaded through
the runner's swap path and loaded back on a prefix hit, local and shared pools) and partial transfer give the
greedy tokens of one big instance; and the engine's per-step schedules equal the simulator's with fake runners.

The requests come in waves (one `engine.run` per wave on the same engine: schedulers, prefix caches and host tiers
persist), so which pages are cached, evicted and offloaded when a wave starts is the same whatever the CPU's
speed: the host-tier hits are deterministic."""
import dataclasses

import numpy as np
import pytest

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import serve_config_from_dict

PAGE_SIZE, MAX_LEN, BUDGET, NUM_PAGES = 8, 64, 32, 12
MAX_TOKENS = 3


def _config(deployment):
    return {
        "model": {"checkpoint": "tiny-llama", "attention_impl": "reference"},
        "engine": {"mode": "offline", "progress": False, "compilation_cache": False, "token_buckets": [BUDGET],
                   "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE_SIZE]},
        "scheduler": {"policy": "sarathi", "token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN,
                      "page_size": PAGE_SIZE, "num_pages": NUM_PAGES, "enable_prefix_caching": True},
        "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 20},
                     "output_len": {"kind": "fixed", "value": 4}, "num_requests": 4, "vocab_size": 256},
        "deployment": deployment}


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def waves(model):
    """Three waves of prompts: a conversation's first turn, unrelated prompts that push its pages off the device,
    then its later turns (sharing 4 and 3 full pages) and a third turn (sharing 5)."""
    rng = np.random.default_rng(7)
    ids = lambda n: [int(t) for t in rng.integers(0, model[0].vocab_size, n)]   # noqa: E731
    base = ids(24)
    turn1 = base + ids(9)
    turn2 = turn1 + ids(7)
    return [{"a": turn1}, {"x": ids(45), "y": ids(45), "z": ids(45), "w": ids(45)},
            {"b": turn2, "c": base + ids(12)}, {"d": turn2 + ids(6)}]


@pytest.fixture(scope="module")
def reference(model, waves):
    """Greedy tokens of every prompt on one device, no prefix cache (the big instance)."""
    return _reference(model, waves)


def _reference(model, waves):
    from pdjax.runtime.batch import Buckets
    from pdjax.runtime.generate import generate
    from pdjax.runtime.runner import ModelRunner
    spec, params = model
    one = ModelRunner(spec, params, num_pages=48, page_size=PAGE_SIZE, attention_impl="reference",
                      buckets=Buckets(tokens=(BUDGET,), seqs=(8,), pages=(MAX_LEN // PAGE_SIZE,)),
                      max_model_len=MAX_LEN)
    prompts = {rid: p for wave in waves for rid, p in wave.items()}
    tokens, _ = generate(one, list(prompts.values()), MAX_TOKENS, chunk_size=16, token_budget=BUDGET)
    return dict(zip(prompts, tokens))


def _serve_waves(engine, waves):
    from pdjax.scheduler import Request
    out, transfers = {}, []
    for wave in waves:
        result = engine.run([Request(rid, p, SamplingParams(max_tokens=MAX_TOKENS), 0.0) for rid, p in wave.items()])
        out.update({rid: [int(t) for t in toks] for rid, toks in result.output_tokens.items()})
        transfers += getattr(result, "transfers", [])
    return out, transfers


def _host_hits(engine):
    return sum(i.scheduler.block_manager.num_host_hit_pages for i in engine.instances)


@pytest.mark.parametrize("router,pool,cost", [
    ("prefix_affinity", "local", "seconds"), ("kv_centric", "shared", "tokens"), ("kv_centric", "shared", "seconds"),
    pytest.param("kv_centric", "local", "tokens", marks=pytest.mark.slow),
    pytest.param("prefix_affinity", "shared", "seconds", marks=pytest.mark.slow)])
def test_colocated_cache_aware_routers_and_host_tier_match_one_instance(model, waves, reference, router, pool,
                                                                         cost):
    """kv_centric by tokens routes the same whatever the CPU's speed (the host-tier hits are deterministic); by
    measured seconds (the default) its picks follow this CPU's step times, and the tokens are one instance's
    whatever they are."""
    from pdjax.serving.build import build_engine
    spec, params = model
    dep = {"kind": "colocated", "router": router, "host_kv_pool": pool,
           "colocated": {"num_instances": 2, "host_kv_blocks": 24}}
    if router == "kv_centric":
        dep["router_cost"] = cost
    cfg = serve_config_from_dict(_config(dep))
    engine = build_engine(cfg, params=params, spec=spec)
    got, _ = _serve_waves(engine, waves)
    assert got == reference
    if cfg.deployment.router_cost == "tokens" or router == "prefix_affinity":
        assert _host_hits(engine) > 0, "the waves are meant to load pages back from the host tier"
    if router == "kv_centric" and cost == "seconds":     # seconds fitted from each replica's own timed steps
        from pdjax.scheduler.step_fit import MeasuredCost
        cost = engine.entry_router.cost
        assert isinstance(cost, MeasuredCost)
        fitted = cost.describe()["instances"]
        assert sorted(fitted) == ["replica0", "replica1"] and all(f["num_steps"] > 0 for f in fitted.values())
    for inst in engine.instances:
        bm = inst.scheduler.block_manager
        bm.check_invariants([])
        assert bm.num_free_pages == NUM_PAGES and not inst.scheduler.has_unfinished()


def test_disaggregated_partial_transfer_and_host_tier_match_one_instance(model, waves, reference):
    """1 prefill + 2 decode instances, kv_centric, host tiers everywhere, partial transfer: the later turns move
    only the pages their decode instance does not hold, and the tokens are one instance's."""
    from pdjax.serving.build import build_engine
    spec, params = model
    cfg = serve_config_from_dict(_config({
        "kind": "disaggregated", "router": "prefix_affinity", "partial_transfer": True,
        "prefill": {"num_instances": 1, "host_kv_blocks": 24}, "decode": {"num_instances": 2, "host_kv_blocks": 24}}))
    engine = build_engine(cfg, params=params, spec=spec)
    got, transfers = _serve_waves(engine, waves)
    assert got == reference
    by_id = {t.request_id: t for t in transfers}
    full_pages = lambda rid: -(-(len(dict(w for wave in waves for w in wave.items())[rid])) // PAGE_SIZE)  # noqa: E731
    assert by_id["a"].num_pages >= full_pages("a")               # nothing held yet: everything moves
    assert any(by_id[r].num_tokens < len(dict(w for wave in waves for w in wave.items())[r]) for r in "bd")
    for inst in engine.instances:
        assert inst.scheduler.block_manager.num_free_pages == NUM_PAGES and not inst.scheduler.has_unfinished()


# ------------------------------------------------------------------------------------- engine == simulator
TICK = 1.0 / 1024


def _dyadic(out) -> float:
    return TICK * (3 + out.total_tokens // 8 + len(out.swap_in))


class _Clock:
    def __init__(self):
        self.t = 0.0

    def clock(self):
        return self.t

    def sleep(self, d):
        self.t += d


class _FakeRunner:
    """ModelRunner's dispatch/collect on a fake device running steps back to back (tests/test_simulator.py's)."""
    pp = 1

    def __init__(self, clock, record):
        self.clock, self.record, self.device_free = clock, record, 0.0

    def dispatch(self, out, prev=None):
        if out.is_empty:
            return out, self.clock.t
        self.record(out, self.clock.t)
        start = max(self.clock.t, self.device_free)
        self.device_free = start + _dyadic(out)
        return out, self.device_free

    def collect(self, handle):
        from pdjax.sim.simulator import placeholder_sample
        out, end = handle
        self.clock.t = max(self.clock.t, end)
        return placeholder_sample(out)


def _snap(out, t):
    return (t, list(out.req_ids), list(out.num_computed_tokens), list(out.num_new_tokens),
            [list(p) for p in out.page_tables], list(out.swap_out), list(out.swap_in))


def _conversation_requests():
    """Five conversations of three turns, each request arriving after the last one finished (idle gaps: the
    engine's lock-step rounds and the simulator's independent instances then schedule alike)."""
    import random
    from pdjax.scheduler import Request
    rng = random.Random(4)
    reqs, t = [], 0.0
    prompts = {c: [rng.randrange(1, 200) for _ in range(60)] for c in range(5)}
    for k in range(3):
        for c in range(5):
            prompts[c] = prompts[c] + [rng.randrange(1, 200) for _ in range(16)]
            reqs.append(Request(f"c{c}t{k}", list(prompts[c]), SamplingParams(max_tokens=4), t))
            t += 1.0
    return reqs


def _tiered(sched, name, tier):
    sched.block_manager.host_tier, sched.block_manager.tier_owner = tier, name
    return sched


@pytest.mark.parametrize("router", ["prefix_affinity", "kv_centric"])
def test_cluster_engine_schedules_equal_the_simulator(router):
    """Two replicas with host tiers (shared pool) behind a cache-aware router: every instance's SchedulerOutputs
    (times, requests, pages, host copies) are the engine's and the simulator's alike."""
    from pdjax.scheduler import make_scheduler
    from pdjax.scheduler.kv_tier import HostKVTier
    from pdjax.scheduler.routing import InstanceRouter
    from pdjax.serving.cluster import ClusterEngine, Instance
    from pdjax.sim.simulator import SimInstance, simulate
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=256, page_size=16,
                          num_pages=16, enable_prefix_caching=True, watermark=0.0)
    options = {"cost": lambda new, cached: 1e-3 * new + 1e-5 * cached, "fetch": lambda local, remote: 1e-4 * remote}
    engine_log, sim_log = {}, {}
    clock = _Clock()
    tier = HostKVTier(40)
    insts = [Instance(f"replica{i}", "colocated",
                      _FakeRunner(clock, lambda out, t, n=f"replica{i}": engine_log.setdefault(n, []).append(
                          _snap(out, t))), _tiered(make_scheduler(cfg), f"replica{i}", tier)) for i in range(2)]
    engine = ClusterEngine(insts, router=router, clock=clock.clock, sleep=clock.sleep, router_options=options)
    engine.run(_conversation_requests())
    sim_tier = HostKVTier(40)
    sims = [SimInstance(f"replica{i}", _tiered(make_scheduler(cfg), f"replica{i}", sim_tier), _dyadic)
            for i in range(2)]
    simulate(_conversation_requests(), sims, InstanceRouter(router, sims, **options),
             on_schedule=lambda inst, out, t: sim_log.setdefault(inst.name, []).append(_snap(out, t)))
    assert sim_log == engine_log
    assert sim_tier.num_hits == tier.num_hits > 0


def test_colocated_engine_with_host_tier_equals_the_simulator_with_decode_runs():
    """One instance with a host tier: the engine's request records equal the simulator's, decode runs on."""
    from pdjax.scheduler import make_scheduler
    from pdjax.scheduler.kv_tier import HostKVTier
    from pdjax.serving.engine import ColocatedEngine
    from pdjax.sim.simulator import SimInstance, simulate
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=256, page_size=16,
                          num_pages=16, enable_prefix_caching=True, watermark=0.0)
    clock = _Clock()
    log = []
    sched = _tiered(make_scheduler(cfg), "replica0", HostKVTier(40))
    result = ColocatedEngine(_FakeRunner(clock, lambda out, t: log.append(_snap(out, t))), sched, clock=clock.clock,
                             sleep=clock.sleep).run(_conversation_requests())
    sim_sched = _tiered(make_scheduler(cfg), "replica0", HostKVTier(40))
    sim = simulate(_conversation_requests(), [SimInstance("replica0", sim_sched, _dyadic)])
    assert [r.__dict__ for r in sim.requests] == [r.__dict__ for r in result.requests]
    assert sim_sched.block_manager.num_host_hit_pages == sched.block_manager.num_host_hit_pages > 0
    assert any(s[6] for s in log)          # some step loaded host pages


def test_disaggregated_engine_routers_get_the_deployments_options():
    """kv_centric and prefix_affinity on a disaggregated ClusterEngine: the deployment's thresholds reach both
    routers and kv_centric keeps a working cost (tokens unless one is given): an arrival goes to the prefill
    instance that holds its prefix."""
    import random
    from pdjax.config.deployment import deployment_from_dict
    from pdjax.scheduler import Request, make_scheduler
    from pdjax.scheduler.fake_runner import drive
    from pdjax.serving.cluster import ClusterEngine, Instance
    from pdjax.serving.kv_tier import router_options
    rng = random.Random(1)
    cfg = SchedulerConfig(policy="prefill_only", token_budget=64, max_num_seqs=8, max_model_len=256, page_size=16,
                          num_pages=64, enable_prefix_caching=True)
    prompt = [rng.randrange(1, 200) for _ in range(80)]
    for router in ("kv_centric", "prefix_affinity"):
        dep = deployment_from_dict({"kind": "disaggregated", "router": router, "router_balance_abs": 7})
        prefill = [Instance(f"prefill{i}", "prefill", None, make_scheduler(cfg)) for i in range(2)]
        decode = [Instance("decode0", "decode", None, make_scheduler(dataclasses.replace(cfg, policy="decode_only")))]
        drive(prefill[1].scheduler, [(0.0, Request("warm", prompt + [1], SamplingParams(max_tokens=1), 0.0))])
        engine = ClusterEngine(prefill + decode, router=router, router_options=router_options(dep))
        assert engine.entry_router.balance_abs == engine.decode_router.balance_abs == 7
        req = Request("r", prompt + [2], SamplingParams(max_tokens=2), 0.0)
        assert engine.entry_router.pick(req) is prefill[1], router


def test_shared_pool_replicated_pages_serve_one_instances_tokens(model):
    """host_kv_replicate_after=1, round_robin over 2 replicas: replica0 offloads a conversation's pages, replica1
    fetches them remotely (and gets copies of them in its part of the shared pool: device -> host copies through
    the runner's swap path), loses them from its device, then serves the next turn from its copies: the tokens are
    one big instance's."""
    from pdjax.serving.build import build_engine
    spec, params = model
    rng = np.random.default_rng(11)
    ids = lambda n: [int(t) for t in rng.integers(0, spec.vocab_size, n)]   # noqa: E731
    turn1 = ids(33)
    turn2 = turn1 + ids(7)
    filler = lambda tag: {f"{tag}{i}": ids(45) for i in range(4)}          # noqa: E731
    waves = [{"a": turn1}, filler("x"), {"b": turn2, "p": ids(20)}, filler("y"), {"e": turn2 + ids(6)}]
    dep = {"kind": "colocated", "router": "round_robin", "host_kv_pool": "shared", "host_kv_replicate_after": 1,
           "colocated": {"num_instances": 2, "host_kv_blocks": 24}}
    engine = build_engine(serve_config_from_dict(_config(dep)), params=params, spec=spec)
    got, _ = _serve_waves(engine, waves)
    assert got == {rid: toks for wave in waves for rid, toks in _reference(model, [wave]).items()}
    tier = engine.instances[0].scheduler.block_manager.host_tier
    assert tier.num_replicas > 0 and tier.num_copy_hits > 0, (tier.num_replicas, tier.num_copy_hits)
