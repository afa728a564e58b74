"""Splitwise's provisioning questions in simulation: for a model, a workload, SLOs and a family of cluster designs,
which cluster is (a) cheapest, (b) least power, (c) fewest machines meeting the SLOs at a target load
(iso-throughput), and (d) what is the highest load each design holds at a fixed cost or power budget
(iso-cost, iso-power). No JAX.

Designs (Splitwise, Patel et al., ISCA 2024, §5-6; splitwise-sim notebooks/utils.py `*_config`):
- Baseline-A100, Baseline-H100: n machines of one SKU, each a colocated instance (prompt and token phases in one
  batch) with the problem's colocated policy: 'sarathi' (chunked prefill at the token budget) or 'vllm_v0'
  (whole prompts first).
- Splitwise-AA, -HH, -HA, -HHcap: P prompt machines + T token machines (a disaggregated deployment: prefill
  group on the prompt SKU, decode group on the token SKU; KV moved machine to machine over the inter-node link):
  AA both DGX-A100, HH both DGX-H100, HA H100 prompt / A100 token, HHcap H100 prompt / power-capped H100 token
  (pdjax.sim.machines 'dgx-h100-pcap': a step carrying prefill tokens runs at `compute_scale` of the H100's
  compute, so a prefill it runs, borrowed into the mixed pool, is slower; a decode-only step draws less than the
  cap and runs at full speed: `PhaseCappedStepTime`).
- Mixed pool 'on' (Splitwise's, machines of one pool borrowed by the other when it is overloaded) sets
  `deployment.mixed_pool='borrow'` (pdjax.config.deployment, pdjax.scheduler.mixed). 'off': the plain prompt/token
  pools. 'rebalance': online XpYd role flips instead (`deployment.rebalance`, pdjax.scheduler.rebalance, at its
  default thresholds), searched only for the designs whose two pools are one SKU (AA, HH).
One model instance per machine at the TP Splitwise used (8 GPUs, TP 8: splitwise-sim configs/start_state/
baseline.yaml and splitwise*.yaml, `tensor_parallelism: 8`, `max_batch_tokens: 2048`, `max_batch_size: 512`:
the problem's defaults). A machine's cost is its SKU's cost per hour, its power its provisioned power (TDP);
both are pdjax.sim.machines' figures (sources in pdjax/sim/profiles/MACHINES_SOURCES.md).

SLOs: `slo='splitwise'` (default): Splitwise's slowdown SLOs (pdjax.metrics.slowdown: P50/P90/P99 of TTFT,
per-request mean TBT and E2E slowdowns, all nine within Splitwise's factors) against each request's unloaded run
on the reference machine (pdjax.sim.reference, default a DGX-A100 at TP 8: the same reference for every design);
`slo='pdjax'`: pdjax's absolute SLOs (TTFT / max-gap TBT / TPOT bounds per request, attainment >= target).
Every probe reports both where both are defined.

Workload: a WorkloadConfig dict. A trace replayed at its own arrival times (`arrival='trace'`, e.g. the Azure
code / conversation traces: `trace_workload`) is scaled to a rate r by `trace_time_scale = own rate / r`, its
own rate being (n - 1) / (last - first arrival) of the n rows replayed; any other arrival process gets `rate=r`.
Lengths are the same at every rate.

Search (each evaluation is one whole simulation, pdjax.sim.run's build -> simulate path, deterministic):
- Monotonicity, the pruning rule: more machines in a pool never hurt, and a lower rate never hurts. So at the
  target rate a colocated design needs the least n that passes (doubling from 1, then bisection), and a
  Splitwise design's passing set is an up-set of (P, T) whose lower boundary is a staircase: T_min(P) is
  non-increasing in P. The walk: the first P (from 1) whose (P, max_machines) passes gets T_min by bisection;
  each next P starts at the previous T_min, checks it (and, should the simulator break monotonicity, searches
  upward), then steps T down while (P, T - 1) passes. It stops at T_min = 1 or once (P, 1) costs more, draws
  more power and counts more machines than the best found (every later P is worse on all three). The cheapest,
  least-power and fewest-machine clusters all lie on this staircase (cost, power and count grow with P and T),
  so the answers are exact under monotonicity; tests/test_provision.py checks them against brute force.
- Iso-cost / iso-power: the candidates are the maximal clusters within the budget (n = floor(B / c); for each P,
  T = floor((B - P c_p) / c_t) >= 1: a cluster with spare budget is beaten by one with another machine). Each
  candidate's highest passing rate is found by doubling then bisection to `rel_tol`, after one probe at the best
  rate so far x (1 + rel_tol) that skips a candidate which cannot beat it.
- Parallelism: the unit of work is one (question, system) search; units run by pdjax.procs.parallel_map in a
  process pool (`workers`) or as Ray tasks (`ray_address`, or `executor='ray'` for a local cluster), results
  are put back in the units' order, so the answer is the same serially and in parallel.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.config.model_specs import get_model_spec
from pdjax.config.registry import BASELINE_POLICIES, POLICIES, disaggregated_base
from pdjax.config.serving import serve_config_from_dict
from pdjax.config.validate import check_max_model_len
from pdjax.metrics.capacity import bisect_rate, bracket_rate
from pdjax.metrics.latency import SLOs, slo_attainment
from pdjax.metrics.plots import _figure
from pdjax.metrics.report import _save_png
from pdjax.metrics.slowdown import SPLITWISE_SLO_FACTORS, splitwise_slo_check
from pdjax.procs import EXECUTORS, parallel_map
from pdjax.sim.build import build_pending_requests, build_setup, group_step_time
from pdjax.sim.machines import MachineSpec, get_machine
from pdjax.sim.reference import SPLITWISE_REFERENCE, ReferenceMachine, UnloadedRuns
from pdjax.sim.run import energy_info, simulate_setup
from pdjax.sim.step_time import StepTimeBase
from pdjax.workload.traces import load_trace

COLOCATED_POLICIES = BASELINE_POLICIES    # the policy table's colocated baselines (live): ('sarathi', 'vllm_v0')
MIXED_SETTINGS = ("off", "on", "rebalance")    # rebalance: online XpYd role flips (pdjax.scheduler.rebalance)
SLO_KINDS = ("splitwise", "pdjax")
QUESTIONS = ("cheapest", "least_power", "fewest_machines", "iso_cost", "iso_power")


@dataclasses.dataclass(frozen=True)
class Design:
    """A cluster design: colocated machines of one SKU, or prompt machines + token machines (SKU names of
    pdjax.sim.machines)."""
    name: str
    kind: str             # 'colocated' | 'disaggregated'
    prompt: str           # the SKU of the prompt pool (colocated: of every machine)
    token: str            # the SKU of the token pool (colocated: = prompt)

    @property
    def prompt_machine(self) -> MachineSpec:
        return get_machine(self.prompt)

    @property
    def token_machine(self) -> MachineSpec:
        return get_machine(self.token)


DESIGNS: Dict[str, Design] = {d.name: d for d in (
    Design("Baseline-A100", "colocated", "dgx-a100", "dgx-a100"),
    Design("Baseline-H100", "colocated", "dgx-h100", "dgx-h100"),
    Design("Splitwise-AA", "disaggregated", "dgx-a100", "dgx-a100"),
    Design("Splitwise-HH", "disaggregated", "dgx-h100", "dgx-h100"),
    Design("Splitwise-HA", "disaggregated", "dgx-h100", "dgx-a100"),
    Design("Splitwise-HHcap", "disaggregated", "dgx-h100", "dgx-h100-pcap"),
)}


@dataclasses.dataclass(frozen=True)
class System:
    """What one search runs: a design with its colocated policy (colocated designs) or its mixed-pool setting
    (Splitwise designs)."""
    design: str
    policy: str = "sarathi"     # colocated: the scheduling policy; disaggregated: the roles' base ('sarathi')
    mixed: str = "off"

    @property
    def name(self) -> str:
        d = DESIGNS[self.design]
        if d.kind == "colocated":
            return f"{self.design} ({self.policy})"
        return f"{self.design}{ {'on': ' +mixed', 'rebalance': ' +rebalance'}.get(self.mixed, '')}"

    @property
    def kind(self) -> str:
        return DESIGNS[self.design].kind


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`num_prompt` prompt machines and `num_token` token machines of a system (colocated: num_prompt machines,
    num_token 0)."""
    system: System
    num_prompt: int
    num_token: int = 0

    @property
    def design(self) -> Design:
        return DESIGNS[self.system.design]

    @property
    def machines(self) -> List[MachineSpec]:
        d = self.design
        return [d.prompt_machine] * self.num_prompt + [d.token_machine] * self.num_token

    @property
    def num_machines(self) -> int:
        return self.num_prompt + self.num_token

    @property
    def cost_per_hour(self) -> float:
        return sum(m.cost_per_hour for m in self.machines)

    @property
    def power_w(self) -> float:
        """Provisioned power: the machines' TDP (W)."""
        return sum(m.tdp_w for m in self.machines)

    @property
    def label(self) -> str:
        if self.system.kind == "colocated":
            return f"{self.num_prompt}"
        return f"{self.num_prompt}P+{self.num_token}T"

    def key(self) -> Tuple:
        return (self.system.name, self.num_prompt, self.num_token)


# --------------------------------------------------------------------------------------------------- problem
@dataclasses.dataclass(frozen=True)
class ProvisionProblem:
    """What to provision (module docstring). workload: a WorkloadConfig dict (its rate or trace time scale is set
    per probe); target_rate: req/s of the iso-throughput questions. Pool sizes are searched in 1..max_machines
    each. Budgets: cost in USD per hour, power in W (0: that iso question is not asked)."""
    model: str
    workload: Mapping[str, Any]
    target_rate: float
    designs: Tuple[str, ...] = tuple(DESIGNS)
    colocated_policies: Tuple[str, ...] = ("sarathi",)
    mixed: Tuple[str, ...] = ("off",)
    slo: str = "splitwise"
    slo_factors: Mapping[str, Mapping[str, float]] = dataclasses.field(
        default_factory=lambda: {m: dict(q) for m, q in SPLITWISE_SLO_FACTORS.items()})
    ttft_s: float = 0.0                 # pdjax's absolute SLOs (0 = no bound)
    tbt_s: float = 0.0
    tpot_s: float = 0.0
    attainment: float = 0.9
    reference: ReferenceMachine = SPLITWISE_REFERENCE
    tp: int = 8
    token_budget: int = 2048
    max_num_seqs: int = 512
    max_model_len: int = 4096
    page_size: int = 16
    mem_util: float = 0.9
    router: str = "least_loaded"
    max_machines: int = 16
    cost_budget: float = 0.0
    power_budget: float = 0.0
    rel_tol: float = 0.05
    max_probes: int = 12                # per candidate's rate search
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "designs", tuple(self.designs))
        object.__setattr__(self, "colocated_policies", tuple(self.colocated_policies))
        object.__setattr__(self, "mixed", tuple(self.mixed))
        _check_names("design", self.designs, tuple(DESIGNS))
        _check_names("colocated policy", self.colocated_policies, COLOCATED_POLICIES)
        _check_names("mixed setting", self.mixed, MIXED_SETTINGS)
        if self.slo not in SLO_KINDS:
            raise ValueError(f"slo={self.slo!r}, expected one of {SLO_KINDS}")
        if not (isinstance(self.target_rate, (int, float)) and self.target_rate > 0):
            raise ValueError(f"target_rate={self.target_rate!r}, expected a rate > 0 (requests/s)")
        if self.slo == "pdjax" and not (self.ttft_s > 0 or self.tbt_s > 0 or self.tpot_s > 0):
            raise ValueError("slo='pdjax' needs at least one of ttft_s, tbt_s, tpot_s > 0 (seconds)")
        for key in ("ttft_s", "tbt_s", "tpot_s", "cost_budget", "power_budget"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key}={getattr(self, key)!r}, expected >= 0 (0 = none)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment={self.attainment!r}, expected in (0, 1]")
        if not isinstance(self.max_machines, int) or self.max_machines < 1:
            raise ValueError(f"max_machines={self.max_machines!r}, expected a positive int")
        if not 0 < self.rel_tol < 1:
            raise ValueError(f"rel_tol={self.rel_tol!r}, expected in (0, 1)")
        check_max_model_len(self.max_model_len, get_model_spec(self.model), key="max_model_len")
        for metric, per_q in self.slo_factors.items():
            if metric not in SPLITWISE_SLO_FACTORS or any(q not in ("p50", "p90", "p99") or not f >= 1
                                                          for q, f in per_q.items()):
                raise ValueError(f"slo_factors[{metric!r}]={dict(per_q)!r}, expected metrics of "
                                 f"{sorted(SPLITWISE_SLO_FACTORS)} with p50/p90/p99 factors >= 1")

    @property
    def systems(self) -> List[System]:
        out = []
        for name in self.designs:
            if DESIGNS[name].kind == "colocated":
                out += [System(name, policy=p) for p in self.colocated_policies]
            else:
                d = DESIGNS[name]    # rebalancing flips a machine's role: only where both pools are one SKU
                out += [System(name, mixed=m) for m in self.mixed if m != "rebalance" or d.prompt == d.token]
        return out

    @property
    def absolute_slos(self) -> Optional[SLOs]:
        bounds = {k: getattr(self, k) or None for k in ("ttft_s", "tbt_s", "tpot_s")}
        return SLOs(**bounds) if any(bounds.values()) else None


def _check_names(what: str, names: Sequence[str], known: Sequence[str]) -> None:
    if not names:
        raise ValueError(f"no {what} given, expected some of {list(known)}")
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown {what} {bad[0]!r}, expected one of {list(known)}")


TRACE_ARRIVALS = ("trace", "poisson")


def trace_workload(path: str, num_requests: int, trace_start: int = 0, seed: int = 0,
                   arrival: str = "trace") -> Dict[str, Any]:
    """A WorkloadConfig dict of `num_requests` rows of the trace at `path` from `trace_start`, with their own
    lengths, arriving at their own times (arrival='trace', scaled per probe to the probed rate) or as a Poisson
    process at the probed rate (arrival='poisson': what splitwise-sim's generate_trace.py makes of the Azure
    traces, exponential gaps with the traces' lengths)."""
    if arrival not in TRACE_ARRIVALS:
        raise ValueError(f"arrival={arrival!r}, expected one of {TRACE_ARRIVALS}")
    return {"kind": "trace", "arrival": arrival, "trace_path": path, "num_requests": int(num_requests),
            "trace_start": int(trace_start), "seed": int(seed)}


@functools.lru_cache(maxsize=16)
def replay_rate(path: str, trace_start: int, num_requests: int) -> float:
    """The trace's own rate over the rows replayed: (n - 1) / (last - first arrival), req/s."""
    rows = load_trace(path).rows[trace_start:trace_start + num_requests]
    if len(rows) < 2 or rows[0].arrival_time is None:
        raise ValueError(f"trace {path!r}: rows {trace_start}..+{num_requests} give no arrival rate (expected >= 2 "
                         "rows with arrival times)")
    span = max(r.arrival_time for r in rows) - min(r.arrival_time for r in rows)
    if not span > 0:
        raise ValueError(f"trace {path!r}: rows {trace_start}..+{num_requests} all arrive at once; no rate to scale")
    return (len(rows) - 1) / span


def workload_at(workload: Mapping[str, Any], rate: float) -> Dict[str, Any]:
    """`workload` at `rate` req/s (module docstring: a trace replay is time-scaled, any other arrival re-rated)."""
    if not rate > 0:
        raise ValueError(f"rate={rate!r}, expected > 0 (requests/s)")
    out = dict(workload)
    if out.get("arrival") == "trace":
        own = replay_rate(out["trace_path"], int(out.get("trace_start", 0)), int(out["num_requests"]))
        out["trace_time_scale"] = own / rate
    else:
        out["rate"] = float(rate)
    return out


# --------------------------------------------------------------------------------------------------- one probe
def serve_config(problem: ProvisionProblem, cluster: Cluster, rate: float) -> Dict[str, Any]:
    """The serve config (plain dict, configs/serve.py's layout) simulating `cluster` at `rate` req/s: one TP
    instance per machine, the prompt SKU's hardware as sim.hardware, the token pool's as deployment.decode's."""
    d, s = cluster.design, cluster.system
    policy = s.policy if d.kind == "colocated" else disaggregated_base()
    budget = problem.token_budget
    if not POLICIES[policy].chunking:      # never chunks (vllm_v0): its budget must hold a max-length prompt
        budget = max(budget, problem.max_model_len)
    workload = {k: v for k, v in workload_at(problem.workload, rate).items() if k not in ("max_model_len",)}
    if d.kind == "colocated":
        deployment = {"kind": "colocated", "router": problem.router,
                      "colocated": {"num_instances": cluster.num_prompt, "tp": problem.tp}}
    else:
        decode = {"num_instances": cluster.num_token, "tp": problem.tp}
        if d.token_machine.hardware != d.prompt_machine.hardware:
            decode["hardware"] = d.token_machine.hardware
        deployment = {"kind": "disaggregated", "router": problem.router,
                      "prefill": {"num_instances": cluster.num_prompt, "tp": problem.tp}, "decode": decode}
        if s.mixed == "on":
            deployment["mixed_pool"] = "borrow"
        elif s.mixed == "rebalance":
            deployment["rebalance"] = True
    pages = max(4096, 2 * -(-problem.max_model_len // problem.page_size))   # validation only: sim sizes the KV
    return {"backend": "sim", "seed": int(problem.seed), "model": {"checkpoint": problem.model},
            "engine": {"mode": "online", "progress": False},
            "scheduler": {"policy": policy, "token_budget": budget, "max_num_seqs": problem.max_num_seqs,
                          "max_model_len": problem.max_model_len, "page_size": problem.page_size,
                          "num_pages": pages},
            "workload": workload,
            "sim": {"hardware": d.prompt_machine.hardware, "num_pages": 0,
                    "gpu_memory_utilization": problem.mem_util},
            "deployment": deployment}


def role_machines(cluster: Cluster) -> Dict[str, MachineSpec]:
    d = cluster.design
    if d.kind == "colocated":
        return {"colocated": d.prompt_machine}
    return {"prefill": d.prompt_machine, "decode": d.token_machine}


def capped(setup, machines: Mapping[str, MachineSpec]):
    """`setup` with every group whose machine is power-capped (compute_scale < 1) on that machine's hardware at
    the capped compute rate (peak FLOP/s x compute_scale; memory and links unchanged)."""
    groups = dict(setup.groups)
    for role, m in machines.items():
        if m.compute_scale < 1 and role in groups:
            g = groups[role]
            hw = g.hardware or setup.hardware
            hw = hw.replace(peak_flops_bf16=hw.peak_flops_bf16 * m.compute_scale,
                            peak_flops_fp16=hw.peak_flops_fp16 * m.compute_scale,
                            peak_flops_fp32=hw.peak_flops_fp32 * m.compute_scale,
                            peak_flops_tf32=hw.peak_flops_tf32 * m.compute_scale)
            groups[role] = dataclasses.replace(g, hardware=hw, params=g.params or setup.params)
    return dataclasses.replace(setup, groups=groups)


class PhaseCappedStepTime(StepTimeBase):
    """A power-capped machine's step time (pdjax.sim.machines): a step carrying prefill tokens draws above the cap
    and runs at the capped compute rate (`capped`), a decode-only step draws less than the cap (token_w <
    prompt_w = the cap) and runs at full speed (`full`)."""

    takes_context = True

    def __init__(self, full: Callable, capped_fn: Callable):
        self.full, self.capped = full, capped_fn

    def __call__(self, out, ctx=None) -> float:
        return (self.capped if out.num_prefill_tokens else self.full)(out, ctx)


def cap_instances(setup, machines: Mapping[str, MachineSpec]) -> Optional[Callable[[dict], None]]:
    """The simulate_setup hook giving every instance on a power-capped machine its PhaseCappedStepTime (None when
    no machine is capped)."""
    roles = [r for r, m in machines.items() if m.compute_scale < 1 and r in setup.groups]
    if not roles:
        return None
    capped_setup = capped(setup, machines)
    if any(setup.groups[r].pp != 1 or setup.groups[r].stack.name != "pdjax" for r in roles):
        raise ValueError("a power-capped machine is modelled for pdjax-stack instances with pp=1 only")

    def adjust(instances: dict) -> None:
        for role in roles:
            capped_fn = group_step_time(capped_setup, role)
            for inst in instances[role]:
                inst.step_time = inst.timer.step_time = PhaseCappedStepTime(inst.step_time, capped_fn)
    return adjust


_REFERENCES: Dict[Tuple[str, ReferenceMachine], UnloadedRuns] = {}


def reference_runs(model: str, reference: ReferenceMachine) -> UnloadedRuns:
    """The unloaded runs on the reference machine, one per process and (model, reference)."""
    key = (model, reference)
    if key not in _REFERENCES:
        _REFERENCES[key] = UnloadedRuns.on(get_model_spec(model), reference)
    return _REFERENCES[key]


@dataclasses.dataclass(frozen=True)
class Probe:
    """One simulation of a cluster at a rate: whether it meets the problem's SLOs and what it showed."""
    cluster: Cluster
    rate: float
    passes: bool
    slowdowns: Dict[str, Dict[str, Optional[float]]]    # Splitwise's nine percentiles
    splitwise_passes: bool
    attainment: Optional[float]                          # pdjax's absolute SLO attainment (None: no bounds)
    num_completed: int
    energy_per_request_j: Optional[float]
    simulated_s: float

    def row(self) -> Dict[str, Any]:
        c = self.cluster
        return {"system": c.system.name, "design": c.system.design, "policy": c.system.policy,
                "mixed": c.system.mixed, "cluster": c.label, "num_prompt": c.num_prompt, "num_token": c.num_token,
                "num_machines": c.num_machines, "cost_per_hour": round(c.cost_per_hour, 4),
                "power_kw": round(c.power_w / 1e3, 4), "rate": round(self.rate, 6), "passes": self.passes,
                "slowdowns": self.slowdowns, "splitwise_passes": self.splitwise_passes,
                "attainment": self.attainment, "num_completed": self.num_completed,
                "energy_per_request_j": self.energy_per_request_j}


def probe(problem: ProvisionProblem, cluster: Cluster, rate: float) -> Probe:
    """Simulate `cluster` at `rate` req/s and check the problem's SLOs."""
    cfg = serve_config_from_dict(serve_config(problem, cluster, rate))
    machines = role_machines(cluster)
    setup = build_setup(cfg)
    result = simulate_setup(setup, build_pending_requests(cfg), cap_instances(setup, machines))
    records = result.requests
    reference = reference_runs(problem.model, problem.reference)
    check = splitwise_slo_check(records, reference.for_records(records), problem.slo_factors)
    slos = problem.absolute_slos
    attainment = slo_attainment(records, slos) if slos is not None else None
    if problem.slo == "splitwise":
        passes = bool(check["passes"])
    else:
        passes = attainment is not None and attainment >= problem.attainment
    energy = energy_info(result, setup, machines)
    return Probe(cluster, float(rate), passes, check["slowdowns"], bool(check["passes"]), attainment,
                 sum(1 for r in records if r.completed), energy.get("energy_per_request_j"), result.duration_s)


class _Prober:
    """Memoized probes of one search unit (each (cluster, rate) simulated once), in the order run."""

    def __init__(self, problem: ProvisionProblem, probe_fn: Callable = probe):
        self.problem, self.probe_fn = problem, probe_fn
        self.probes: Dict[Tuple, Probe] = {}

    def __call__(self, cluster: Cluster, rate: float) -> Probe:
        key = (cluster.key(), rate)
        if key not in self.probes:
            self.probes[key] = self.probe_fn(self.problem, cluster, rate)
        return self.probes[key]

    def ok(self, cluster: Cluster, rate: float) -> bool:
        return self(cluster, rate).passes


# --------------------------------------------------------------------------------------------------- iso-throughput
def _least_passing(ok: Callable[[int], bool], lo: int, hi: int) -> Optional[int]:
    """The least n in lo..hi with ok(n), ok monotone (False ... False True ... True); None if ok(hi) fails.
    Doubling from lo, then bisection; ok is called on hi only when the doubling reaches it."""
    n, last_bad = lo, lo - 1
    while True:
        if ok(n):
            break
        last_bad = n
        if n >= hi:
            return None
        n = min(hi, max(n + 1, 2 * n - lo + 1))
    good = n
    while good - last_bad > 1:
        mid = (good + last_bad) // 2
        if ok(mid):
            good = mid
        else:
            last_bad = mid
    return good


def _dominated(cluster: Cluster, best: Mapping[str, Cluster]) -> bool:
    """`cluster` is worse than the best so far on cost, power and machine count (so is every larger one)."""
    return bool(best) and (cluster.cost_per_hour > best["cheapest"].cost_per_hour + 1e-9
                           and cluster.power_w > best["least_power"].power_w + 1e-9
                           and cluster.num_machines > best["fewest_machines"].num_machines)


OBJECTIVES = {   # question -> sort key of a cluster (ties: the other figures, then the label)
    "cheapest": lambda c: (round(c.cost_per_hour, 9), round(c.power_w, 6), c.num_machines, c.num_prompt),
    "least_power": lambda c: (round(c.power_w, 6), round(c.cost_per_hour, 9), c.num_machines, c.num_prompt),
    "fewest_machines": lambda c: (c.num_machines, round(c.cost_per_hour, 9), round(c.power_w, 6), c.num_prompt),
}


def _best_of(clusters: Sequence[Cluster]) -> Dict[str, Cluster]:
    return {q: min(clusters, key=key) for q, key in OBJECTIVES.items()} if clusters else {}


def frontier(problem: ProvisionProblem, system: System, prober: _Prober) -> List[Cluster]:
    """The minimal clusters of `system` meeting the SLOs at the target rate (module docstring: the staircase;
    colocated: the one least n), each verified by a simulation."""
    rate, top = problem.target_rate, problem.max_machines
    if system.kind == "colocated":
        n = _least_passing(lambda k: prober.ok(Cluster(system, k), rate), 1, top)
        return [] if n is None else [Cluster(system, n)]
    found: List[Cluster] = []
    t_min: Optional[int] = None
    for p in range(1, top + 1):
        if found and _dominated(Cluster(system, p, 1), _best_of(found)):
            break
        ok_t = functools.partial(lambda prompt, k: prober.ok(Cluster(system, prompt, k), rate), p)
        if t_min is None:    # the first P that works at all (one probe at the largest token pool otherwise)
            if not prober.ok(Cluster(system, p, top), rate):
                continue
            t = _least_passing(ok_t, 1, top)
        elif prober.ok(Cluster(system, p, t_min), rate):
            t = t_min
            while t > 1 and prober.ok(Cluster(system, p, t - 1), rate):
                t -= 1
        else:   # the simulator broke monotonicity in P: search upward
            t = _least_passing(ok_t, t_min + 1, top) if t_min < top else None
        if t is None:
            continue
        found.append(Cluster(system, p, t))
        t_min = t
        if t == 1:
            break
    return found


# --------------------------------------------------------------------------------------------------- iso budget
def budget_clusters(problem: ProvisionProblem, system: System, question: str) -> List[Cluster]:
    """The maximal clusters of `system` within the question's budget (module docstring)."""
    d = DESIGNS[system.design]
    if question == "iso_cost":
        budget, cp, ct = problem.cost_budget, d.prompt_machine.cost_per_hour, d.token_machine.cost_per_hour
    else:
        budget, cp, ct = problem.power_budget, d.prompt_machine.tdp_w, d.token_machine.tdp_w
    eps = 1e-9 * budget
    if d.kind == "colocated":
        n = int(math.floor((budget + eps) / cp))
        return [Cluster(system, n)] if n >= 1 else []
    out = []
    for p in range(1, int(math.floor((budget + eps) / cp)) + 1):
        t = int(math.floor((budget - p * cp + eps) / ct))
        if t >= 1:
            out.append(Cluster(system, p, t))
    return out


def highest_rate(problem: ProvisionProblem, cluster: Cluster, prober: _Prober, beat: float = 0.0) -> float:
    """The highest rate (to rel_tol) at which `cluster` meets the SLOs, 0 if none was found; with beat > 0, 0 at
    once unless it passes at beat x (1 + rel_tol)."""
    probes: List[float] = []

    def ok(rate: float) -> bool:
        probes.append(rate)
        return prober.ok(cluster, rate)

    def more() -> bool:
        return len(probes) < problem.max_probes

    start = beat * (1 + problem.rel_tol) if beat > 0 else problem.target_rate
    good, bad = bracket_rate(ok, start, more=more, halve=beat <= 0)    # beating `beat` or nothing: no halving
    good, _ = bisect_rate(ok, good, bad, rel_tol=problem.rel_tol, more=more)
    return good


def iso_budget(problem: ProvisionProblem, system: System, question: str, prober: _Prober) -> Dict[str, Any]:
    """{'budget', 'cluster', 'rate', 'num_candidates'}: the highest load `system` holds within the budget."""
    best_rate, best = 0.0, None
    candidates = budget_clusters(problem, system, question)
    for cluster in candidates:
        rate = highest_rate(problem, cluster, prober, beat=best_rate)
        if rate > best_rate:
            best_rate, best = rate, cluster
    return {"budget": problem.cost_budget if question == "iso_cost" else problem.power_budget,
            "cluster": best, "rate": best_rate, "num_candidates": len(candidates)}


# --------------------------------------------------------------------------------------------------- units of work
@dataclasses.dataclass(frozen=True)
class Unit:
    question: str           # 'throughput' (questions a-c) | 'iso_cost' | 'iso_power'
    system: System


def units(problem: ProvisionProblem) -> List[Unit]:
    out = [Unit("throughput", s) for s in problem.systems]
    if problem.cost_budget > 0:
        out += [Unit("iso_cost", s) for s in problem.systems]
    if problem.power_budget > 0:
        out += [Unit("iso_power", s) for s in problem.systems]
    return out


def run_unit(problem: ProvisionProblem, unit: Unit, probe_fn: Callable = probe) -> Dict[str, Any]:
    """One unit's search; returns its answer and every probe it ran (rows), with its wall seconds."""
    start = time.perf_counter()
    prober = _Prober(problem, probe_fn)
    out: Dict[str, Any] = {"question": unit.question, "system": unit.system.name}
    if unit.question == "throughput":
        found = frontier(problem, unit.system, prober)
        out["frontier"] = [prober(c, problem.target_rate).row() for c in found]
        out["best"] = {q: prober(c, problem.target_rate).row() for q, c in _best_of(found).items()}
    else:
        answer = iso_budget(problem, unit.system, unit.question, prober)
        c = answer["cluster"]
        out.update(budget=answer["budget"], rate=answer["rate"], num_candidates=answer["num_candidates"],
                   best=prober(c, answer["rate"]).row() if c is not None else None)
    out["probes"] = [p.row() for p in prober.probes.values()]
    out["wall_s"] = round(time.perf_counter() - start, 3)
    return out


class _RunUnit:
    def __init__(self, problem: ProvisionProblem, probe_fn: Callable = probe):
        self.problem, self.probe_fn = problem, probe_fn

    def __call__(self, unit: Unit) -> Dict[str, Any]:
        return run_unit(self.problem, unit, self.probe_fn)


# --------------------------------------------------------------------------------------------------- the search
def provision(problem: ProvisionProblem, *, workers: int = 1, executor: str = "local", ray_address: str = "",
              probe_fn: Callable = probe, log: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Answer the questions (module docstring). Returns {'problem', 'systems': {system: {...}}, 'answers':
    {question: row of the winning system, or None}, 'table': [per-system row], 'num_simulations', 'wall_s'}.
    `log`: told one line as each (question, system) search ends."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r}, expected one of {EXECUTORS}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}, expected a positive int")
    start = time.perf_counter()
    todo = units(problem)
    fn = _RunUnit(problem, probe_fn)
    finished = []

    def done(i: int, res: Mapping[str, Any]) -> None:
        finished.append(i)
        if log is not None:
            log(f"provision: [{len(finished)}/{len(todo)}] {res['question']} {res['system']}: "
                f"{len(res['probes'])} simulations, {res['wall_s']:.1f} s")

    results = parallel_map(fn, todo, workers=workers, executor=executor, ray_address=ray_address, done=done)
    systems: Dict[str, Dict[str, Any]] = {s.name: {"design": s.design, "policy": s.policy, "mixed": s.mixed}
                                          for s in problem.systems}
    for unit, res in zip(todo, results):
        entry = systems[unit.system.name]
        if unit.question == "throughput":
            entry["frontier"] = res["frontier"]
            for q in OBJECTIVES:
                entry[q] = res["best"].get(q)
        else:
            entry[unit.question] = {"budget": res["budget"], "rate": res["rate"], "best": res["best"],
                                    "num_candidates": res["num_candidates"]}
        entry.setdefault("num_simulations", 0)
        entry["num_simulations"] += len(res["probes"])
    answers: Dict[str, Any] = {}
    for q, key in (("cheapest", "cost_per_hour"), ("least_power", "power_kw"), ("fewest_machines", "num_machines")):
        rows = [e[q] for e in systems.values() if e.get(q)]
        answers[q] = min(rows, key=lambda r: (r[key], r["cost_per_hour"], r["power_kw"], r["num_machines"],
                                              r["system"])) if rows else None
    for q in ("iso_cost", "iso_power"):
        rows = [e[q] for e in systems.values() if q in e and e[q]["best"]]
        answers[q] = max(rows, key=lambda r: (r["rate"], r["best"]["system"]))["best"] if rows else None
    return {"problem": describe(problem), "systems": systems, "answers": answers, "table": table_rows(systems),
            "num_simulations": sum(len(r["probes"]) for r in results), "workers": workers, "executor": executor,
            "wall_s": round(time.perf_counter() - start, 2)}


def describe(problem: ProvisionProblem) -> Dict[str, Any]:
    d = dataclasses.asdict(problem)
    d["reference"] = problem.reference.describe()
    d["machines"] = {name: get_machine(name).to_dict() for name in
                     sorted({m for n in problem.designs for m in (DESIGNS[n].prompt, DESIGNS[n].token)})}
    return d


# --------------------------------------------------------------------------------------------------- table, plots
def table_rows(systems: Mapping[str, Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """One row per system: its cheapest / least-power / fewest-machine cluster at the target rate and the highest
    rate it holds at the iso budgets."""
    rows = []
    for name, e in systems.items():
        row: Dict[str, Any] = {"system": name}
        for q, figure in (("cheapest", "cost_per_hour"), ("least_power", "power_kw"),
                          ("fewest_machines", "num_machines")):
            best = e.get(q)
            row[q] = best["cluster"] if best else None
            row[f"{q}_{figure}"] = best[figure] if best else None
        for q in ("iso_cost", "iso_power"):
            if q in e:
                best = e[q]["best"]
                row[f"{q}_cluster"] = best["cluster"] if best else None
                row[f"{q}_rate"] = round(e[q]["rate"], 4)
        rows.append(row)
    return rows


def format_table(result: Mapping[str, Any]) -> str:
    rows = result["table"]
    cols = ["system", "cheapest", "cheapest_cost_per_hour", "least_power", "least_power_power_kw",
            "fewest_machines", "fewest_machines_num_machines"]
    cols += [c for c in ("iso_cost_cluster", "iso_cost_rate", "iso_power_cluster", "iso_power_rate")
             if any(c in r for r in rows)]
    cells = [[("-" if r.get(c) is None else f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r[c]))
              for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    for q, row in result["answers"].items():
        if q.startswith("iso") and not any(q in e for e in result["systems"].values()):
            continue    # not asked (no budget)
        if row:
            lines.append(f"{q}: {row['system']} {row['cluster']} (${row['cost_per_hour']:.2f}/h, "
                         f"{row['power_kw']:.1f} kW, {row['num_machines']} machines, {row['rate']:.3g} req/s)")
        else:
            lines.append(f"{q}: no cluster in the search space meets the SLOs")
    return "\n".join(lines)


PLOTS = {   # question -> (file, y label, what each bar is)
    "cheapest": ("cheapest.png", "cost (USD / hour)", "cheapest cluster meeting the SLOs"),
    "least_power": ("least_power.png", "provisioned power (kW)", "least-power cluster meeting the SLOs"),
    "fewest_machines": ("fewest_machines.png", "machines", "fewest machines meeting the SLOs"),
    "iso_cost": ("iso_cost.png", "highest load held (req/s)", "at the iso-cost budget"),
    "iso_power": ("iso_power.png", "highest load held (req/s)", "at the iso-power budget"),
}


def plot_questions(result: Mapping[str, Any], outdir: str) -> List[str]:
    """One bar chart per question answered (PLOTS), each bar a system labelled with its cluster; returns paths."""
    systems = result["systems"]
    rate = result["problem"]["target_rate"]
    paths = []
    for q, (fname, ylabel, what) in PLOTS.items():
        if q.startswith("iso") and not any(q in e for e in systems.values()):
            continue
        names, values, labels = [], [], []
        for name, e in systems.items():
            if q.startswith("iso"):
                best = e[q]["best"]
                value = e[q]["rate"] if best else 0.0
            else:
                best = e.get(q)
                value = (best[{"cheapest": "cost_per_hour", "least_power": "power_kw",
                               "fewest_machines": "num_machines"}[q]] if best else 0.0)
            names.append(name)
            values.append(value)
            labels.append(best["cluster"] if best else "none")
        fig = _figure(height=3.4, width=max(5.0, 1.1 * len(names)))
        ax = fig.add_subplot(1, 1, 1)
        bars = ax.bar(range(len(names)), values, color="tab:blue")
        for bar, label in zip(bars, labels):
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        if q.startswith("iso"):
            budget = next(e[q]["budget"] for e in systems.values() if q in e)
            title = f"{what} ({budget:g} USD/h)" if q == "iso_cost" else f"{what} ({budget / 1e3:g} kW)"
        else:
            title = f"{what} ({rate:g} req/s)"
        ax.set_title(f"{result['problem']['model']}: {title}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        path = os.path.join(outdir, fname)
        _save_png(path)(fig)
        paths.append(path)
    return paths
