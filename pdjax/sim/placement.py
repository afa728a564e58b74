"""DistServe-style placement search in simulation: which prefill/decode layouts, instance counts and device
placement give the highest per-GPU goodput under TTFT/TPOT SLOs at an attainment target, beside colocated
candidates (sarathi, vllm_v0) on the same GPUs.

My reading of DistServe (Zhong et al., OSDI'24, §4.1-4.2, Algorithms 1 and 2):
- Algorithm 1, *high node-affinity* (the cluster's inter-node network is fast enough that the KV transfer is
  negligible wherever the two instances sit): prefill and decode are optimized independently. For every
  intra-op degree (TP, at most the GPUs of one node) and inter-op degree (PP, up to #nodes · GPUs per node / TP)
  whose shards fit in GPU memory, simulate the phase's goodput and divide by the GPUs it uses; keep the best
  prefill and the best decode configuration, then replicate each enough to carry the traffic rate
  (n = ⌈R / goodput_prefill⌉, m = ⌈R / goodput_decode⌉). Instances may sit on any nodes.
- Algorithm 2, *low node-affinity* (slow cross-node network): the KV transfer must stay inside a node, so prefill
  and decode share the inter-op degree and their corresponding pipeline stages are colocated: an *instance
  segment* = one stage of the prefill instance (TP_p GPUs) plus the same layers of the decode instance (TP_d GPUs)
  on one node (TP_p + TP_d ≤ GPUs per node). For every PP degree and every intra-node (TP_p, TP_d) that fits,
  simulate the prefill+decode pair and keep the best goodput per GPU; replicate the pair to carry the rate.
  KV moves stage to stage over the node's link (NVLink).

What this module does with that (a GPU budget instead of a traffic rate, and whole-deployment simulation):
- Candidates. `high`: every (prefill layout, n prefill instances, decode layout, m decode instances) with
  n·GPUs_p + m·GPUs_d ≤ budget, TP ≤ GPUs per node and every pipeline stage's TP group inside one node
  (instances packed first-fit onto nodes, prefill first). `low`: every (PP, TP_p, TP_d, k pairs) with
  TP_p + TP_d ≤ GPUs per node and k·PP·(TP_p + TP_d) ≤ budget, each segment on one node. `colocated`: policy
  (sarathi, vllm_v0) x layout x replicas within the budget. Layouts: TP dividing the model's heads, KV heads and
  MLP width; PP dividing the layer count; the weights and one max-length request's KV must fit
  (`kv_cache_capacity_tokens`). Candidates that simulate identically (same layouts, counts and transfer links)
  are kept once (on one node, every `low` candidate is also a `high` one).
- Each candidate is simulated whole (its serve config through pdjax.sim.run.simulate_config: the real
  prefill_only/decode_only schedulers, or the colocated policy's replicas) with the KV transfer over the link its
  placement gives (pdjax.sim.disagg.kv_link): same node -> the node's link (NVLink pair, NVSwitch or PCIe),
  else the inter-node network; equal PP: per stage, PP·min(TP_p, TP_d) streams (low affinity: all inside
  nodes), else min(devices of the two instances). Link figures come from the node type.
- Goodput: the highest arrival rate whose SLO attainment (share of requests meeting both TTFT and TPOT) is at
  least the target, by doubling then bisection on the rate (same seed: arrivals rescaled, lengths unchanged);
  reported per GPU (rate / GPUs the candidate uses), as DistServe ranks placements.
- SLO scale (DistServe's other axis, its Figures 8-9 lower rows): at a fixed per-GPU rate, the tightest factor s
  on both SLOs (TTFT s·ttft_s, TPOT s·tpot_s) each candidate still passes under the problem's rule. A run's
  records do not depend on the SLOs, so each candidate is simulated once (at the per-GPU rate x its GPUs) and s
  is read off its records in closed form (`tightest_slo_scale`), not bisected over simulations.
- Parallelism: candidates are evaluated on `workers` processes (pdjax.procs.parallel_map: fork unless JAX is
  loaded, workers that die with the parent, terminated on any error or interruption).
  Every evaluation is deterministic, so the ranking is the same serially and in parallel.
- Each ranking row carries `deployment`: the placement as a serve config's deployment block (groups, layouts,
  devices, each group's token budget and sequence limit), to run it with `experiments.serve` on either backend.
  One simulate path: a candidate is simulated as its whole serve config (`serve_config`: that block plus the
  problem's model, scheduler knobs, workload, hardware and profile) through pdjax.sim.run.simulate_config, the
  function `--config.backend=sim` runs, and its KV links are the simulator's (pdjax.sim.disagg.kv_link); so a
  ranked placement's numbers are what `experiments.serve --config.backend=sim` reports for that config.
- Online XpYd rebalancing (`rebalance=True` of enumerate_placements / search / slo_scale_search; off by default):
  every disaggregated candidate whose instances could swap roles gets a second design, the same placement with
  `deployment.rebalance=True` (pdjax.scheduler.rebalance: an instance flips between prefill and decode when one side's
  queue stays over a threshold for a window; thresholds from the problem's `rebalance_*` fields, the deployment's
  defaults unless set; `rebalance_trigger='slo'`: flip on the problem's own SLOs instead,
  pdjax.scheduler.rebalance_slo, the serve config then carrying them as its slo block). Swappable (`swappable`): what
  pdjax.config.overload requires of the two groups (one layout, and so the same devices per instance; one stack; equal
  token budget and sequence limit, `role_budgets`) and a side with two instances (a flip needs a donor that keeps one;
  1P1D could never flip). A flipped instance sends or receives KV on links the fixed design never uses, so a variant's
  key also holds every ordered pair's link (`pair_links`). Its name ends in ' +rebalance', its rows say `"rebalance":
  true`.
Not modelled here: Splitwise's mixed pool; DistServe's online re-planning. No JAX.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.config.model_specs import ModelSpec, get_model_spec
from pdjax.config.overload import REBALANCE_TRIGGERS, SLO_TRIGGERS
from pdjax.config.registry import BASELINE_POLICIES, POLICIES, STACKS, disaggregated_base, is_stack
from pdjax.config.serving import serve_config_from_dict
from pdjax.config.validate import check_max_model_len
from pdjax.metrics.capacity import bisect_rate, bracket_rate
from pdjax.metrics.latency import SLO_RULES, SLOs, distserve_slo_check, slo_attainment
from pdjax.procs import parallel_map
from pdjax.sim.cost_model import kv_cache_capacity_tokens
from pdjax.sim.disagg import kv_link
from pdjax.sim.run import simulate_config
from pdjax.sim.stack import get_stack
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec

AFFINITIES = ("high", "low")
REBALANCE_THRESHOLDS = ("rebalance_prefill_queue_tokens", "rebalance_decode_load", "rebalance_window_s",
                        "rebalance_flip_s", "rebalance_trigger")
COLOCATED_POLICIES = BASELINE_POLICIES    # the policy table's colocated baselines (live): ('sarathi', 'vllm_v0')


# --------------------------------------------------------------------------------------------------- problem
@dataclasses.dataclass(frozen=True)
class NodeType:
    """A node: `hardware` (a registry spec name) with optional overrides of GPUs per node and link figures
    (bytes/s per device per direction, seconds per hop; 0 / negative = the spec's)."""
    hardware: str = "a100-80gb-sxm"
    gpus_per_node: int = 0
    intra_node_bandwidth: float = 0.0
    intra_node_latency: float = -1.0
    inter_node_bandwidth: float = 0.0
    inter_node_latency: float = -1.0

    def spec(self) -> HardwareSpec:
        hw = get_hardware_spec(self.hardware)
        changes: Dict[str, Any] = {}
        if self.gpus_per_node:
            changes["devices_per_node"] = int(self.gpus_per_node)
        if self.intra_node_bandwidth > 0:
            changes["intra_node_bandwidth"] = float(self.intra_node_bandwidth)
            if hw.intra_node_topology == "pairwise":
                changes["pairwise_bandwidth"] = max(float(self.intra_node_bandwidth), hw.pairwise_bandwidth)
        if self.intra_node_latency >= 0:
            changes["intra_node_latency"] = float(self.intra_node_latency)
        if self.inter_node_bandwidth > 0:
            changes["inter_node_bandwidth"] = float(self.inter_node_bandwidth)
        if self.inter_node_latency >= 0:
            changes["inter_node_latency"] = float(self.inter_node_latency)
        return hw.replace(name=f"{hw.name}-node{changes.get('devices_per_node', hw.devices_per_node)}",
                          **changes) if changes else hw


def _check_rebalance_thresholds(problem) -> None:
    """The rebalancing thresholds as deployment.rebalance_* accepts them (pdjax.config.deployment), in one line."""
    q, load = problem.rebalance_prefill_queue_tokens, problem.rebalance_decode_load
    window, flip = problem.rebalance_window_s, problem.rebalance_flip_s
    if not (isinstance(q, int) and not isinstance(q, bool) and q >= 1):
        raise ValueError(f"rebalance_prefill_queue_tokens={q!r}, expected an int >= 1 (prompt tokens queued per "
                         "prefill instance)")
    for key, value, low_open in (("rebalance_decode_load", load, True), ("rebalance_window_s", window, False),
                                 ("rebalance_flip_s", flip, False)):
        ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 if low_open else value >= 0)
        if not ok:
            raise ValueError(f"{key}={value!r}, expected a number {'> 0' if low_open else '>= 0'}")
    if problem.rebalance_trigger not in REBALANCE_TRIGGERS:
        raise ValueError(f"rebalance_trigger={problem.rebalance_trigger!r}, expected one of {REBALANCE_TRIGGERS}")


@dataclasses.dataclass(frozen=True)
class PlacementProblem:
    """What to place. workload: a WorkloadConfig dict (its `rate` is replaced by the probed rates). SLOs in
    seconds; attainment in (0, 1]. Scheduler knobs per role; page_size shared."""
    model: str
    node: NodeType
    gpu_budget: int
    workload: Mapping[str, Any]
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9
    profile: str = ""                   # a profile name/path; '' = the shipped one for the hardware
    mem_util: float = 0.9
    max_model_len: int = 2048
    page_size: int = 16
    prefill_token_budget: int = 2048    # DistServe batches prefills up to a token limit (L_m)
    decode_max_num_seqs: int = 256
    sarathi_token_budget: int = 512
    max_pp: int = 8
    rel_tol: float = 0.05               # bisection stops when the bracket is within rel_tol of its low end
    max_probes: int = 14
    colocated_stack: str = "pdjax"      # serving stack per role (pdjax.sim.stack; 'pdjax': the cost model)
    prefill_stack: str = "pdjax"
    decode_stack: str = "pdjax"
    slo_rule: str = "pdjax"             # 'pdjax': attainment (both SLOs per request) >= target; 'distserve': the
                                        # target quantile of TTFT and of TPOT each within its SLO (computed apart)
    # online XpYd rebalancing's thresholds (deployment.rebalance_*; used by the rebalance variants only)
    rebalance_prefill_queue_tokens: int = 8192
    rebalance_decode_load: float = 0.9
    rebalance_window_s: float = 2.0
    rebalance_flip_s: float = 0.0
    rebalance_trigger: str = "load"     # 'slo' / 'slo_predicted': flip on the problem's own SLOs (ttft_s, tpot_s at
                                        # `attainment`)

    def __post_init__(self):
        if not isinstance(self.gpu_budget, int) or self.gpu_budget < 1:
            raise ValueError(f"gpu_budget={self.gpu_budget!r}, expected a positive int")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment={self.attainment!r}, expected in (0, 1]")
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"ttft_s={self.ttft_s!r}, tpot_s={self.tpot_s!r}: expected seconds > 0")
        check_max_model_len(self.max_model_len, get_model_spec(self.model), key="max_model_len")
        for key in ("colocated_stack", "prefill_stack", "decode_stack"):
            if not is_stack(getattr(self, key)):
                raise ValueError(f"{key}={getattr(self, key)!r}, expected one of {STACKS} or a stack file (.json)")
        if self.slo_rule not in SLO_RULES:
            raise ValueError(f"slo_rule={self.slo_rule!r}, expected one of {SLO_RULES}")
        _check_rebalance_thresholds(self)
        hardware = get_hardware_spec(self.node.hardware).name
        for role in ("colocated", "prefill", "decode"):   # a side no candidate can use would vanish from the ranking
            if not any(self.fits_stack(role, Layout(tp, 1)) for tp in range(1, self.gpu_budget + 1)):
                raise ValueError(f"{role}_stack={self.stack(role)!r} has no step times for model {self.model!r} on "
                                 f"hardware {hardware!r} at any tp <= {self.gpu_budget} (a fitted stack times only "
                                 f"what it was measured on); expected 'pdjax' or a stack measured there")

    def stack(self, role: str) -> str:
        return getattr(self, f"{role}_stack")

    def rebalance_keys(self) -> Dict[str, Any]:
        """The deployment block's rebalancing keys of a rebalance variant (pdjax.config.overload); the SLO trigger
        compares the side's latency at the attainment target's quantile (its SLOs: `serve_config`'s slo block).
        The default trigger is left out (the block as before the option)."""
        keys = {"rebalance": True, **{k: getattr(self, k) for k in REBALANCE_THRESHOLDS}}
        if self.rebalance_trigger == "load":
            del keys["rebalance_trigger"]
        else:
            keys["rebalance_slo_quantile"] = self.attainment
        return keys

    def slo_block(self) -> Dict[str, float]:
        """The serve config's slo block: the problem's SLOs (what the pass / fail rule checks afterwards)."""
        return {"ttft": self.ttft_s, "tpot": self.tpot_s}

    def fits_stack(self, role: str, layout: "Layout") -> bool:
        """Whether the role's stack times this layout (`Stack.check`: a step-fit stack times only the TP degrees
        it was measured at, pdjax.sim.stack; the cost model, every layout)."""
        try:
            get_stack(self.stack(role)).check(self.model, get_hardware_spec(self.node.hardware).name, layout.tp)
        except ValueError:
            return False
        return True


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"tp{self.tp}pp{self.pp}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """One candidate. kind: 'high' | 'low' (disaggregated) or 'colocated' (policy sarathi / vllm_v0; `prefill`
    is its layout and `num_prefill` its replicas). devices: per instance (prefill ones, then decode ones), the
    device indices in stage-major order (stage 0's TP group first). links: per (prefill i, decode j) the KV
    transfer's (bandwidth, latency, streams). rebalance: online XpYd rebalancing on (`rebalance_variant`);
    pair_links: then the link of every ordered pair of its instances (pair_links()), which flips may use."""
    kind: str
    policy: str
    prefill: Layout
    num_prefill: int
    decode: Optional[Layout]
    num_decode: int
    devices: Tuple[Tuple[int, ...], ...]
    links: Tuple[Tuple[float, float, int], ...] = ()
    rebalance: bool = False
    pair_links: Tuple[Tuple[float, float, int], ...] = ()

    @property
    def num_gpus(self) -> int:
        return sum(len(d) for d in self.devices)

    @property
    def name(self) -> str:
        if self.kind == "colocated":
            return f"colocated-{self.policy} {self.num_prefill}x{self.prefill}"
        name = f"disagg-{self.kind} P {self.num_prefill}x{self.prefill} + D {self.num_decode}x{self.decode}"
        return name + " +rebalance" if self.rebalance else name

    def deployment(self, problem: Optional["PlacementProblem"] = None) -> Dict[str, Any]:
        """This placement as a serve config's `deployment` block (pdjax.config.deployment), so that
        `--config.backend=sim` (or the real engine) runs it: groups with their instances, layouts and devices;
        given the `problem`, each group's token_budget and max_num_seqs too (`role_budgets`: what the search
        simulated; the rest of the run is `serve_config`)."""
        def group(layout: Layout, first: int, count: int, role: str) -> Dict[str, Any]:
            devices = [d for inst in self.devices[first:first + count] for d in inst]
            block = {"num_instances": count, "pp": layout.pp, "tp": layout.tp, "devices": devices}
            if problem is not None:
                block["token_budget"], block["max_num_seqs"] = role_budgets(problem, role, self.policy)
                if problem.stack(role) != "pdjax":
                    block["stack"] = problem.stack(role)
            return block
        if self.kind == "colocated":
            return {"kind": "colocated", "router": "round_robin",
                    "colocated": group(self.prefill, 0, self.num_prefill, "colocated")}
        block = {"kind": "disaggregated", "router": "round_robin",
                 "prefill": group(self.prefill, 0, self.num_prefill, "prefill"),
                 "decode": group(self.decode, self.num_prefill, self.num_decode, "decode")}
        if self.rebalance:
            block.update(problem.rebalance_keys() if problem is not None else {"rebalance": True})
        return block

    def key(self) -> tuple:
        """What the simulation depends on (candidates with equal keys simulate identically)."""
        key = (self.kind == "colocated", self.policy, self.prefill, self.num_prefill, self.decode, self.num_decode,
               self.links)
        return key + (self.pair_links,) if self.rebalance else key


# --------------------------------------------------------------------------------------------------- enumeration
def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelSpec, hw: HardwareSpec, problem: PlacementProblem) -> List[Layout]:
    """(tp, pp) an instance can use: tp <= GPUs per node dividing heads, KV heads and MLP width; pp dividing the
    layers (<= max_pp); tp·pp <= budget; weights plus one max-length request's KV fit (mem_util)."""
    out = []
    for tp in _divisors(hw.devices_per_node):
        if model.num_heads % tp or model.num_kv_heads % tp or model.intermediate_size % tp:
            continue
        for pp in _divisors(model.num_layers):
            if pp > problem.max_pp or tp * pp > problem.gpu_budget:
                continue
            try:
                cap = kv_cache_capacity_tokens(model, hw, tp, pp, problem.mem_util,
                                               max_num_batched_tokens=problem.prefill_token_budget,
                                               max_num_seqs=problem.decode_max_num_seqs)
            except ValueError:
                continue
            if cap >= problem.max_model_len:
                out.append(Layout(tp, pp))
    return out


class _Nodes:
    """First-fit allocation of TP groups (each inside one node) on nodes of `per_node` GPUs."""

    def __init__(self, num_nodes: int, per_node: int):
        self.per_node = per_node
        self.free = [list(range(n * per_node, (n + 1) * per_node)) for n in range(num_nodes)]

    def take(self, count: int, node: Optional[int] = None) -> Optional[Tuple[int, ...]]:
        nodes = range(len(self.free)) if node is None else [node]
        for n in nodes:
            if len(self.free[n]) >= count:
                got, self.free[n] = self.free[n][:count], self.free[n][count:]
                return tuple(got)
        return None


def _place_instances(groups: Sequence[Layout], budget: int, per_node: int) -> Optional[List[Tuple[int, ...]]]:
    nodes = _Nodes(-(-budget // per_node), per_node)
    out = []
    used = 0
    for layout in groups:
        devices: Tuple[int, ...] = ()
        for _ in range(layout.pp):
            got = nodes.take(layout.tp)
            if got is None:
                return None
            devices += got
        used += len(devices)
        out.append(devices)
    return out if used <= budget else None


def _links(hw, devices, num_prefill, prefill: Layout, decode: Layout) -> Tuple[Tuple[float, float, int], ...]:
    """Per (prefill i, decode j) the KV link of the simulator (pdjax.sim.disagg.kv_link): what a serve run of
    this placement's deployment block moves its KV over."""
    return tuple(kv_link(hw, devices[i], devices[j], prefill.pp, decode.pp)
                 for i in range(num_prefill) for j in range(num_prefill, len(devices)))


def pair_links(hw, devices: Sequence[Tuple[int, ...]], layout: Layout) -> Tuple[Tuple[float, float, int], ...]:
    """The KV link (pdjax.sim.disagg.kv_link) of every ordered pair (i, j), i != j, of instances of one `layout`
    on `devices`, in (i, j) order: what a rebalanced deployment's transfers may use once instances flip."""
    return tuple(kv_link(hw, devices[i], devices[j], layout.pp, layout.pp)
                 for i in range(len(devices)) for j in range(len(devices)) if i != j)


def swappable(problem: PlacementProblem, p: Placement) -> bool:
    """Whether `p`'s prefill and decode instances can swap roles online (module docstring): disaggregated, one
    layout, one stack, equal role budgets (pdjax.config.overload.SAME_MACHINE_KEYS), and two instances on a side."""
    if p.kind == "colocated" or p.prefill != p.decode or problem.prefill_stack != problem.decode_stack:
        return False
    if role_budgets(problem, "prefill", p.policy) != role_budgets(problem, "decode", p.policy):
        return False
    return max(p.num_prefill, p.num_decode) >= 2


def rebalance_variant(problem: PlacementProblem, p: Placement) -> Placement:
    """`p` (swappable) with online XpYd rebalancing on: same instances and devices, `pair_links` on the problem's
    node type. Raises ValueError naming the placement when it is not swappable."""
    if not swappable(problem, p):
        raise ValueError(f"placement {p.name!r} cannot rebalance: expected a disaggregated placement whose prefill "
                         "and decode instances share layout, stack and budgets, with two instances on a side")
    return dataclasses.replace(p, rebalance=True, pair_links=pair_links(problem.node.spec(), p.devices, p.prefill))


def check_rebalance_option(rebalance: bool, affinities: Sequence[str]) -> None:
    """rebalance=True needs a disaggregated family to vary (colocated candidates have no roles to flip)."""
    if rebalance and not any(a in AFFINITIES for a in affinities):
        raise ValueError(f"rebalance=True with affinities={tuple(affinities)!r}: online rebalancing flips the "
                         f"instances of disaggregated placements; expected some of {AFFINITIES} or rebalance=False")


def enumerate_placements(problem: PlacementProblem, affinities: Sequence[str] = AFFINITIES,
                         colocated: Sequence[str] = COLOCATED_POLICIES, rebalance: bool = False) -> List[Placement]:
    """Every candidate of the module docstring, deduplicated, in a deterministic order; rebalance=True: then
    each swappable disaggregated candidate's rebalance variant, in the same order."""
    check_rebalance_option(rebalance, affinities)
    found = _enumerate_fixed(problem, affinities, colocated)
    if rebalance:
        for p in list(found.values()):
            if swappable(problem, p):
                q = rebalance_variant(problem, p)
                found.setdefault(q.key(), q)
    return list(found.values())


def _enumerate_fixed(problem: PlacementProblem, affinities: Sequence[str],
                     colocated: Sequence[str]) -> Dict[tuple, Placement]:
    """The fixed-design candidates by key (enumerate_placements without rebalancing)."""
    model, hw = get_model_spec(problem.model), problem.node.spec()
    per_node, budget = hw.devices_per_node, problem.gpu_budget
    options = layouts(model, hw, problem)
    found: Dict[tuple, Placement] = {}

    def add(p: Optional[Placement]):
        if p is None or p.num_gpus > budget or p.key() in found:
            return
        roles = (("colocated", p.prefill),) if p.kind == "colocated" else (("prefill", p.prefill), ("decode", p.decode))
        if all(problem.fits_stack(role, layout) for role, layout in roles):
            found[p.key()] = p

    if "high" in affinities:
        for lp, ld in itertools.product(options, options):
            for n in range(1, budget // lp.gpus + 1):
                for m in range(1, (budget - n * lp.gpus) // ld.gpus + 1):
                    devices = _place_instances([lp] * n + [ld] * m, budget, per_node)
                    if devices is None:
                        continue
                    add(Placement("high", "disagg", lp, n, ld, m, tuple(devices), _links(hw, devices, n, lp, ld)))
    if "low" in affinities:
        for lp, ld in itertools.product(options, options):
            if lp.pp != ld.pp or lp.tp + ld.tp > per_node:
                continue
            for k in range(1, budget // (lp.gpus + ld.gpus) + 1):
                nodes = _Nodes(-(-budget // per_node), per_node)
                pre, dec, ok = [], [], True
                for _ in range(k):
                    a: Tuple[int, ...] = ()
                    b: Tuple[int, ...] = ()
                    for _ in range(lp.pp):       # one segment: a prefill stage and a decode stage on one node
                        seg = next((n for n in range(len(nodes.free)) if len(nodes.free[n]) >= lp.tp + ld.tp), None)
                        if seg is None:
                            ok = False
                            break
                        a += nodes.take(lp.tp, seg)
                        b += nodes.take(ld.tp, seg)
                    if not ok:
                        break
                    pre.append(a)
                    dec.append(b)
                if ok:
                    devices = tuple(pre + dec)
                    add(Placement("low", "disagg", lp, k, ld, k, devices, _links(hw, devices, k, lp, ld)))
    for policy in colocated:
        for layout in options:
            for r in range(1, budget // layout.gpus + 1):
                devices = _place_instances([layout] * r, budget, per_node)
                if devices is not None:
                    add(Placement("colocated", policy, layout, r, None, 0, tuple(devices)))
    return found


# --------------------------------------------------------------------------------------------------- simulation
def role_budgets(problem: PlacementProblem, role: str, policy: str) -> Tuple[int, int]:
    """(token_budget, max_num_seqs) of an instance: prefill: DistServe's prefill token limit; decode: room for
    every running sequence; a colocated chunking policy (sarathi): its chunk budget; a colocated policy that never
    chunks (vllm_v0): whole prompts (the max model length). Every role runs up to decode_max_num_seqs sequences."""
    if role == "prefill":
        budget = problem.prefill_token_budget
    elif role == "decode":
        budget = max(problem.decode_max_num_seqs, problem.prefill_token_budget)
    elif POLICIES[policy].chunking:
        budget = problem.sarathi_token_budget
    else:
        budget = max(problem.max_model_len, problem.prefill_token_budget)
    return budget, problem.decode_max_num_seqs


def serve_config(problem: PlacementProblem, placement: Placement, rate: float) -> Dict[str, Any]:
    """The serve config (plain dict, configs/serve.py's layout, every unset key at its default) that runs
    `placement` at `rate` req/s: `placement.deployment(problem)` with the problem's model, scheduler knobs,
    workload (its caps follow scheduler.max_model_len, its seed is the run's), hardware, profile and memory
    utilization. `simulate_placement` simulates exactly this through the `--config.backend=sim` path
    (pdjax.sim.run.simulate_config); only a NodeType that overrides its hardware's figures is passed as a
    hardware override (a serve config names a registry spec)."""
    base_policy = placement.policy if placement.kind == "colocated" else disaggregated_base()   # the roles' base
    budget, max_seqs = role_budgets(problem, "colocated", base_policy)
    workload = {k: v for k, v in problem.workload.items() if k not in ("max_model_len", "seed")}
    workload["rate"] = float(rate)
    pages = max(4096, 2 * -(-problem.max_model_len // problem.page_size))    # validation only: sim sizes the KV
    return {"backend": "sim", "seed": int(problem.workload.get("seed", 0)),
            "model": {"checkpoint": problem.model},
            "scheduler": {"policy": base_policy, "token_budget": budget, "max_num_seqs": max_seqs,
                          "max_model_len": problem.max_model_len, "page_size": problem.page_size,
                          "num_pages": pages},
            "workload": workload,
            "sim": {"hardware": problem.node.hardware, "profile": problem.profile, "num_pages": 0,
                    "gpu_memory_utilization": problem.mem_util},
            "deployment": placement.deployment(problem),
            **({"slo": problem.slo_block()} if placement.rebalance and problem.rebalance_trigger in SLO_TRIGGERS
               else {})}


def simulate_placement(problem: PlacementProblem, placement: Placement, rate: float):
    """Run `placement` at `rate` req/s (its `serve_config`, simulated as `--config.backend=sim` runs it);
    returns the request records."""
    cfg = serve_config_from_dict(serve_config(problem, placement, rate))
    result, _ = simulate_config(cfg, hardware=problem.node.spec())
    return result.requests


def attainment_at(problem: PlacementProblem, placement: Placement, rate: float) -> float:
    return probe(problem, placement, rate)[1]


def probe(problem: PlacementProblem, placement: Placement, rate: float) -> Tuple[bool, float]:
    """(passes the problem's SLO rule, pdjax attainment) of `placement` at `rate` req/s."""
    records = simulate_placement(problem, placement, rate)
    return slo_rule_passes(records, problem.ttft_s, problem.tpot_s, problem.slo_rule, problem.attainment)


def slo_rule_passes(records: Sequence[Any], ttft_s: float, tpot_s: float, rule: str = "pdjax",
                    attainment: float = 0.9) -> Tuple[bool, float]:
    """(passes `rule` with SLOs TTFT `ttft_s` / TPOT `tpot_s` seconds at target `attainment`, pdjax attainment):
    'pdjax': the share of requests meeting both SLOs (unserved ones failing) >= attainment; 'distserve': the
    `attainment` quantile of TTFT and of TPOT each within its SLO (pdjax.metrics.latency.distserve_slo_check)."""
    if rule not in SLO_RULES:
        raise ValueError(f"slo rule {rule!r}, expected one of {SLO_RULES}")
    slos = SLOs(ttft_s=ttft_s, tpot_s=tpot_s)
    share = slo_attainment(records, slos) or 0.0
    if rule == "distserve":
        return distserve_slo_check(records, slos, quantile=attainment)["passes"], share
    return share >= attainment, share


def _design(p: Placement) -> Dict[str, Any]:
    """A ranking row's mark of a rebalance variant (absent on fixed designs: their rows are as before)."""
    return {"rebalance": True} if p.rebalance else {}


@dataclasses.dataclass(frozen=True)
class Evaluation:
    placement: Placement
    goodput_rps: float               # highest probed rate meeting the attainment target (0: none)
    per_gpu_rps: float
    probes: Tuple[Tuple[float, float], ...]    # (rate, attainment) in the order run
    wall_s: float

    def row(self, problem: Optional[PlacementProblem] = None) -> Dict[str, Any]:
        """The ranking row; `deployment` is the placement's block (with each group's budgets given the problem:
        what serve_config runs)."""
        p = self.placement
        return {"placement": p.name, "kind": p.kind, "policy": p.policy, "num_gpus": p.num_gpus,
                "prefill": str(p.prefill), "num_prefill": p.num_prefill,
                "decode": str(p.decode) if p.decode else None, "num_decode": p.num_decode,
                "devices": [list(d) for d in p.devices], "deployment": p.deployment(problem),
                "kv_link_gbps": sorted({round(bw / 1e9, 1) for bw, _, _ in p.links}) or None,
                "goodput_rps": round(self.goodput_rps, 4), "per_gpu_goodput_rps": round(self.per_gpu_rps, 4),
                "num_probes": len(self.probes), "wall_s": round(self.wall_s, 2), **_design(p)}


def rate_search(ok: Callable[[float], Tuple[bool, float]], num_gpus: int, rel_tol: float,
                max_probes: int) -> Tuple[float, Tuple[Tuple[float, float], ...]]:
    """The highest rate `ok` passes: (rate, ((rate, attainment), ...) in probe order). `ok(rate)` -> (passes,
    attainment). Start at 0.5 req/s per GPU, double (or halve) until the bracket holds, then bisect to rel_tol (at
    most max_probes probes). Shared by evaluate and pdjax.sim.regime (whose probes reuse cached simulations)."""
    probes: List[Tuple[float, float]] = []

    def test(rate: float) -> bool:
        passes, a = ok(rate)
        probes.append((rate, a))
        return passes

    good, bad = bracket_rate(test, 0.5 * num_gpus, more=lambda: len(probes) < max_probes // 2)
    good, _ = bisect_rate(test, good, bad, rel_tol=rel_tol, more=lambda: len(probes) < max_probes)
    return good, tuple(probes)


def evaluate(problem: PlacementProblem, placement: Placement) -> Evaluation:
    """Highest rate meeting the attainment target (rate_search over simulations of the placement)."""
    start = time.perf_counter()
    good, probes = rate_search(lambda rate: probe(problem, placement, rate), placement.num_gpus, problem.rel_tol,
                               problem.max_probes)
    return Evaluation(placement, good, good / placement.num_gpus, probes, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------- search
class _Evaluate:
    def __init__(self, problem: PlacementProblem):
        self.problem = problem

    def __call__(self, placement: Placement) -> Evaluation:
        return evaluate(self.problem, placement)


def rank(evaluations: Sequence[Evaluation]) -> List[Evaluation]:
    """Best per-GPU goodput first; ties: fewer GPUs, then a fixed design before a rebalancing one (no flips for
    the same goodput), then name."""
    return sorted(evaluations, key=lambda e: (-round(e.per_gpu_rps, 9), e.placement.num_gpus, e.placement.rebalance,
                                              e.placement.name))


def _candidates(problem: PlacementProblem, affinities: Sequence[str], colocated: Sequence[str],
                placements: Optional[Sequence[Placement]], rebalance: bool = False) -> Sequence[Placement]:
    """`placements`, or every candidate of the families asked for (with rebalance variants: `rebalance`); refuses
    an unknown family, rebalancing without a disaggregated family, or an empty set."""
    bad = [a for a in affinities if a not in AFFINITIES]
    if bad:
        raise ValueError(f"affinities {bad}: expected some of {AFFINITIES}")
    if placements is None:
        placements = enumerate_placements(problem, affinities, colocated, rebalance=rebalance)
    if not placements:
        raise ValueError(f"no placement of {problem.model} fits {problem.gpu_budget} GPU(s) of "
                         f"{problem.node.hardware} (weights + one {problem.max_model_len}-token request)")
    return placements


def search(problem: PlacementProblem, *, workers: int = 1, affinities: Sequence[str] = AFFINITIES,
           colocated: Sequence[str] = COLOCATED_POLICIES,
           placements: Optional[Sequence[Placement]] = None, rebalance: bool = False) -> Dict[str, Any]:
    """Evaluate every candidate (`placements`, default `enumerate_placements`, with the rebalance variants when
    `rebalance`) on `workers` processes (1: in this process) and return {"ranking": [row, ...],
    "best_disaggregated", "best_colocated", "num_candidates", "wall_s", "workers"}."""
    start = time.perf_counter()
    placements = _candidates(problem, affinities, colocated, placements, rebalance)
    ranked = rank(parallel_map(_Evaluate(problem), placements, workers=workers))
    rows = [e.row(problem) for e in ranked]
    disagg = [r for r in rows if r["kind"] != "colocated"]
    coloc = [r for r in rows if r["kind"] == "colocated"]
    return {"ranking": rows, "best_disaggregated": disagg[0] if disagg else None,
            "best_colocated": {p: next((r for r in coloc if r["policy"] == p), None) for p in colocated},
            "num_candidates": len(rows), "wall_s": round(time.perf_counter() - start, 2), "workers": workers}


# --------------------------------------------------------------------------------------------------- SLO scale
def _request_scales(records: Sequence[Any], ttft_s: float, tpot_s: float) -> List[float]:
    """Per request, the smallest scale s at which it meets TTFT s·ttft_s and TPOT s·tpot_s (pdjax's per-request
    test, pdjax.metrics.latency.meets_slos; a one-token output has no TPOT); inf for an unserved request."""
    out = []
    for r in records:
        if not r.completed:
            out.append(math.inf)
            continue
        t = r.token_times
        scale = (t[0] - r.arrival_time) / ttft_s
        if len(t) >= 2:
            scale = max(scale, (t[-1] - t[0]) / (len(t) - 1) / tpot_s)
        out.append(max(scale, 0.0))
    return out


def tightest_slo_scale(records: Sequence[Any], ttft_s: float, tpot_s: float, rule: str = "pdjax",
                       attainment: float = 0.9) -> Optional[float]:
    """The smallest factor s such that `records` pass `rule` (slo_rule_passes) with both SLOs multiplied by s
    (DistServe's SLO-scale axis: smaller = tighter), None when no scale passes (too many unserved requests).
    The records do not depend on the SLOs, so this is read off them in closed form: 'pdjax' is the k-th smallest
    per-request scale (k the fewest passing requests the target allows), 'distserve' the larger of the TTFT and
    TPOT quantiles over their SLOs; then checked by the rule itself (nudged up by ulps against rounding)."""
    if not records:
        return None
    if rule == "pdjax":
        scales = sorted(_request_scales(records, ttft_s, tpot_s))
        n = len(scales)
        need = next(k for k in range(1, n + 1) if k / n >= attainment)
        scale = scales[need - 1]
    else:
        check = distserve_slo_check(records, SLOs(ttft_s=ttft_s, tpot_s=tpot_s), quantile=attainment)
        if check["ttft_p90_s"] is None or check["tpot_p90_s"] is None:
            return None
        scale = max(check["ttft_p90_s"] / ttft_s, check["tpot_p90_s"] / tpot_s)
    if not math.isfinite(scale):
        return None
    scale = max(scale, 5e-324)              # SLOs must stay > 0
    for _ in range(8):
        if slo_rule_passes(records, scale * ttft_s, scale * tpot_s, rule, attainment)[0]:
            return scale
        scale = math.nextafter(scale, math.inf)
    raise AssertionError(f"tightest_slo_scale: {scale!r} does not pass the {rule!r} rule it was read from")


@dataclasses.dataclass(frozen=True)
class ScaleEvaluation:
    placement: Placement
    rate_rps: float                  # the rate simulated: per-GPU rate x the placement's GPUs
    tightest_scale: Optional[float]  # smallest SLO factor that still passes (None: none does)
    attainment_at_1: float           # pdjax attainment at the problem's SLOs (scale 1)
    passes_at_1: bool
    ttft_q_s: Optional[float]        # the target quantile of TTFT / TPOT (unserved requests infinitely late)
    tpot_q_s: Optional[float]
    wall_s: float

    def row(self, problem: Optional[PlacementProblem] = None) -> Dict[str, Any]:
        p = self.placement
        rnd = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"placement": p.name, "kind": p.kind, "policy": p.policy, "num_gpus": p.num_gpus,
                "prefill": str(p.prefill), "num_prefill": p.num_prefill,
                "decode": str(p.decode) if p.decode else None, "num_decode": p.num_decode,
                "devices": [list(d) for d in p.devices], "deployment": p.deployment(problem),
                "rate_rps": round(self.rate_rps, 4), "tightest_slo_scale": rnd(self.tightest_scale),
                "passes_at_scale_1": self.passes_at_1, "attainment_at_scale_1": round(self.attainment_at_1, 4),
                "ttft_quantile_s": rnd(self.ttft_q_s), "tpot_quantile_s": rnd(self.tpot_q_s),
                "wall_s": round(self.wall_s, 2), **_design(p)}


def evaluate_slo_scale(problem: PlacementProblem, placement: Placement, per_gpu_rate: float) -> ScaleEvaluation:
    """One simulation of `placement` at `per_gpu_rate` x its GPUs req/s, and the tightest SLO scale it holds
    under the problem's rule and attainment target (tightest_slo_scale)."""
    if not (per_gpu_rate > 0 and math.isfinite(per_gpu_rate)):
        raise ValueError(f"per_gpu_rate={per_gpu_rate!r}, expected req/s per GPU > 0")
    start = time.perf_counter()
    rate = per_gpu_rate * placement.num_gpus
    records = simulate_placement(problem, placement, rate)
    passes, share = slo_rule_passes(records, problem.ttft_s, problem.tpot_s, problem.slo_rule, problem.attainment)
    check = distserve_slo_check(records, SLOs(ttft_s=problem.ttft_s, tpot_s=problem.tpot_s),
                                quantile=problem.attainment)
    scale = tightest_slo_scale(records, problem.ttft_s, problem.tpot_s, problem.slo_rule, problem.attainment)
    return ScaleEvaluation(placement, rate, scale, share, passes, check["ttft_p90_s"], check["tpot_p90_s"],
                           time.perf_counter() - start)


class _EvaluateScale:
    def __init__(self, problem: PlacementProblem, per_gpu_rate: float):
        self.problem, self.per_gpu_rate = problem, per_gpu_rate

    def __call__(self, placement: Placement) -> ScaleEvaluation:
        return evaluate_slo_scale(self.problem, placement, self.per_gpu_rate)


def rank_by_scale(evaluations: Sequence[ScaleEvaluation]) -> List[ScaleEvaluation]:
    """Tightest SLO scale first (None last); ties: fewer GPUs, a fixed design before a rebalancing one, name."""
    return sorted(evaluations, key=lambda e: (e.tightest_scale is None, round(e.tightest_scale or 0.0, 9),
                                              e.placement.num_gpus, e.placement.rebalance, e.placement.name))


def slo_scale_search(problem: PlacementProblem, per_gpu_rate: float, *, workers: int = 1,
                     affinities: Sequence[str] = AFFINITIES, colocated: Sequence[str] = COLOCATED_POLICIES,
                     placements: Optional[Sequence[Placement]] = None, rebalance: bool = False) -> Dict[str, Any]:
    """DistServe's other axis: at a fixed per-GPU rate (each candidate simulated once at per_gpu_rate x its GPUs),
    the tightest factor on both SLOs each candidate holds (evaluate_slo_scale); `rebalance` as in `search`.
    Returns {"ranking": [row, ...] (tightest first), "best_disaggregated", "best_colocated" (per policy),
    "per_gpu_rate", "num_candidates", "wall_s", "workers"}."""
    start = time.perf_counter()
    if not (per_gpu_rate > 0 and math.isfinite(per_gpu_rate)):
        raise ValueError(f"per_gpu_rate={per_gpu_rate!r}, expected req/s per GPU > 0")
    placements = _candidates(problem, affinities, colocated, placements, rebalance)
    evaluations = parallel_map(_EvaluateScale(problem, per_gpu_rate), placements, workers=workers)
    rows = [e.row(problem) for e in rank_by_scale(evaluations)]
    held = [r for r in rows if r["tightest_slo_scale"] is not None]
    disagg = [r for r in held if r["kind"] != "colocated"]
    coloc = [r for r in held if r["kind"] == "colocated"]
    return {"ranking": rows, "best_disaggregated": disagg[0] if disagg else None,
            "best_colocated": {p: next((r for r in coloc if r["policy"] == p), None) for p in colocated},
            "per_gpu_rate": per_gpu_rate, "num_candidates": len(rows),
            "wall_s": round(time.perf_counter() - start, 2), "workers": workers}


# --------------------------------------------------------------------------------------------------- decomposition
PAIRINGS = {   # name -> (colocated stack, prefill stack, decode stack)
    "architecture (both on pdjax)": ("pdjax", "pdjax", "pdjax"),
    "both on DistServe's engine": ("distserve", "distserve", "distserve"),
    "the paper's pairing (colocated on DistServe's vLLM, disaggregated on DistServe's engine)":
        ("distserve-vllm", "distserve", "distserve"),
}


def decompose(problem: PlacementProblem, per_gpu_rate: Optional[float] = None, **search_kwargs) -> Dict[str, Any]:
    """How much of a published disaggregation win is the architecture and how much the serving stack: the same
    search under PAIRINGS (the problem's stacks replaced), each with the ratio R of best disaggregated over best
    colocated: per-GPU goodput (`search`), or, given `per_gpu_rate`, on DistServe's SLO-scale axis
    (`slo_scale_search`): R = best colocated tightest scale / best disaggregated tightest scale (how many times
    tighter SLOs the disaggregated side holds). R > 1 favours disaggregation either way. With R_same the ratio on
    one stack (DistServe's engine on both sides) and R_paper the paper's pairing's, the stack's factor is
    R_paper / R_same and its share of the published win log(R_paper / R_same) / log(R_paper) (1 = all of it;
    > 1: the architecture alone loses)."""
    out: Dict[str, Any] = {"pairings": {}, "axis": "per-GPU goodput" if per_gpu_rate is None else
                           f"SLO scale at {per_gpu_rate} req/s per GPU"}
    for name, (coloc, pre, dec) in PAIRINGS.items():
        p = dataclasses.replace(problem, colocated_stack=coloc, prefill_stack=pre, decode_stack=dec)
        if per_gpu_rate is None:
            result = search(p, **search_kwargs)
            metric, larger_is_better = "per_gpu_goodput_rps", True
        else:
            result = slo_scale_search(p, per_gpu_rate, **search_kwargs)
            metric, larger_is_better = "tightest_slo_scale", False
        best_d = result["best_disaggregated"]
        pick = max if larger_is_better else min
        best_c = pick((r for r in result["best_colocated"].values() if r), key=lambda r: r[metric], default=None)
        ratio = None
        if best_d and best_c and best_d[metric] and best_c[metric]:
            ratio = (best_d[metric] / best_c[metric] if larger_is_better else best_c[metric] / best_d[metric])
        entry = {"stacks": {"colocated": coloc, "prefill": pre, "decode": dec}, "best_disaggregated": best_d,
                 "best_colocated": best_c, "ratio": ratio, "wall_s": result["wall_s"]}
        if per_gpu_rate is not None:
            entry["ranking"] = result["ranking"]
        out["pairings"][name] = entry
    ratios = [v["ratio"] for v in out["pairings"].values()]
    r_arch, r_same, r_paper = ratios
    out["architecture_ratio"], out["same_stack_ratio"], out["paper_ratio"] = r_arch, r_same, r_paper
    out["stack_factor"] = r_paper / r_same if r_same and r_paper else None
    # the share is defined where the paper's pairing shows a win (R_paper > 1) to attribute
    out["stack_share_of_paper_win"] = (math.log(r_paper / r_same) / math.log(r_paper)
                                       if r_same and r_paper and r_paper > 1 else None)
    return out
