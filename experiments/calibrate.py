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
the Pallas kernels loop over each sequence's own pages (cost by the real context), and only the linear layers see
the token padding. The profile stores that choice ("padding") and, for host-cpu, the measured HardwareSpec the
efficiencies are relative to ("hardware_spec"), so the simulator reproduces the fit exactly; its "source" names
the attention implementation and the buckets.
Prints JSON: fit errors overall and per batch kind, measurement count, the machine's measured ceilings.
"""
from __future__ import annotations

import json
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
    """How `runner` pads steps: its buckets, and dense attention only for the jnp reference kernel (which
    attends every padded token over the whole page-table bucket); the blocked and Pallas kernels cost by the real
    context of each sequence."""
    from pdjax.sim.step_cost import EnginePadding
    return EnginePadding(runner.buckets, runner.page_size, attention_impl(runner) == "reference")


def engine_grid(cfg, runner, quick: bool = False):
    """The calibration grid of `runner` within the config's limits and the runner's buckets."""
    sc, b = cfg.scheduler, runner.buckets
    return calibration_grid(min(sc.token_budget, b.max_tokens), min(sc.max_num_seqs, b.max_seqs),
                            min(sc.max_model_len, b.max_pages * runner.page_size), quick)


def fit_and_save(cfg, runner, measured, *, repeats: int, out_path: str, profile_s: float = 0.0,
                 note: str = "", command: str = "") -> dict:
    """Fit [(kind, SchedulerOutput, seconds)] measured on `runner`, write the sim profile; returns a report."""
    from pdjax.sim.hardware import get_hardware_spec
    from pdjax.sim.step_cost import padded_shape, save_sim_profile

    padding = engine_padding(runner)
    dense = padding.dense_attention
    hw = get_hardware_spec(cfg.sim.hardware)     # host-cpu: measured now, and frozen into the profile
    impl = attention_impl(runner)
    source = (f"pdjax engine ({impl} attention: {'dense over the page bucket' if dense else 'real context'}), "
              f"model {runner.spec.name}, "
              f"{len(measured)} batch compositions x {repeats} repeats{note}, buckets {padding.buckets}")
    command = command or "python -m experiments.calibrate " + " ".join(sys.argv[1:])
    profile, report = fit_engine_profile(measured, runner.spec, hw, padding, source=source, command=command)
    raw = [{"kind": kind, "shape": list(padded_shape(out, padding)), "seconds": s,
            "seqs": [[n, c, bool(p)] for n, c, p in zip(out.num_new_tokens, out.num_computed_tokens, out.is_prefill)]}
           for kind, out, s in measured]   # (new tokens, context before them, is_prefill) per sequence
    save_sim_profile(out_path, profile, hardware_spec=hw if hw.kind == "cpu" else None,
                     padding={"dense_attention": dense}, extra={"measurements": raw})
    return {"profile": out_path, "hardware": hw.name, "model": runner.spec.name, "attention_impl": impl,
            "dense_attention": dense,
            "fit": report, "profiling_s": profile_s,
            "machine_ceiling": {"matmul_flops_fp32": hw.peak_flops_fp32, "memory_bandwidth_bytes_s": hw.hbm_bandwidth},
            "fitted_params": {k: getattr(profile.params, k) for k in profile.fitted}}


def calibrate(cfg, runner, *, repeats: int, quick: bool, out_path: str, log=None) -> dict:
    """Profile `runner` (built for ServeConfig `cfg`), fit, write the sim profile to out_path; returns a report."""
    start = time.perf_counter()
    measured = profile_engine(runner, engine_grid(cfg, runner, quick), page_size=runner.page_size, repeats=repeats,
                              log=log)
    return fit_and_save(cfg, runner, measured, repeats=repeats, out_path=out_path,
                        profile_s=time.perf_counter() - start)


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
