"""Before you book a pod: compile every step a serving config would run, for a TPU topology, on this host.

    pip install -e ".[tpu]"
    python -m experiments.aot_compile --config=configs/serve.py --config.model.checkpoint=llama-3.1-8b \
        --config.model.dtype=bfloat16 --config.deployment.colocated.tp=4 --topology=v5e:2x2
    python -m experiments.aot_compile --config=configs/serve.py --config.model.checkpoint=llama-3.1-8b \
        --config.model.dtype=bfloat16 --config.deployment.kind=disaggregated --config.deployment.prefill.tp=4 \
        --config.deployment.decode.tp=2 --config.deployment.decode.num_instances=2 --topology=v5e:2x4

Same config file and keys as `experiments.serve`. `--topology` gives every group its devices from one slice, in
the order the real engine takes them (deployment.device_assignment); `--prefill_topology` / `--decode_topology` /
`--mixed_topology` give a group a slice of its own. Nothing is loaded: the weights are abstract, so a 70B model
compiles here. Prints one table row per group and per (bucket, pipeline stage) with the per-device HBM (weights,
KV cache, temporaries, total) against the generation's, and the KV pages that fit at --utilization; --out writes
the same as JSON (pdjax.experiment.aot). --compare_sim adds XLA's FLOPs and optimal seconds over the simulator's.
Exit 0 only when every step of every group compiled and fits; a group that cannot fit is one line naming the
model, the group and the bytes.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host runs nothing; the topology's devices are compile-only

from absl import flags

from pdjax.errors import user_errors
from pdjax.experiment import aot as aot_report
from pdjax.experiment import cli
from pdjax.experiment.run import resolve_config
from pdjax.metrics.report import write_json
from pdjax.runtime.aot import topology_devices

_CONFIG = cli.define_config_file("config", "configs/serve.py", "Serve config file (as experiments.serve).")
_TOPOLOGY = flags.DEFINE_string("topology", "", "TPU topology every group takes its devices from, e.g. v5e:2x2, "
                                "v5p:2x2x2, v6e:2x4.")
_ROLE_TOPOLOGY = {role: flags.DEFINE_string(f"{role}_topology", "", f"TPU topology of the {role} group alone "
                                            "(default: --topology).") for role in ("prefill", "decode", "mixed")}
_UTILIZATION = flags.DEFINE_float("utilization", None, "Fraction of HBM the weights, temporaries and KV cache may "
                                  "fill when planning num_pages (default: the config's engine.kv_memory_utilization).")
_JOBS = flags.DEFINE_integer("jobs", 1, "Steps compiled at once, in threads (small models only: large compiles did not "
                             "overlap on a host).", lower_bound=1)
_COMPARE_SIM = flags.DEFINE_bool("compare_sim", False, "Put XLA's FLOPs, bytes and optimal seconds next to the "
                                 "simulator cost model's for each bucket.")
_OUT = flags.DEFINE_string("out", "", "Write the report as JSON to this file (atomically).")


def devices_by_role(cfg) -> dict:
    """role -> its devices: its own --<role>_topology's, else --topology's (one list shared by those roles, so the
    deployment's device assignment places them as the real engine would)."""
    out, shared = {}, None
    for role in cfg.deployment.roles:
        own = _ROLE_TOPOLOGY[role].value if role in _ROLE_TOPOLOGY else ""
        if not (own or _TOPOLOGY.value):
            raise cli.UserError(f"no topology for deployment group {role!r}: give --topology (or --{role}_topology)")
        with user_errors():
            if own:
                out[role] = topology_devices(own)
            else:
                shared = shared or topology_devices(_TOPOLOGY.value)
                out[role] = shared
    return out


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}; settings go in --config.KEY=VALUE flags")
    with user_errors():
        cfg = resolve_config(_CONFIG.value)
    placed = devices_by_role(cfg)
    utilization = cfg.engine.kv_memory_utilization if _UTILIZATION.value is None else _UTILIZATION.value

    def progress(row):
        print(f"  compiled {row['role']} bucket {tuple(row['bucket'])} stage {row['stage']}: "
              f"{'ok' if row['compiled'] else 'FAILED'} in {row['compile_s']:.1f} s", flush=True)

    with user_errors():
        report = aot_report.compile_deployment(cfg, placed, utilization=utilization, jobs=_JOBS.value,
                                               compare_sim=_COMPARE_SIM.value, on_step=progress)
    report.update(config=cli_config_summary(cfg), utilization=utilization,
                  topologies={role: placed[role][0].device_kind for role in placed})
    print(aot_report.format_report(report))
    if _OUT.value:
        write_json(_OUT.value, report)
    if not report["ok"]:
        raise SystemExit(1)


def cli_config_summary(cfg) -> dict:
    return {"model": cfg.model.checkpoint, "dtype": cfg.model.dtype, "attention_impl": cfg.model.attention_impl,
            "deployment": cfg.deployment.kind}


if __name__ == "__main__":
    cli.run(main)
