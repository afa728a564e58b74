"""Splitwise's provisioning questions in simulation (pdjax.sim.provision): the cheapest, least-power and
fewest-machine cluster of each design meeting the SLOs at a target load, and the highest load each design holds
at an iso-cost and an iso-power budget.

python -m experiments.provision --model=llama-2-70b-16k --trace=conv --num_requests=600 --rate=7 \
    --designs=Baseline-A100,Baseline-H100,Splitwise-AA,Splitwise-HH,Splitwise-HA,Splitwise-HHcap \
    --max_machines=12 --budget_machines=4 --workers=2 --out=/tmp/provision_conv

--trace: 'code' / 'conv' (the Azure LLM inference traces 2023, ../shared/data/traces), a trace CSV with
arrival times (replayed at its own times, scaled to --rate), or '' for Poisson arrivals of --preset's lengths.
Budgets: --budget_machines=N machines of --budget_machine (Splitwise: 40 DGX-H100) give both the iso-cost and the
iso-power budget; --cost_budget (USD/h) and --power_budget_kw set them directly. Prints the table and the answers;
writes provision.json (atomically) and one PNG per question into --out.
"""
from __future__ import annotations

import os
import sys

from absl import flags

from pdjax.config.files import shared_trace
from pdjax.experiment import cli
from pdjax.metrics.report import write_json
from pdjax.sim import provision as pv
from pdjax.sim.machines import MACHINES, get_machine
from pdjax.sim.reference import ReferenceMachine

NAMED_TRACES = {"code": "azure_llm_2023_code.csv", "conv": "azure_llm_2023_conv.csv"}

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama-2-70b-16k", "Model spec name (llama-2-70b-16k: Llama-2-70B with room for the "
                    "Azure traces' long prompts, as Splitwise served them).")
flags.DEFINE_string("trace", "conv", "'code', 'conv' (Azure LLM 2023), a trace CSV path, or '' (--preset, Poisson).")
flags.DEFINE_string("preset", "chat", "Workload preset when --trace=''.")
flags.DEFINE_integer("num_requests", 600, "Requests per simulation.", lower_bound=2)
flags.DEFINE_integer("trace_start", 0, "First trace row replayed.")
flags.DEFINE_enum("arrival", "trace", list(pv.TRACE_ARRIVALS), "With a trace: its own arrival times scaled to the "
                  "rate, or Poisson arrivals at the rate with the trace's lengths (splitwise-sim's rr_* traces).")
flags.DEFINE_float("rate", 6.0, "Target load of the iso-throughput questions (requests/s).")
flags.DEFINE_list("designs", list(pv.DESIGNS), f"Cluster designs (of {list(pv.DESIGNS)}).")
flags.DEFINE_list("colocated", ["sarathi"], f"Scheduling of the colocated baselines (of {pv.COLOCATED_POLICIES}).")
flags.DEFINE_list("mixed", ["off"], "Mixed pool of the Splitwise designs: off, on (deployment.mixed_pool='borrow'), "
                  "rebalance (deployment.rebalance: online role flips; AA / HH only), "
                  "or both (= off,on).")
flags.DEFINE_enum("slo", "splitwise", list(pv.SLO_KINDS), "Pass rule: Splitwise's slowdown SLOs, or pdjax's "
                  "absolute ones (--ttft/--tbt/--tpot, --attainment).")
flags.DEFINE_float("ttft", 0.0, "Absolute TTFT SLO (s; 0 = none).")
flags.DEFINE_float("tbt", 0.0, "Absolute max-gap TBT SLO (s; 0 = none).")
flags.DEFINE_float("tpot", 0.0, "Absolute TPOT SLO (s; 0 = none).")
flags.DEFINE_float("attainment", 0.9, "Absolute-SLO attainment target.")
flags.DEFINE_string("reference_hardware", "a100-80gb-sxm", "Slowdown reference machine's GPUs.")
flags.DEFINE_integer("reference_tp", 8, "Slowdown reference machine's TP degree.")
flags.DEFINE_integer("max_machines", 12, "Largest prompt / token pool (and colocated cluster) searched.")
flags.DEFINE_integer("budget_machines", 0, "Iso budgets = this many --budget_machine machines (0: use "
                     "--cost_budget / --power_budget_kw).", lower_bound=0)
flags.DEFINE_enum("budget_machine", "dgx-h100", sorted(MACHINES), "Machine SKU of --budget_machines.")
flags.DEFINE_float("cost_budget", 0.0, "Iso-cost budget (USD per hour; 0 = not asked).")
flags.DEFINE_float("power_budget_kw", 0.0, "Iso-power budget (kW of provisioned power; 0 = not asked).")
flags.DEFINE_integer("max_model_len", 8192, "Max prompt + output tokens; longer trace rows are cut.")
flags.DEFINE_float("rel_tol", 0.05, "Relative tolerance of the load bisection.")
flags.DEFINE_integer("seed", 0, "Run seed.")
flags.DEFINE_integer("workers", 2, "Processes (or Ray CPUs of a local cluster).")
flags.DEFINE_enum("executor", "local", list(pv.EXECUTORS), "local processes, or Ray tasks.")
flags.DEFINE_string("ray_address", "", "Join this Ray cluster (implies --executor=ray).")
flags.DEFINE_string("out", "", "Directory for provision.json and the PNGs ('' = print only).")


def workload(trace: str, preset: str, num_requests: int, trace_start: int, seed: int, arrival: str = "trace") -> dict:
    if not trace:
        return {"preset": preset, "num_requests": num_requests, "seed": seed, "fit_to_model": False}
    path = shared_trace(NAMED_TRACES[trace]) if trace in NAMED_TRACES else trace
    if not os.path.isfile(path):
        raise ValueError(f"--trace={trace!r}: no file {path!r}; expected 'code', 'conv' or a trace CSV path")
    return pv.trace_workload(path, num_requests, trace_start, seed, arrival)


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:
        cost_budget, power_budget = FLAGS.cost_budget, FLAGS.power_budget_kw * 1e3
        if FLAGS.budget_machines:
            m = get_machine(FLAGS.budget_machine)
            cost_budget, power_budget = FLAGS.budget_machines * m.cost_per_hour, FLAGS.budget_machines * m.tdp_w
        problem = pv.ProvisionProblem(
            model=FLAGS.model, target_rate=FLAGS.rate,
            workload=workload(FLAGS.trace, FLAGS.preset, FLAGS.num_requests, FLAGS.trace_start, FLAGS.seed,
                              FLAGS.arrival),
            designs=tuple(FLAGS.designs), colocated_policies=tuple(FLAGS.colocated),
            mixed=("off", "on") if FLAGS.mixed == ["both"] else tuple(FLAGS.mixed),
            slo=FLAGS.slo, ttft_s=FLAGS.ttft, tbt_s=FLAGS.tbt, tpot_s=FLAGS.tpot, attainment=FLAGS.attainment,
            reference=ReferenceMachine(FLAGS.reference_hardware, FLAGS.reference_tp),
            max_machines=FLAGS.max_machines, cost_budget=cost_budget, power_budget=power_budget,
            max_model_len=FLAGS.max_model_len, rel_tol=FLAGS.rel_tol, seed=FLAGS.seed)
        if FLAGS.out:
            os.makedirs(FLAGS.out, exist_ok=True)
        result = pv.provision(problem, workers=FLAGS.workers, executor=FLAGS.executor,
                              ray_address=FLAGS.ray_address, log=lambda line: print(line, file=sys.stderr,
                                                                                     flush=True))
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    print(pv.format_table(result))
    print(f"{result['num_simulations']} simulations in {result['wall_s']} s on {FLAGS.workers} worker(s)")
    if FLAGS.out:
        write_json(os.path.join(FLAGS.out, "provision.json"), result)
        for path in pv.plot_questions(result, FLAGS.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    cli.run(main)
