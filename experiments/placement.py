"""DistServe placement search in simulation (pdjax.sim.placement): ranked placements and colocated baselines.

python -m experiments.placement --model=opt-13b --hardware=a100-80gb-sxm --gpus_per_node=4 --budget=4 \
    --trace=../shared/data/traces/sarathi_sharegpt_8k_filtered_llama2_tok.csv --num_requests=300 \
    --ttft=0.2 --tpot=0.1 --attainment=0.9 --workers=2

Workload: with --trace, DistServe's filtering: the trace's rows whose prompt + output fit --max_model_len, as
(prompt, output) pairs drawn from those rows (--length_sampling=joint, as DistServe samples; 'independent' draws
the two columns separately), Poisson arrivals; without it, the
--preset (e.g. chat) capped at --max_model_len. Prints JSON: the problem, the ranking (per-GPU goodput), the best
disaggregated and colocated placements, and the wall time.
"""
from __future__ import annotations

import json
from typing import Dict, Optional

from absl import flags

from pdjax.experiment import cli
from pdjax.sim.placement import AFFINITIES, COLOCATED_POLICIES, NodeType, PlacementProblem, search
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


def _names_among(flag: str, allowed) -> None:
    """Checked at parsing: a name outside `allowed` fails in one line naming it (pdjax.experiment.cli)."""
    def check(names) -> bool:
        bad = [n for n in names if n not in allowed]
        if bad:
            raise flags.ValidationError(f"unknown {', '.join(map(repr, bad))}; expected some of {', '.join(allowed)}")
        return True
    flags.register_validator(flag, check)


_names_among("affinity", AFFINITIES)
_names_among("colocated", COLOCATED_POLICIES)


def trace_workload(path: str, max_model_len: int, num_requests: int, seed: int,
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
        top: int = 0, stacks: Optional[Dict[str, str]] = None, slo_rule: str = "pdjax", decompose: bool = False
        ) -> dict:
    """One placement search; `stacks`: {'colocated' | 'prefill' | 'decode': stack name} ('pdjax' for the rest)."""
    node = NodeType(hardware, gpus_per_node=gpus_per_node, intra_node_bandwidth=intra_node_gbps * 1e9,
                    inter_node_bandwidth=inter_node_gbps * 1e9)
    problem = PlacementProblem(model=model, node=node, gpu_budget=budget, workload=workload, ttft_s=ttft,
                               tpot_s=tpot, attainment=attainment, profile=profile, max_model_len=max_model_len,
                               slo_rule=slo_rule, **{f"{role}_stack": name for role, name in (stacks or {}).items()})
    if decompose:
        result = decompose_win(problem, workers=workers, affinities=tuple(affinity), colocated=tuple(colocated))
    else:
        result = search(problem, workers=workers, affinities=tuple(affinity), colocated=tuple(colocated))
    if top and "ranking" in result:
        result["ranking"] = result["ranking"][:top]
    spec = node.spec()
    result["problem"] = {"model": model, "hardware": spec.name, "gpus_per_node": spec.devices_per_node,
                         "budget": budget, "ttft_s": ttft, "tpot_s": tpot, "attainment": attainment,
                         "num_requests": workload.get("num_requests"), "slo_rule": slo_rule,
                         "stacks": {role: problem.stack(role) for role in ("colocated", "prefill", "decode")}}
    return result


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:     # a bad trace, model, hardware, profile, preset or budget: one line naming it
        if FLAGS.trace:
            workload = trace_workload(FLAGS.trace, FLAGS.max_model_len, FLAGS.num_requests, FLAGS.seed,
                                      FLAGS.length_sampling)
        else:
            workload = {"preset": FLAGS.preset, "num_requests": FLAGS.num_requests, "seed": FLAGS.seed,
                        "max_model_len": FLAGS.max_model_len}
        out = run(FLAGS.model, FLAGS.hardware, FLAGS.budget, workload, FLAGS.ttft, FLAGS.tpot, FLAGS.attainment,
                  FLAGS.gpus_per_node, FLAGS.intra_node_gbps, FLAGS.inter_node_gbps, FLAGS.workers,
                  FLAGS.affinity, FLAGS.colocated, FLAGS.profile, FLAGS.max_model_len, FLAGS.top,
                  {"colocated": FLAGS.colocated_stack, "prefill": FLAGS.prefill_stack, "decode": FLAGS.decode_stack},
                  FLAGS.slo_rule, FLAGS.decompose)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    cli.run(main)
