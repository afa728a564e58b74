"""Decode runs (pdjax.scheduler.runs, the simulator's bulk steps) change nothing: the same simulation with
decode_runs=False (every step through schedule() and update()) is the reference, compared record for record
(requests, iterations, pipeline accounting, scheduler counters and page pools), across policies and the rules that
shape a run (chunk caps, tiles, the prefill guard, full running lists, page pressure and preemption, several
instances). Also: the decode-only and chunked step costs equal the cost model's on random batches."""
from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler import runs as runs_module
from pdjax.scheduler.output import SchedulerOutput
from pdjax.scheduler.routing import InstanceRouter
from pdjax.config.deployment import InstanceGroupConfig, instance_scheduler_config
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time, stage_times
from pdjax.sim.disagg import DisaggSimInstance, simulate_disaggregated
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.simulator import SimInstance, simulate
from pdjax.sim.step_cost import CachedIterationTime, CachedStageTimes, make_step_time
from pdjax.sim.step_time import StepTimeBase

MODEL, HARDWARE = get_model_spec("mistral-7b"), get_hardware_spec("a100-80gb-sxm")

CONFIGS = {
    "sarathi": dict(policy="sarathi", token_budget=256, max_num_seqs=16),
    "sarathi_guard_cap_tile": dict(policy="sarathi", token_budget=256, max_num_seqs=16, min_prefill_tokens=32,
                                   long_prefill_token_threshold=96, tile_size=16),
    "sarathi_dynamic": dict(policy="sarathi", token_budget=256, max_num_seqs=16, dynamic_chunking=True,
                            dynamic_chunk_ref_context=256, dynamic_chunk_min_tokens=32),
    "sarathi_full": dict(policy="sarathi", token_budget=512, max_num_seqs=4),
    "sarathi_tight_memory": dict(policy="sarathi", token_budget=128, max_num_seqs=16, num_pages=72, watermark=0.0),
    "sarathi_swap": dict(policy="sarathi", token_budget=128, max_num_seqs=16, num_pages=72, watermark=0.0,
                         preemption_mode="swap", num_host_pages=96),
    "vllm_v0": dict(policy="vllm_v0", token_budget=1024, max_num_seqs=8),
    "vllm_v0_tight_memory": dict(policy="vllm_v0", token_budget=1024, max_num_seqs=16, num_pages=72, watermark=0.0),
    "orca": dict(policy="orca", token_budget=1024, max_num_seqs=6),
    "decode_first": dict(policy="decode_first", token_budget=1024, max_num_seqs=6),
    "chunked_only": dict(policy="chunked_only", token_budget=128, max_num_seqs=8),
    "chunked_prefill_first": dict(policy="chunked_prefill_first", token_budget=128, max_num_seqs=8),
    "vllm_v1": dict(policy="vllm_v1", token_budget=256, max_num_seqs=8, long_prefill_token_threshold=64,
                    min_prefill_tokens=16),
    "vllm_v1_full": dict(policy="vllm_v1", token_budget=512, max_num_seqs=3),
    "prefix_caching": dict(policy="sarathi", token_budget=256, max_num_seqs=16, enable_prefix_caching=True),
}


PREEMPTING = ("sarathi_tight_memory", "sarathi_swap", "vllm_v0_tight_memory")


def make_requests(n: int, seed: int, rate: float = 20.0):
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 400))]
        reqs.append(Request(f"r{i:03d}", prompt, SamplingParams(max_tokens=rng.randint(1, 120)), t))
    return reqs


def run(cfg: SchedulerConfig, decode_runs: bool, instances: int = 1, seed: int = 0, router: str = "round_robin",
        pp: int = 1, max_in_flight=None, requests=None):
    insts = [SimInstance(f"i{k}", make_scheduler(cfg), make_step_time(MODEL, HARDWARE, 1, pp,
                                                                       CostParams(per_seq_overhead_s=2e-5)),
                         max_in_flight=max_in_flight)
             for k in range(instances)]
    result = simulate(make_requests(60, seed) if requests is None else requests, insts,
                      InstanceRouter(router, insts, role="colocated"), decode_runs=decode_runs)
    state = [(i.scheduler.step, i.scheduler.num_preemptions, i.scheduler.num_swaps,
              list(i.scheduler.block_manager._free), list(i.scheduler.block_manager.ref_count)) for i in insts]
    return result, state


def count_run_steps(monkeypatch) -> list:
    """Patch DecodeRun.apply to count the steps applied in bulk."""
    applied = [0]
    apply = runs_module.DecodeRun.apply_range

    def counting(self, a, starts, ends, schedules=1, scheduled=False):
        applied[0] += len(starts)
        return apply(self, a, starts, ends, schedules, scheduled)

    monkeypatch.setattr(runs_module.DecodeRun, "apply_range", counting)
    return applied


def count_kv_admissions(monkeypatch) -> list:
    """Patch DecodeRun._admit_kv to list the handed-off requests runs admit."""
    admitted = []
    admit = runs_module.DecodeRun._admit_kv

    def counting(self, now):
        admitted.extend(req.request_id for req, _ in self.admitted)
        return admit(self, now)

    monkeypatch.setattr(runs_module.DecodeRun, "_admit_kv", counting)
    return admitted


def assert_same(reference, got):
    (ref, ref_state), (res, state) = reference, got
    assert [r.__dict__ for r in res.requests] == [r.__dict__ for r in ref.requests]
    assert [(i.step, i.start_time, i.end_time, i.num_prefill_tokens, i.num_decode_tokens, i.num_seqs, i.instance)
            for i in res.iterations] == \
        [(i.step, i.start_time, i.end_time, i.num_prefill_tokens, i.num_decode_tokens, i.num_seqs, i.instance)
         for i in ref.iterations]
    assert res.pipeline == ref.pipeline
    assert res.duration_s == ref.duration_s
    assert state == ref_state


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_runs_change_nothing(name, monkeypatch):
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, **{"num_pages": 512, **CONFIGS[name]})
    reference = run(cfg, decode_runs=False)
    applied = count_run_steps(monkeypatch)
    got = run(cfg, decode_runs=True)
    assert_same(reference, got)
    # under page pressure requests wait for pages (or sit swapped) most of the time: fewer runs
    share = 20 if name in PREEMPTING else 3
    assert applied[0] > len(got[0].iterations) // share, "the case is meant to run many steps in bulk"
    if name in PREEMPTING:
        assert sum(r.num_preemptions for r in got[0].requests) > 0, "the case is meant to preempt"


@pytest.mark.parametrize("name", ["sarathi", "sarathi_tight_memory", "sarathi_dynamic"])
def test_continued_reading_equals_a_fresh_one(name, monkeypatch):
    """Scheduler.decode_run reads the running requests from the run applied last when nothing touched the
    scheduler since: continued_run for its decoders, joined with a fresh reading of the requests after them (a
    run with prefills: its prefills, some now decoders). Every such reading equals _run_parts' of all of them."""
    from pdjax.scheduler import base
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, **{"num_pages": 512, **CONFIGS[name]})
    kinds = {"after decodes": 0, "after prefills": 0}
    decode_run = base.Scheduler.decode_run

    def checked(self, max_steps):
        after, running = self._run_after, list(self.running)
        continued = after is not None and after[:2] == (self.step, self._applied_step) and \
            running[:len(after[2])] == after[2]
        fresh = self._run_parts(running, max_steps) if continued else None
        run = decode_run(self, max_steps)
        if continued and run is not None:
            assert (run.decoders, run.prefills, run._crossings, run._lefts, run.total, run.limit) == \
                (fresh[0], fresh[1], fresh[2], fresh[3], fresh[4], min(fresh[5], max_steps))
            kinds["after prefills" if len(running) > len(after[2]) else "after decodes"] += 1
        return run

    monkeypatch.setattr(base.Scheduler, "decode_run", checked)
    run(cfg, decode_runs=True, instances=2, router="least_loaded")
    assert min(kinds.values()) > 0, f"the case is meant to continue after both kinds of run: {kinds}"


@pytest.mark.parametrize("pp,max_in_flight", [(2, None), (2, 1), (1, 2)])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_runs_on_stages_change_nothing(name, pp, max_in_flight, monkeypatch):
    """Pipeline stages (pp batches in flight, or one) and batches in flight on one stage: the decode runs of
    decoders only, one batch at a time through the stages (Simulation.decode_run, plan_stage_clock), change
    nothing either: scheduler counters (the empty schedule() after each step included), stage accounting, records."""
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, **{"num_pages": 512, **CONFIGS[name]})
    reference = run(cfg, decode_runs=False, pp=pp, max_in_flight=max_in_flight)
    applied = count_run_steps(monkeypatch)
    got = run(cfg, decode_runs=True, pp=pp, max_in_flight=max_in_flight)
    assert_same(reference, got)
    if name not in PREEMPTING:
        assert applied[0] > 0, "the case is meant to run steps in bulk"


def chat_requests(n: int, seed: int, rate: float):
    """Chat-like requests: prompts of 64-1500 tokens (several chunks each at a 256-token budget), 8-160 outputs."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(64, 1500))]
        reqs.append(Request(f"c{i:03d}", prompt, SamplingParams(max_tokens=rng.randint(8, 160)), t))
    return reqs


# Pair runs: (config, arrival rate, least share of the iterations in bulk, least prefill chunks in bulk). Long
# prompts at a 256-token budget: several chunks each, beside the decoders; tight memory preempts; full running
# lists (sarathi_full at a high rate) keep requests waiting beside the chunks.
PAIR_CASES = {
    "sarathi": (dict(policy="sarathi", token_budget=256, max_num_seqs=32), 10.0, 3, 20),
    "sarathi_guard_cap_tile": (dict(policy="sarathi", token_budget=256, max_num_seqs=32, min_prefill_tokens=32,
                                    long_prefill_token_threshold=96, tile_size=16), 10.0, 3, 50),
    "sarathi_dynamic": (dict(policy="sarathi", token_budget=256, max_num_seqs=32, dynamic_chunking=True,
                             dynamic_chunk_ref_context=256, dynamic_chunk_min_tokens=32), 10.0, 3, 50),
    "sarathi_full": (dict(policy="sarathi", token_budget=512, max_num_seqs=6), 40.0, 3, 10),
    "sarathi_tight_memory": (dict(policy="sarathi", token_budget=256, max_num_seqs=32, num_pages=300,
                                  watermark=0.0), 10.0, 20, 5),
    "vllm_v0": (dict(policy="vllm_v0", token_budget=2048, max_num_seqs=16), 10.0, 3, 0),
    "decode_first": (dict(policy="decode_first", token_budget=2048, max_num_seqs=8), 10.0, 3, 0),
}


@pytest.mark.parametrize("pp,max_in_flight", [(2, None), (1, 2)])
@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_pair_runs_change_nothing(name, pp, max_in_flight, monkeypatch):
    """Two batches in flight, two groups taking turns (Simulation.pair_run, pdjax.scheduler.runs.PairRun), with
    new prompts' chunks beside the decoders: bulk half-steps leave the records, pipeline accounting, scheduler
    counters and page pool of one schedule() / update() at a time."""
    params, rate, share, least_chunks = PAIR_CASES[name]
    cfg = SchedulerConfig(max_model_len=2048, page_size=16, **{"num_pages": 1024, **params})
    reference = run(cfg, False, pp=pp, max_in_flight=max_in_flight, requests=chat_requests(40, 1, rate))
    applied = {"half_steps": 0, "chunks": 0}
    apply = runs_module.PairRun.apply

    def counting(self, times, half_steps):
        applied["half_steps"] += half_steps
        applied["chunks"] += sum(len(c) for c in self.chunks[:half_steps])
        return apply(self, times, half_steps)

    monkeypatch.setattr(runs_module.PairRun, "apply", counting)
    got = run(cfg, True, pp=pp, max_in_flight=max_in_flight, requests=chat_requests(40, 1, rate))
    assert_same(reference, got)
    assert applied["half_steps"] > len(got[0].iterations) // share, "the case is meant to run pair runs"
    assert applied["chunks"] >= least_chunks, "the case is meant to carry prefill chunks in pair runs"
    if name == "sarathi_tight_memory":
        assert sum(r.num_preemptions for r in got[0].requests) > 0, "the case is meant to preempt"


@pytest.mark.parametrize("router", ["round_robin", "least_loaded"])
def test_decode_runs_with_several_instances(router, monkeypatch):
    cfg = SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=16, max_model_len=1024, page_size=16,
                          num_pages=512)
    reference = run(cfg, decode_runs=False, instances=3, seed=3, router=router)
    applied = count_run_steps(monkeypatch)
    got = run(cfg, decode_runs=True, instances=3, seed=3, router=router)
    assert_same(reference, got)
    assert applied[0] > 0


# Several colocated replicas: each one's runs go up to the next arrival, past the other replicas' steps (only the
# router reads another instance's state, at an arrival); the records are put in completion order at the end.
# "paired": identical requests in pairs, round robin: two replicas step in lockstep, their steps end at the same
# times (ties go by instance index).
@pytest.mark.parametrize("name,instances,router,seed,pp,max_in_flight,share", [
    ("sarathi", 4, "least_loaded", 0, 1, None, 2), ("sarathi", 2, "round_robin", 1, 1, None, 2),
    ("sarathi_tight_memory", 3, "least_loaded", 2, 1, None, 4), ("vllm_v0", 3, "round_robin", 4, 1, None, 2),
    ("decode_first", 2, "least_loaded", 5, 1, None, 2), ("sarathi", 3, "least_loaded", 6, 2, 1, 4),
    ("sarathi", 2, "round_robin", 7, 2, None, 100), ("paired", 2, "round_robin", 8, 1, None, 2),
    ("sarathi", 4, "kv_centric", 9, 1, None, 2), ("vllm_v1", 3, "prefix_affinity", 10, 1, None, 4),
    ("sarathi_tight_memory", 4, "kv_centric", 11, 1, None, 4)])
def test_decode_runs_of_replicas_pass_the_other_replicas_steps(name, instances, router, seed, pp, max_in_flight,
                                                               share, monkeypatch):
    cfg = SchedulerConfig(max_model_len=1024, page_size=16,
                          **{"num_pages": 512, **CONFIGS["sarathi" if name == "paired" else name]})

    def requests():
        return paired_requests(40, seed) if name == "paired" else make_requests(80, seed, rate=40.0)

    reference = run(cfg, False, instances=instances, seed=seed, router=router, pp=pp, max_in_flight=max_in_flight,
                    requests=requests())
    applied = count_run_steps(monkeypatch)
    got = run(cfg, True, instances=instances, seed=seed, router=router, pp=pp, max_in_flight=max_in_flight,
              requests=requests())
    assert_same(reference, got)
    steps = len(got[0].iterations)
    assert applied[0] > steps // share, f"the case is meant to run steps in runs ({applied[0]} of {steps})"
    if name == "paired":
        ends = [it.end_time for it in got[0].iterations]
        assert len(set(ends)) < len(ends) * 0.75, "the case is meant to end steps of both replicas at once"


def paired_requests(n: int, seed: int):
    """Requests in identical pairs (same arrival, prompt length and output length): with two prefill and two
    decode instances, round robin, the two decode instances step in lockstep and wake at the same times."""
    reqs = []
    for r in make_requests(n, seed, rate=30.0):
        for k in range(2):
            reqs.append(Request(f"{r.request_id}-{k}", list(r.prompt_token_ids),
                                SamplingParams(max_tokens=r.max_tokens), r.arrival_time))
    return reqs


def run_disaggregated(decode_runs: bool, num_prefill: int, num_decode: int, decode_pages: int, router: str,
                      seed: int, paired: bool = False, caching: bool = False, tier: int = 0):
    base = SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=16, max_model_len=1024, page_size=16,
                           num_pages=512, enable_prefix_caching=caching)
    groups = {"prefill": InstanceGroupConfig(), "decode": InstanceGroupConfig(num_pages=decode_pages)}
    made = {role: [DisaggSimInstance(f"{role}{i}", role, make_scheduler(instance_scheduler_config(base, group, role)),
                                     make_step_time(MODEL, HARDWARE, 1, 1, CostParams(per_seq_overhead_s=2e-5)))
                   for i in range(n)]
            for role, n, group in (("prefill", num_prefill, groups["prefill"]),
                                   ("decode", num_decode, groups["decode"]))}
    reqs = paired_requests(40, seed) if paired else make_requests(80, seed, rate=30.0)
    if tier:     # one host KV tier shared by every instance
        from pdjax.scheduler.kv_tier import HostKVTier
        shared = HostKVTier(tier)
        for inst in made["prefill"] + made["decode"]:
            inst.scheduler.block_manager.host_tier, inst.scheduler.block_manager.tier_owner = shared, inst.name
    result = simulate_disaggregated(reqs, made["prefill"], made["decode"],
                                    lambda src, dst, n: 1e-4 + 2e-6 * n, router=router, decode_runs=decode_runs)
    state = [(i.scheduler.step, i.num_steps, list(i.scheduler.block_manager._free),
              list(i.scheduler.block_manager.ref_count)) for i in made["prefill"] + made["decode"]]
    if caching:
        state.append(cache_state(made["prefill"] + made["decode"], reqs))
    return result, state


# share: the run steps are at least 1/share of the decode steps. Several decode instances bound each other's
# runs (a run ends before any other instance's step does); 72 decode pages: handoffs wait for pages
# (backpressure), and the KV landings that admit them cut the runs short.
@pytest.mark.parametrize("num_prefill,num_decode,decode_pages,router,share", [
    (1, 1, 512, "round_robin", 4), (2, 2, 512, "least_loaded", 100), (1, 2, 512, "round_robin", 100),
    (1, 1, 72, "round_robin", 100)])
def test_decode_runs_in_the_disaggregated_loop_change_nothing(num_prefill, num_decode, decode_pages, router, share,
                                                              monkeypatch):
    args = (num_prefill, num_decode, decode_pages, router, num_prefill + 7 * num_decode)
    (ref, ref_state) = run_disaggregated(False, *args)
    applied = count_run_steps(monkeypatch)
    (res, state) = run_disaggregated(True, *args)
    assert_same((ref, ref_state), (res, state))
    assert [t.__dict__ for t in res.transfers] == [t.__dict__ for t in ref.transfers]
    decode_steps = sum(1 for i in res.iterations if i.instance.startswith("decode"))
    assert applied[0] > decode_steps // share, "the case is meant to run decode steps in bulk"


@pytest.mark.parametrize("decode_pages", [512, 72])
def test_decode_runs_admit_landed_kv(decode_pages, monkeypatch):
    """A decode instance's run takes the step that admits handed-off requests whose KV landed (decode_only's
    admission after the decode pass: pages, a sequence slot, the budget), and the landed ones that step leaves
    waiting (72 pages: backpressure) stay waiting through the run: the same records as one step at a time."""
    args = (1, 1, decode_pages, "round_robin", 11)
    reference = run_disaggregated(False, *args)
    admitted = count_kv_admissions(monkeypatch)
    got = run_disaggregated(True, *args)
    assert_same(reference, got)
    assert len(admitted) > len(got[0].requests) // 2, "the case is meant to admit landed KV in decode runs"


@pytest.mark.parametrize("num_prefill,num_decode,decode_pages,router,crosses", [
    (1, 2, 512, "round_robin", True), (2, 2, 512, "least_loaded", False)])
def test_decode_runs_across_the_next_event(num_prefill, num_decode, decode_pages, router, crosses, monkeypatch):
    """A decode instance's run may end with the step across the next event (simulator.RunStep: applied at once,
    recorded at its end) only where nothing reads its state meanwhile (round robin; the least-loaded router reads
    its load), and the records stay those of one step at a time."""
    from pdjax.sim import simulator
    made = []

    class Counting(simulator.RunStep):
        __slots__ = ()

        def __init__(self, record):
            super().__init__(record)
            made.append(record)

    args = (num_prefill, num_decode, decode_pages, router, 3)
    reference = run_disaggregated(False, *args)
    monkeypatch.setattr(simulator, "RunStep", Counting)
    got = run_disaggregated(True, *args)
    assert_same(reference, got)
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    assert bool(made) == crosses


@pytest.mark.parametrize("seed", [13, 3])
def test_decode_runs_pass_arrivals_while_every_other_instance_is_busy(seed, monkeypatch):
    """A decode instance whose state nothing reads between its steps (round robin over two decode instances) plans
    its run past the arrivals that come while every other instance is blocked on a step (they only queue: no
    step, hence no handoff or landing, can start before the next step end): the same records as one step at a
    time."""
    from pdjax.sim import simulator
    passed = []
    cross_limit = simulator.Simulation.cross_limit

    def counting(self, idx):
        limit = cross_limit(self, idx)
        passed.append(limit > self.next_event_time())
        return limit

    args = (1, 2, 512, "round_robin", seed)
    reference = run_disaggregated(False, *args)
    monkeypatch.setattr(simulator.Simulation, "cross_limit", counting)
    got = run_disaggregated(True, *args)
    assert_same(reference, got)
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    assert sum(passed) >= 5, "the case is meant to plan runs past arrivals"


@pytest.mark.parametrize("num_prefill,decode_pages,seed", [(1, 512, 3), (1, 72, 3), (1, 512, 13), (2, 512, 5)])
def test_pending_decode_runs_pass_other_events(num_prefill, decode_pages, seed, monkeypatch):
    """One decode instance: its runs go on past the prefill instances' step ends (handoffs) and the arrivals,
    up to the next KV landing (simulator.PendingRun, applied when its last step ends; a landing whose transfer
    starts meanwhile drops the steps from the one that would admit it); its records are merged into the
    iteration list in completion order: the same records, transfers and page pools as one step at a time."""
    from pdjax.sim import simulator
    spans, cuts = [], []
    start_pending, truncate = simulator.Simulation.start_pending_run, simulator.Simulation.truncate_pending

    def starting(self, idx, t):
        end = start_pending(self, idx, t)
        if end is not None:
            spans.append((self, t, end))
        return end

    def cutting(self, idx, landing):
        before = len(self.instances[idx].in_flight.starts)
        truncate(self, idx, landing)
        cuts.append(before - len(self.instances[idx].in_flight.starts))

    args = (num_prefill, 1, decode_pages, "round_robin", seed)
    reference = run_disaggregated(False, *args)
    monkeypatch.setattr(simulator.Simulation, "start_pending_run", starting)
    monkeypatch.setattr(simulator.Simulation, "truncate_pending", cutting)
    got = run_disaggregated(True, *args)
    assert_same(reference, got)
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    other_ends = sorted(i.end_time for i in got[0].iterations if i.instance.startswith("prefill"))
    arrivals = sorted(r.arrival_time for r in got[0].requests)
    passed = sum(1 for _, t, end in spans
                 if any(t < e < end for e in other_ends) or any(t < a < end for a in arrivals))
    assert passed >= 5, "the case is meant to run decode steps past other instances' steps and arrivals"
    assert sum(1 for c in cuts if c > 0) >= 3, "the case is meant to cut pending runs at KV landings"


class DyadicStepTime(StepTimeBase):
    """Constant step times that are exact binary fractions: every step end falls on a grid of 1/16 s, so the
    decode instance's steps end exactly when prefill steps do and KV lands exactly when decode steps start."""
    decode_only_exact = True

    def __init__(self, decode_s: float, prefill_s: float):
        self.decode_s, self.prefill_s = decode_s, prefill_s

    def __call__(self, out, ctx=None) -> float:
        return self.prefill_s if out.num_prefill_tokens else self.decode_s

    def decode_fn(self, count: int):
        return lambda total: self.decode_s

    def composition(self, count, total_context, chunks) -> float:
        return self.prefill_s

    def decode_stages_fn(self, count: int):
        return lambda total: ((self.decode_s,), ())


def run_dyadic(decode_runs: bool, num_prefill: int, seed: int, transfer_s: float, decode_s: float):
    base = SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=16, max_model_len=1024, page_size=16,
                           num_pages=512)
    made = {role: [DisaggSimInstance(f"{role}{i}", role,
                                     make_scheduler(instance_scheduler_config(base, InstanceGroupConfig(), role)),
                                     DyadicStepTime(decode_s, 0.25 if i % 2 else 0.375))
                   for i in range(n)] for role, n in (("prefill", num_prefill), ("decode", 1))}
    reqs = make_requests(60, seed, rate=6.0)
    for r in reqs:
        r.arrival_time = round(r.arrival_time * 16) / 16
    result = simulate_disaggregated(reqs, made["prefill"], made["decode"], lambda src, dst, n: transfer_s,
                                    decode_runs=decode_runs)
    state = [(i.scheduler.step, i.num_steps, list(i.scheduler.block_manager._free),
              list(i.scheduler.block_manager.ref_count)) for i in made["prefill"] + made["decode"]]
    return result, state


@pytest.mark.parametrize("num_prefill,seed,transfer_s,decode_s", [
    (1, 0, 0.125, 0.125), (2, 1, 0.0625, 0.125), (2, 2, 0.0, 0.125), (1, 3, 0.25, 0.125), (1, 4, 0.125, 0.5),
    (2, 6, 0.125, 0.5), (1, 14, 0.125, 0.5), (1, 16, 0.125, 0.625)])
def test_pending_decode_runs_keep_the_order_of_ties(num_prefill, seed, transfer_s, decode_s):
    """Step ends on a 1/16 s grid: decode steps end exactly with prefill steps (the records keep the completion
    heap's order: the earlier dispatch first; decode steps shorter or longer than prefill steps put them after or
    before) and KV lands exactly at a decode step's start (that step admits it): the same records as one step at
    a time."""
    reference = run_dyadic(False, num_prefill, seed, transfer_s, decode_s)
    got = run_dyadic(True, num_prefill, seed, transfer_s, decode_s)
    assert_same(reference, got)
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    its = got[0].iterations
    decode_ends = {i.end_time for i in its if i.instance == "decode0"}
    ties = sum(1 for i in its if i.instance.startswith("prefill") and i.end_time in decode_ends)
    assert ties >= 5, "the case is meant to have decode and prefill steps ending at the same time"


def test_decode_runs_wait_for_every_instance_woken_at_the_same_time(monkeypatch):
    # Two decode instances in lockstep: a run of the first must not start while the second has yet to dispatch
    # its step at the same time (its end would fall inside the run).
    args = (2, 2, 512, "round_robin", 5)
    reference = run_disaggregated(False, *args, paired=True)
    got = run_disaggregated(True, *args, paired=True)
    assert_same(reference, got)
    ends = {i.end_time for i in got[0].iterations if i.instance == "decode0"}
    assert len(ends & {i.end_time for i in got[0].iterations if i.instance == "decode1"}) >= 20, "meant as lockstep"


def test_decode_runs_under_max_iterations():
    cfg = SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=16, max_model_len=1024, page_size=16,
                          num_pages=512)
    inst = SimInstance("a", make_scheduler(cfg), make_step_time(MODEL, HARDWARE))
    with pytest.raises(RuntimeError, match="max_iterations=50"):
        simulate(make_requests(20, 1), [inst], max_iterations=50)


@pytest.mark.parametrize("model,hw,tp,launch", [("mistral-7b", "a100-80gb-sxm", 1, 0.0),
                                                ("yi-34b", "a100-80gb-pcie", 2, 4e-6),
                                                ("llama-2-70b", "h100-sxm", 4, 2e-6)])
def test_decode_and_chunked_costs_equal_the_cost_model(model, hw, tp, launch):
    spec, hardware = get_model_spec(model), get_hardware_spec(hw)
    params = CostParams(per_seq_overhead_s=3e-5, launch_overhead_s=launch, attn_seq_head_s=1e-8,
                        attn_decode_fixed_s=5e-6, attn_prefill_fixed_s=7e-6)
    cached = CachedIterationTime(spec, hardware, tp, params)
    rng = random.Random(tp)
    for _ in range(400):
        count = rng.randint(0, 64)
        contexts = [rng.randint(0, 8000) for _ in range(count)]
        chunks = [(rng.randint(1, 512), rng.randint(0, 4000)) for _ in range(rng.choice([0, 0, 1, 2]))]
        batch = BatchComposition(tuple(chunks), tuple((1, c) for c in contexts))
        if batch.num_tokens == 0:
            continue
        reference = iteration_time(batch, spec, hardware, tp, 1, params).total
        assert cached.chunked(chunks, count, sum(contexts)) == reference
        if not chunks:
            assert cached.decode_fn(count)(sum(contexts)) == reference
            assert cached.decode_only(count, sum(contexts)) == reference


@pytest.mark.parametrize("model,hw,tp,pp,launch", [("llama-2-70b", "a100-80gb-sxm", 4, 2, 0.0),
                                                   ("llama-2-13b", "a100-80gb-pcie", 1, 4, 3e-6),
                                                   ("yi-34b", "h100-sxm", 2, 3, 0.0)])
def test_cached_stage_times_equal_the_cost_model(model, hw, tp, pp, launch):
    spec, hardware = get_model_spec(model), get_hardware_spec(hw)
    params = CostParams(per_seq_overhead_s=3e-5, launch_overhead_s=launch, tp_sync_s=1e-5, attn_decode_fixed_s=5e-6)
    cached = CachedStageTimes(spec, hardware, tp, pp, params)
    rng = random.Random(pp)
    for _ in range(300):
        batch = BatchComposition(tuple((rng.randint(1, 512), rng.randint(0, 4000))
                                       for _ in range(rng.choice([0, 0, 1, 2]))),
                                 tuple((rng.randint(1, 8), rng.randint(0, 8000)) for _ in range(rng.randint(0, 4))))
        assert cached(batch) == stage_times(batch, spec, hardware, tp, pp, params)


@pytest.mark.parametrize("model,hw,tp,pp,launch", [("mistral-7b", "a100-80gb-sxm", 1, 2, 0.0),
                                                   ("llama-2-70b", "a100-80gb-pcie", 4, 2, 2e-6),
                                                   ("llama-2-70b", "h100-sxm", 2, 4, 5e-5)])
def test_pipelined_decode_and_chunk_stages_equal_the_cost_model(model, hw, tp, pp, launch):
    """The stage times of the pair runs and stage runs (PipelineStepTime.decode_stages_fn, composition_stages)
    and of stage_times(out) for a decode-only batch equal the cost model's stage_times of the compact
    composition, bit for bit."""
    spec, hardware = get_model_spec(model), get_hardware_spec(hw)
    params = CostParams(per_seq_overhead_s=3e-5, launch_overhead_s=launch, tp_sync_s=1e-5, attn_decode_fixed_s=5e-6)
    source = make_step_time(spec, hardware, tp, pp, params)
    rng = random.Random(tp * pp)
    for _ in range(300):
        count = rng.randint(0, 40)
        total = sum(rng.randint(1, 4000) for _ in range(count))
        chunks = [(rng.randint(1, 512), rng.randint(0, 4000)) for _ in range(rng.choice([0, 1, 1, 2]))]
        decodes = ()
        if count:
            q, r = divmod(total, count)
            decodes = ((count - r, q), (r, q + 1)) if r else ((count, q),)
        expected = stage_times(BatchComposition(tuple(chunks), decodes), spec, hardware, tp, pp, params)
        expected = (tuple(expected[0]), tuple(expected[1]))
        assert source.composition_stages(count, total, chunks) == expected
        if not chunks:
            assert source.decode_stages_fn(count)(total) == expected
            contexts = [total // count + (i < total % count) for i in range(count)] if count else []
            out = SchedulerOutput(step=1, req_ids=[str(i) for i in range(count)], num_computed_tokens=contexts,
                                  num_new_tokens=[1] * count, is_prefill=[False] * count)
            if count:
                assert source.stage_times(out) == expected


# ------------------------------------------------------------------------------------- decode runs with prefix caching
def shared_prefix_requests(n: int, seed: int, rate: float = 25.0):
    """Prompts from a few shared prefixes (32-300 tokens) plus a random tail, every fifth one an exact copy of an
    earlier request (same prompt and output length: its placeholder pages get the same keys), 8-100 outputs:
    prefix hits at admission, and decoders registering keys other pages hold or held."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randint(32, 300))] for _ in range(5)]
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        if i % 5 == 4:
            src = reqs[rng.randrange(len(reqs))]
            prompt, max_tokens = list(src.prompt_token_ids), src.max_tokens
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randint(0, 200))]
            max_tokens = rng.randint(8, 100)
        reqs.append(Request(f"s{i:03d}", prompt, SamplingParams(max_tokens=max_tokens), t))
    return reqs


def lru_pages(bm) -> list:
    """A block manager's free cached pages in eviction order, a dead segment's (free_dead) in its place."""
    return [p for page, seg in bm._free_cached.items() for p in ([page] if seg is None else seg[::-1])]


def lru_slots(tier) -> list:
    """A host tier's entries in eviction order, (key, owner, slot) each, a dead segment's (offload_dead) one per
    slot with key None, however the offloads grouped them into segments."""
    return [x for key, (owner, index) in tier._slot.items()
            for x in ([(None, owner, i) for i in index[::-1]] if index.__class__ is list else [(key, owner, index)])]


def cache_state(insts, requests) -> list:
    """Everything prefix caching leaves behind: per instance the block manager's free lists in order, key map,
    page keys, counters, pending tier copies and host tier (entries in LRU order, free slots, counters); per
    request its page keys and registered pages."""
    state, tiers = [], []
    for inst in insts:
        bm = inst.scheduler.block_manager
        state.append((list(bm._free), lru_pages(bm), dict(bm._key_to_page), list(bm.page_key),
                      list(bm.ref_count), bm.num_evictions, bm.num_cache_hit_pages, bm.num_query_pages,
                      bm.num_host_hit_pages, bm.num_remote_hit_pages, list(bm.pending_swap_out),
                      list(bm.pending_swap_in)))
        tier = bm.host_tier
        if tier is not None and all(tier is not t for t in tiers):
            tiers.append(tier)
            state.append((lru_slots(tier), dict(tier._hits), list(tier._heap), list(tier._free),
                          tier.num_offloads, tier.num_hits, tier.num_remote_hits, tier.num_evictions))
    state.append([(r.request_id, r.page_keys, r.num_registered_pages, r.num_cached_tokens) for r in requests])
    return state


def cached_replicas(params: dict, instances: int, tier: str, eviction: str) -> list:
    """`instances` SimInstances (a 1024-token, 16-token-page scheduler of `params`, 160 pages unless given, prefix
    caching on) with host KV tiers: 'none', 'local' (40 pages each) or 'shared' (120 for all), `eviction` order,
    host loads priced (HostLoadStepTime)."""
    from pdjax.scheduler.kv_tier import HostKVTier
    from pdjax.sim.kv_tier import HostLoadStepTime
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, enable_prefix_caching=True, watermark=0.0,
                          **{"num_pages": 160, **params})
    insts = []
    shared = HostKVTier(120, eviction) if tier == "shared" else None
    for k in range(instances):
        step = make_step_time(MODEL, HARDWARE, 1, 1, CostParams(per_seq_overhead_s=2e-5))
        sched = make_scheduler(cfg)
        if tier != "none":
            sched.block_manager.host_tier = shared or HostKVTier(40, eviction)
            sched.block_manager.tier_owner = f"i{k}"
            step = HostLoadStepTime(step, f"i{k}", 2e-5, 5e-5)
        insts.append(SimInstance(f"i{k}", sched, step))
    return insts


def run_cached(params: dict, decode_runs: bool, instances: int = 1, router: str = "round_robin",
               tier: str = "none", seed: int = 0, n: int = 60, eviction: str = "lru", rate: float = 25.0,
               workload=None):
    """shared_prefix_requests on `instances` replicas with prefix caching on and a small page pool (evictions in
    runs); tier: 'none', 'local' (one host KV tier each) or 'shared' (one for all, Mooncake's pool), host loads
    priced (HostLoadStepTime). Returns (result, scheduler counters, cache_state, pages hit in device or host)."""
    insts = cached_replicas(params, instances, tier, eviction)
    reqs = (workload or shared_prefix_requests)(n, seed, rate)
    result = simulate(reqs, insts, InstanceRouter(router, insts, role="colocated"), decode_runs=decode_runs)
    state = [(i.scheduler.step, i.scheduler.num_preemptions, i.scheduler.num_swaps) for i in insts]
    hits = sum(i.scheduler.block_manager.num_cache_hit_pages + i.scheduler.block_manager.num_host_hit_pages
               for i in insts)
    return result, state, cache_state(insts, reqs), hits


def count_cached_runs(monkeypatch) -> dict:
    """Patch DecodeRun._grow_pages_caching to count the run steps applied with prefix caching and the cached pages
    they evicted."""
    seen = {"steps": 0, "evicted": 0}
    grow = runs_module.DecodeRun._grow_pages_caching

    def counting(self, a, b):
        evicted = grow(self, a, b)
        seen["steps"] += b - a
        seen["evicted"] += len(evicted)
        return evicted

    monkeypatch.setattr(runs_module.DecodeRun, "_grow_pages_caching", counting)
    return seen


def assert_same_cached(reference, got):
    assert_same(reference[:2], got[:2])
    assert got[2:] == reference[2:]


CACHED_POLICIES = {name: CONFIGS[name] for name in (
    "sarathi", "sarathi_guard_cap_tile", "sarathi_dynamic", "sarathi_full", "vllm_v0", "orca", "decode_first",
    "chunked_only", "chunked_prefill_first", "vllm_v1", "vllm_v1_full")}


@pytest.mark.parametrize("name", sorted(CACHED_POLICIES))
def test_decode_runs_with_prefix_caching_change_nothing(name, monkeypatch):
    """Prefix caching on, shared prefixes and copies, a pool small enough that runs evict cached pages: the runs
    allocate, evict and register exactly as the steps one at a time (records, free lists in order, key map)."""
    params = {k: v for k, v in CACHED_POLICIES[name].items() if k != "num_pages"}
    reference = run_cached(params, False)
    seen = count_cached_runs(monkeypatch)
    got = run_cached(params, True)
    assert_same_cached(reference, got)
    assert seen["steps"] > len(got[0].iterations) // 10, "the case is meant to run steps in bulk"
    assert seen["evicted"] > 0, "the case is meant to evict cached pages inside runs"
    assert got[3] > 0, "the case is meant to hit the prefix cache"


@pytest.mark.parametrize("tier", ["none", "local", "shared"])
@pytest.mark.parametrize("router", ["round_robin", "prefix_affinity", "kv_centric"])
@pytest.mark.parametrize("policy", ["sarathi", "vllm_v1"])
def test_decode_runs_with_prefix_caching_on_several_instances(policy, router, tier, monkeypatch):
    """Three replicas behind the cache-aware routers (which read each one's prefix cache and host tier at every
    arrival), without a host tier, with one each, and with one shared: runs evict into the tiers (offload order,
    slots, LRU order) as the steps one at a time."""
    params = dict(CONFIGS[policy], num_pages=120)
    args = dict(instances=3, router=router, tier=tier, seed=2, n=90, rate=6.0)
    reference = run_cached(params, False, **args)
    seen = count_cached_runs(monkeypatch)
    got = run_cached(params, True, **args)
    assert_same_cached(reference, got)
    assert seen["steps"] > 0 and seen["evicted"] > 0, "the case is meant to evict cached pages inside runs"
    assert got[3] > 0, "the case is meant to hit the prefix cache"


def first_page_followers(n: int, seed: int, rate: float) -> list:
    """Short prompts (3-12 tokens of a few heads) and, every other request, a head padded with the placeholder
    token to a full page plus a tail: its first page is the page a short request registers while it decodes."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        head = rng.choice(heads)
        prompt = list(head)
        if i % 2:
            prompt += [runs_module.PLACEHOLDER] * (16 - len(head)) + [rng.randrange(1, 500)
                                                                      for _ in range(rng.randint(1, 60))]
        reqs.append(Request(f"s{i:03d}", prompt, SamplingParams(max_tokens=rng.randint(20, 80)), t))
    return reqs


@pytest.mark.parametrize("router", ["kv_centric", "prefix_affinity"])
@pytest.mark.parametrize("policy,tier,workload,seed,num_pages,rate", [
    ("vllm_v1", "none", "shared", 2, 80, 3.0), ("vllm_v1", "local", "shared", 4, 80, 6.0),
    ("vllm_v1", "local", "shared", 0, 64, 6.0),
    ("sarathi", "none", "followers", 2, 80, 3.0), ("vllm_v1", "local", "followers", 3, 80, 30.0)])
def test_cache_aware_routers_route_past_unapplied_decode_steps(router, policy, tier, workload, seed, num_pages, rate,
                                                               monkeypatch):
    """The cache-aware routers read a replica with decode-only steps unapplied (RouterInfo.stale_ok) only when they
    cannot change the request's hit there: records and caches equal the steps one at a time, in cases where routing
    on a replica whose decode steps evict the request's first page (shared prefixes, a small pool) or register it
    (followers of short prompts) would differ; and some reads do skip the catch-up."""
    from pdjax.scheduler import routing
    skipped = []
    stale_ok = routing.ROUTERS[router].stale_ok

    def counting(router_, inst, req, prefill_tokens):
        ok = stale_ok(router_, inst, req, prefill_tokens)
        skipped.append(ok)
        return ok

    monkeypatch.setattr(routing.ROUTERS[router], "stale_ok", counting)
    params = dict(CONFIGS[policy], num_pages=num_pages)
    args = dict(instances=3, router=router, tier=tier, seed=seed, n=90, rate=rate,
                workload=first_page_followers if workload == "followers" else None)
    reference = run_cached(params, False, **args)
    got = run_cached(params, True, **args)
    assert_same_cached(reference, got)
    assert 0 < sum(skipped) < len(skipped), "the case is meant to skip some catch-ups and not others"


def prefix_pairs(n: int, seed: int, rate: float) -> list:
    """Pairs of requests sharing a fresh prefix (40-120 tokens) with their own tails, the second arriving up to 50 ms
    after the first: it arrives while the first one's prompt steps, registering that prefix, may be unapplied."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(0, n, 2):
        t += rng.expovariate(rate)
        prefix = [rng.randrange(1, 500) for _ in range(rng.randint(40, 120))]
        for k in range(2):
            prompt = prefix + [rng.randrange(1, 500) for _ in range(rng.randint(10, 100))]
            reqs.append(Request(f"p{i + k:03d}", prompt, SamplingParams(max_tokens=rng.randint(8, 60)),
                                t + k * 0.05 * rng.random()))
    return sorted(reqs, key=lambda r: r.arrival_time)


@pytest.mark.parametrize("router", ["kv_centric", "prefix_affinity"])
@pytest.mark.parametrize("workload,tier,seed,num_pages", [("shared", "none", 1, 80), ("shared", "local", 0, 160),
                                                          ("pairs", "local", 0, 80)])
def test_cache_aware_routers_route_past_unapplied_prefill_steps(router, workload, tier, seed, num_pages, monkeypatch):
    """Sarathi with a small token budget (prompts take several steps) behind the cache-aware routers: a replica whose
    unapplied steps compute prompt tokens is read without a catch-up only when no request they run can register the
    arriving request's first page (routing.no_hit_change); records and caches equal the steps one at a time (the
    pairs: where a read past the first one's prompt steps would differ), and reads over prefill steps both skip the
    catch-up and make it."""
    from pdjax.scheduler import routing
    seen = []
    stale_ok = routing.ROUTERS[router].stale_ok

    def counting(router_, inst, req, prefill_tokens):
        ok = stale_ok(router_, inst, req, prefill_tokens)
        if prefill_tokens:
            seen.append(ok)
        return ok

    monkeypatch.setattr(routing.ROUTERS[router], "stale_ok", counting)
    params = dict(CONFIGS["sarathi"], num_pages=num_pages, token_budget=32)
    args = dict(instances=3, router=router, tier=tier, seed=seed, n=90, rate=6.0,
                workload=prefix_pairs if workload == "pairs" else None)
    reference = run_cached(params, False, **args)
    got = run_cached(params, True, **args)
    assert_same_cached(reference, got)
    assert 0 < sum(seen) < len(seen), "the case is meant to skip some catch-ups over prefill steps and not others"


@pytest.mark.parametrize("decode_pages", [512, 72])
def test_decode_runs_admit_landed_kv_with_prefix_caching(decode_pages, monkeypatch):
    """Prefix caching on both sides of a disaggregated deployment: a decode instance's runs admit landed KV (each
    admitted request registers its full pages in its first update) and evict cached pages (72 pages) as the steps
    one at a time."""
    args = (1, 1, decode_pages, "round_robin", 11)
    reference = run_disaggregated(False, *args, caching=True)
    seen = count_cached_runs(monkeypatch)
    admitted = count_kv_admissions(monkeypatch)
    got = run_disaggregated(True, *args, caching=True)
    assert_same(reference, got)
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    assert len(admitted) > len(got[0].requests) // 4, "the case is meant to admit landed KV in decode runs"
    if decode_pages == 72:
        assert seen["evicted"] > 0, "the case is meant to evict cached pages inside runs"


@pytest.mark.parametrize("num_prefill,seed", [(1, 3), (2, 5)])
def test_decode_runs_with_a_shared_host_tier_do_not_cross_events(num_prefill, seed, monkeypatch):
    """One host KV tier shared by the prefill and decode instances: the decode instance's runs offload their
    evictions into it, which the prefill instances' admissions read, so no run goes past another instance's
    event (pdjax.sim.disagg._enable_crossing_runs); the tier ends as with the steps one at a time."""
    args = (num_prefill, 1, 72, "round_robin", seed)
    reference = run_disaggregated(False, *args, caching=True, tier=60)
    seen = count_cached_runs(monkeypatch)
    got = run_disaggregated(True, *args, caching=True, tier=60)
    assert_same(reference, got)
    assert [t.__dict__ for t in got[0].transfers] == [t.__dict__ for t in reference[0].transfers]
    assert seen["evicted"] > 0, "the case is meant to evict (offload) cached pages inside runs"


def scheduler_state(sched) -> tuple:
    """A scheduler's whole state after some steps: counters, queues, every request's slots, the block manager's
    and host tier's (cache_state), pending tier copies included."""
    reqs = sched.running + sched.waiting + sched.finished
    # (the token lists as read: a chain of runs' decoders catch up with its clock then; run_lag is that bookkeeping)
    lists = ("_output_token_ids", "_all_token_ids", "_token_times")
    fields = [f[1:] if f in lists else f for f in type(reqs[0]).__slots__ if f not in ("sampling", "run_lag")] \
        if reqs else []
    # (vllm_v1's _chunk_cap is left out: its schedule() sets it afresh first thing, so no step reads the value a
    # run leaves, which is what the run's last schedule() saw, not the count after its finishes)
    return ((sched.step, sched._applied_step, sched._last_emitted, sched._floor),
            [r.request_id for r in sched.running], [r.request_id for r in sched.waiting],
            [r.request_id for r in sched.finished], [[getattr(r, f) for f in fields] for r in reqs],
            cache_state([SimpleNamespace(scheduler=sched)], []))


def test_a_chain_of_decode_runs_leaves_the_state_of_its_steps():
    """Decode runs applied back to back, each continuing the last (its decoders on the chain's clock,
    Request.run_lag, their token lists caught up when read), leave every request as the same steps through
    schedule() and update() leave it: the finished ones too, which gain nothing from the runs after their finish."""
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, **{"num_pages": 512, **CONFIGS["sarathi"]})
    sched = make_scheduler(cfg)
    for i, max_tokens in enumerate((4, 9, 17, 30, 41, 41)):
        sched.add_request(Request(f"r{i}", list(range(1 + i, 21 + 3 * i)), SamplingParams(max_tokens=max_tokens), 0.0))
    t = 0.0
    while any(r.num_computed_tokens < r.prefill_end for r in sched.running + sched.waiting):
        t = advance(sched, [], t)
    ref = copy.deepcopy(sched)
    times, continued = [], 0
    while sched.has_unfinished():
        run = sched.decode_run(1 << 30)
        continued += run._joined == len(run.decoders) > 0
        starts = [t + 0.01 * j for j in range(run.plan_decode_steps())]
        times += starts
        t = starts[-1] + 0.01
        run.apply(starts, [s + 0.01 for s in starts])
    for s in times:
        out = ref.schedule(s)
        ref.update(out, [0 if x else -1 for x in out.do_sample], s + 0.01)
    assert continued >= 3, "the case is meant to continue chains past finishes"
    assert scheduler_state(sched) == scheduler_state(ref)
    assert [len(r.token_times) for r in sched.finished] == [4, 9, 17, 30, 41, 41]


def planned_steps(sched, run=None) -> int:
    """The steps (at most 40) of sched's decode run `run` (None: the one it would start now), planned."""
    run = sched.decode_run(1 << 30) if run is None else run
    if run is None:
        return 0
    if run.prefills or run.admits_first:
        while run.steps < 40 and run.next_step() is not None:
            pass
    else:
        run.plan_decode_steps()
    return min(run.steps, 40)


def advance(sched, pending: list, t: float) -> float:
    """One step of `sched` through schedule() and update() from t (10 ms), or with nothing unfinished none, up to
    the next arrival of `pending`; returns the time after it."""
    if not sched.has_unfinished():
        return pending[0].arrival_time
    out = sched.schedule(t)
    sched.update(out, [0 if x else -1 for x in out.do_sample], t + 0.01)
    return t + 0.01


def stepped_copy(sched, t: float, k: int) -> tuple:
    """(a copy of `sched` after k steps through schedule() and update(), 10 ms each from t, their starts, ends)."""
    ref = copy.deepcopy(sched)
    starts, ends = [t + 0.01 * j for j in range(k)], [t + 0.01 * (j + 1) for j in range(k)]
    for s, e in zip(starts, ends):
        out = ref.schedule(s)
        ref.update(out, [0 if x else -1 for x in out.do_sample], e)
    return ref, starts, ends


@pytest.mark.parametrize("policy,eviction", [("sarathi", "lru"), ("vllm_v1", "lfu"), ("orca", "lru")])
def test_a_decode_run_leaves_the_state_of_its_steps(policy, eviction):
    """Scheduler level, prefix caching and a host tier on a small pool: at every step where a run of two or more
    steps is possible, applying it (DecodeRun.apply) leaves a copy of the scheduler in exactly the state its steps
    through schedule() and update() leave another copy (pending host-tier copies drained, as each step's
    SchedulerOutput takes them)."""
    from pdjax.scheduler.kv_tier import HostKVTier
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, enable_prefix_caching=True, watermark=0.0,
                          num_pages=100, **{k: v for k, v in CONFIGS[policy].items() if k != "num_pages"})
    sched = make_scheduler(cfg)
    sched.block_manager.host_tier, sched.block_manager.tier_owner = HostKVTier(50, eviction), "i0"
    pending = shared_prefix_requests(40, 4, rate=10.0)
    t, compared, evicting = 0.0, 0, 0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival_time <= t:
            sched.add_request(pending.pop(0))
        # (from the first eviction on: runs on a warm pool evict)
        if compared < 30 and sched.block_manager.num_evictions and planned_steps(sched) >= 2:
            run_copy = copy.deepcopy(sched)
            run = run_copy.decode_run(1 << 30)
            k = planned_steps(run_copy, run)
            if k >= 2:
                ref, starts, ends = stepped_copy(sched, t, k)
                evicting += ref.block_manager.num_evictions > sched.block_manager.num_evictions
                run.apply(starts, ends)
                assert scheduler_state(run_copy) == scheduler_state(ref)
                compared += 1
        t = advance(sched, pending, t)
    assert compared == 30 and evicting >= 3, "the case is meant to compare many runs, some evicting"


ADMITTING = {   # sarathi configs whose runs admit waiting requests in their first step, within each limit
    "sarathi": dict(token_budget=256, max_num_seqs=16),
    "guard_cap_tile_long": dict(token_budget=256, max_num_seqs=16, min_prefill_tokens=32,
                                long_prefill_token_threshold=96, tile_size=16),
    "full": dict(token_budget=512, max_num_seqs=4),
    "watermark": dict(token_budget=128, max_num_seqs=16, num_pages=96, watermark=0.1),
    "tight_memory": dict(token_budget=128, max_num_seqs=16, num_pages=72, watermark=0.0),
}


@pytest.mark.parametrize("caching,tier", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("name", sorted(ADMITTING))
def test_a_decode_run_admits_waiting_requests_as_its_first_step_would(name, caching, tier):
    """Scheduler level, sarathi: a run whose first step admits waiting requests (DecodeRun._plan_admissions:
    fresh requests with numbered keys, nothing to hit) leaves a copy of the scheduler in exactly the state its
    steps through schedule() and update() leave another: queues, pages, prefix-cache and host-tier state and
    counters, every request's slots (admission time and order, long-prefill mark, cached tokens ...)."""
    from pdjax.scheduler.block_manager import numbered_keys
    from pdjax.scheduler.kv_tier import HostKVTier
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, policy="sarathi", enable_prefix_caching=caching,
                          **{"num_pages": 256, **ADMITTING[name]})
    sched = make_scheduler(cfg)
    if tier:
        sched.block_manager.host_tier, sched.block_manager.tier_owner = HostKVTier(64, "lru"), "i0"
    pending = make_requests(80, 7, rate=30.0)
    for req, base, pages in zip(pending, *numbered_keys([r.prompt_token_ids for r in pending], 16, 0)):
        req.key_base, req.content_key_pages = base, pages
    t, admitted = 0.0, 0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival_time <= t:
            sched.add_request(pending.pop(0))
        probe = sched.decode_run(1 << 30)     # (reads the scheduler only)
        if admitted < 30 and probe is not None and probe.admits_first:
            run_copy = copy.deepcopy(sched)
            run = run_copy.decode_run(1 << 30)
            k = planned_steps(run_copy, run)
            if k:
                admitted += len(run._fresh)
                ref, starts, ends = stepped_copy(sched, t, k)
                run.apply(starts, ends)
                assert scheduler_state(run_copy) == scheduler_state(ref)
        t = advance(sched, pending, t)
    assert admitted >= 20, "the case is meant to compare many runs that admit"


def test_a_decode_run_admits_until_one_does_not_fit():
    """The first step's admission pass counts the pages of the requests it admitted before: of three waiting
    3-page prompts with 8 pages left after the decoder grows, two are admitted (2 left), the third waits, as
    schedule() has it."""
    cfg = SchedulerConfig(max_model_len=160, page_size=16, policy="sarathi", token_budget=512, max_num_seqs=8,
                          num_pages=10, watermark=0.0)
    sched = make_scheduler(cfg)
    sched.add_request(Request("a", list(range(1, 17)), SamplingParams(max_tokens=50), 0.0))
    out = sched.schedule(0.0)
    sched.update(out, [0], 0.01)
    for name in "bcd":
        sched.add_request(Request(name, list(range(1, 49)), SamplingParams(max_tokens=5), 0.01))
    ref, starts, ends = stepped_copy(sched, 0.01, 1)
    run = sched.decode_run(1 << 30)
    assert run.admits_first and run.next_step() == [(48, 0), (48, 0)]
    assert [req.request_id for req, _, _ in run._fresh] == ["b", "c"]
    run.apply(starts, ends)
    assert scheduler_state(sched) == scheduler_state(ref)
    assert [r.request_id for r in sched.waiting] == ["d"] and sched.block_manager.num_free_pages == 2


def test_run_registrations_follow_the_updates_one_by_one():
    """DecodeRun._registrations against a plain replay of update()'s rule (a request registers when its computed
    tokens fill pages past its registered ones), step by step in batch order: decoders behind or ahead of each
    other, one that has not registered its full pages yet, prefill chunks completing pages; requests registered
    without keys (Scheduler._keyless) only counted, at their last registration."""
    ps, k = 4, 11
    def request(c, r):
        return SimpleNamespace(num_computed_tokens=c, num_registered_pages=r, key_base=None, num_preemptions=0,
                               content_key_pages=0, run_lag=None)

    def registrations(run, a):     # as apply_range reads them: after the decoders' tokens of steps a .. k - 1
        return run._registrations(a, k, run._append_tokens(k - a, [0.0] * (k - a), k))
    decoders = [request(c, r) for c, r in ((9, 2), (2, 0), (7, 1), (12, 1), (3, 0))]
    prefills = [request(c, c // ps) for c in (0, 6)]
    plan = [((0, 5, 0), (1, 3, 0)), (), ((1, 8, 0),), ((0, 1, 0),), ((0, 2, 0), (1, 4, 0))] + [()] * (k - 5)
    def sched():
        return SimpleNamespace(_ps=ps, step=0, _dead=True,
                               _keyless=lambda req: req.key_base is not None and not req.num_preemptions)
    run = runs_module.DecodeRun(sched(), decoders, prefills, [0] * 5, [99] * 5, 0, 99, 0, 0)
    run._plan = plan
    expected = []
    counts = [[r.num_computed_tokens, r.num_registered_pages] for r in decoders + prefills]
    states = {}        # the requests' (computed, registered) before step j
    for j in range(k):
        states[j] = [list(c) for c in counts]
        batch = [(0, i, 1) for i in range(len(decoders))] + [(1, p, n) for p, n, _ in plan[j]]
        for kind, i, n in batch:
            state = counts[i + kind * len(decoders)]
            state[0] += n
            if state[0] // ps > state[1]:
                state[1] = state[0] // ps
                expected.append((j, kind, i, state[1]))
    assert registrations(run, 0) == (expected, [])
    for a in (3, 7):          # a later range (apply_range): read from the requests as the steps before a left them
        later = [request(c, r) for c, r in states[a]]
        run = runs_module.DecodeRun(sched(), later[:5], later[5:], [0] * 5, [99] * 5, 0, 99, 0, 0)
        run._plan = plan
        assert registrations(run, a) == ([e for e in expected if e[0] >= a], [])
    assert expected != sorted(expected, key=lambda e: e[1:3]), "the case is meant to interleave the requests"
    keyless = {(0, 1), (0, 3), (1, 1)}
    fresh = [request(c, r) for c, r in states[0]]     # (the runs above applied their tokens)
    decoders, prefills = fresh[:5], fresh[5:]
    for kind, i in keyless:     # numbered keys, never preempted
        (prefills if kind else decoders)[i].key_base = 1 << 32
    last = {(kind, i): full for _, kind, i, full in expected}
    run = runs_module.DecodeRun(sched(), decoders, prefills, [0] * 5, [99] * 5, 0, 99, 0, 0)
    run._plan = plan
    events, counts = registrations(run, 0)
    assert events == [e for e in expected if e[1:3] not in keyless]
    # a keyless prefill's count is set after the events; a keyless decoder's with its tokens
    assert counts == [(prefills[i], last[kind, i]) for kind, i in sorted(keyless) if kind]
    assert [decoders[i].num_registered_pages for kind, i in sorted(keyless) if not kind] == \
        [last[kind, i] for kind, i in sorted(keyless) if not kind]


def iteration_rows(iterations) -> list:
    return [(i.step, i.start_time, i.end_time, i.num_prefill_tokens, i.num_decode_tokens, i.num_seqs, i.instance)
            for i in iterations]


@pytest.mark.parametrize("kind,pool", [("colocated", "shared"), ("colocated", "local"), ("disaggregated", "shared")])
def test_decode_runs_with_prefix_caching_on_the_mooncake_trace(kind, pool, shared_data, monkeypatch):
    """The Mooncake conversation trace (prompts built from its hash_ids: shared 512-token blocks) through the
    config path of pdjax.experiment.kv_cache: kv_centric routing, host KV tiers local or shared, partial transfer
    for the disaggregated deployment, small device pools: the same records and caches with runs as without."""
    from pdjax.experiment import kv_cache
    from pdjax.sim import disagg, simulator
    if not (shared_data / "traces" / kv_cache.TRACES["conversation"]).is_file():
        pytest.skip("Mooncake trace not present")
    config = kv_cache.base_config("conversation", kind=kind, router="kv_centric", num_requests=40,
                                  time_scale=kv_cache.time_scale_for("conversation", 1.0, 40), host_blocks=600,
                                  host_pool=pool, num_pages=1100)
    config["deployment"]["colocated"]["num_instances"] = 2

    def simulate_config(runs: bool):
        with monkeypatch.context() as patch:
            if not runs:      # every step through schedule() and update()
                patch.setattr(simulator, "decode_run_ready", lambda inst: False)
                patch.setattr(disagg, "decode_run_ready", lambda inst: False)
            result, instances, _ = kv_cache.simulate_dict(config)
        return result, cache_state([i for group in instances.values() for i in group], [])

    ref, ref_cache = simulate_config(False)
    seen = count_cached_runs(monkeypatch)
    got, cache = simulate_config(True)
    assert [r.__dict__ for r in got.requests] == [r.__dict__ for r in ref.requests]
    assert iteration_rows(got.iterations) == iteration_rows(ref.iterations)
    assert cache == ref_cache
    assert seen["steps"] > 0 and seen["evicted"] > 0, "the case is meant to evict cached pages inside runs"


@pytest.mark.parametrize("seed", range(6))
def test_run_serial_is_dispatch_then_collect_bit_for_bit(seed):
    """StagePipeline.run_serial (the decode runs' accounting, in one pass) against dispatch() and collect() of each
    batch in turn, after some history: the same busy, in-flight and active seconds to the last bit."""
    from pdjax.sim.pipeline import StagePipeline
    rng = random.Random(seed)
    starts, ends, seconds = [], [], []
    t = rng.uniform(1300.0, 1400.0)
    for _ in range(rng.randint(1, 40)):
        d = rng.uniform(1e-5, 0.2)
        starts.append(t)
        ends.append(t + d)
        seconds.append(d)
        t = t + d + rng.choice([0.0, rng.uniform(0.0, 0.01)])
    ref, got = StagePipeline(), StagePipeline()

    def batch(i):
        return SimpleNamespace(is_empty=False, step=i, req_ids=[f"r{i}"])
    for pipe in (ref, got):      # a long history: its sums are large, so the order of the additions shows
        pipe.dispatch(batch(-1), 0.1, [1234.5678])
        pipe.collect(1234.6678)
    for i, (start, end, d) in enumerate(zip(starts, ends, seconds)):
        assert ref.dispatch(batch(i), start, [d]) == end
        ref.collect(end)
    got.run_serial(starts, ends, seconds)
    assert (got.stage_busy, got.in_flight_s, got.active_s, got.stage_free, got.queue.num_pushed) == \
        (ref.stage_busy, ref.in_flight_s, ref.active_s, ref.stage_free, ref.queue.num_pushed)
