"""The regime map (pdjax.sim.regime): where chunked prefill on one pool beats disaggregation and by how much, over
workload shape x SLO tightness x KV link bandwidth, for one model, hardware and GPU budget, in simulation.

python -m experiments.regime_map --model=opt-13b --hardware=a100-80gb-sxm --budget=4 \
    --workloads=1:2,1:1,4:1,16:1,64:1 --slo_scales=0.5,0.7,1,1.4,2 --links=nvlink,infiniband,ethernet-25g \
    --ttft=0.25 --tpot=0.1 --num_requests=200 --workers=2 --out_dir=workdirs/regime_map

Workloads: 'P:O' prompt:output mean-length ratios at --total_tokens mean tokens, 'P:O>P2:O2' (the mix shifts halfway
through the requests), or named traces (presets: chat, code, conv, arxiv, ...). --rebalance: the disaggregated side
also searches online XpYd rebalancing (--rebalance_* thresholds; --rebalance_trigger=slo: flip on the point's own
SLOs instead); the CSV then says which design won that side
(disagg_design) and the best of each. SLO point s: TTFT = s x --ttft, TPOT = s x --tpot. Links: nvlink (one node),
infiniband, ethernet-25g, or 'NNgbps'. Writes regime_map.csv (one row per point), regime_map.png (heatmap of the
disaggregated / colocated per-GPU goodput ratio, one facet per link, winner marked) and regime_map.json (grid, timing,
where disaggregation wins) to --out_dir, atomically; prints the JSON summary without the per-point detail.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from pdjax.experiment import cli
from pdjax.sim.placement import COLOCATED_POLICIES
from pdjax.sim.regime import RegimeGrid, run_grid, summary, write_outputs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "opt-13b", "Model spec name.")
flags.DEFINE_string("hardware", "a100-80gb-sxm", "Hardware spec of a node's GPUs.")
flags.DEFINE_integer("gpus_per_node", 0, "GPUs per node (0: the spec's).")
flags.DEFINE_integer("budget", 4, "GPU budget of every placement.")
flags.DEFINE_list("workloads", ["1:2", "1:1", "4:1", "16:1", "64:1"],
                  "Workload axis: prompt:output ratios 'P:O' and/or preset names (named traces).")
flags.DEFINE_list("slo_scales", ["0.5", "0.7", "1", "1.4", "2"], "SLO axis: factors on (--ttft, --tpot).")
flags.DEFINE_list("links", ["nvlink", "infiniband", "ethernet-25g"], "KV link axis: nvlink, infiniband, "
                  "ethernet-25g or 'NNgbps'.")
flags.DEFINE_float("ttft", 0.25, "Base TTFT SLO (s).")
flags.DEFINE_float("tpot", 0.1, "Base TPOT SLO (s).")
flags.DEFINE_float("attainment", 0.9, "SLO attainment target.")
flags.DEFINE_integer("num_requests", 200, "Requests per simulation.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_integer("total_tokens", 1024, "Mean prompt + output tokens of a ratio workload.")
flags.DEFINE_integer("max_model_len", 2048, "Max prompt + output tokens (OPT: 2048).")
flags.DEFINE_string("stack", "pdjax", "Serving stack of both sides (pdjax.sim.stack).")
flags.DEFINE_string("colocated_stack", "", "Colocated side's stack ('' = --stack).")
flags.DEFINE_string("disagg_stack", "", "Disaggregated side's stack ('' = --stack).")
flags.DEFINE_list("colocated", list(COLOCATED_POLICIES), f"Colocated policies (of {COLOCATED_POLICIES}).")
flags.DEFINE_string("profile", "", "Machine profile (default: the shipped one for the hardware).")
flags.DEFINE_enum("slo_rule", "pdjax", ["pdjax", "distserve"], "Pass rule of a probe (pdjax.sim.placement).")
flags.DEFINE_integer("max_pp", 8, "Largest pipeline degree of a layout.")
flags.DEFINE_float("rel_tol", 0.05, "Rate search: stop when the bracket is within this fraction of its low end.")
flags.DEFINE_integer("max_probes", 14, "Rate search: most simulations per (point, candidate).")
flags.DEFINE_integer("max_num_seqs", 256, "Sequences per instance (Sarathi's budget is at least this).")
flags.DEFINE_bool("rebalance", False, "Also search online XpYd rebalancing on the disaggregated side (every "
                  "swappable placement again with deployment.rebalance=True); rows say which design won.")
flags.DEFINE_integer("rebalance_prefill_queue_tokens", 8192, "Rebalancing: prompt tokens queued per prefill instance "
                     "over which the prefill side is overloaded.")
flags.DEFINE_float("rebalance_decode_load", 0.9, "Rebalancing: mean decode load over which the decode side is.")
flags.DEFINE_float("rebalance_window_s", 2.0, "Rebalancing: seconds a side must stay over before a flip.")
flags.DEFINE_float("rebalance_flip_s", 0.0, "Rebalancing: seconds a drained instance takes to change role.")
flags.DEFINE_enum("rebalance_trigger", "load", ["load", "slo", "slo_predicted"], "Rebalancing: 'load' (the two "
                  "thresholds above), 'slo' (a side's observed TTFT / TPOT over the point's SLO at the attainment "
                  "quantile; pdjax.scheduler.rebalance_slo) or 'slo_predicted' ('slo' with the decode side's TPOT "
                  "predicted from its queue; pdjax.scheduler.rebalance_predict).")
flags.DEFINE_integer("workers", 2, "Processes.")
flags.DEFINE_bool("cache", True, "Share simulations across SLO points and colocated results across links "
                  "(--nocache: every point and candidate through placement.evaluate on its own; same numbers).")
flags.DEFINE_integer("progress_every", 25, "Print progress to stderr every this many tasks (0: never).")
flags.DEFINE_string("out_dir", "workdirs/regime_map", "Where regime_map.{csv,png,json} go.")


def _scales(values):
    out = []
    for v in values:
        try:
            out.append(float(v))
        except ValueError:
            raise cli.UserError(f"--slo_scales: {v!r} is not a number; expected factors > 0, e.g. 0.5,1,2") from None
    return tuple(out)


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:     # a bad axis value, model, hardware, stack or budget: one line naming it
        grid = RegimeGrid(model=FLAGS.model, hardware=FLAGS.hardware, gpu_budget=FLAGS.budget,
                          gpus_per_node=FLAGS.gpus_per_node, workloads=tuple(FLAGS.workloads),
                          slo_scales=_scales(FLAGS.slo_scales), links=tuple(FLAGS.links), base_ttft_s=FLAGS.ttft,
                          base_tpot_s=FLAGS.tpot, attainment=FLAGS.attainment, num_requests=FLAGS.num_requests,
                          seed=FLAGS.seed, total_tokens=FLAGS.total_tokens, max_model_len=FLAGS.max_model_len,
                          stack=FLAGS.stack, colocated_stack=FLAGS.colocated_stack, disagg_stack=FLAGS.disagg_stack,
                          colocated=tuple(FLAGS.colocated), profile=FLAGS.profile, slo_rule=FLAGS.slo_rule,
                          max_pp=FLAGS.max_pp, rel_tol=FLAGS.rel_tol, max_probes=FLAGS.max_probes,
                          max_num_seqs=FLAGS.max_num_seqs, rebalance=FLAGS.rebalance,
                          rebalance_prefill_queue_tokens=FLAGS.rebalance_prefill_queue_tokens,
                          rebalance_decode_load=FLAGS.rebalance_decode_load,
                          rebalance_window_s=FLAGS.rebalance_window_s, rebalance_flip_s=FLAGS.rebalance_flip_s,
                          rebalance_trigger=FLAGS.rebalance_trigger)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    start = time.perf_counter()
    step = max(1, FLAGS.progress_every)

    def progress(done: int, total: int) -> None:
        if FLAGS.progress_every and (done % step == 0 or done == total):
            print(f"regime_map: {done}/{total} tasks, {time.perf_counter() - start:.0f} s, load "
                  f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    result = run_grid(grid, workers=FLAGS.workers, cache=FLAGS.cache, progress=progress)
    paths = write_outputs(grid, result, FLAGS.out_dir)
    out = {k: v for k, v in summary(grid, result).items() if k != "points"}
    out["outputs"] = paths
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    cli.run(main)
