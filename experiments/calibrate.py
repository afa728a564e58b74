"""Calibrate the simulator on the machine at hand: profile the real pdjax engine (ModelRunner) over a grid of batch
compositions and fit a machine profile (pdjax.sim.calibration.fit_cost_params).

    python -m experiments.calibrate --config=configs/serve.py --out=/tmp/host_cpu_profile.json
    python -m experiments.calibrate --config=configs/serve.py --config.sim.hardware=h200 --out=h200.json  # on a GPU

Grid (every point within the config's token budget, max_num_seqs and max_model_len): prefill chunks x context
offsets, decode batches x contexts, and mixed batches (decodes + one chunk). Each point is built as a
SchedulerOutput, its bucket shape compiled first, then timed `--repeats` times in rounds over the grid (median
kept: the machine is shared and noisy) through `runner.execute`, which is what one engine iteration runs.

The engine pads every step to its (T, S, P) buckets; the fit sees each measurement as the work the padded step
does under the attention implementation the runner actually runs (`engine_padding`; pdjax.sim.step_cost.
padded_composition, plus a per-real-sequence host cost: `fit_padded_engine`): the jnp reference attends every
padded token over every padded page (dense: cost by the page bucket); the blocked XLA path (the CPU default) and
the Pallas kernels loop over each sequence's own pages (cost by the real context; the blocked kernel's decode
pass by the longest context in it, over its padded width), and only the linear layers see
the token padding. The profile stores that choice ("padding") and, for host-cpu, the measured HardwareSpec the
efficiencies are relative to ("hardware_spec"), so the simulator reproduces the fit exactly; its "source" names
the attention implementation and the buckets.

Step context (`profile_step_context`, a short dedicated measurement after the grid): a few compositions of
distinct padded shapes, each timed right after itself and right after each other one (shape switch), and after
sleeps of 0.5/2/5/20/50 ms (idle wake), as paired differences; `pdjax.sim.calibration.fit_step_context` turns
them into CostParams' shape_switch_s and idle_wake_{s,tau_s,fixed_s}, stored with the raw data
("step_context") in the profile.

Step noise (`probe_engine_loop`, last): the real engine loop serves a probe workload of its own (not the
configured one); the fitted model replays its batches (pdjax.sim.replay) and the measured / predicted ratios of
its steady decode steps become the profile's "step_noise" quantiles, which the simulator samples per step
(pdjax.sim.step_cost.StepNoise): the engine loop's step times scatter (host work, thread wake-ups, the OS) far
more than back-to-back timings of one step do, and that scatter is the P99 TBT of a CPU engine.
Prints JSON: fit errors overall and per batch kind, measurement count, the machine's measured ceilings.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Sequence, Tuple

from absl import flags

from pdjax.experiment import cli

FLAGS = flags.FLAGS


def _define_flags():
    """Flags exist only when this is the main module (experiments.sim_fidelity imports the functions below)."""
    cli.define_config_file("config", "configs/serve.py", "Serve config (model, scheduler limits).")
    flags.DEFINE_string("out", None, "Where to write the machine-profile JSON.")
    flags.DEFINE_integer("repeats", 5, "Timed runs per grid point (median kept).")
    flags.DEFINE_bool("quick", False, "A smaller grid (for tests).")


def synthetic_output(prefills: Sequence[Tuple[int, int]], decodes: Sequence[Tuple[int, int]], *, page_size: int,
                     num_pages: int, vocab_size: int):
    """A SchedulerOutput running `prefills` ((chunk tokens, context before it)) and `decodes` ((count, context))
    with in-range page tables (pages are reused across sequences: only the timing matters)."""
    from pdjax.config.sampling import SamplingParams
    from pdjax.scheduler import SchedulerOutput
    out = SchedulerOutput(step=0)
    next_page = 0
    seqs = [(n, c, True) for n, c in prefills] + [(1, c, False) for count, c in decodes for _ in range(count)]
    for i, (new, start, is_prefill) in enumerate(seqs):
        pages = -(-(start + new) // page_size)
        table = [(next_page + j) % num_pages for j in range(pages)]
        next_page = (next_page + pages) % num_pages
        out.req_ids.append(f"cal{i}")
        out.token_ids.append([(7 * i + j) % vocab_size for j in range(new)])
        out.num_computed_tokens.append(start)
        out.num_new_tokens.append(new)
        out.page_tables.append(table)
        out.do_sample.append(True)
        out.sampling.append(SamplingParams(temperature=0.0, max_tokens=1))
        out.is_prefill.append(is_prefill)
        if is_prefill:
            out.num_prefill_tokens += new
        else:
            out.num_decode_tokens += new
    return out


def calibration_grid(token_budget: int, max_num_seqs: int, max_model_len: int, quick: bool = False):
    """[(kind, prefills, decodes)] within the limits: prefill chunks x contexts, decode batches x contexts, mixed."""
    def pow2_upto(lo, hi):
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= 2
        return out
    chunks = sorted(set(pow2_upto(16, token_budget) + [token_budget, max(1, 3 * token_budget // 4)]))
    contexts = sorted({0, max_model_len // 8, max_model_len // 4, max_model_len // 2, 3 * max_model_len // 4})
    counts = sorted(set(pow2_upto(1, max_num_seqs) + [max(1, 3 * max_num_seqs // 4)]))
    dec_contexts = sorted({16, max_model_len // 8, max_model_len // 4, max_model_len // 2, max_model_len - 8})
    if quick:
        chunks, contexts = chunks[::2], contexts[::2]
        counts, dec_contexts = counts[::2], dec_contexts[::2]
    grid = []
    for chunk in chunks:
        for ctx in contexts:
            if chunk + ctx <= max_model_len:
                grid.append(("prefill", ((chunk, ctx),), ()))
    for count in counts:
        for ctx in dec_contexts:
            if ctx + 1 <= max_model_len:
                grid.append(("decode", (), ((count, ctx),)))
    for count in counts[1::2]:
        for ctx in dec_contexts[1::2]:
            for chunk in chunks[::2]:
                if count + chunk <= token_budget and count + 1 <= max_num_seqs and chunk + ctx <= max_model_len:
                    grid.append(("mixed", ((chunk, ctx // 2),), ((count, ctx),)))
    return grid


def profile_engine(runner, grid, *, page_size: int, repeats: int, log=None):
    """[(kind, SchedulerOutput, median seconds)] for every grid point (compiles each bucket shape first).

    The repeats run in rounds over the whole grid (not back to back per point), so a burst of load from other
    processes on a shared machine lands on one sample of many points instead of every sample of a few."""
    outputs = [(kind, synthetic_output(prefills, decodes, page_size=page_size, num_pages=runner.num_pages,
                                       vocab_size=runner.spec.vocab_size)) for kind, prefills, decodes in grid]
    for _, out in outputs:
        runner.execute(out)              # compile this shape (no-op when warm) and settle caches
    times = [[] for _ in outputs]
    for r in range(repeats):
        for i, (_, out) in enumerate(outputs):
            start = time.perf_counter()
            runner.execute(out)
            times[i].append(time.perf_counter() - start)
        if log is not None:
            log(f"calibrate: round {r + 1}/{repeats} over {len(outputs)} batch compositions done")
    return [(kind, out, statistics.median(ts)) for (kind, out), ts in zip(outputs, times)]


CONTEXT_GAPS_S = (0.0005, 0.002, 0.005, 0.02, 0.05)   # idle gaps (sleeps) before a step, seconds


def context_outputs(cfg, runner):
    """A few batch compositions of distinct padded shapes for `profile_step_context`, within the config's
    limits and the runner's buckets: a small and a full decode batch, a short and a full-budget prefill chunk,
    a mixed batch."""
    from pdjax.sim.step_cost import padded_shape
    sc, b = cfg.scheduler, runner.buckets
    budget, seqs = min(sc.token_budget, b.max_tokens), min(sc.max_num_seqs, b.max_seqs)
    max_len = min(sc.max_model_len, b.max_pages * runner.page_size)
    ctx = max(1, min(max_len // 4, max_len - 2))
    few = max(1, seqs // 4)
    points = [((), ((few, ctx),)), ((), ((seqs, ctx),)),
              (((max(2, budget // 4), min(max_len // 8, max_len - budget // 4)),), ()), (((budget, 0),), ())]
    if budget // 2 + few <= budget and few + 1 <= seqs:
        points.append((((budget // 2, 0),), ((few, ctx),)))
    padding = engine_padding(runner)
    outs, shapes = [], set()
    for prefills, decodes in points:
        if any(c + n > max_len for n, c in prefills) or any(c + 1 > max_len for _, c in decodes):
            continue
        out = synthetic_output(prefills, decodes, page_size=runner.page_size, num_pages=runner.num_pages,
                               vocab_size=runner.spec.vocab_size)
        shape = padded_shape(out, padding)
        if shape not in shapes:
            shapes.add(shape)
            outs.append(out)
    return outs


def profile_step_context(runner, outputs, *, rounds: int = 11, gaps=CONTEXT_GAPS_S, log=None, sleep=time.sleep):
    """Direct measurements of the step-context terms (pdjax.sim.cost_model.context_time) on `runner`.

    For each composition B of `outputs` (distinct padded shapes), every round: B twice, then B timed (steady);
    for every other composition A: A, then B timed (shape switch: minus that round's steady B); for every gap g:
    B twice, B timed, sleep g, B timed (idle wake: the second minus the first). Medians over rounds of the paired
    differences, so load changing across the rounds cancels. Returns {"switch": [{"prev", "next", "delta_s"}],
    "idle": [{"next", "gap_s", "delta_s"}], "steady": [{"shape", "seconds"}], "rounds"} (shapes as (T, S, P))."""
    from pdjax.sim.step_cost import padded_shape
    padding = engine_padding(runner)
    shapes = [padded_shape(out, padding) for out in outputs]
    for out in outputs:
        runner.execute(out)                       # compiled and warm

    def timed(out):
        start = time.perf_counter()
        runner.execute(out)
        return time.perf_counter() - start

    n = len(outputs)
    steady = [[] for _ in range(n)]
    switch = {(a, b): [] for b in range(n) for a in range(n) if a != b}
    idle = {(b, g): [] for b in range(n) for g in gaps}
    for r in range(rounds):
        for b, out in enumerate(outputs):
            runner.execute(out)
            runner.execute(out)
            base = timed(out)
            steady[b].append(base)
            for a in range(n):
                if a != b:
                    runner.execute(outputs[a])
                    switch[(a, b)].append(timed(out) - base)
                    runner.execute(out)
            for g in gaps:
                runner.execute(out)
                before = timed(out)
                sleep(g)
                idle[(b, g)].append(timed(out) - before)
        if log is not None:
            log(f"calibrate: step-context round {r + 1}/{rounds} done")
    med = statistics.median
    return {"switch": [{"prev": list(shapes[a]), "next": list(shapes[b]), "delta_s": med(v)}
                       for (a, b), v in switch.items()],
            "idle": [{"next": list(shapes[b]), "gap_s": g, "delta_s": med(v)} for (b, g), v in idle.items()],
            "steady": [{"shape": list(shapes[b]), "seconds": med(v)} for b, v in enumerate(steady)],
            "rounds": rounds}


PROBE_SEED = 9001        # the engine-loop probe's own requests (never the configured workload)
PROBE_REQUESTS = 32
PROBE_CONCURRENCY = 2.0  # requests decoding at once, on average (Poisson rate from the measured decode step)


def probe_engine_loop(cfg, runner, decode_step_s: float, *, num_requests: int = PROBE_REQUESTS,
                      seed: int = PROBE_SEED):
    """Serve a probe workload on the real engine loop (ColocatedEngine, the config's scheduler and async mode);
    returns (batches, iterations) for pdjax.sim.replay (the step-time noise: `fit_and_save(probe=...)`).

    The probe is independent of the configured workload: prompts uniform in [8, max_len / 2] tokens, outputs
    uniform in [16, 64], random token ids, Poisson arrivals at PROBE_CONCURRENCY / (mean output x
    decode_step_s), so a few requests decode at once and most steps are steady decode steps."""
    import dataclasses
    import random
    from pdjax.config.sampling import SamplingParams
    from pdjax.scheduler import Request, make_scheduler
    from pdjax.serving.engine import ColocatedEngine
    from pdjax.sim.replay import ScheduleRecorder
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


def median_decode_step_s(measured) -> float:
    """The median seconds of the grid's decode-only points ([(kind, SchedulerOutput, seconds)])."""
    decode = [s for kind, _, s in measured if kind == "decode"]
    return statistics.median(decode if decode else [s for _, _, s in measured])


def merge_step_context(first: dict, second: dict) -> dict:
    """The mean of two `profile_step_context` results of the same compositions (bracketing a real run)."""
    out = {"rounds": first["rounds"] + second["rounds"]}
    for key, value in (("switch", "delta_s"), ("idle", "delta_s"), ("steady", "seconds")):
        out[key] = [{**a, value: 0.5 * (a[value] + b[value])} for a, b in zip(first[key], second[key])]
    return out


def fit_step_context_terms(context: dict) -> dict:
    """CostParams step-context values from `profile_step_context` data (pdjax.sim.calibration.fit_step_context)."""
    from pdjax.sim.calibration import fit_step_context
    return fit_step_context([e["delta_s"] for e in context["switch"]],
                            [(e["gap_s"], e["delta_s"]) for e in context["idle"]])


def fit_engine_profile(measured, spec, hw, padding, *, source: str, command: str):
    """Fit CostParams to [(kind, SchedulerOutput, seconds)] measured on `hw`; returns (MachineProfile, report)."""
    import numpy as np
    from pdjax.sim.calibration import ITERATION_FIT_PARAMS, MachineProfile
    from pdjax.sim.step_cost import fit_padded_engine

    # attn_seq_head_s too: in the dense (padded reference) composition it is a per-token attention cost
    # (softmax bookkeeping, masks, index math per query) that the byte and FLOP terms do not capture.
    names = ITERATION_FIT_PARAMS + ("attn_seq_head_s",)
    if not padding.dense_attention and hw.kind == "cpu":
        # Blocked XLA attention: each pass is a fori_loop of its own with a fixed cost per call (the chunk pass
        # runs only when a batch holds a prefill chunk, the decode pass when it holds decodes); prefill-only,
        # decode-only and mixed batches tell the two apart from the per-iteration overhead.
        names = names + ("attn_prefill_fixed_s", "attn_decode_fixed_s")
    # No tensor-core tiles on a CPU (the token axis is already padded to its bucket); GPUs round up to 64-128.
    tiles = (1, 16) if padding.dense_attention or hw.kind == "cpu" else (1, 16, 64, 128)
    params, err = fit_padded_engine([out for _, out, _ in measured], [s for _, _, s in measured], spec, hw,
                                    padding, names, tiles=tiles)
    groups = {}
    for kind in sorted({k for k, _, _ in measured}):
        e = np.array([x for x, (k, _, _) in zip(err, measured) if k == kind])
        groups[kind] = {"median_rel_error": float(np.median(e)), "p90_rel_error": float(np.percentile(e, 90)),
                        "num_measurements": int(e.size)}
    report = {"median_rel_error": float(np.median(err)), "p90_rel_error": float(np.percentile(err, 90)),
              "num_measurements": len(measured), "groups": groups}
    profile = MachineProfile(hardware=hw.name, params=params, fitted=tuple(names) + ("gemm_token_tile",),
                             fit=report, source=source, command=command)
    return profile, report


def attention_impl(runner) -> str:
    """The attention implementation `runner` runs: 'reference' (jnp oracle), 'blocked' (XLA, the CPU default) or
    'pallas' (GPU/TPU kernels, or any other implementation that loops over each sequence's own pages)."""
    from pdjax.kernels import reference_attention
    fn = runner.attention_fn
    if fn is reference_attention:
        return "reference"
    if getattr(fn, "__module__", "") == "pdjax.kernels.blocked":
        return "blocked"
    return "pallas"


def engine_padding(runner):
    """How `runner` pads steps: its buckets, its attention implementation, and dense attention only for the jnp
    reference kernel (which attends every padded token over the whole page-table bucket); the Pallas kernels cost
    by the real context of each sequence, the blocked XLA kernel's decode pass by the longest context in it."""
    from pdjax.kernels import blocked
    from pdjax.sim.step_cost import EnginePadding
    impl = attention_impl(runner)
    return EnginePadding(runner.buckets, runner.page_size, impl == "reference", impl,
                         getattr(blocked, "DECODE_KEYS", 128))


def engine_grid(cfg, runner, quick: bool = False):
    """The calibration grid of `runner` within the config's limits and the runner's buckets."""
    sc, b = cfg.scheduler, runner.buckets
    return calibration_grid(min(sc.token_budget, b.max_tokens), min(sc.max_num_seqs, b.max_seqs),
                            min(sc.max_model_len, b.max_pages * runner.page_size), quick)


def fit_and_save(cfg, runner, measured, *, repeats: int, out_path: str, profile_s: float = 0.0,
                 note: str = "", command: str = "", context: dict = None, probe=None) -> dict:
    """Fit [(kind, SchedulerOutput, seconds)] measured on `runner`, write the sim profile; returns a report.
    context: `profile_step_context` data; its fitted terms (shape switch, idle wake) go into the profile.
    probe: [(batches, iterations)] of `probe_engine_loop` runs; the fitted model replays them and the measured /
    predicted ratios of their steady decode steps become the profile's "step_noise" (pdjax.sim.step_cost)."""
    from pdjax.sim.hardware import get_hardware_spec
    from pdjax.sim.step_cost import padded_shape, save_sim_profile

    padding = engine_padding(runner)
    dense = padding.dense_attention
    hw = get_hardware_spec(cfg.sim.hardware)     # host-cpu: measured now, and frozen into the profile
    impl = attention_impl(runner)
    kind = {"reference": "dense over the page bucket", "blocked": "decodes by the longest context"}.get(
        impl, "real context")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    source = (f"pdjax engine ({impl} attention: {kind}), model {runner.spec.name}, "
              f"{len(measured)} batch compositions x {repeats} repeats{note}, buckets {padding.buckets}, "
              f"load average {load:.1f} at the fit on {os.cpu_count()} CPUs")
    command = command or "python -m experiments.calibrate " + " ".join(sys.argv[1:])
    profile, report = fit_engine_profile(measured, runner.spec, hw, padding, source=source, command=command)
    context_terms = None
    if context is not None:
        import dataclasses
        from pdjax.sim.calibration import STEP_CONTEXT_PARAMS
        context_terms = fit_step_context_terms(context)
        profile = dataclasses.replace(profile, params=profile.params.replace(**context_terms),
                                      fitted=profile.fitted + STEP_CONTEXT_PARAMS,
                                      source=profile.source + f"; step context: {len(context['switch'])} shape "
                                      f"switches and {len(context['idle'])} idle gaps x {context['rounds']} rounds")
    raw = [{"kind": kind, "shape": list(padded_shape(out, padding)), "seconds": s,
            "seqs": [[n, c, bool(p)] for n, c, p in zip(out.num_new_tokens, out.num_computed_tokens, out.is_prefill)]}
           for kind, out, s in measured]   # (new tokens, context before them, is_prefill) per sequence
    extra = {"measurements": raw}
    if context is not None:
        extra["step_context"] = context
    noise = None
    if probe:
        from pdjax.sim.calibration import fit_step_noise
        from pdjax.sim.replay import replay_steps, step_noise_ratios
        from pdjax.sim.step_cost import make_step_time
        step_time = make_step_time(runner.spec, hw, 1, 1, profile.params, padding)   # the fitted model, no noise
        try:
            ratios = [r for batches, iterations in probe
                      for r in step_noise_ratios(replay_steps(batches, iterations, step_time, padding))]
            quantiles = fit_step_noise(ratios)
        except ValueError as e:   # too few steady decode steps: a profile without noise, and the reason
            noise = {"skipped": str(e)}
            print(f"calibrate: no step noise in the profile: {e}", file=sys.stderr)
        else:
            noise = {"num_steps": len(ratios), "p50": quantiles[50], "p90": quantiles[90], "p99": quantiles[99]}
            extra["step_noise"] = {"quantiles": quantiles, "num_steps": len(ratios),
                                   "source": f"engine-loop probe ({len(probe)} run(s) of {PROBE_REQUESTS} "
                                             "requests, steady decode steps, measured / fitted model)"}
    save_sim_profile(out_path, profile, hardware_spec=hw if hw.kind == "cpu" else None,
                     padding=padding.profile_dict(), extra=extra)
    return {"profile": out_path, "hardware": hw.name, "model": runner.spec.name, "attention_impl": impl,
            "dense_attention": dense, "step_context": context_terms, "step_noise": noise,
            "fit": report, "profiling_s": profile_s,
            "machine_ceiling": {"matmul_flops_fp32": hw.peak_flops_fp32, "memory_bandwidth_bytes_s": hw.hbm_bandwidth},
            "fitted_params": {k: getattr(profile.params, k) for k in profile.fitted}}


def calibrate(cfg, runner, *, repeats: int, quick: bool, out_path: str, log=None) -> dict:
    """Profile `runner` (built for ServeConfig `cfg`), fit, write the sim profile to out_path; returns a report."""
    start = time.perf_counter()
    measured = profile_engine(runner, engine_grid(cfg, runner, quick), page_size=runner.page_size, repeats=repeats,
                              log=log)
    context = profile_step_context(runner, context_outputs(cfg, runner), rounds=5 if quick else 11, log=log)
    probe = [probe_engine_loop(cfg, runner, median_decode_step_s(measured))]
    if log is not None:
        log(f"calibrate: engine-loop probe served {PROBE_REQUESTS} requests in {len(probe[0][1])} steps")
    return fit_and_save(cfg, runner, measured, repeats=repeats, out_path=out_path,
                        profile_s=time.perf_counter() - start, context=context, probe=probe)


def main(argv):
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.run import to_plain_dict
    from pdjax.serving.build import build_runner

    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.out:
        raise cli.UserError("--out=PATH.json is required")
    try:    # the config, and the checkpoint (missing, truncated)
        cfg = serve_config_from_dict(to_plain_dict(FLAGS.config))
        runner = build_runner(cfg)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    t = time.perf_counter()
    runner.warmup()
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    log(f"calibrate: compiled {runner.compile_count} shapes in {time.perf_counter() - t:.1f} s")
    report = calibrate(cfg, runner, repeats=FLAGS.repeats, quick=FLAGS.quick, out_path=FLAGS.out, log=log)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
