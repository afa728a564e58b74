"""Simulator fidelity on this machine: calibrate on the CPU engine, run one online workload for real and in
simulation, compare the latency metrics.

    python -m experiments.sim_fidelity                                   # configs/sim/fidelity_cpu.py
    python -m experiments.sim_fidelity --profile=pdjax/sim/profiles/host-cpu.json   # skip calibration

Steps: build the real engine's runner for the config (the same `build_runner` run_real uses) and compile its
buckets; unless --profile is given, time experiments.calibrate's grid on that runner; serve the workload on the
real engine (ColocatedEngine, as run_real does) into <workdir>/real; unless --profile, time the grid again and
fit the profile on each point's mean of the two medians (bracketing: on a shared machine other jobs change step
times over minutes, and the real run sits between the two timings); simulate the same config, seed and workload
with the profile into <workdir>/sim; print JSON with, per metric, real vs simulated and the relative error, the
simulator's speed (simulated iterations per wall second) and the load drift (after / before ratio of the grid).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, Optional

from absl import flags

from pdjax.experiment import cli

_CONFIG = cli.define_config_file("config", "configs/sim/fidelity_cpu.py", "Serve config of the workload.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pdjax_sim_fidelity", "Outputs: real/, sim/, profile.json.")
_PROFILE = flags.DEFINE_string("profile", "", "Use this sim profile instead of calibrating now.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Calibration: timed runs per grid point.")
_QUICK = flags.DEFINE_bool("quick", False, "Calibration: the smaller grid.")

METRICS = ("ttft.p50", "ttft.p90", "tbt.p50", "tbt.p90", "tbt.p99", "tpot.p50", "e2e.p50", "sched_delay.p50",
           "iterations.step_time.p50", "duration_s")
MUST_HOLD = ("ttft.p50", "tbt.p50", "tbt.p99")     # within 25% (issue 6); target 10%


def _value(summary: Dict[str, Any], path: str) -> Optional[float]:
    node: Any = summary
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def compare(real: Dict[str, Any], sim: Dict[str, Any]) -> Dict[str, Dict[str, Optional[float]]]:
    out = {}
    for path in METRICS:
        r, s = _value(real, path), _value(sim, path)
        err = abs(s - r) / r if r and s is not None else None
        out[path] = {"real": r, "sim": s, "rel_error": err}
    return out


def run_fidelity(config_dict: Dict[str, Any], workdir: str, *, profile: str = "", repeats: int = 5,
                 quick: bool = False, log=None) -> Dict[str, Any]:
    """The whole check (module docstring); returns the report dict."""
    from experiments.calibrate import engine_grid, fit_and_save, profile_engine
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.metrics import write_run_outputs
    from pdjax.scheduler import make_scheduler
    from pdjax.scheduler import request_from_workload
    from pdjax.serving.engine import ColocatedEngine
    from pdjax.serving.build import build_runner
    from pdjax.sim.run import run_sim
    from pdjax.workload import make_workload

    os.makedirs(workdir, exist_ok=True)
    config_dict = json.loads(json.dumps(config_dict))
    config_dict["backend"] = "real"
    cfg = serve_config_from_dict(config_dict)
    runner = build_runner(cfg)
    t = time.perf_counter()
    runner.warmup()
    compile_s = time.perf_counter() - t
    calibration = None
    before = None
    if not profile:
        grid = engine_grid(cfg, runner, quick)
        before = profile_engine(runner, grid, page_size=runner.page_size, repeats=repeats, log=log)

    workload = make_workload(cfg.workload, seed=cfg.seed)
    offline = cfg.engine.mode == "offline"
    requests = [request_from_workload(w, eos_token_id=cfg.model.eos_token_id, offline=offline, seed=cfg.seed)
                for w in workload]
    sched_cfg = cfg.scheduler
    if not sched_cfg.vocab_size:   # as run_real
        sched_cfg = dataclasses.replace(sched_cfg, vocab_size=runner.spec.vocab_size)
    engine = ColocatedEngine(runner, make_scheduler(sched_cfg), async_scheduling=cfg.engine.async_scheduling)
    compiles_before = runner.compile_count
    result = engine.run(requests)
    real = write_run_outputs(os.path.join(workdir, "real"), config_dict, result.requests, result.iterations,
                             cfg.slo.as_dict(), plots=False,
                             extra={"engine": {"backend": "real", "compiles_during_run":
                                               runner.compile_count - compiles_before}})

    drift = None
    if before is not None:
        # Bracketing calibration: the grid is timed again after the real run and each point's two medians are
        # averaged, so a load change on a shared machine during the real run is seen half-way, not missed.
        after = profile_engine(runner, grid, page_size=runner.page_size, repeats=repeats, log=log)
        measured = [(kind, out, 0.5 * (a + b)) for (kind, out, a), (_, _, b) in zip(before, after)]
        profile = os.path.join(workdir, "profile.json")
        calibration = fit_and_save(cfg, runner, measured, repeats=2 * repeats, out_path=profile,
                                   note=" (before and after the real run)",
                                   command="python -m experiments.sim_fidelity " + " ".join(sys.argv[1:]))
        ratios = sorted(b / a for (_, _, a), (_, _, b) in zip(before, after))
        drift = {"median_ratio_after_vs_before": ratios[len(ratios) // 2], "min_ratio": ratios[0],
                 "max_ratio": ratios[-1]}

    sim_dict = json.loads(json.dumps(config_dict))
    sim_dict["backend"] = "sim"
    sim_dict.setdefault("sim", {})
    sim_dict["sim"]["profile"] = profile
    sim_dict["sim"]["hardware"] = "host-cpu"
    sim_cfg = serve_config_from_dict(sim_dict)
    sim = run_sim(sim_cfg, sim_dict, os.path.join(workdir, "sim"), plots=False)
    metrics = compare(real, sim)
    return {
        "metrics": metrics,
        "must_hold_within_25pct": all(metrics[m]["rel_error"] is not None and metrics[m]["rel_error"] <= 0.25
                                      for m in MUST_HOLD),
        "max_must_hold_error": max(metrics[m]["rel_error"] or 0.0 for m in MUST_HOLD),
        "num_requests": real["num_requests"],
        "real_iterations": real["iterations"]["num_iterations"],
        "sim_iterations": sim["iterations"]["num_iterations"],
        "sim_iterations_per_s": sim["sim"]["iterations_per_s"],
        "real_compiles_during_run": real["engine"]["compiles_during_run"],
        "compile_s": compile_s,
        "profile": profile,
        "calibration_fit": calibration["fit"] if calibration else None,
        "load_drift": drift,
        "workdir": workdir,
    }


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.run import to_plain_dict
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    config = to_plain_dict(_CONFIG.value)
    try:
        serve_config_from_dict({**config, "backend": "real"})
    except ValueError as e:
        raise cli.UserError(cli.one_line(e)) from None
    if _PROFILE.value and not os.path.isfile(_PROFILE.value):
        raise cli.UserError(f"--profile={_PROFILE.value!r} is not a file")
    report = run_fidelity(config, _WORKDIR.value, profile=_PROFILE.value,
                          repeats=_REPEATS.value, quick=_QUICK.value, log=log)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    cli.run(main)
