"""KV transfer benchmark (pdjax.experiment.kv_transfer_bench): one request's KV moved from a prefill device group
to a decode device group, in process, through the engine loop (synchronous vs asynchronous transfer) and across
2 processes; JSON to stdout.

    python -m experiments.bench_kv_transfer            # defaults per backend
    python -m experiments.bench_kv_transfer --quick    # shortest lengths (smoke run)
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Two disjoint CPU groups need several (fake) host devices; no effect on accelerator platforms.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.kv_transfer_bench import run

_QUICK = flags.DEFINE_bool("quick", False, "shortest lengths only, for a smoke run")
_REPS = flags.DEFINE_integer("reps", 5, "timed repetitions per case")
_ENGINE = flags.DEFINE_bool("engine", True, "also time the engine loop with synchronous vs asynchronous transfer")
_ENGINE_REPS = flags.DEFINE_integer("engine_reps", 3, "engine runs per transfer mode")
_CROSS = flags.DEFINE_bool("cross_process", True, "also time transfers between 2 processes (CPU backend only)")
_CROSS_DEVICES = flags.DEFINE_integer("cross_devices_per_process", 4, "CPU devices per process (cross-process)")
_CROSS_TIMEOUT = flags.DEFINE_float("cross_timeout_s", 240.0, "the cross-process run's time limit (then "
                                    "SIGKILLed)")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    print(json.dumps(run(reps=_REPS.value, quick=_QUICK.value, engine=_ENGINE.value, engine_reps=_ENGINE_REPS.value,
                         cross=_CROSS.value, cross_devices_per_process=_CROSS_DEVICES.value,
                         cross_timeout_s=_CROSS_TIMEOUT.value), indent=1))


if __name__ == "__main__":
    cli.run(main)
