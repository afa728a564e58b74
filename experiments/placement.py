"""DistServe placement search in simulation (pdjax.sim.placement): ranked placements and colocated baselines.

python -m experiments.placement --model=opt-13b --hardware=a100-80gb-sxm --gpus_per_node=4 --budget=4 \
    --trace=../shared/data/traces/sarathi_sharegpt_8k_filtered_llama2_tok.csv --num_requests=300 \
    --ttft=0.2 --tpot=0.1 --attainment=0.9 --workers=2

SLO scale (DistServe's Figures 8-9, lower rows): --slo_scale_per_gpu_rate=R simulates every candidate once at
R req/s per GPU (R x its GPUs) and ranks the candidates by the tightest factor s on both SLOs (TTFT s x --ttft,
TPOT s x --tpot) they still pass under --slo_rule (smaller = tighter); with --decompose, on the three stack
pairings. DistServe's OPT-66B summarization setting (its AE plot script: 0.375 req/s per GPU, TTFT 15 s,
TPOT 0.15 s, 90%; DistServe on 8 GPUs, vLLM TP4 on 4):

python -m experiments.placement --model=opt-66b --hardware=a100-80gb-sxm --gpus_per_node=8 --budget=8 \
    --trace=../shared/data/traces/vidur_arxiv_summarization_llama2_tok_filtered_v2.csv --num_requests=200 \
    --ttft=15 --tpot=0.15 --attainment=0.9 --slo_rule=distserve --slo_scale_per_gpu_rate=0.375 --decompose \
    --output=/tmp/slo_scale.json

Prints a table (placement, tightest scale) per search; the JSON goes to --output (written atomically), or after
the table when --output is not given.

Workload: with --trace, DistServe's filtering: the trace's rows whose prompt + output fit --max_model_len, as
(prompt, output) pairs drawn from those rows (--length_sampling=joint, as DistServe samples; 'independent' draws
the two columns separately), Poisson arrivals; without it, the
--preset (e.g. chat) capped at --max_model_len. Prints JSON: the problem, the ranking (per-GPU goodput), the best
disaggregated and colocated placements, and the wall time.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

from absl import flags

from pdjax.experiment import cli
from pdjax.metrics.report import write_json
from pdjax.sim.placement import AFFINITIES, COLOCATED_POLICIES, NodeType, PlacementProblem, search, slo_scale_search
from pdjax.sim.placement import decompose as decompose_win
from pdjax.workload.traces import load_trace

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "opt-13b", "Model spec name.")
flags.DEFINE_string("hardware", "a100-80gb-sxm", "Hardware spec of a node's GPUs.")
flags.DEFINE_integer("gpus_per_node", 0, "GPUs per node (0: the spec's).")
flags.DEFINE_float("intra_node_gbps", 0.0, "Intra-node link GB/s per GPU per direction (0: the spec's).")
flags.DEFINE_float("inter_node_gbps", 0.0, "Inter-node link GB/s per GPU per direction (0: the spec's).")
flags.DEFINE_integer("budget", 4, "GPU budget.")
flags.DEFINE_string("trace", "", "Trace CSV for the lengths (any format of pdjax.workload.traces).")
flags.DEFINE_enum("length_sampling", "joint", ["joint", "independent"],
                  "With --trace: draw (prompt, output) rows jointly, or each column on its own.")
flags.DEFINE_string("preset", "chat", "Workload preset when no --trace is given.")
flags.DEFINE_integer("num_requests", 300, "Requests per simulation.")
flags.DEFINE_integer("max_model_len", 2048, "Max prompt + output tokens (OPT: 2048).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_float("ttft", 0.2, "TTFT SLO (s).")
flags.DEFINE_float("tpot", 0.1, "TPOT SLO (s).")
flags.DEFINE_float("attainment", 0.9, "SLO attainment target.")
flags.DEFINE_list("affinity", list(AFFINITIES), f"DistServe placement families to search (of {AFFINITIES}).")
flags.DEFINE_list("colocated", list(COLOCATED_POLICIES), f"Colocated policies to compare (of {COLOCATED_POLICIES}).")
flags.DEFINE_integer("workers", 2, "Processes.")
flags.DEFINE_bool("rebalance", False, "Also search online XpYd rebalancing: every disaggregated placement whose "
                  "instances can swap roles again with deployment.rebalance=True (default thresholds).")
flags.DEFINE_string("profile", "", "Machine profile (default: the shipped one for the hardware).")
flags.DEFINE_integer("top", 10, "Rows of the ranking to print (0: all).")
flags.DEFINE_string("colocated_stack", "pdjax", "Serving stack of the colocated candidates (pdjax.sim.stack).")
flags.DEFINE_string("prefill_stack", "pdjax", "Serving stack of the disaggregated candidates' prefill instances.")
flags.DEFINE_string("decode_stack", "pdjax", "Serving stack of the disaggregated candidates' decode instances.")
flags.DEFINE_bool("decompose", False, "Run the search three times (both sides on pdjax, both on DistServe's "
                  "engine, the paper's pairing: colocated on its vLLM) and print how much of the disaggregated / "
                  "colocated ratio the serving stack accounts for (pdjax.sim.placement.decompose).")
flags.DEFINE_enum("slo_rule", "pdjax", ["pdjax", "distserve"], "Pass rule: pdjax (attainment of both SLOs per "
                  "request >= --attainment) or distserve (the --attainment quantile of TTFT and of TPOT each within "
                  "its SLO).")

flags.DEFINE_float("slo_scale_per_gpu_rate", 0.0, "If > 0: DistServe's SLO-scale axis at this fixed rate (req/s "
                   "per GPU): each candidate simulated once, ranked by the tightest factor on both SLOs it passes.")
flags.DEFINE_string("output", "", "Also write the JSON result here (atomically); in SLO-scale mode it then is "
                    "not printed after the table.")


def _names_among(flag: str, allowed) -> None:
    """Checked at parsing: a name outside `allowed` fails in one line naming it (pdjax.experiment.cli)."""
    def check(names) -> bool:
        bad = [n for n in names if n not in allowed]
        if bad:
            raise flags.ValidationError(f"unknown {', '.join(map(repr, bad))}; expected some of {', '.join(allowed)}")
        return True
    flags.register_validator(flag, check)


flags.register_validator("slo_scale_per_gpu_rate", lambda r: r >= 0,
                         "--slo_scale_per_gpu_rate: expected req/s per GPU >= 0 (0: the goodput search)")
_names_among("affinity", AFFINITIES)
_names_among("colocated", COLOCATED_POLICIES)


def trace_length_workload(path: str, max_model_len: int, num_requests: int, seed: int,
                          length_sampling: str = "joint") -> dict:
    """Empirical length distributions of the trace rows with prompt + output <= max_model_len (DistServe's
    filtering), as a WorkloadConfig dict. Raises ValueError (OSError for an unreadable file) naming the trace."""
    rows = [r for r in load_trace(path).rows if r.prompt_len + r.output_len <= max_model_len]
    prompts, outputs = [r.prompt_len for r in rows], [r.output_len for r in rows]
    if not prompts:
        raise ValueError(f"--trace={path!r}: no row fits max_model_len={max_model_len} (prompt + output tokens)")
    return {"kind": "synthetic", "arrival": "poisson", "num_requests": num_requests, "seed": seed,
            "prompt_len": {"kind": "empirical", "samples": tuple(prompts)},
            "output_len": {"kind": "empirical", "samples": tuple(outputs)}, "max_model_len": max_model_len,
            "length_sampling": length_sampling}


def run(model: str, hardware: str, budget: int, workload: dict, ttft: float, tpot: float, attainment: float = 0.9,
        gpus_per_node: int = 0, intra_node_gbps: float = 0.0, inter_node_gbps: float = 0.0, workers: int = 2,
        affinity=("high", "low"), colocated=("sarathi", "vllm_v0"), profile: str = "", max_model_len: int = 2048,
        top: int = 0, stacks: Optional[Dict[str, str]] = None, slo_rule: str = "pdjax", decompose: bool = False,
        slo_scale_per_gpu_rate: float = 0.0, rebalance: bool = False) -> dict:
    """One placement search (per-GPU goodput; or, with slo_scale_per_gpu_rate > 0, the tightest SLO scale at that
    per-GPU rate); `stacks`: {'colocated' | 'prefill' | 'decode': stack name} ('pdjax' for the rest)."""
    node = NodeType(hardware, gpus_per_node=gpus_per_node, intra_node_bandwidth=intra_node_gbps * 1e9,
                    inter_node_bandwidth=inter_node_gbps * 1e9)
    problem = PlacementProblem(model=model, node=node, gpu_budget=budget, workload=workload, ttft_s=ttft,
                               tpot_s=tpot, attainment=attainment, profile=profile, max_model_len=max_model_len,
                               slo_rule=slo_rule, **{f"{role}_stack": name for role, name in (stacks or {}).items()})
    kwargs = {"workers": workers, "affinities": tuple(affinity), "colocated": tuple(colocated),
              "rebalance": rebalance}
    rate = slo_scale_per_gpu_rate if slo_scale_per_gpu_rate > 0 else None
    if decompose:
        result = decompose_win(problem, per_gpu_rate=rate, **kwargs)
    elif rate is not None:
        result = slo_scale_search(problem, rate, **kwargs)
    else:
        result = search(problem, **kwargs)
    if top:
        for part in [result] + list(result.get("pairings", {}).values()):
            if "ranking" in part:
                part["ranking"] = part["ranking"][:top]
    spec = node.spec()
    result["problem"] = {"model": model, "hardware": spec.name, "gpus_per_node": spec.devices_per_node,
                         "budget": budget, "ttft_s": ttft, "tpot_s": tpot, "attainment": attainment,
                         "num_requests": workload.get("num_requests"), "slo_rule": slo_rule,
                         "slo_scale_per_gpu_rate": rate,
                         "stacks": {role: problem.stack(role) for role in ("colocated", "prefill", "decode")}}
    return result


def scale_table(ranking) -> str:
    """The SLO-scale ranking as a text table: placement, GPUs, rate, tightest scale, P90 TTFT / TPOT."""
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"{'placement':<44} {'GPUs':>4} {'rate':>7} {'tightest scale':>14} {'TTFT q (s)':>10} "
             f"{'TPOT q (s)':>10}"]
    for r in ranking:
        lines.append(f"{r['placement']:<44} {r['num_gpus']:>4} {r['rate_rps']:>7.3f} "
                     f"{fmt(r['tightest_slo_scale'], '.4f'):>14} {fmt(r['ttft_quantile_s'], '.3f'):>10} "
                     f"{fmt(r['tpot_quantile_s'], '.4f'):>10}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if FLAGS.output and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.output))):
        raise cli.UserError(f"--output={FLAGS.output!r}: its directory does not exist")
    try:     # a bad trace, model, hardware, profile, preset or budget: one line naming it
        if FLAGS.trace:
            workload = trace_length_workload(FLAGS.trace, FLAGS.max_model_len, FLAGS.num_requests, FLAGS.seed,
                                             FLAGS.length_sampling)
        else:
            workload = {"preset": FLAGS.preset, "num_requests": FLAGS.num_requests, "seed": FLAGS.seed,
                        "max_model_len": FLAGS.max_model_len}
        out = run(FLAGS.model, FLAGS.hardware, FLAGS.budget, workload, FLAGS.ttft, FLAGS.tpot, FLAGS.attainment,
                  FLAGS.gpus_per_node, FLAGS.intra_node_gbps, FLAGS.inter_node_gbps, FLAGS.workers,
                  FLAGS.affinity, FLAGS.colocated, FLAGS.profile, FLAGS.max_model_len, FLAGS.top,
                  {"colocated": FLAGS.colocated_stack, "prefill": FLAGS.prefill_stack, "decode": FLAGS.decode_stack},
                  FLAGS.slo_rule, FLAGS.decompose, FLAGS.slo_scale_per_gpu_rate, FLAGS.rebalance)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    if FLAGS.output:
        write_json(FLAGS.output, out)
    if FLAGS.slo_scale_per_gpu_rate > 0:
        parts = out["pairings"].items() if "pairings" in out else [("", out)]
        for name, part in parts:
            print(f"\n{name}" if name else "")
            print(scale_table(part["ranking"]))
            if name:
                print(f"ratio (best colocated / best disaggregated scale): {part['ratio']}")
        if "pairings" in out:
            print(f"\nstack factor {out['stack_factor']}, stack share of the paper's win "
                  f"{out['stack_share_of_paper_win']}")
        if FLAGS.output:
            return
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    cli.run(main)
