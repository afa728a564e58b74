"""Capacity search in simulation: parallel bisection on the rate with DESIGN §4's rule."""
from __future__ import annotations

import os
import pickle

import pytest

from pdjax.sim.capacity import ConfigProbe, parallel_capacity_search, search_config_capacity, simulate_summary

TRUE_CAPACITY = 3.3


def fake_summary(rate: float) -> dict:
    """P99 TBT grows with the rate and crosses 0.1 s at TRUE_CAPACITY; scheduling delay stays small."""
    return {"tbt": {"p99": 0.1 * rate / TRUE_CAPACITY}, "sched_delay": {"p50": 0.01}}


@pytest.mark.parametrize("parallel", [1, 3])
def test_parallel_bisection_brackets_the_capacity(parallel):
    res = parallel_capacity_search(fake_summary, 0.1, 10.0, limits={"tbt.p99": 0.1}, parallel=parallel,
                                   rel_tol=0.02, max_rounds=30, map_fn=map)
    good, bad = res.bracket
    assert good <= TRUE_CAPACITY < bad and bad - good <= 0.02 * good
    assert res.capacity_rps == good
    assert all(ok == (rate <= TRUE_CAPACITY) for rate, ok, _ in res.probes)
    if parallel == 3:
        # Each round cuts the bracket by 4 instead of 2: fewer rounds than plain bisection needs.
        plain = parallel_capacity_search(fake_summary, 0.1, 10.0, limits={"tbt.p99": 0.1}, parallel=1,
                                         rel_tol=0.02, max_rounds=30, map_fn=map)
        assert res.rounds < plain.rounds


def test_edges_and_the_scheduling_delay_rule():
    res = parallel_capacity_search(fake_summary, 5.0, 9.0, limits={"tbt.p99": 0.1}, map_fn=map)
    assert res.capacity_rps is None and len(res.probes) == 2
    res = parallel_capacity_search(fake_summary, 0.5, 2.0, limits={"tbt.p99": 0.1}, map_fn=map)
    assert res.capacity_rps == 2.0
    queued = lambda rate: {**fake_summary(rate), "sched_delay": {"p50": 1.0 * rate}}  # noqa: E731
    res = parallel_capacity_search(queued, 0.5, 10.0, limits={"tbt.p99": 0.1}, rel_tol=0.01, max_rounds=40,
                                   map_fn=map)
    assert 1.97 <= res.capacity_rps <= 2.0     # the 2 s median scheduling delay binds first (rate 2)
    with pytest.raises(ValueError, match="lo=2.0, hi=1.0"):
        parallel_capacity_search(fake_summary, 2.0, 1.0, limits={})
    with pytest.raises(ValueError, match="parallel=0"):
        parallel_capacity_search(fake_summary, 1.0, 2.0, limits={}, parallel=0)


def small_config():
    return {"backend": "sim", "seed": 1, "model": {"checkpoint": "llama-2-7b"}, "engine": {"progress": False},
            "scheduler": {"policy": "sarathi", "token_budget": 512, "max_num_seqs": 64, "max_model_len": 2048,
                          "page_size": 16, "num_pages": 1024},
            "workload": {"preset": "chat", "num_requests": 40, "rate": 1.0, "vocab_size": 32000,
                         "fit_to_model": True},
            "slo": {"tbt": 0.1}, "sim": {"hardware": "a100-80gb-sxm"}}


def test_simulated_probes_in_processes():
    probe = ConfigProbe(small_config())
    pickle.dumps(probe)
    slow, fast = simulate_summary(small_config(), 0.5), simulate_summary(small_config(), 50.0)
    assert slow["num_completed"] == fast["num_completed"] == 40
    assert fast["sched_delay"]["p50"] > slow["sched_delay"]["p50"]   # a flood queues; a trickle does not
    res = parallel_capacity_search(probe, 0.5, 50.0, limits={"ttft.p50": 0.2}, parallel=2, rel_tol=0.5,
                                   max_rounds=2)
    assert res.rounds == 2 and len(res.probes) == 4
    assert res.capacity_rps is not None and 0.5 <= res.capacity_rps < 50.0


def test_an_open_bracket_is_not_reported_as_the_capacity():
    """issue 27 item 6: when the top probe held, --hi was reported as the capacity; now null, with the bound."""
    report = search_config_capacity(small_config(), tbt_p99=10.0, lo=0.05, hi=0.1, map_fn=map)
    assert report["capacity_rps"] is None and report["capacity_at_least_rps"] == 0.1
    assert report["bracket"] == [0.1, float("inf")] and "raise hi" in report["note"]
    with pytest.raises(ValueError, match="tbt_p99=-1"):
        search_config_capacity(small_config(), tbt_p99=-1, map_fn=map)


@pytest.mark.parametrize("flag, message", [("--slo_tbt_p99=-1", "--slo_tbt_p99=-1.0, expected a limit in seconds > 0"),
                                           ("--rel_tol=0", "--rel_tol=0.0, expected a fraction in (0, 1)")])
def test_capacity_cli_refuses_bad_limits_in_one_line(flag, message):
    import subprocess
    import sys
    args = [sys.executable, "-m", "experiments.capacity", "--config=configs/serve.py", "--config.backend=sim",
            "--slo_tbt_p99=0.1", flag]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {message}", proc.stderr
