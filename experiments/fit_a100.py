"""Fit the A100 machine profile from Vidur's operator measurements and write pdjax/sim/profiles/a100.json.

python -m experiments.fit_a100 [--profiling_dir=../shared/data/profiling] [--out=pdjax/sim/profiles/a100.json]

Prints JSON: the fitted CostParams and median/p90 relative errors (overall, per operator group, per model).
"""
from __future__ import annotations

import json
import pathlib

from absl import app, flags

FLAGS = flags.FLAGS
_REPO = pathlib.Path(__file__).resolve().parents[1]
flags.DEFINE_string("profiling_dir", str(_REPO.parent / "shared" / "data" / "profiling"),
                    "Directory with a100/*.csv and network/*.csv (see its SOURCES.md).")
flags.DEFINE_string("out", str(_REPO / "pdjax" / "sim" / "profiles" / "a100.json"), "Profile JSON to write.")
flags.DEFINE_string("hardware", "a100-80gb-sxm", "Spec the compute profiles are relative to.")
flags.DEFINE_string("network_hardware", "a100-80gb-pcie", "Spec of the all-reduce measurements (pairwise NVLink).")


def run(profiling_dir: str, out: str, hardware: str = "a100-80gb-sxm",
        network_hardware: str = "a100-80gb-pcie") -> dict:
    from pdjax.sim.calibration import A100_FIT_PARAMS, MachineProfile, fit_vidur_a100, save_profile  # noqa: PLC0415

    if not pathlib.Path(profiling_dir).is_dir():
        raise SystemExit(f"--profiling_dir={profiling_dir!r} is not a directory")
    params, report = fit_vidur_a100(profiling_dir, hardware=hardware, network_hardware=network_hardware)
    profile = MachineProfile(
        hardware=hardware, params=params, fitted=tuple(A100_FIT_PARAMS) + ("gemm_token_tile",),
        fit={**report["overall"], "groups": report["groups"], "network_hardware": network_hardware},
        source=("microsoft/vidur@7d47513 A100 operator profiles: Llama-2-7B and Llama-3-8B per-layer GEMMs and "
                "element-wise ops (TP 1/2/4/8), attention prefill/decode subsets (TP1), NCCL all-reduce on 4x "
                "A100 80GB PCIe with pairwise NVLink. iteration_overhead_s / per_seq_overhead_s are priors (no "
                "host-side data)."),
        command="python -m experiments.fit_a100")
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_profile(out, profile)
    return {"out": str(out), "cost_params": params.to_dict(), **report}


def main(argv):
    del argv
    print(json.dumps(run(FLAGS.profiling_dir, FLAGS.out, FLAGS.hardware, FLAGS.network_hardware), indent=2))


if __name__ == "__main__":
    app.run(main)
