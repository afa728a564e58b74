"""The 'vllm-eager' serving stack: pdjax's cost model under the host floor of an eager engine (no JAX).

What it models. An engine that issues every kernel from Python (PyTorch eager: vLLM up to 0.2.x without CUDA graphs,
the vLLM that Splitwise (Patel et al., ISCA 2024) built on and that DistServe compared against) cannot finish a
step before its host has issued all of the step's kernels. At TP 8 a 70B model's per-device work is small (a
batch-1 decode streams 17.5 GB of weights per A100 in ~9 ms), so the step is host-bound: the measured batch-1
decode of Llama-2-70B on a DGX-A100 is ~45 ms at TP 4 and at TP 8 alike, where the devices' work is 32 and 21 ms.
That host-bound floor is what makes such an engine's decode step grow only ~1.2x from batch 1 to 32: the batch's
extra device work hides under the floor, only the per-sequence host work adds.

How. The cost model already has the term (`CostParams.launch_overhead_s`: a step costs host + max(device work,
kernels x launch_overhead_s), pdjax.sim.cost_model.iteration_time); the shipped GPU profiles set it to the CUDA
launch latency (4 us), right for an engine that launches from C++ or a graph (pdjax's XLA executables,
DistServe's engine). This stack raises it to the host's measured per-kernel issue time of the eager engine on that
machine (`HOST_KERNEL_S`; its host CPU sets it), everything else (device roofline, all-reduces, host terms) as the
group's profile has it.

The figures (per kernel as pdjax.sim.cost_model.kernels_per_iteration counts them: per layer the GEMMs, the
element-wise kernels, the attention calls and the two TP all-reduces):
- DGX-A100 (a100-*-sxm): fitted from DistServe's step fits of the vLLM it compared against (simdistserve,
  ../shared/data/profiling/distserve/profiler-a100-80g.vllm.json; `fit_host_kernel_s`): at each model's highest
  TP (OPT-13B TP 4, OPT-66B TP 8: the least device work per kernel) the decode fit's batch-1 time minus the
  profile's host terms, over the step's kernels: 49.1 and 38.3 us, mean 43.7 us. Checked against Splitwise's own
  measurement (held out): Llama-2-70B TP 8 batch 1 on DGX-A100, 44.9 ms measured, 46.3 ms here
  (experiments/README.md, "The TP 8 step floor").
- DGX-H100 / DGX-H200 (h100-sxm, h200: the same host, 2x Xeon Platinum 8480C): no H100 step fit in the shared
  data; fitted on Splitwise's DGX-H100 measurement (Llama-2-70B TP 8 and TP 4, batch 1: 29.8 ms, both
  host-bound), 26.5 us. A fit, not a check.
Other hardware has no measurement: `check` refuses it, naming the hardware this stack knows.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Mapping, Optional

from pdjax.config.model_specs import get_model_spec
from pdjax.sim.cost_model import (BatchComposition, CostParams, host_time, iteration_time, kernels_per_iteration,
                                  sharded_shapes)
from pdjax.sim.hardware import HardwareSpec
from pdjax.sim.step_cost import make_step_time
from pdjax.sim.step_time import GroupTiming, StepTime, register_stack

# Per-kernel host issue time of the eager engine, by hardware registry name (module docstring).
A100_HOST_KERNEL_S = 43.7e-6
H100_HOST_KERNEL_S = 26.5e-6
HOST_KERNEL_S: Dict[str, float] = {"a100-80gb-sxm": A100_HOST_KERNEL_S, "a100-40gb-sxm": A100_HOST_KERNEL_S,
                                   "h100-sxm": H100_HOST_KERNEL_S, "h200": H100_HOST_KERNEL_S}
VLLM_FITS = os.path.join("distserve", "profiler-a100-80g.vllm.json")


@dataclasses.dataclass(frozen=True)
class EagerHostStack:
    """A serving stack: the cost model (pdjax.sim.step_cost.make_step_time) with launch_overhead_s raised to the
    eager engine's per-kernel host time on the group's hardware (`host_kernel_s`, seconds per kernel)."""
    name: str = "vllm-eager"
    host_kernel_s: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(HOST_KERNEL_S))
    follows_dtype = True     # the cost model underneath costs the spec's dtype (pdjax.sim.build._check_stack_dtype)

    def check(self, model: str, hardware: str, tp: int) -> None:
        """ValueError unless the host floor of `hardware` was measured."""
        if hardware not in self.host_kernel_s:
            raise ValueError(f"stack {self.name!r} has no measured host floor for hardware={hardware!r}; it knows "
                             f"{sorted(self.host_kernel_s)} (pdjax.sim.eager)")

    def params_for(self, hardware: str, params: Optional[CostParams]) -> CostParams:
        """`params` (None: the defaults) with launch_overhead_s = max(its own, the eager host's per-kernel time)."""
        self.check("", hardware, 1)
        params = CostParams() if params is None else params
        return params.replace(launch_overhead_s=max(params.launch_overhead_s, self.host_kernel_s[hardware]))

    def step_time(self, group: GroupTiming) -> StepTime:
        return make_step_time(group.model, group.hardware, group.tp, group.pp, self.params_for(group.gpu, group.params),
                              group.padding, group.noise)

    def describe(self) -> dict:
        return {"stack": self.name, "kind": "cost_model+eager_host_floor",
                "host_kernel_s": dict(sorted(self.host_kernel_s.items())), "source": "pdjax.sim.eager"}


register_stack("vllm-eager", EagerHostStack)


def implied_host_kernel_s(measured_s: float, model: str, hw: HardwareSpec, tp: int, params: CostParams,
                          context: int = 1) -> float:
    """The per-kernel host time that makes a batch-1 decode of `model` (context `context`) at TP `tp` take
    `measured_s` when the launch floor binds: (measured - host terms) / kernels of the step."""
    spec = get_model_spec(model)
    kernels = kernels_per_iteration(sharded_shapes(spec, tp), spec.num_layers, tp, False, True)
    return (measured_s - host_time(params, 1, tp)) / kernels


def fit_host_kernel_s(profiling_dir: str, hw: HardwareSpec, params: CostParams) -> Dict[str, float]:
    """The A100 figure from DistServe's vLLM step fits (module docstring): {'opt-13b/tp4': s, 'opt-66b/tp8': s,
    'mean': s}, each the implied per-kernel host time at the model's highest TP (decode fit at batch 1, context 1).
    Each entry's floor must bind: its device work is below the floor it implies (ValueError otherwise)."""
    with open(os.path.join(profiling_dir, VLLM_FITS)) as f:
        fits = json.load(f)
    out = {}
    for hf_name, by_tp in fits.items():
        model = hf_name.split("/")[-1]
        tp = max(int(t) for t in by_tp)
        a, b, c = by_tp[str(tp)]["decoding_smallbs"]
        measured = (a + b * 1 + c * 1) / 1e3
        value = implied_host_kernel_s(measured, model, hw, tp, params)
        cost = iteration_time(BatchComposition((), ((1, 1),)), get_model_spec(model), hw, tp, 1, params)
        device = cost.total - cost.host_s
        if measured - cost.host_s <= device:
            raise ValueError(f"{model} tp={tp}: the measured {measured * 1e3:.1f} ms is not above the device work "
                             f"{device * 1e3:.1f} ms: its floor does not bind, it measures no host floor")
        out[f"{model}/tp{tp}"] = value
    out["mean"] = sum(out.values()) / len(out)
    return out
