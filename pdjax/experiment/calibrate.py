"""Calibrate the simulator on the machine at hand: probe the real engine and fit a machine profile
(`python -m experiments.calibrate`, experiments.sim_fidelity). This module composes the two sides, which never
import each other: the runner probes of pdjax.runtime.probe (the grid, the step context), the engine-loop probe
below (the real ColocatedEngine serving a probe workload), and the fits of pdjax.sim.calibration
(`engine_profile`).

The engine pads every step to its (T, S, P) buckets; the fit sees each measurement as the work the padded step
does under the attention implementation the runner actually runs (`engine_padding`; pdjax.sim.step_cost.
padded_composition, plus a per-real-sequence host cost: pdjax.sim.calibration.fit_padded_engine): the jnp
reference attends every padded token over every padded page (dense: cost by the page bucket); the blocked XLA
path (the CPU default) and the Pallas kernels loop over each sequence's own pages (cost by the real context; the
blocked kernel's decode pass by the longest context in it, over its padded width), and only the linear layers see
the token padding. The profile stores that choice ("padding") and, for host-cpu, the measured HardwareSpec the
efficiencies are relative to ("hardware_spec"), so the simulator reproduces the fit exactly; its "source" names
the attention implementation and the buckets.

Step context: `profile_step_context` (a short dedicated measurement after the grid) as paired differences;
pdjax.sim.calibration.fit_step_context turns them into CostParams' shape_switch_s and
idle_wake_{s,tau_s,fixed_s}, stored with the raw data ("step_context") in the profile.

Step noise (`probe_engine_loop`, last): the real engine loop serves a probe workload of its own (not the
configured one); the fitted model replays its batches (pdjax.sim.replay) and the measured / predicted ratios of
its steady decode steps become the profile's "step_noise" quantiles, which the simulator samples per step
(pdjax.sim.step_cost.StepNoise): the engine loop's step times scatter (host work, thread wake-ups, the OS) far
more than back-to-back timings of one step do, and that scatter is the P99 TBT of a CPU engine.
"""
from __future__ import annotations

import dataclasses
import os
import random
import sys
import time

from pdjax.config.sampling import SamplingParams
from pdjax.runtime.probe import (context_outputs, engine_grid, profile_engine, profile_step_context,
                                 runner_padding)
from pdjax.scheduler import Request, make_scheduler
from pdjax.serving.engine import ColocatedEngine
from pdjax.sim.calibration import engine_profile, median_decode_step_s
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import save_profile
from pdjax.sim.replay import ScheduleRecorder
from pdjax.sim.step_cost import EnginePadding, padding_from_profile

PROBE_SEED = 9001        # the engine-loop probe's own requests (never the configured workload)
PROBE_REQUESTS = 32
PROBE_CONCURRENCY = 2.0  # requests decoding at once, on average (Poisson rate from the measured decode step)


def engine_padding(runner) -> EnginePadding:
    """How `runner` pads steps (pdjax.runtime.probe.runner_padding) at its own buckets and page size."""
    return padding_from_profile(runner_padding(runner), runner.buckets, runner.page_size)


def probe_engine_loop(cfg, runner, decode_step_s: float, *, num_requests: int = PROBE_REQUESTS,
                      seed: int = PROBE_SEED):
    """Serve a probe workload on the real engine loop (ColocatedEngine, the config's scheduler and async mode);
    returns (batches, iterations) for pdjax.sim.replay (the step-time noise: `fit_and_save(probe=...)`).

    The probe is independent of the configured workload: prompts uniform in [8, max_len / 2] tokens, outputs
    uniform in [16, 64], random token ids, Poisson arrivals at PROBE_CONCURRENCY / (mean output x
    decode_step_s), so a few requests decode at once and most steps are steady decode steps."""
    if not decode_step_s > 0:
        raise ValueError(f"probe_engine_loop: decode_step_s={decode_step_s!r}, expected > 0")
    rng = random.Random(seed)
    sc = cfg.scheduler
    max_len = min(sc.max_model_len, runner.buckets.max_pages * runner.page_size)
    rate = PROBE_CONCURRENCY / (40.0 * decode_step_s)
    requests, t = [], 0.0
    for i in range(num_requests):
        prompt_len = rng.randint(8, max(8, max_len // 2))
        output_len = max(1, min(rng.randint(16, 64), max_len - prompt_len))
        prompt = [rng.randrange(1, runner.spec.vocab_size) for _ in range(prompt_len)]
        requests.append(Request(f"probe{i}", prompt, SamplingParams(max_tokens=output_len), arrival_time=t))
        t += rng.expovariate(rate)
    scheduler = make_scheduler(dataclasses.replace(sc, vocab_size=sc.vocab_size or runner.spec.vocab_size))
    recorder = ScheduleRecorder(scheduler)
    result = ColocatedEngine(runner, scheduler, async_scheduling=cfg.engine.async_scheduling).run(requests)
    return recorder.batches, result.iterations


def fit_and_save(cfg, runner, measured, *, repeats: int, out_path: str, profile_s: float = 0.0,
                 note: str = "", command: str = "", context: dict = None, probe=None) -> dict:
    """Fit [(kind, SchedulerOutput, seconds)] measured on `runner`, write the profile; returns a report.
    context: `profile_step_context` data; its fitted terms (shape switch, idle wake) go into the profile.
    probe: [(batches, iterations)] of `probe_engine_loop` runs; the fitted model replays them and the measured /
    predicted ratios of their steady decode steps become the profile's "step_noise" (pdjax.sim.step_cost)."""
    padding = engine_padding(runner)
    hw = get_hardware_spec(cfg.sim.hardware)     # host-cpu: measured now, and frozen into the profile
    impl = padding.attention
    kind = {"reference": "dense over the page bucket", "blocked": "decodes by the longest context"}.get(
        impl, "real context")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    source = (f"pdjax engine ({impl} attention: {kind}), model {runner.spec.name}, "
              f"{len(measured)} batch compositions x {repeats} repeats{note}, buckets {padding.buckets}, "
              f"load average {load:.1f} at the fit on {os.cpu_count()} CPUs")
    command = command or "python -m experiments.calibrate " + " ".join(sys.argv[1:])
    profile, found = engine_profile(measured, runner.spec, hw, padding, source=source, command=command,
                                    context=context, probe=probe or (), probe_requests=PROBE_REQUESTS)
    if found["step_noise"] is not None and "skipped" in found["step_noise"]:
        print(f"calibrate: no step noise in the profile: {found['step_noise']['skipped']}", file=sys.stderr)
    save_profile(out_path, profile)
    return {"profile": out_path, "hardware": hw.name, "model": runner.spec.name, "attention_impl": impl,
            "dense_attention": padding.dense_attention, "step_context": found["step_context"],
            "step_noise": found["step_noise"], "fit": found["fit"], "profiling_s": profile_s,
            "machine_ceiling": {"matmul_flops_fp32": hw.peak_flops_fp32, "memory_bandwidth_bytes_s": hw.hbm_bandwidth},
            "fitted_params": {k: getattr(profile.params, k) for k in profile.fitted}}


def calibrate(cfg, runner, *, repeats: int, quick: bool, out_path: str, log=None) -> dict:
    """Profile `runner` (built for ServeConfig `cfg`), fit, write the profile to out_path; returns a report."""
    start = time.perf_counter()
    measured = profile_engine(runner, engine_grid(cfg, runner, quick), page_size=runner.page_size, repeats=repeats,
                              log=log)
    context = profile_step_context(runner, context_outputs(cfg, runner), rounds=5 if quick else 11, log=log)
    probe = [probe_engine_loop(cfg, runner, median_decode_step_s(measured))]
    if log is not None:
        log(f"calibrate: engine-loop probe served {PROBE_REQUESTS} requests in {len(probe[0][1])} steps")
    return fit_and_save(cfg, runner, measured, repeats=repeats, out_path=out_path,
                        profile_s=time.perf_counter() - start, context=context, probe=probe)
