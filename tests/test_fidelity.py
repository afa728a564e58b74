"""Fidelity here (issue 6 "Must hold"; issue 12 reports the tail): calibrate on the CPU engine, run one online
workload for real and in simulation; simulated P50 TTFT, P50 TBT and P99 TBT within 25% of the real run, as the
median over three seeds (issue 12's 10% target on the median P99 TBT is what `python -m experiments.sim_fidelity`
reports, see experiments/README.md; on a loaded shared machine it is not reliably met).

The slow test is the must-hold check on configs/sim/fidelity_cpu.py (40 requests, ~2 minutes: compiling the
engine's 20 bucket shapes dominates). Its accuracy needs a machine whose load does not change between the
calibration and the real run (other jobs on a shared 2-core box can double step times for a while), which is why
it is not in the default run. The fast test runs the ':small' variant (2 bucket shapes, 16 requests, a quick
calibration grid, ~10 s) end to end and checks the pipeline and its consistency (same workload, a sound fit,
about as many iterations, every latency present), not the timing accuracy; `python -m experiments.sim_fidelity`
reports the actual errors. Each run also measures the step-context terms (shape switch, idle wake) and the
engine loop's step noise, and simulates the same profile without each.
"""
from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("jax")

from pdjax.experiment.fidelity import MUST_HOLD, format_table, run_fidelity, run_seeds, summarize
from pdjax.config.files import config_file
from pdjax.experiment.run import to_plain_dict

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "sim" / "fidelity_cpu.py"


def fidelity_config(arg: str) -> dict:
    return to_plain_dict(config_file(str(CONFIG), CONFIG.name, arg))


def check_consistent(report: dict) -> None:
    assert report["real_compiles_during_run"] == 0, "a compile inside the timed run would distort the reference"
    for metric in MUST_HOLD:
        entry = report["metrics"][metric]
        assert entry["real"] > 0 and entry["sim"] > 0 and entry["rel_error"] is not None, (metric, entry)
    # The simulated run is the same workload: same request count, and about as many iterations.
    real_it, sim_it = report["real_iterations"], report["sim_iterations"]
    assert abs(real_it - sim_it) <= 0.25 * real_it, (real_it, sim_it)
    fit = report["calibration_fit"]
    assert fit["num_measurements"] >= 10 and fit["median_rel_error"] < 0.5
    # The step replay re-costs every batch the engine ran (one per iteration) and classifies it.
    replay = report["step_replay"]
    assert replay is not None and replay["all"]["num_steps"] == real_it
    assert sum(replay[k]["num_steps"] for k in ("steady", "shape_switch", "after_idle")) == real_it
    assert report["metrics"]["ttft.p99"]["real"] > 0 and report["metrics"]["ttft.p99"]["sim"] > 0
    # The step-context terms were measured directly (bracketing the real run) and fitted into the profile; the
    # same profile with them at 0 is simulated too (what they buy), when any came out > 0.
    import json
    profile = json.loads(pathlib.Path(report["profile"]).read_text())
    ctx = profile["step_context"]
    assert ctx["switch"] and ctx["idle"] and ctx["rounds"] >= 2
    assert {"shape_switch_s", "idle_wake_s", "idle_wake_tau_s", "idle_wake_fixed_s"} <= set(profile["fitted"])
    assert profile["padding"] == {"dense_attention": False, "attention": "blocked", "decode_keys": 128}
    # The step noise: fitted from the engine-loop probes (before and after the real run) into the profile, and
    # the same profile simulated without it.
    noise = profile["step_noise"]
    assert len(noise["quantiles"]) == 101 and noise["num_steps"] >= 100
    assert noise["quantiles"] == sorted(noise["quantiles"]) and noise["quantiles"][0] > 0
    assert set(report["without_step_noise"]["metrics"]) == set(report["metrics"])
    without = report["without_step_context"]
    if any(profile["cost_params"][k] > 0 for k in ("shape_switch_s", "idle_wake_s", "idle_wake_fixed_s")):
        assert set(without["metrics"]) == set(report["metrics"]) and without["step_replay"] is not None
    else:
        assert without is None


def test_fidelity_pipeline_small_run(tmp_path):
    report = run_fidelity(fidelity_config("small"), str(tmp_path), repeats=3, quick=True)
    check_consistent(report)
    assert report["num_requests"] == 16 and report["seed"] == 0
    for name in ("real", "sim"):
        assert (tmp_path / name / "results.json").is_file()
    # The per-seed table and the median / target line (one seed here: its own errors).
    result = {"summary": summarize([report]), "runs": [report]}
    assert result["summary"]["median_rel_error"]["tbt.p99"] == report["metrics"]["tbt.p99"]["rel_error"]
    table = format_table(result)
    assert "median P99 TBT error <= 10%" in table and ("PASS" in table or "FAIL" in table)


def test_summarize_takes_the_median_over_seeds():
    def fake(seed, err):
        return {"seed": seed, "metrics": {m: {"real": 1.0, "sim": 1.0 + err, "rel_error": err}
                                          for m in ("ttft.p50", "ttft.p90", "ttft.p99", "tbt.p50", "tbt.p90",
                                                    "tbt.p99", "tpot.p50", "e2e.p50", "sched_delay.p50",
                                                    "iterations.step_time.p50", "duration_s")}}
    s = summarize([fake(0, 0.30), fake(1, 0.05), fake(2, 0.08)])
    assert s["seeds"] == [0, 1, 2] and s["median_rel_error"]["tbt.p99"] == 0.08
    assert s["target"]["pass"] and s["must_hold_within_25pct_median"]


@pytest.mark.slow
def test_fidelity_must_hold(tmp_path):
    result = run_seeds(fidelity_config("full"), str(tmp_path), (0, 1, 2), repeats=5, quick=False)
    for report in result["runs"]:
        check_consistent(report)
    median = result["summary"]["median_rel_error"]
    for metric in MUST_HOLD:
        assert median[metric] <= 0.25, f"{metric}: median error over seeds {median[metric]:.3f}\n" + \
            format_table(result)


def test_calibration_without_enough_probe_steps_writes_a_profile_without_noise(tmp_path):
    """A probe that ran too few steady decode steps (here: none) leaves the noise out, says why, and the profile
    still loads (deterministic steps)."""
    from pdjax.experiment.calibrate import fit_and_save
    from pdjax.runtime.probe import engine_grid, profile_engine
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.serving.build import build_runner
    from pdjax.sim.profile import load_profile
    cfg = serve_config_from_dict({**fidelity_config("small"), "backend": "real"})
    runner = build_runner(cfg)
    measured = profile_engine(runner, engine_grid(cfg, runner, quick=True), page_size=runner.page_size, repeats=1)
    report = fit_and_save(cfg, runner, measured, repeats=1, out_path=str(tmp_path / "p.json"), probe=[([], [])])
    assert "expected the same non-zero number" in report["step_noise"]["skipped"]
    assert load_profile(tmp_path / "p.json").step_noise == ()
