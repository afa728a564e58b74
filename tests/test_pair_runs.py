"""Pair runs (pdjax.scheduler.pair_runs, Simulation.pair_run) through the events that change their groups change
nothing: prompts completed mid-run (and by the in-flight batch's collect), requests finishing mid-run (their pages
freed between the schedules' allocations), requests admitted from the waiting queue as they arrive (budget, sequence
slots, the watermark), first tokens that finish a request, identical arrival times. The same simulation with
decode_runs=False is the reference, compared record for record with scheduler counters and page pools
(test_decode_runs.assert_same); each case also checks that the runs it means to exercise happened."""
from __future__ import annotations

import random

import pytest
from test_decode_runs import assert_same, run

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request
from pdjax.scheduler import pair_runs
from pdjax.sim.cost_model import stage_device_times
from pdjax.sim.step_cost import stage_times_fn


def mixed_requests(n: int, seed: int, rate: float, ties: bool):
    """Prompts of 1 .. 700 tokens (one chunk or several at the budgets below), outputs of 1 .. 80 tokens (1: the
    first token finishes the request); ties: arrivals in bunches at one instant."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        if not ties or i % 3 == 0:
            t += rng.expovariate(rate)
        prompt = [rng.randrange(1, 500) for _ in range(rng.choice([1, 2, rng.randint(3, 700)]))]
        max_tokens = rng.choice([1, 2, 3, rng.randint(4, 80)])
        reqs.append(Request(f"m{i:03d}", prompt, SamplingParams(max_tokens=max_tokens), t))
    return reqs


# (scheduler config, arrival rate, ties): room for everyone; few sequence slots (admission waits for a finish);
# a watermark over a small pool (admission waits for pages); the prefill guard, chunk cap and tiles; dynamic chunks.
CASES = {
    "roomy": (dict(policy="sarathi", token_budget=256, max_num_seqs=32), 60.0, False),
    "few_slots": (dict(policy="sarathi", token_budget=256, max_num_seqs=5), 60.0, True),
    "watermark": (dict(policy="sarathi", token_budget=128, max_num_seqs=32, num_pages=160, watermark=0.1), 60.0,
                  False),
    "guard_cap_tile": (dict(policy="sarathi", token_budget=256, max_num_seqs=32, min_prefill_tokens=32,
                            long_prefill_token_threshold=96, tile_size=16), 60.0, True),
    "dynamic": (dict(policy="sarathi", token_budget=256, max_num_seqs=32, dynamic_chunking=True,
                     dynamic_chunk_ref_context=256, dynamic_chunk_min_tokens=32), 60.0, False),
}


def count_pair_events(monkeypatch) -> dict:
    """Patch PairRun.apply to count what the applied runs did: half-steps, admissions, requests finished before
    the run's last collect, prompts completed before it."""
    seen = {"half_steps": 0, "admitted": 0, "finished_mid_run": 0, "completed_mid_run": 0}
    apply = pair_runs.PairRun.apply

    def counting(self, times, half_steps):
        apply(self, times, half_steps)
        seen["half_steps"] += half_steps
        seen["admitted"] += sum(1 for h, _ in self.admitted if h < half_steps)
        seen["finished_mid_run"] += sum(1 for r in self.finished if r.finish_time < times[half_steps])
        seen["completed_mid_run"] += sum(1 for done in self._p_done for h in done if h + 2 < half_steps)

    monkeypatch.setattr(pair_runs.PairRun, "apply", counting)
    return seen


@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("pp,max_in_flight", [(2, None), (1, 2)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_pair_runs_through_group_changes_change_nothing(name, pp, max_in_flight, seed, monkeypatch):
    params, rate, ties = CASES[name]
    cfg = SchedulerConfig(max_model_len=1024, page_size=16, **{"num_pages": 1024, **params})
    reference = run(cfg, False, pp=pp, max_in_flight=max_in_flight, requests=mixed_requests(40, seed, rate, ties))
    seen = count_pair_events(monkeypatch)
    got = run(cfg, True, pp=pp, max_in_flight=max_in_flight, requests=mixed_requests(40, seed, rate, ties))
    assert_same(reference, got)
    assert seen["half_steps"] > len(got[0].iterations) // 3, "the case is meant to run many half-steps in bulk"
    assert seen["admitted"] > 0 and seen["finished_mid_run"] > 0 and seen["completed_mid_run"] > 0, seen


def test_pair_runs_cover_a_long_steady_run(monkeypatch):
    """Many requests at a steady rate: most half-steps in bulk, in a few long runs (the bench's shape)."""
    cfg = SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=64, max_model_len=1024, page_size=16,
                          num_pages=2048)
    reference = run(cfg, False, pp=2, requests=mixed_requests(120, 5, 60.0, False))
    seen = count_pair_events(monkeypatch)
    got = run(cfg, True, pp=2, requests=mixed_requests(120, 5, 60.0, False))
    assert_same(reference, got)
    assert seen["half_steps"] > 0.75 * len(got[0].iterations)


@pytest.mark.parametrize("counts", [(40, 40), (1, 79), (3,), (10, 10, 20)])
def test_stage_times_fn_equals_the_cost_model(counts):
    """step_cost.stage_times_fn (the decode and chunk stage functions' last step) == cost_model.stage_device_times
    bit for bit, launch floors binding or not."""
    rng = random.Random(len(counts))
    for _ in range(500):
        launch = rng.choice([0.0, 1e-7, 1e-5, 1e-3])
        kernels = rng.randint(1, 12)
        args = (rng.uniform(0, 2e-3), rng.uniform(0, 1e-3), rng.uniform(0, 1e-3), rng.uniform(0, 1e-3))
        fn = stage_times_fn(counts, launch, kernels)
        assert fn(*args) == tuple(stage_device_times(counts, *args, launch, kernels))


def edge_requests(n: int, seed: int, rate: float, max_len: int):
    """Bunched arrivals; prompts of 1, 2, 16, 128, 256 (== max_model_len for some cases) or up to max_len - 1
    tokens; outputs of 1 .. 100 tokens or max_len (then max_model_len ends the request)."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        if rng.random() < 0.7:
            t += rng.expovariate(rate)
        length = rng.choice([1, 2, 16, 128, 256, rng.randint(3, max_len - 1)])
        max_tokens = rng.choice([1, 2, 3, rng.randint(4, 100), max_len])
        prompt = [rng.randrange(1, 500) for _ in range(length)]
        reqs.append(Request(f"s{i:03d}", prompt, SamplingParams(max_tokens=max_tokens), t))
    return reqs


def random_case(seed: int):
    """(SchedulerConfig or None where it is invalid, pp, max_in_flight, requests) drawn from seed: budgets, slots,
    small page pools (preemption), watermarks, the guard, tiles, chunk caps, a few vllm_v0 / decode_first cases;
    max_model_len 256 .. 1024."""
    rng = random.Random(1000 + seed)
    params = dict(policy="sarathi", token_budget=rng.choice([32, 64, 128, 256, 512]),
                  max_num_seqs=rng.choice([2, 3, 5, 8, 32]), num_pages=rng.choice([64, 100, 160, 400, 1024]),
                  watermark=rng.choice([0.0, 0.01, 0.1]))
    if rng.random() < 0.3:
        params["min_prefill_tokens"] = 16
    if rng.random() < 0.3:
        params["tile_size"] = 16
    if rng.random() < 0.2:
        params["long_prefill_token_threshold"] = 48
    if rng.random() < 0.15:
        params = dict(policy=rng.choice(["vllm_v0", "decode_first"]), token_budget=2048,
                      max_num_seqs=rng.choice([3, 8, 16]), num_pages=rng.choice([100, 1024]))
    max_len = rng.choice([256, 512, 1024])
    try:
        cfg = SchedulerConfig(max_model_len=max_len, page_size=16, **params)
    except ValueError:                 # a pool too small for one max-length request
        cfg = None
    pp, max_in_flight = rng.choice([(2, None), (1, 2), (3, None)])
    rate = rng.choice([20.0, 60.0, 200.0])
    return cfg, pp, max_in_flight, edge_requests(rng.choice([20, 50]), seed, rate, max_len)


def test_pair_runs_on_random_configs_change_nothing(monkeypatch):
    """40 random cases (random_case), among them prompts of exactly max_model_len tokens whose first token ends
    them, completed by the in-flight batch after a preemption (seed 194)."""
    seen = count_pair_events(monkeypatch)
    ran = 0
    for seed in range(170, 210):
        cfg, pp, max_in_flight, _ = random_case(seed)
        if cfg is None:
            continue
        reference = run(cfg, False, pp=pp, max_in_flight=max_in_flight, requests=random_case(seed)[3])
        got = run(cfg, True, pp=pp, max_in_flight=max_in_flight, requests=random_case(seed)[3])
        assert_same(reference, got)
        ran += 1
    assert ran >= 35
    assert seen["half_steps"] > 10_000 and seen["admitted"] > 300 and seen["finished_mid_run"] > 300, seen
