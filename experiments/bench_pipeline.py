"""Pipeline parallelism with batches in flight (pdjax.experiment.pipeline_bench): pp 1 / 2 / 4 on the same offline
job on fake CPU devices, and a paper-scale table in simulation. JSON to stdout.

    python -m experiments.bench_pipeline [--checkpoint=tiny-byte] [--requests=32] [--pp=1,2,4]
    python -m experiments.bench_pipeline --sim [--sim_requests=256] [--sim_rate=1.0]
"""
import json
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.pipeline_bench import run_cpu, sim_table

_SIM = flags.DEFINE_boolean("sim", False, "Run the paper-scale simulated table instead of the CPU benchmark.")
_CKPT = flags.DEFINE_string("checkpoint", "tiny-byte", "Checkpoint dir or registry spec name (CPU benchmark).")
_PP = flags.DEFINE_list("pp", ["1", "2", "4"], "Pipeline degrees to run (CPU benchmark).")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests (offline, all at t=0; CPU benchmark).")
_PROMPT = flags.DEFINE_integer("prompt_len", 96, "Prompt tokens (CPU benchmark).")
_OUTPUT = flags.DEFINE_integer("output_len", 32, "Output tokens (CPU benchmark).")
_BUDGET = flags.DEFINE_integer("token_budget", 128, "Sarathi token budget (CPU benchmark).")
_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Max sequences per instance (CPU benchmark).")
_SIM_REQUESTS = flags.DEFINE_integer("sim_requests", 256, "Requests of the simulated table.")
_SIM_RATE = flags.DEFINE_float("sim_rate", 1.0, "Poisson arrival rate (req/s) of the simulated table.")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if _SIM.value:
        print(json.dumps(sim_table(_SIM_REQUESTS.value, _SIM_RATE.value), indent=2))
        return
    try:
        pps = [int(p) for p in _PP.value]
    except ValueError:
        raise cli.UserError(f"--pp={','.join(_PP.value)!r}: expected comma-separated integers") from None
    print(json.dumps(run_cpu(_CKPT.value, pps, _REQUESTS.value, _PROMPT.value, _OUTPUT.value, _BUDGET.value,
                             _SEQS.value), indent=2))


if __name__ == "__main__":
    cli.run(main)
