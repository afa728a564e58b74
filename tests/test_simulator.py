"""Discrete-event simulator: same SchedulerOutputs as the real engine loop, routers, step cost, determinism."""
from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.metrics import summarize_run
from pdjax.scheduler import Request, make_scheduler, policy_class
from pdjax.serving.engine import ColocatedEngine
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time
from pdjax.sim.hardware import get_hardware_spec
from pdjax.scheduler.routing import LeastOutstandingTokensRouter, RoundRobinRouter
from pdjax.sim.simulator import SimInstance, placeholder_sample, simulate
from pdjax.sim.step_cost import (CachedIterationTime, EnginePadding, compact_composition,
                                 make_step_time, padded_composition, padded_shape)
from pdjax.config.buckets import Buckets, engine_buckets

TICK = 1.0 / 1024   # dyadic times: sums are exact in floating point, so both loops see identical clocks


def dyadic_step_time(out) -> float:
    """A toy step time in whole ticks (exact float sums): fixed + per token + per context page."""
    ctx_pages = sum((c + n) // 64 for c, n in zip(out.num_computed_tokens, out.num_new_tokens))
    return TICK * (3 + out.total_tokens // 8 + ctx_pages)


def make_requests(n: int, seed: int, *, max_prompt: int = 300, max_out: int = 40, rate_ticks: int = 6):
    rng = random.Random(seed)
    reqs, t = [], 0
    for i in range(n):
        t += rng.randint(0, 2 * rate_ticks)
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, max_prompt))]
        reqs.append(Request(f"r{i:03d}", prompt, SamplingParams(max_tokens=rng.randint(1, max_out)), t * TICK))
    return reqs


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    def sleep(self, d: float) -> None:
        self.t += d


class FakeRunner:
    """dispatch/collect like ModelRunner on a fake device that runs steps back to back: a step dispatched at
    host time t starts when the device is free (>= t) and collect() advances the clock to its end."""

    def __init__(self, clock: FakeClock, step_time, record):
        self.clock, self.step_time, self.record = clock, step_time, record
        self.device_free = 0.0

    def dispatch(self, out, prev=None):
        if out.is_empty:                 # swap copies only (nothing to time: the simulator models none)
            return out, self.clock.t
        self.record(out, self.clock.t)
        start = max(self.clock.t, self.device_free)
        self.device_free = start + self.step_time(out)
        return out, self.device_free

    def collect(self, handle):
        out, end = handle
        self.clock.t = max(self.clock.t, end)
        return placeholder_sample(out)


def dyadic_stage_times(pp: int):
    """Toy per-stage times and sends in whole ticks for a pp-stage pipeline: stage s costs its share of the
    token work plus s ticks (unequal stages), a send 1 tick per 64 tokens."""
    def stage_times(out):
        ctx_pages = sum((c + n) // 64 for c, n in zip(out.num_computed_tokens, out.num_new_tokens))
        stages = tuple(TICK * (1 + s + (out.total_tokens // 8 + ctx_pages) // pp) for s in range(pp))
        return stages, tuple(TICK * (1 + out.total_tokens // 64) for _ in range(pp - 1))
    return stage_times


class FakePipelineRunner(FakeRunner):
    """FakeRunner on a pp-stage fake device: each stage is a resource running batches in dispatch order; batch k
    starts stage s at max(its end on stage s-1 + the send, the end of batch k-1 on stage s)."""

    def __init__(self, clock: FakeClock, stage_times, record, pp: int):
        super().__init__(clock, None, record)
        self.stage_times, self.pp = stage_times, pp
        self.stage_free = [0.0] * pp

    def dispatch(self, out, prev=None):
        if out.is_empty:
            return out, self.clock.t
        self.record(out, self.clock.t)
        stages, sends = self.stage_times(out)
        ready = self.clock.t
        for s in range(self.pp):
            if s:
                ready += sends[s - 1]
            ready = max(ready, self.stage_free[s]) + stages[s]
            self.stage_free[s] = ready
        return out, ready


def snapshot(out, t):
    return (t, out.step, list(out.req_ids), [list(x) for x in out.token_ids], list(out.num_computed_tokens),
            list(out.num_new_tokens), [list(p) for p in out.page_tables], list(out.do_sample), list(out.is_prefill),
            out.num_prefill_tokens, out.num_decode_tokens, list(out.swap_out), list(out.swap_in),
            list(out.preempted_req_ids))


SCHED_CONFIGS = {
    "sarathi": dict(policy="sarathi", token_budget=128, max_num_seqs=8),
    "sarathi_tight_memory": dict(policy="sarathi", token_budget=96, max_num_seqs=8, num_pages=40, watermark=0.0),
    "vllm_v0": dict(policy="vllm_v0", token_budget=512, max_num_seqs=8),
    "orca_swap": dict(policy="orca", token_budget=512, max_num_seqs=6, num_pages=40, preemption_mode="swap",
                      num_host_pages=64),
    "chunked_only": dict(policy="chunked_only", token_budget=64, max_num_seqs=8),
    "vllm_v1": dict(policy="vllm_v1", token_budget=128, max_num_seqs=8, long_prefill_token_threshold=48),
    "sarathi_decode_split": dict(policy="sarathi", token_budget=128, max_num_seqs=8, decode_batches=2),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(SCHED_CONFIGS))
def test_simulator_reproduces_engine_schedule(name, async_scheduling):
    cfg = SchedulerConfig(max_model_len=512, page_size=16, **{"num_pages": 256, **SCHED_CONFIGS[name]})
    engine_sched, sim_sched = make_scheduler(cfg), make_scheduler(cfg)
    assert type(engine_sched) is type(sim_sched) is policy_class(cfg.policy)

    engine_log, sim_log = [], []
    clock = FakeClock()
    runner = FakeRunner(clock, dyadic_step_time, lambda out, t: engine_log.append(snapshot(out, t)))
    engine = ColocatedEngine(runner, engine_sched, clock=clock.clock, sleep=clock.sleep,
                             async_scheduling=async_scheduling)
    engine_result = engine.run(make_requests(40, seed=1))

    sim_result = simulate(make_requests(40, seed=1), [SimInstance("a", sim_sched, dyadic_step_time)],
                          async_scheduling=async_scheduling,
                          on_schedule=lambda inst, out, t: sim_log.append(snapshot(out, t)))
    assert len(sim_log) == len(engine_log) > 40
    for i, (a, b) in enumerate(zip(engine_log, sim_log)):
        assert a == b, f"iteration {i} differs"
    assert [r.__dict__ for r in sim_result.requests] == [r.__dict__ for r in engine_result.requests]
    assert [(it.start_time, it.end_time, it.num_seqs) for it in sim_result.iterations] == \
        [(it.start_time, it.end_time, it.num_seqs) for it in engine_result.iterations]
    if name == "sarathi_tight_memory":
        assert sum(r.num_preemptions for r in sim_result.requests) > 0, "the case is meant to preempt"
    # Async: step 2 is scheduled while step 1 runs (same host time); sync: only after step 1 ends.
    assert (sim_log[1][0] == sim_log[0][0]) == async_scheduling
    assert sim_result.pipeline is None if async_scheduling else sim_result.pipeline["bubble_fraction"] == 0.0


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", sorted(SCHED_CONFIGS))
def test_simulator_reproduces_pipelined_engine(name, pp):
    """pp stages with up to pp batches in flight: the engine's batch-queue loop over a fake pipelined device and the
    simulator's stage resources give the same SchedulerOutputs, iteration records (overlapping) and requests."""
    cfg = SchedulerConfig(max_model_len=512, page_size=16, **{"num_pages": 256, **SCHED_CONFIGS[name]})
    stage_times = dyadic_stage_times(pp)
    engine_log, sim_log = [], []
    clock = FakeClock()
    runner = FakePipelineRunner(clock, stage_times, lambda out, t: engine_log.append(snapshot(out, t)), pp)
    engine = ColocatedEngine(runner, make_scheduler(cfg), clock=clock.clock, sleep=clock.sleep, max_in_flight=pp)
    engine_result = engine.run(make_requests(40, seed=1))

    inst = SimInstance("a", make_scheduler(cfg), stage_times=stage_times, max_in_flight=pp)
    sim_result = simulate(make_requests(40, seed=1), [inst],
                          on_schedule=lambda inst, out, t: sim_log.append(snapshot(out, t)))
    assert len(sim_log) == len(engine_log) > 40
    for i, (a, b) in enumerate(zip(engine_log, sim_log)):
        assert a == b, f"iteration {i} differs"
    assert [r.__dict__ for r in sim_result.requests] == [r.__dict__ for r in engine_result.requests]
    assert [(it.start_time, it.end_time, it.num_seqs) for it in sim_result.iterations] == \
        [(it.start_time, it.end_time, it.num_seqs) for it in engine_result.iterations]
    assert all(r.finish_reason == "length" for r in sim_result.requests)
    if name == "sarathi_tight_memory":
        assert sum(r.num_preemptions for r in sim_result.requests) > 0, "the case is meant to preempt"
    # Batches really overlap: some iteration starts before the previous one ended.
    its = sim_result.iterations
    assert any(b.start_time < a.end_time for a, b in zip(its, its[1:]))
    # No request in two in-flight batches: a request's consecutive schedules are an applied batch apart.
    spans = {}
    for it, entry in zip(its, sim_log):
        for rid in entry[2]:
            spans.setdefault(rid, []).append((it.start_time, it.end_time))
    for rid, ss in spans.items():
        assert all(b[0] >= a[1] for a, b in zip(ss, ss[1:])), f"{rid} in two in-flight batches"
    stats = sim_result.pipeline
    assert 0.0 < stats["bubble_fraction"] < 1.0
    assert 1.0 < stats["mean_batches_in_flight"] <= pp
    one = stats["instances"]["a"]
    assert one["pp"] == pp and len(one["stage_busy_s"]) == pp
    # busy seconds are the stage times of every batch
    for s in range(pp):
        want = sum(stage_times(_output_of(e))[0][s] for e in sim_log)
        assert abs(one["stage_busy_s"][s] - want) < 1e-9


def _output_of(entry):
    from pdjax.scheduler import SchedulerOutput
    out = SchedulerOutput(step=entry[1], req_ids=entry[2], num_computed_tokens=entry[4], num_new_tokens=entry[5])
    out.num_prefill_tokens, out.num_decode_tokens = entry[9], entry[10]
    return out


def test_async_scheduling_refuses_batches_in_flight():
    cfg = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=8, max_model_len=512, num_pages=256)
    with pytest.raises(ValueError, match="async_scheduling=True with max_in_flight=2"):
        ColocatedEngine(None, make_scheduler(cfg), async_scheduling=True, max_in_flight=2)
    with pytest.raises(ValueError, match="max_in_flight=0"):
        ColocatedEngine(None, make_scheduler(cfg), max_in_flight=0)
    inst = SimInstance("a", make_scheduler(cfg), stage_times=dyadic_stage_times(2), max_in_flight=2)
    with pytest.raises(ValueError, match="async_scheduling with pipeline stages"):
        simulate(make_requests(3, seed=0), [inst], async_scheduling=True)


def test_simulation_is_deterministic():
    cfg = SchedulerConfig(policy="sarathi", token_budget=96, max_num_seqs=8, max_model_len=512, num_pages=60)
    model, hw = get_model_spec("llama-2-7b"), get_hardware_spec("a100-80gb-sxm")
    runs = []
    for _ in range(2):
        insts = [SimInstance(f"i{k}", make_scheduler(cfg), make_step_time(model, hw)) for k in range(2)]
        res = simulate(make_requests(50, seed=3), insts, LeastOutstandingTokensRouter())
        runs.append((res.requests, [dataclasses.asdict(it) for it in res.iterations]))
    assert runs[0] == runs[1]


def test_round_robin_and_least_outstanding_routing():
    cfg = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=8, max_model_len=512, num_pages=256)
    insts = [SimInstance(f"i{k}", make_scheduler(cfg), dyadic_step_time) for k in range(3)]
    rr = RoundRobinRouter()
    res = simulate(make_requests(31, seed=4), insts, rr)
    assert rr.num_routed == {"i0": 11, "i1": 10, "i2": 10}
    assert {it.instance for it in res.iterations} == {"i0", "i1", "i2"}
    assert all(r.finish_reason == "length" for r in res.requests)
    lot = LeastOutstandingTokensRouter()
    simulate(make_requests(31, seed=4), [SimInstance(f"i{k}", make_scheduler(cfg), dyadic_step_time)
                                         for k in range(3)], lot)
    assert lot.outstanding == {"i0": 0, "i1": 0, "i2": 0}, "every routed token was run"

    # Least outstanding tokens: one huge request first, then small ones avoid its instance while it is loaded.
    big = Request("big", [1] * 500, SamplingParams(max_tokens=10), 0.0)
    small = [Request(f"s{k}", [1] * 8, SamplingParams(max_tokens=2), TICK * (1 + k)) for k in range(4)]
    insts = [SimInstance(f"i{k}", make_scheduler(cfg), dyadic_step_time) for k in range(2)]
    lot = LeastOutstandingTokensRouter()
    simulate([big] + small, insts, lot)
    assert lot.num_routed == {"i0": 1, "i1": 4}


def test_rejected_requests_do_not_stall():
    cfg = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=8, max_model_len=256, num_pages=64)
    reqs = [Request("long", [1] * 300, SamplingParams(max_tokens=4), 0.0),
            Request("ok", [1] * 20, SamplingParams(max_tokens=4), TICK)]
    res = simulate(reqs, [SimInstance("a", make_scheduler(cfg), dyadic_step_time)])
    reasons = {r.request_id: r.finish_reason for r in res.requests}
    assert reasons == {"long": "rejected", "ok": "length"}
    summary = summarize_run(res.requests, res.iterations)
    assert summary["num_rejected"] == 1 and summary["num_completed"] == 1


# ------------------------------------------------------------------------------------------------ step cost
def random_output(rng: random.Random, n_prefill: int, n_decode: int):
    from pdjax.scheduler import SchedulerOutput
    out = SchedulerOutput(step=1)
    for i in range(n_prefill + n_decode):
        pre = i < n_prefill
        new = rng.randint(1, 300) if pre else 1
        start = rng.randint(0, 2000)
        out.req_ids.append(str(i))
        out.num_new_tokens.append(new)
        out.num_computed_tokens.append(start)
        out.is_prefill.append(pre)
        out.token_ids.append([0] * new)
        out.page_tables.append([])
        out.do_sample.append(True)
    return out


@pytest.mark.parametrize("model,hw,tp", [("llama-2-7b", "a100-80gb-sxm", 1), ("yi-34b", "a100-80gb-pcie", 2),
                                         ("llama-3-8b", "h100-sxm", 4)])
def test_fast_step_time_equals_cost_model(model, hw, tp):
    spec, hardware = get_model_spec(model), get_hardware_spec(hw)
    params = CostParams(per_seq_overhead_s=3e-5)
    fast = make_step_time(spec, hardware, tp, 1, params)
    cached = CachedIterationTime(spec, hardware, tp, params)
    rng = random.Random(0)
    for _ in range(300):
        out = random_output(rng, rng.randint(0, 3), rng.randint(0, 40))
        if not out.req_ids:
            continue
        reference = iteration_time(BatchComposition.from_scheduler_output(out), spec, hardware, tp, 1, params).total
        assert fast(out) == reference
        assert cached(compact_composition(out)) == reference
    assert cached(BatchComposition()) == params.iteration_overhead_s


def test_compact_composition_keeps_context_sum():
    rng = random.Random(1)
    for _ in range(50):
        out = random_output(rng, rng.randint(0, 2), rng.randint(1, 30))
        full = BatchComposition.from_scheduler_output(out)
        compact = compact_composition(out)
        assert compact.prefills == full.prefills
        assert compact.num_seqs == full.num_seqs and compact.num_tokens == full.num_tokens
        assert sum(n * c for n, c in compact.decodes) == sum(n * c for n, c in full.decodes)
        assert len(compact.decodes) <= 2


@pytest.mark.parametrize("budget,seqs,max_len,page", [(256, 32, 1024, 16), (512, 128, 4096, 16), (100, 5, 50, 8),
                                                      (16, 1, 16, 16)])
def test_engine_buckets_match_the_engine(budget, seqs, max_len, page):
    run = pytest.importorskip("pdjax.serving.run")
    from pdjax.config.serving import serve_config_from_dict
    cfg = serve_config_from_dict({"scheduler": {"policy": "sarathi", "token_budget": budget, "max_num_seqs": seqs,
                                                "max_model_len": max_len, "page_size": page,
                                                "num_pages": 4 * max_len // page + 8},
                                  "workload": {"preset": "chat"}})
    real = run.default_buckets(cfg)
    mine = engine_buckets(budget, seqs, max_len, page)
    assert (mine.tokens, mine.seqs, mine.pages) == (real.tokens, real.seqs, real.pages)
    explicit = engine_buckets(budget, seqs, max_len, page, (8, 64), (2,), (3, 9))
    assert (explicit.tokens, explicit.seqs, explicit.pages) == ((8, 64), (2,), (3, 9))


def test_padded_shape_matches_ragged_batch():
    batch_lib = pytest.importorskip("pdjax.runtime.batch")
    buckets = Buckets(tokens=(16, 32, 64, 128), seqs=(2, 8), pages=(4, 16))
    padding = EnginePadding(buckets, page_size=16, dense_attention=True)
    rt = batch_lib.Buckets(tokens=buckets.tokens, seqs=buckets.seqs, pages=buckets.pages)
    rng = random.Random(2)
    for _ in range(40):
        out = random_output(rng, rng.randint(0, 1), rng.randint(0, 6))
        if not out.req_ids:
            continue
        out.num_new_tokens = [min(n, 100 // len(out.req_ids)) or 1 for n in out.num_new_tokens]
        out.num_computed_tokens = [min(c, 256 - n) for c, n in zip(out.num_computed_tokens, out.num_new_tokens)]
        out.token_ids = [[0] * n for n in out.num_new_tokens]
        tables = [list(range(-(-(c + n) // 16))) for c, n in zip(out.num_computed_tokens, out.num_new_tokens)]
        rb = batch_lib.build_ragged_batch(out.token_ids, out.num_computed_tokens, tables, out.do_sample,
                                          [None] * len(tables), page_size=16, buckets=rt)
        assert padded_shape(out, padding) == rb.shape_key
        dense = padded_composition(out, padding)
        t_pad, _, p_pad = rb.shape_key
        assert dense.decodes == ((t_pad, p_pad * 16 - 1),) and not dense.prefills
        sparse = padded_composition(out, EnginePadding(buckets, 16, dense_attention=False))
        assert sparse.num_tokens == t_pad
        assert sparse.prefills == compact_composition(out).prefills


def test_padded_cost_is_a_step_function_of_the_bucket():
    spec, hw = get_model_spec("tiny-llama"), get_hardware_spec("a100-80gb-sxm")
    buckets = Buckets(tokens=(16, 32, 64), seqs=(4, 8), pages=(4, 16))
    step = make_step_time(spec, hw, padding=EnginePadding(buckets, 16, True))
    rng = random.Random(3)
    a = random_output(rng, 1, 0)
    a.num_new_tokens, a.num_computed_tokens = [17], [0]
    b = copy.deepcopy(a)
    b.num_new_tokens = [32]
    c = copy.deepcopy(a)
    c.num_new_tokens = [33]
    assert step(a) == step(b) < step(c)          # 17 and 32 tokens share the 32 bucket; 33 pays for 64
    d = copy.deepcopy(b)
    d.num_computed_tokens = [40]                 # 72 tokens of context: 5 pages -> the 16-page bucket
    assert step(d) > step(b)


# ------------------------------------------------------------------------------------------------ speed
def _chat_config(num_requests: int):
    from pdjax.config.files import config_file
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.run import to_plain_dict
    d = to_plain_dict(config_file(__file__, "../configs/sim/chat10k.py"))
    d["workload"]["num_requests"] = num_requests
    return serve_config_from_dict(d)


def _run_chat(num_requests: int):
    from pdjax.sim.run import simulate_config
    result, setup = simulate_config(_chat_config(num_requests))
    assert all(r.finish_reason == "length" for r in result.requests)
    assert len(result.requests) == num_requests
    busy = sum(it.end_time - it.start_time for it in result.iterations)
    assert busy <= result.duration_s * (1 + 1e-9)
    print(f"\n{num_requests} chat requests: {result.num_iterations} iterations in {result.wall_s:.1f} s "
          f"({result.iterations_per_s:.0f} simulated iterations/s)")
    return result


def test_thousand_chat_requests_one_replica():
    _run_chat(1000)


@pytest.mark.slow
def test_ten_thousand_chat_requests_one_replica():
    """Issue 6: a 10,000-request chat trace on one replica simulates in well under a minute (no timing assert;
    the printed iterations/s is the benchmark)."""
    _run_chat(10_000)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_context_taking_step_time_keeps_the_engine_schedule(async_scheduling):
    """The simulator passes a StepContext to a step time that takes one (make_step_time's); with the step-context
    terms at 0 (every profile without them) the engine over a fake device running the same step time without a
    context and the simulator produce the same schedule."""
    cfg = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=8, max_model_len=512, num_pages=256)
    buckets = Buckets(tokens=(16, 64, 128), seqs=(2, 8), pages=(32,))
    step = make_step_time(get_model_spec("tiny-llama"), get_hardware_spec("a100-80gb-sxm"),
                          params=CostParams(per_seq_overhead_s=3e-5),
                          padding=EnginePadding(buckets, 16, False, "blocked"))
    assert step.takes_context
    engine_log, sim_log = [], []
    clock = FakeClock()
    runner = FakeRunner(clock, lambda out: step(out), lambda out, t: engine_log.append(snapshot(out, t)))
    engine = ColocatedEngine(runner, make_scheduler(cfg), clock=clock.clock, sleep=clock.sleep,
                             async_scheduling=async_scheduling)
    engine_result = engine.run(make_requests(30, seed=2))
    sim_result = simulate(make_requests(30, seed=2), [SimInstance("a", make_scheduler(cfg), step)],
                          async_scheduling=async_scheduling,
                          on_schedule=lambda inst, out, t: sim_log.append(snapshot(out, t)))
    assert len(sim_log) == len(engine_log) > 30 and sim_log == engine_log
    assert [(it.start_time, it.end_time) for it in sim_result.iterations] == \
        [(it.start_time, it.end_time) for it in engine_result.iterations]


def test_pending_requests_are_made_on_arrival_and_dropped_once_recorded():
    """Memory (issue 19): a PendingRequest becomes its Request when it arrives, and a finished request is kept
    only as its RequestRecord (not by the simulator, nor by its scheduler's `finished` list); the records equal
    those of a run on ready-made Requests."""
    import gc
    from pdjax.sim.simulator import PendingRequest
    cfg = SchedulerConfig(policy="sarathi", token_budget=96, max_num_seqs=8, max_model_len=512, num_pages=60)
    made = []

    def lazy(req):
        rid, prompt, max_tokens, t = req.request_id, list(req.prompt_token_ids), req.max_tokens, req.arrival_time

        def make():
            made.append(t)
            return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), t)
        return PendingRequest(rid, t, make)

    def on_schedule(instance, out, t):
        assert all(a <= t for a in made), "a request was made before it arrived"

    eager = simulate(make_requests(40, seed=5), [SimInstance("i", make_scheduler(cfg), dyadic_step_time)])
    inst = SimInstance("lazy", make_scheduler(cfg), dyadic_step_time)
    pending = [lazy(r) for r in make_requests(40, seed=5)]
    res = simulate(pending, [inst], on_schedule=on_schedule)
    assert res.requests == eager.requests
    assert [dataclasses.asdict(i) for i in res.iterations] == [dataclasses.asdict(i) for i in eager.iterations]
    assert len(made) == 40 and not inst.scheduler.finished
    gc.collect()
    ids = {p.request_id for p in pending}
    held = [o for o in gc.get_objects() if isinstance(o, Request) and o.request_id in ids and o.finish_reason]
    assert held == [], f"{len(held)} finished requests are still referenced"


class _LandedKV:
    """A fake StagedKV that has already landed (zero transfer time)."""

    def __init__(self, num_tokens: int, page_size: int = 16):
        self.num_tokens, self.num_pages = num_tokens, -(-num_tokens // page_size)
        self.kv_bytes = self.moved_bytes = 0

    def wait(self) -> None:
        pass

    def is_ready(self) -> bool:
        return True


@pytest.mark.parametrize("async_transfer", [False, True], ids=["sync_kv", "async_kv"])
@pytest.mark.parametrize("decode_seqs", [32, 5], ids=["all_fit", "handoffs_wait_for_slots"])
def test_simulator_reproduces_a_disaggregated_pp2_decode_group(monkeypatch, decode_seqs, async_transfer):
    """A disaggregated decode group of one pp2 instance with decode_batches=2 (what instance_scheduler_config gives
    it) keeps 2 batches in flight, its running decodes split over them: the engine's loop (DisaggregatedEngine,
    fake runners, fake clock, KV that lands at once) and the simulator's (simulate_disaggregated) make the same
    per-step schedules, admissions of handed-off KV included, iteration records and requests. Every request arrives
    at 0 and one prefill step hands all off: the engine runs its instances in lock-step rounds, which the simulator
    deliberately does not copy (pdjax/sim/disagg.py), so the two loops agree where only the decode group runs."""
    pytest.importorskip("jax")
    from pdjax.config.deployment import InstanceGroupConfig, instance_scheduler_config
    from pdjax.serving import cluster
    from pdjax.serving.disagg import DisaggregatedEngine, Instance
    from pdjax.sim.disagg import DisaggSimInstance, simulate_disaggregated
    monkeypatch.setattr(cluster, "scatter_kv_pages", lambda caches, pages, staged: caches)   # no KV to move
    base = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=512, page_size=16,
                           num_pages=512)
    prefill_cfg = instance_scheduler_config(base, InstanceGroupConfig(token_budget=8192, max_num_seqs=64), "prefill")
    decode_cfg = instance_scheduler_config(base, InstanceGroupConfig(pp=2, max_num_seqs=decode_seqs), "decode")
    assert decode_cfg.decode_batches == 2 and prefill_cfg.decode_batches == 1
    stage_times = dyadic_stage_times(2)

    def reqs():
        return make_requests(24, seed=5, max_prompt=300, max_out=30, rate_ticks=0)   # every arrival at 0

    engine_log = {"prefill0": [], "decode0": []}
    clock = FakeClock()

    def entry(out, t):
        """snapshot without out.step: the engine's round tops a pipelined instance's queue up before it collects
        (pdjax.serving.cluster, loop step 4), one more schedule() call that finds nothing to run here and only
        advances the scheduler's call counter."""
        snap = snapshot(out, t)
        return snap[:1] + snap[2:], list(out.kv_handoff_req_ids)

    def recorder(name):
        return lambda out, t: engine_log[name].append(entry(out, t))
    prefill_runner = FakeRunner(clock, dyadic_step_time, recorder("prefill0"))
    decode_runner = FakePipelineRunner(clock, stage_times, recorder("decode0"), pp=2)
    for runner in (prefill_runner, decode_runner):
        runner.kv_stages = runner.kv_stage_meshes = None
    engine = DisaggregatedEngine(
        [Instance("prefill0", "prefill", prefill_runner, make_scheduler(prefill_cfg))],
        [Instance("decode0", "decode", decode_runner, make_scheduler(decode_cfg))],
        clock=clock.clock, sleep=clock.sleep, async_transfer=async_transfer,
        transfer=lambda src, pages, dst, num_tokens, wait=False: _LandedKV(num_tokens))
    assert [engine.instance_max_in_flight(i) for i in engine.instances] == [1, 2]
    engine_result = engine.run(reqs())

    sim_log = {"prefill0": [], "decode0": []}
    sim_result = simulate_disaggregated(
        reqs(), [DisaggSimInstance("prefill0", "prefill", make_scheduler(prefill_cfg), dyadic_step_time)],
        [DisaggSimInstance("decode0", "decode", make_scheduler(decode_cfg), stage_times=stage_times,
                           max_in_flight=2)],
        lambda src, dst, n: 0.0,
        on_schedule=lambda inst, out, t: sim_log[inst.name].append(entry(out, t)))
    assert len(engine_log["prefill0"]) == 1, "the premise: one prefill step hands every request off"
    for name in ("prefill0", "decode0"):
        assert len(sim_log[name]) == len(engine_log[name])
        for i, (a, b) in enumerate(zip(engine_log[name], sim_log[name])):
            assert a == b, f"{name} iteration {i} differs"
    assert len(sim_log["decode0"]) > 30
    assert [r.__dict__ for r in sim_result.requests] == [r.__dict__ for r in engine_result.requests]
    key = lambda it: (it.instance, it.step)   # noqa: E731
    assert [(it.instance, it.step, it.start_time, it.end_time, it.num_seqs) for it in sorted(sim_result.iterations,
            key=key)] == [(it.instance, it.step, it.start_time, it.end_time, it.num_seqs)
                          for it in sorted(engine_result.iterations, key=key)]
    assert all(r.finish_reason == "length" for r in sim_result.requests)
    # The case is what it claims: two decode batches in flight, each with at most half the running decodes, and
    # (with few slots) handed-off KV admitted while a batch is in flight.
    its = [it for it in sim_result.iterations if it.instance == "decode0"]
    assert any(b.start_time < a.end_time for a, b in zip(its, its[1:]))
    running, split = set(), []
    for snap, handed in sim_log["decode0"]:
        decoded = [rid for rid in snap[1] if rid not in handed]
        split.append(len(decoded) <= -(-len(running) // 2))
        running |= set(snap[1])
        running -= {r.request_id for r in sim_result.requests if r.token_times and r.token_times[-1] <= snap[0]}
    assert all(split)
    late = [i for i, (_, handed) in enumerate(sim_log["decode0"]) if handed and i > 0]
    assert bool(late) == (decode_seqs < 24), "with few slots, handed-off KV is admitted while batches run"
