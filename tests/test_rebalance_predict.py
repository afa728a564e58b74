"""The predicted-wait SLO trigger of online XpYd rebalancing (pdjax.scheduler.rebalance_predict,
deployment.rebalance_trigger='slo_predicted'): the queue prediction by hand, the trigger firing on a decode backlog
before any miss is certain (where the observed 'slo' trigger does not), nothing predicted without an observed step,
no thrash in the simulator where the load rule thrashes, the config keys. The engine == simulator test is
tests/test_rebalance_slo.py's, run with both triggers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdjax.config.deployment import DeploymentConfig
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.slo import SLOConfig
from pdjax.scheduler import Request
from pdjax.scheduler.mixed import make_borrowing_scheduler
from pdjax.scheduler.rebalance import RebalancingPool, rebalancing_pool
from pdjax.scheduler.rebalance_predict import PredictedSLOTrigger, observed_step, predicted_tpots
from pdjax.scheduler.rebalance_slo import SLOTrigger
from pdjax.scheduler.request import RequestStatus


def _req(rid: str, first: float, max_tokens: int, gaps=(), running: bool = True) -> Request:
    """A handed-off request: first token at `first`, then one token after each of `gaps` (seconds)."""
    req = Request(rid, [1] * 8, SamplingParams(max_tokens=max_tokens), first - 0.01)
    req.first_token_time, req.token_times = first, [first]
    for gap in gaps:
        req.token_times.append(req.token_times[-1] + gap)
    req.output_token_ids = [1] * len(req.token_times)
    req.status = RequestStatus.RUNNING if running else RequestStatus.WAITING_FOR_KV
    return req


# ------------------------------------------------------------------------------------------------ the prediction
def test_predicted_tpots_by_hand():
    """2 slots, step 0.1 s, now 10: A (first 9, 11 tokens, 3 done) ends at 10.8, B (first 9.5, 6 tokens, 2 done) at
    10.4; the queue takes their slots: C (first 9.8, 5 tokens) from 10.4 to 10.8, D (first 9.9, 3 tokens) from 10.8
    to 11.0. TPOT = (end - first) / (max_tokens - 1)."""
    a, b = _req("a", 9.0, 11, (0.1, 0.1)), _req("b", 9.5, 6, (0.1,))
    c, d = _req("c", 9.8, 5, running=False), _req("d", 9.9, 3, running=False)
    got = predicted_tpots([a, c, b, d], slots=2, step=0.1, now=10.0)
    assert got == pytest.approx({"a": 0.18, "b": 0.18, "c": 0.25, "d": 0.55})
    # a free slot is taken at once; never below the observed lower bound (now - first) / (max_tokens - 1)
    assert predicted_tpots([c], slots=1, step=0.1, now=10.0) == pytest.approx({"c": 0.6 / 4})
    assert predicted_tpots([_req("e", 0.0, 3, (0.1, 0.1))], slots=1, step=0.1, now=10.0)["e"] >= 10.0 / 2


def test_observed_step_is_the_median_last_decode_gap_of_running_requests():
    reqs = [_req("a", 0.0, 9, (5.0, 0.1)), _req("b", 0.0, 9, (5.0, 0.3)), _req("c", 0.0, 9, (5.0, 0.2)),
            _req("q", 0.0, 9, (5.0,)),                      # its only gap holds its queue wait: not a step
            _req("w", 0.0, 9, (5.0, 9.0), running=False)]   # not running (preempted): not counted
    assert observed_step(reqs) == pytest.approx(0.2)
    assert observed_step(reqs[3:]) is None


# ------------------------------------------------------------------------------------------------ the trigger in a pool
def _pool(trigger, window_s: float = 1.0):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=512, page_size=16,
                          num_pages=64)
    insts = [SimpleNamespace(name=f"{role}{i}", scheduler=make_borrowing_scheduler(role, cfg))
             for role in ("prefill", "decode") for i in range(2)]
    return RebalancingPool("least_loaded", insts[:2], insts[2:], window_s=window_s, trigger=trigger), insts


def _backlog(pool, running: int, queued: int, now: float = 10.0) -> None:
    """On the decode side (least_loaded: every handoff to decode0, whose scheduler stays empty): `running` requests
    of 101 tokens, 50 done at 0.05 s steps; `queued` ones of 101 tokens handed off just now. TPOT SLO 0.1 s: no
    lower bound is over it (the running ones' is 2.45 / 100)."""
    for i in range(running + queued):
        req = (_req(f"r{i}", now - 2.5, 101, (0.05,) * 49) if i < running else
               _req(f"q{i}", now - 0.01, 101, running=False))
        pool.trigger.on_prefill(req, req.arrival_time)
        pool.pick_decode(req, req.first_token_time, None)


def test_fires_on_a_decode_backlog_before_any_miss_is_certain():
    """8 running on 8 slots, 24 queued: at a 0.05 s step the queue's second wave finishes ~12.5 s after its first
    token (TPOT 0.125 s), the third's 0.175 s: 16 of 32 predicted over 0.1 s. The observed trigger sees no certain
    miss and keeps 2P2D; the predicting one takes a prefill instance after the 1 s window."""
    for make, flips in ((SLOTrigger, []), (PredictedSLOTrigger, [("prefill0", "prefill", "decode")])):
        pool, (p0, p1, d0, d1) = _pool(make(ttft_s=1.0, tpot_s=0.1, window_s=1.0))
        _backlog(pool, running=8, queued=24)
        pool.return_idle(10.0)
        pool.return_idle(11.0)
        assert [(f.instance, f.src, f.dst) for f in pool.flips] == flips, make.name
        assert pool.trigger.samples("decode", 0.1) == [] or make is PredictedSLOTrigger
    # over since the last handoff (9.99); at 11 the third wave ends at 11 + 2.55 + 3 x 5 s: (28.55 - 9.99) / 100
    assert pool.trigger.latency("decode") == pytest.approx(0.1856)
    assert pool.flips[0].reason.startswith("decode over for 1.010s")
    assert pool.summary()["trigger"] == "slo_predicted"


def test_a_short_queue_within_the_tpot_does_not_fire():
    """8 running, 8 queued: the queue's one wave ends ~7.6 s after its first token (TPOT ~0.076 s): within 0.1 s."""
    pool, _ = _pool(PredictedSLOTrigger(ttft_s=1.0, tpot_s=0.1, window_s=1.0))
    _backlog(pool, running=8, queued=8)
    for t in (10.0, 11.0, 12.0):
        pool.return_idle(t)
    assert not pool.flips and pool.trigger.latency("decode") < 0.1


def test_nothing_is_predicted_without_an_observed_step():
    """A queue with nothing decoded yet (no step observed anywhere on the side): only certain misses count, as in
    the observed trigger."""
    pool, _ = _pool(PredictedSLOTrigger(ttft_s=1.0, tpot_s=0.1, window_s=1.0))
    _backlog(pool, running=0, queued=24)
    pool.return_idle(10.0)
    assert pool.trigger.samples("decode", 0.1) == [] and pool.trigger.latency("decode") == 0.0


# ------------------------------------------------------------------------------------------------ the simulator
def test_no_thrash_on_a_stationary_mix_where_the_load_rule_thrashes():
    """2P1D on stationary 16:1 at 2.875 req/s per GPU (the load rule flips there three times:
    test_rebalance_slo): the predicted decode TPOT (P90 ~0.05 s of 0.1 s) never puts the decode side over."""
    from test_rebalance_slo import _opt13b_16to1
    flips, share = _opt13b_16to1("slo_predicted", 2, 1, 2.875)
    assert flips == [] and share >= 0.9


# ------------------------------------------------------------------------------------------------ config
def test_the_slo_keys_are_required_in_one_line():
    from pdjax.config.serving import serve_config_from_dict
    dep = DeploymentConfig(kind="disaggregated", rebalance=True, rebalance_trigger="slo_predicted")
    with pytest.raises(ValueError, match="deployment.rebalance_trigger='slo_predicted' with slo.ttft=0.0") as e:
        rebalancing_pool(dep, [], [], SLOConfig(tpot=0.1))
    assert "\n" not in str(e.value)
    config = {"backend": "sim", "model": {"checkpoint": "tiny-mha"}, "slo": {"tpot": 0.1},
              "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 8},
                           "output_len": {"kind": "fixed", "value": 4}, "num_requests": 2, "vocab_size": 256},
              "deployment": {"kind": "disaggregated", "prefill": {"num_instances": 2}, "rebalance": True,
                             "rebalance_trigger": "slo_predicted"}}
    with pytest.raises(ValueError, match="deployment.rebalance_trigger='slo_predicted' with slo.ttft=0.0") as e:
        serve_config_from_dict(config)
    assert "\n" not in str(e.value)
    config["deployment"]["rebalance_trigger"] = "predicted"
    with pytest.raises(ValueError, match="'slo_predicted'") as e:
        serve_config_from_dict(config)
    assert "\n" not in str(e.value)


def test_regime_variants_carry_the_trigger_and_the_point_s_slos():
    """A regime grid with rebalance_trigger='slo_predicted': the variants' serve configs carry the trigger and the
    point's SLOs, and their simulations are one task per SLO point (as 'slo')."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim import placement as pl, regime as rg
    grid = rg.RegimeGrid(model="opt-13b", hardware="a100-80gb-sxm", gpu_budget=3, workloads=("16:1",),
                         slo_scales=(0.4, 1.0), links=("nvlink",), num_requests=24, total_tokens=384,
                         max_model_len=1024, max_num_seqs=64, max_pp=1, colocated=("sarathi",), rebalance=True,
                         rebalance_trigger="slo_predicted")
    problem, variant = next((q, p) for q, p in rg.point_problems(grid, "16:1", 0.4, "nvlink")["disaggregated"]
                            if p.rebalance)
    cfg = pl.serve_config(problem, variant, 1.0)
    assert cfg["slo"] == {"ttft": problem.ttft_s, "tpot": problem.tpot_s}
    assert serve_config_from_dict(cfg).deployment.rebalance_trigger == "slo_predicted"
    tasks = [t for t in rg._tasks(grid, rg.sarathi_budgets(grid)) if t.link is not None]
    assert all(len(t.problems) == (1 if t.placement.rebalance else 2) for t in tasks)
