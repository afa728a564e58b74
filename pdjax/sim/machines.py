"""Machine SKUs: GPUs per machine, provisioned power, cost per hour and a per-phase power model (no JAX).

A machine is what a cluster provisions and pays for: `gpus` accelerators of one `hardware` spec
(pdjax.sim.hardware), a provisioned power (`tdp_w`, the machine's budget in an iso-power cluster), a cost per
machine-hour, and what each GPU draws by phase: `idle_w` when it runs nothing, `prompt_w` in a step that
carries prefill tokens (compute-bound), `token_w` in a decode-only step (memory-bound). Energy of a run is then
sum over its GPUs of (prompt time x prompt_w + token time x token_w + idle time x idle_w) (`phase_energy_j`).

Figures (see pdjax/sim/profiles/MACHINES_SOURCES.md): Splitwise (Patel et al., ISCA 2024) Table 2 and its
public simulator (Mutinifni/splitwise-sim: configs/hardware_repo/skus/*.yaml for GPUs and TDP,
configs/power_model/constant.yaml for the per-phase power, configs/cluster/iso*.yaml for the iso-cost ratio).
The power-capped DGX-H100 ("HHcap") caps every GPU at 70% of 700 W; its token phase draws less than the cap and
runs at full speed, its prompt phase is limited to the cap (`prompt_w` = 490 W) and runs at
`compute_scale` = 0.7 of the H100's compute rate (pdjax's model of the cap's effect, applied per step by
pdjax.sim.provision.PhaseCappedStepTime; Splitwise reports the token phase barely slows, the prompt phase does).
"""
from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Dict, Mapping, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    name: str
    hardware: str             # a pdjax.sim.hardware name (per-GPU roofline)
    gpus: int
    tdp_w: float              # provisioned power of the whole machine (W)
    cost_per_hour: float      # USD per machine-hour
    idle_w: float             # per GPU (W)
    prompt_w: float
    token_w: float
    compute_scale: float = 1.0   # share of the hardware's peak compute the machine runs at (power caps)
    source: str = ""

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"machine {self.name!r}: gpus={self.gpus!r}, expected >= 1")
        for key in ("tdp_w", "cost_per_hour", "idle_w", "prompt_w", "token_w"):
            if not getattr(self, key) > 0:
                raise ValueError(f"machine {self.name!r}: {key}={getattr(self, key)!r}, expected > 0")
        if not 0 < self.compute_scale <= 1:
            raise ValueError(f"machine {self.name!r}: compute_scale={self.compute_scale!r}, expected 0 < s <= 1")
        if not self.idle_w <= self.token_w <= self.prompt_w:
            raise ValueError(f"machine {self.name!r}: expected idle_w <= token_w <= prompt_w, got "
                             f"{self.idle_w}, {self.token_w}, {self.prompt_w}")

    def phase_energy_j(self, prompt_s: float, token_s: float, idle_s: float, num_gpus: int = 0) -> float:
        """Joules drawn by `num_gpus` of this machine's GPUs (all of them by default) over the given seconds."""
        n = num_gpus or self.gpus
        return n * (prompt_s * self.prompt_w + token_s * self.token_w + idle_s * self.idle_w)

    def cost(self, num_machines: float, seconds: float) -> float:
        """USD for `num_machines` machines over `seconds`."""
        return num_machines * self.cost_per_hour * seconds / 3600.0

    def to_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


_SPLITWISE = "Splitwise (ISCA'24) Table 2; splitwise-sim configs/hardware_repo/skus, configs/power_model/constant"
_MACHINES = [
    MachineSpec("dgx-a100", "a100-80gb-sxm", 8, tdp_w=6500, cost_per_hour=8 * 2.21, idle_w=63, prompt_w=400,
                token_w=250, source=_SPLITWISE),
    MachineSpec("dgx-h100", "h100-sxm", 8, tdp_w=10200, cost_per_hour=8 * 4.76, idle_w=75, prompt_w=700,
                token_w=380, source=_SPLITWISE),
    MachineSpec("dgx-h100-pcap", "h100-sxm", 8, tdp_w=7140, cost_per_hour=8 * 4.76, idle_w=75, prompt_w=490,
                token_w=380, compute_scale=0.7, source=_SPLITWISE + "; GPUs capped at 70% of 700 W"),
]
MACHINES: Dict[str, MachineSpec] = {m.name: m for m in _MACHINES}


def get_machine(name: str) -> MachineSpec:
    if name not in MACHINES:
        raise ValueError(f"machine={name!r}, expected one of {sorted(MACHINES)}")
    return MACHINES[name]


def machine_for_hardware(hardware: str) -> MachineSpec:
    """The default machine of a GPU hardware name (the uncapped SKU); an error names the known ones."""
    for m in _MACHINES:
        if m.hardware == hardware and m.compute_scale == 1.0:
            return m
    known = sorted({m.hardware for m in _MACHINES})
    raise ValueError(f"no machine SKU for hardware={hardware!r} (cost and power are known for {known})")


def _union_s(intervals: Sequence[Tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def busy_seconds_by_phase(steps: Sequence[Tuple[float, float, int]]) -> Tuple[float, float]:
    """(prompt seconds, token seconds) an instance spends in (start, end, num_prefill_tokens) steps: time covered
    by a step carrying prefill tokens is prompt phase (compute-bound), the rest of the time covered by a
    decode-only step token phase. Overlapping steps (pipeline batches in flight) count once."""
    prompt = _union_s([(a, b) for a, b, prefill in steps if prefill])
    busy = _union_s([(a, b) for a, b, _ in steps])
    return prompt, busy - prompt


def energy_report(iterations: Sequence, instances: Mapping[str, Tuple[MachineSpec, int]], duration_s: float,
                  num_completed: int) -> Dict[str, object]:
    """Energy, machine-hours and cost of a run. `iterations`: records with start_time, end_time,
    num_prefill_tokens and instance; `instances`: {instance name: (machine, GPUs it uses)}; every GPU draws its
    machine's idle power whenever it runs no step during the run's `duration_s`. Machine-hours count the
    machines' share the instances use (GPUs / GPUs per machine) for the whole run."""
    per_instance, energy, machine_hours, cost = {}, 0.0, 0.0, 0.0
    steps_of: Dict[str, list] = {name: [] for name in instances}
    step = attrgetter("start_time", "end_time", "num_prefill_tokens")
    for it in iterations:   # one pass over the run's iterations, grouped by instance
        steps = steps_of.get(it.instance)
        if steps is not None:
            steps.append(step(it))
    for name, (machine, gpus) in sorted(instances.items()):
        prompt_s, token_s = busy_seconds_by_phase(steps_of[name])
        idle_s = max(0.0, duration_s - prompt_s - token_s)
        joules = machine.phase_energy_j(prompt_s, token_s, idle_s, gpus)
        share = gpus / machine.gpus
        per_instance[name] = {"machine": machine.name, "gpus": gpus, "prompt_s": prompt_s, "token_s": token_s,
                              "idle_s": idle_s, "energy_j": joules}
        energy += joules
        machine_hours += share * duration_s / 3600.0
        cost += machine.cost(share, duration_s)
    return {"energy_j": energy, "energy_per_request_j": energy / num_completed if num_completed else None,
            "machine_hours": machine_hours, "cost_usd": cost, "per_instance": per_instance}
