"""The regime map: for a model, hardware and GPU budget, where does chunked prefill on one pool (colocated) beat
prefill/decode disaggregation and where the reverse, and by how much: a grid over workload shape, SLO tightness
and KV link bandwidth, each point answered by the placement search (pdjax.sim.placement) on both sides.

At each grid point (workload w, SLO scale s, KV link k):
- SLOs: TTFT = s · base TTFT, TPOT = s · base TPOT (one scale on a base pair: tightness).
- Workload: 'P:O' is a prompt:output mean-length ratio at a fixed mean total (`total_tokens`): prompt lengths
  uniform on [m/2, 3m/2] around their mean m (the same for outputs), Poisson arrivals; a preset name (chat, code,
  conv, arxiv, ...: pdjax.workload.presets, a real trace's length distributions) is that trace's lengths scaled onto
  max_model_len (`fit_to_model`, which keeps its prompt:output shape). 'P:O>P2:O2' is a mix that shifts halfway:
  the first half of the requests drawn as 'P:O', the second as 'P2:O2', replayed in that order with Poisson
  arrivals (`shifting_trace`: a trace CSV written once under the temp directory); the workload online
  rebalancing is for (a stationary mix has one best fixed split).
- Best colocated: every colocated candidate of the placement search (policies x layouts x replicas within the
  budget), each evaluated as `placement.evaluate` does (highest rate meeting the attainment target, per GPU).
  Sarathi's token budget is chosen from the TPOT target as Sarathi-Serve sizes it (the largest budget whose
  hybrid-batch iteration fits the SLO; `sarathi_budget`), per layout, on the colocated stack's own step-time model
  (the simulator's: pdjax.sim.build.group_step_time). vLLM-v0 (whole prompts) needs no budget.
- Best disaggregated: the placement search's disaggregated candidates with the KV link of k (`KV_LINKS`):
  'nvlink': the candidates as the search lays them out on the node (a budget within one node keeps every KV
  transfer on the node's NVLink/NVSwitch); a network link ('infiniband', 'ethernet-25g', or 'NNgbps'): the prefill
  and decode pools on separate nodes (every prefill instance first-fit on nodes from 0, every decode instance on
  the nodes after them; TP groups still inside a node), the node type's inter-node link set to that bandwidth
  per GPU per direction (placement.NodeType overrides), so every KV transfer crosses it (pdjax.sim.disagg.kv_link).
  Low-affinity segments (prefill and decode stages sharing a node) do not exist there by construction.
- Online XpYd rebalancing (`rebalance=True`; off by default): the disaggregated side also gets the placement
  search's rebalance variants (pdjax.sim.placement.rebalance_variant: every swappable candidate again with
  `deployment.rebalance=True`, thresholds `rebalance_*`; with separate pools its pair links are recomputed there,
  so a flipped instance's transfers cross the network too; `rebalance_trigger='slo'`: they flip on the point's own
  SLOs, so their simulations are not shared across SLO points). Each row then says which design won that side
  (`disagg_design`: 'fixed' | 'rebalance'; a tie goes to the fixed one) and the best of each (REBALANCE_COLUMNS).
- Both sides run on one serving stack by default (`stack`, pdjax.sim.stack; 'pdjax': the cost model).
- Winner: the side with the higher per-GPU goodput ('tie' when equal, 'neither' when both are 0); ratio =
  disaggregated / colocated per-GPU goodput (None when the colocated one is 0).

What a point's numbers equal: the same `placement.evaluate` (and so `placement.search`) on the point's problems
(`point_problems`), by construction: both run `placement.rate_search` (tests/test_regime_map.py checks it at every
point).

Speed (shared sub-results; every one is exact, not an approximation):
- Colocated results do not depend on the KV link: computed once per (workload, SLO) and shared by the links.
- A simulation's records do not depend on the SLOs (but a rebalance variant's with the SLO trigger: one task per
  point): for each (workload, candidate, link, Sarathi budget) the
  records are simulated once per probed rate and every SLO point's rate search reads them. The rate search is
  evaluate's (start at 0.5 req/s per GPU, double or halve, bisect): its probes are dyadic points of the start
  rate's octaves, so searches at different SLOs meet on the same rates and mostly hit the cache.
- The work is split into tasks (one per workload x candidate [x link] [x budget], each running its SLO points'
  searches on its own cache) spread over `workers` processes; results are deterministic, serial or parallel.
No JAX.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import re
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from pdjax.config.overload import SLO_TRIGGERS
from pdjax.config.registry import STACKS, is_stack
from pdjax.config.serving import serve_config_from_dict
from pdjax.errors import UserError
from pdjax.metrics.latency import SLO_RULES
from pdjax.metrics.report import atomic_write_bytes, atomic_write_text
from pdjax.procs import parallel_map
from pdjax.scheduler.output import SchedulerOutput
from pdjax.sim.build import build_setup, group_step_time
from pdjax.sim.disagg import kv_link
from pdjax.sim.placement import (COLOCATED_POLICIES, REBALANCE_THRESHOLDS, Layout, NodeType, Placement,
                                 PlacementProblem, enumerate_placements, evaluate, pair_links, rate_search,
                                 serve_config, simulate_placement, slo_rule_passes)
from pdjax.workload.config import WorkloadConfig
from pdjax.workload.generate import make_workload
from pdjax.workload.presets import PRESETS

GBIT = 1e9 / 8     # bytes/s in one Gb/s


@dataclasses.dataclass(frozen=True)
class KVLink:
    """A KV link preset. bandwidth: bytes/s per GPU per direction (0: the node's own intra-node link); latency: s
    (negative: the node's); separate: prefill and decode pools on different nodes (the KV crosses this link)."""
    name: str
    bandwidth: float = 0.0
    latency: float = -1.0
    separate: bool = False
    description: str = ""


KV_LINKS: Dict[str, KVLink] = {
    "nvlink": KVLink("nvlink", description="prefill and decode in one node: the node's NVLink/NVSwitch "
                     "(A100 SXM: 300 GB/s per GPU per direction)"),
    # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU (pdjax.sim.hardware's _HDR_IB), 5 us per hop.
    "infiniband": KVLink("infiniband", 200 * GBIT, 5e-6, True, "pools on separate nodes, 200 Gb/s HDR "
                         "InfiniBand per GPU (25 GB/s per direction)"),
    # 25 Gb/s Ethernet taken per GPU (a NIC shared by a node's GPUs would be slower still); TCP-ish 20 us.
    "ethernet-25g": KVLink("ethernet-25g", 25 * GBIT, 20e-6, True, "pools on separate nodes, 25 Gb/s Ethernet "
                           "per GPU (3.125 GB/s per direction)"),
}
_GBPS = re.compile(r"^(\d+(?:\.\d+)?)gbps$")
_RATIO = re.compile(r"^(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)$")
BUDGET_STEP = 128            # Sarathi token budgets tried: multiples of this up to max_model_len
WINNERS = ("disaggregated", "colocated", "tie", "neither")


def kv_link_preset(name: str) -> KVLink:
    """A KV_LINKS name or 'NNgbps' (pools on separate nodes, NN Gb/s per GPU, InfiniBand latency)."""
    if name in KV_LINKS:
        return KV_LINKS[name]
    m = _GBPS.match(name)
    if m and float(m.group(1)) > 0:
        return KVLink(name, float(m.group(1)) * GBIT, 5e-6, True, f"pools on separate nodes, {m.group(1)} Gb/s per GPU")
    raise ValueError(f"KV link {name!r}: expected one of {', '.join(KV_LINKS)} or 'NNgbps' (e.g. '100gbps')")


def parse_workload(label: str) -> Tuple[str, Any]:
    """('ratio', (prompt share, output share)) for 'P:O' (both > 0), ('shift', ((P, O), (P2, O2))) for 'P:O>P2:O2',
    ('preset', name) for a preset name."""
    if label.count(">") == 1:
        first, second = (parse_workload(part) for part in label.split(">"))
        if first[0] == second[0] == "ratio":
            return "shift", (first[1], second[1])
    m = _RATIO.match(label)
    if m:
        p, o = float(m.group(1)), float(m.group(2))
        if p > 0 and o > 0:
            return "ratio", (p, o)
    if label in PRESETS:
        return "preset", label
    raise ValueError(f"workload {label!r}: expected a prompt:output ratio 'P:O' with P, O > 0 (e.g. '4:1'), a shift "
                     f"'P:O>P2:O2' (e.g. '1:4>16:1') or a named trace ({', '.join(sorted(PRESETS))})")


def ratio_lengths(p: float, o: float, total_tokens: int) -> Dict[str, Any]:
    """A 'P:O' workload's length distributions: prompt and output uniform on [m/2, 3m/2] around their means
    (total_tokens split P:O)."""
    means = (total_tokens * p / (p + o), total_tokens * o / (p + o))
    dists = [{"kind": "uniform", "low": max(1, math.ceil(m / 2)), "high": max(1, math.floor(1.5 * m))}
             for m in means]
    return {"kind": "synthetic", "arrival": "poisson", "prompt_len": dists[0], "output_len": dists[1]}


def shifting_trace(phases: Tuple[Tuple[float, float], ...], num_requests: int, seed: int, total_tokens: int,
                   max_model_len: int) -> str:
    """A trace CSV ('simple' format: prompt_tokens,output_tokens; no times) whose prompt:output mix shifts: the
    requests split evenly over `phases` in order, each phase's lengths drawn as its 'P:O' workload's (seed + phase
    index). Written (atomically) to a path named by its content's hash under the temp directory when missing; a
    'trace' workload replays its rows in order with Poisson arrivals at the probed rate. Returns the path."""
    text = _shifting_text(phases, num_requests, seed, total_tokens, max_model_len)
    folder = os.path.join(tempfile.gettempdir(), "pdjax-regime-traces")
    path = os.path.join(folder, f"shift-{hashlib.sha256(text.encode()).hexdigest()[:16]}.csv")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        atomic_write_text(path, text)
    return path


@functools.lru_cache(maxsize=None)
def _shifting_text(phases: Tuple[Tuple[float, float], ...], num_requests: int, seed: int, total_tokens: int,
                   max_model_len: int) -> str:
    """shifting_trace's CSV text (memoized: the grid asks for a workload at every point and candidate)."""
    lines = ["prompt_tokens,output_tokens"]
    for i, (p, o) in enumerate(phases):
        n = num_requests // len(phases) + (i < num_requests % len(phases))
        cfg = WorkloadConfig.from_dict({**ratio_lengths(p, o, total_tokens), "num_requests": n, "seed": seed + i,
                                        "max_model_len": max_model_len})
        lines += [f"{len(r.prompt_token_ids)},{r.max_tokens}" for r in make_workload(cfg, cfg.seed)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- the grid
@dataclasses.dataclass(frozen=True)
class RegimeGrid:
    """The map to draw: model, hardware (with gpus_per_node, 0 = the spec's) and GPU budget; the axes
    (workloads: 'P:O' ratios or preset names; slo_scales: factors on (base_ttft_s, base_tpot_s); links: KV_LINKS
    names or 'NNgbps'); the placement search's knobs (pdjax.sim.placement.PlacementProblem). stack: both sides'
    serving stack unless colocated_stack / disagg_stack ('' = stack) say otherwise."""
    model: str = "opt-13b"
    hardware: str = "a100-80gb-sxm"
    gpu_budget: int = 4
    gpus_per_node: int = 0
    workloads: Tuple[str, ...] = ("1:2", "1:1", "4:1", "16:1", "64:1")
    slo_scales: Tuple[float, ...] = (0.5, 0.7, 1.0, 1.4, 2.0)
    links: Tuple[str, ...] = ("nvlink", "infiniband", "ethernet-25g")
    base_ttft_s: float = 0.25            # DistServe's chatbot SLOs for OPT-13B
    base_tpot_s: float = 0.1
    attainment: float = 0.9
    num_requests: int = 200
    seed: int = 0
    total_tokens: int = 1024             # mean prompt + output tokens of a ratio workload
    max_model_len: int = 2048
    stack: str = "pdjax"
    colocated_stack: str = ""
    disagg_stack: str = ""
    colocated: Tuple[str, ...] = dataclasses.field(default_factory=lambda: tuple(COLOCATED_POLICIES))
    profile: str = ""
    slo_rule: str = "pdjax"
    max_pp: int = 8
    rel_tol: float = 0.05
    max_probes: int = 14
    max_num_seqs: int = 256              # sequences per instance (every role; Sarathi's budget is at least this)
    rebalance: bool = False              # also search online XpYd rebalancing on the disaggregated side
    rebalance_prefill_queue_tokens: int = 8192      # its thresholds (deployment.rebalance_*)
    rebalance_decode_load: float = 0.9
    rebalance_window_s: float = 2.0
    rebalance_flip_s: float = 0.0
    rebalance_trigger: str = "load"     # 'slo', 'slo_predicted': flip on each point's own SLOs (per point runs)

    def __post_init__(self):
        for name in ("workloads", "slo_scales", "links", "colocated"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name}=(): expected at least one value")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}={list(values)}: values repeat")
        for w in self.workloads:
            parse_workload(w)
        for s in self.slo_scales:
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise ValueError(f"SLO scale {s!r}: expected a number > 0 (a factor on the base TTFT and TPOT)")
        for k in self.links:
            kv_link_preset(k)
        bad = [p for p in self.colocated if p not in COLOCATED_POLICIES]
        if bad:
            raise ValueError(f"colocated policies {bad}: expected some of {COLOCATED_POLICIES}")
        if not isinstance(self.gpu_budget, int) or self.gpu_budget < 2:
            raise ValueError(f"gpu_budget={self.gpu_budget!r}: expected an int >= 2 (a prefill and a decode GPU)")
        if not isinstance(self.total_tokens, int) or not 2 <= self.total_tokens < self.max_model_len * 2 // 3:
            raise ValueError(f"total_tokens={self.total_tokens!r}: expected an int in [2, 2/3 of max_model_len="
                             f"{self.max_model_len}) (lengths reach 1.5x their means)")
        if not (self.base_ttft_s > 0 and self.base_tpot_s > 0):
            raise ValueError(f"base SLOs ttft={self.base_ttft_s!r}, tpot={self.base_tpot_s!r}: expected seconds > 0")
        for key in ("stack", "colocated_stack", "disagg_stack"):
            name = getattr(self, key)
            if (name or key == "stack") and not is_stack(name):
                raise ValueError(f"{key}={name!r}: expected one of {STACKS} or a stack file (.json)")
        if self.slo_rule not in SLO_RULES:
            raise ValueError(f"slo_rule={self.slo_rule!r}: expected one of {SLO_RULES}")
        # the rest (model, hardware, attainment, max_model_len, ...) is checked by PlacementProblem
        self.problem("colocated", self.workloads[0], self.slo_scales[0], None)

    @property
    def stacks(self) -> Tuple[str, str]:
        """(colocated stack, disaggregated stack)."""
        return self.colocated_stack or self.stack, self.disagg_stack or self.stack

    def node(self, link: Optional[str]) -> NodeType:
        """The node type of a side: colocated (link None) and 'nvlink' run on the hardware's own node; a network
        link sets the inter-node bandwidth and latency."""
        preset = kv_link_preset(link) if link else None
        if preset is None or not preset.separate:
            return NodeType(self.hardware, gpus_per_node=self.gpus_per_node)
        return NodeType(self.hardware, gpus_per_node=self.gpus_per_node, inter_node_bandwidth=preset.bandwidth,
                        inter_node_latency=preset.latency)

    def workload(self, label: str) -> Dict[str, Any]:
        """The WorkloadConfig dict of a workload label (module docstring)."""
        kind, value = parse_workload(label)
        base = {"num_requests": self.num_requests, "seed": self.seed, "max_model_len": self.max_model_len}
        if kind == "preset":
            return {**base, "preset": value, "fit_to_model": True}
        if kind == "shift":
            path = shifting_trace(value, self.num_requests, self.seed, self.total_tokens, self.max_model_len)
            return {**base, "kind": "trace", "arrival": "poisson", "trace_path": path}
        return {**base, **ratio_lengths(*value, self.total_tokens)}

    def slo(self, scale: float) -> Tuple[float, float]:
        return scale * self.base_ttft_s, scale * self.base_tpot_s

    def problem(self, side: str, workload: str, scale: float, link: Optional[str],
                sarathi_budget: int = 512) -> PlacementProblem:
        """The placement problem of one side ('colocated' | 'disaggregated') at a point."""
        ttft, tpot = self.slo(scale)
        coloc, disagg = self.stacks
        return PlacementProblem(model=self.model, node=self.node(link if side == "disaggregated" else None),
                                gpu_budget=self.gpu_budget, workload=self.workload(workload), ttft_s=ttft,
                                tpot_s=tpot, attainment=self.attainment, profile=self.profile,
                                max_model_len=self.max_model_len, sarathi_token_budget=sarathi_budget,
                                max_pp=self.max_pp, rel_tol=self.rel_tol, max_probes=self.max_probes,
                                colocated_stack=coloc, prefill_stack=disagg, decode_stack=disagg,
                                slo_rule=self.slo_rule, decode_max_num_seqs=self.max_num_seqs,
                                **{k: getattr(self, k) for k in REBALANCE_THRESHOLDS})

    @property
    def points(self) -> List[Tuple[str, float, str]]:
        """(workload, SLO scale, link) in CSV order: link-major, then workload, then scale."""
        return [(w, s, k) for k in self.links for w in self.workloads for s in self.slo_scales]


# --------------------------------------------------------------------------------------------------- candidates
def colocated_candidates(grid: RegimeGrid) -> List[Placement]:
    """The placement search's colocated candidates (they depend on neither workload, SLO nor link)."""
    return enumerate_placements(grid.problem("colocated", grid.workloads[0], grid.slo_scales[0], None),
                                affinities=(), colocated=grid.colocated)


def _first_fit(layouts: Sequence[Layout], per_node: int, first_node: int) -> List[Tuple[int, ...]]:
    """Device indices of instances placed first-fit from `first_node` on, each stage's TP group inside a node."""
    free: Dict[int, List[int]] = {}
    out = []
    for layout in layouts:
        devices: Tuple[int, ...] = ()
        for _ in range(layout.pp):
            node = first_node
            while len(free.setdefault(node, list(range(node * per_node, (node + 1) * per_node)))) < layout.tp:
                node += 1
            devices += tuple(free[node][:layout.tp])
            free[node] = free[node][layout.tp:]
        out.append(devices)
    return out


def separate_pools(p: Placement, problem: PlacementProblem) -> Placement:
    """`p` (a disaggregated candidate) with its decode instances on the nodes after its prefill instances', and
    the KV links that gives (pdjax.sim.disagg.kv_link on the problem's node type)."""
    hw = problem.node.spec()
    per_node = hw.devices_per_node
    pre = _first_fit([p.prefill] * p.num_prefill, per_node, 0)
    last = max(d // per_node for devices in pre for d in devices)
    dec = _first_fit([p.decode] * p.num_decode, per_node, last + 1)
    links = tuple(kv_link(hw, a, b, p.prefill.pp, p.decode.pp) for a in pre for b in dec)
    pairs = pair_links(hw, pre + dec, p.prefill) if p.rebalance else ()
    return dataclasses.replace(p, kind="high", devices=tuple(pre + dec), links=links, pair_links=pairs)


def disaggregated_candidates(grid: RegimeGrid, link: str) -> List[Placement]:
    """The disaggregated candidates at KV link `link` (module docstring), deduplicated, in the search's order;
    with grid.rebalance, the rebalance variants of the swappable ones too (pdjax.sim.placement.swappable)."""
    problem = grid.problem("disaggregated", grid.workloads[0], grid.slo_scales[0], link)
    if not kv_link_preset(link).separate:
        return enumerate_placements(problem, colocated=(), rebalance=grid.rebalance)
    found: Dict[tuple, Placement] = {}
    for p in enumerate_placements(problem, affinities=("high",), colocated=(), rebalance=grid.rebalance):
        q = separate_pools(p, problem)
        found.setdefault(q.key(), q)
    return list(found.values())


# --------------------------------------------------------------------------------------------------- Sarathi budget
def workload_means(workload: Mapping[str, Any]) -> Tuple[float, float]:
    """(mean prompt, mean output) tokens of the requests the workload generates (what is simulated)."""
    cfg = WorkloadConfig.from_dict(dict(workload))
    reqs = make_workload(cfg, cfg.seed)
    return (sum(len(r.prompt_token_ids) for r in reqs) / len(reqs), sum(r.max_tokens for r in reqs) / len(reqs))


def hybrid_batch(budget: int, mean_prompt: float, mean_output: float, max_num_seqs: int,
                 kv_capacity_tokens: int) -> SchedulerOutput:
    """A full Sarathi iteration of `budget` tokens at saturation: decodes take the workload's decode share of the
    tokens (mean output / (prompt + output); at least 1, at most max_num_seqs, budget - 1 and as many as the KV
    cache holds at their context) at the mean context of a decoding request (prompt + half the output), the rest
    is one prefill chunk, the last chunk of a mean prompt (offset mean prompt - chunk, or 0)."""
    share = mean_output / (mean_prompt + mean_output)
    context = round(mean_prompt + mean_output / 2)
    decodes = max(1, min(max_num_seqs, budget - 1, kv_capacity_tokens // max(1, context), round(budget * share)))
    chunk = budget - decodes
    offset = max(0, round(mean_prompt) - chunk)
    return SchedulerOutput(step=0, req_ids=[f"r{i}" for i in range(decodes + 1)],
                           num_computed_tokens=[offset] + [context] * decodes,
                           num_new_tokens=[chunk] + [1] * decodes, is_prefill=[True] + [False] * decodes,
                           num_prefill_tokens=chunk, num_decode_tokens=decodes)


def hybrid_step_time(problem: PlacementProblem, layout: Layout, budget: int, means: Tuple[float, float]) -> float:
    """Seconds of `hybrid_batch` on one colocated Sarathi instance of `layout`: the simulator's own step-time
    function for it (the serve config's group, stack and profile; no step noise), the whole pipeline for pp > 1."""
    p = dataclasses.replace(problem, sarathi_token_budget=budget)
    placement = Placement("colocated", "sarathi", layout, 1, None, 0, (tuple(range(layout.gpus)),))
    setup = build_setup(serve_config_from_dict(serve_config(p, placement, 1.0)), hardware=p.node.spec())
    batch = hybrid_batch(budget, *means, problem.decode_max_num_seqs, setup.groups["colocated"].kv_capacity_tokens)
    return float(group_step_time(setup, "colocated", noise=False)(batch))


def sarathi_budget(problem: PlacementProblem, layout: Layout, means: Tuple[float, float],
                   step_time: Optional[Callable[[int], float]] = None) -> Dict[str, Any]:
    """Sarathi-Serve's token budget for a TPOT target (problem.tpot_s): the largest multiple of BUDGET_STEP from
    decode_max_num_seqs (a stall-free budget holds every running decode) up to max_model_len whose hybrid-batch
    step fits the target (fits False: none does, the smallest is used).
    step_time: budget -> seconds (default `hybrid_step_time`; the grid passes a memoized one)."""
    step_time = step_time or (lambda b: hybrid_step_time(problem, layout, b, means))
    low = -(-problem.decode_max_num_seqs // BUDGET_STEP) * BUDGET_STEP   # stall-free: budget >= max_num_seqs
    budgets = list(range(low, problem.max_model_len + 1, BUDGET_STEP)) or [problem.max_model_len]
    best = None
    for b in budgets:   # step time grows with the budget: stop at the first that does not fit
        t = step_time(b)
        if t > problem.tpot_s:
            break
        best = (b, t)
    if best is None:
        return {"budget": budgets[0], "step_s": step_time(budgets[0]), "fits": False}
    return {"budget": best[0], "step_s": best[1], "fits": True}


# --------------------------------------------------------------------------------------------------- rate search
@dataclasses.dataclass(frozen=True)
class Task:
    """One candidate on one workload (and link, and Sarathi budget), searched at several SLO points that share its
    simulations: `problems` are the points' problems (equal but for ttft_s / tpot_s), keyed by SLO scale."""
    workload: str
    link: Optional[str]            # None: colocated
    placement: Placement
    problems: Tuple[Tuple[float, PlacementProblem], ...]


@dataclasses.dataclass(frozen=True)
class TaskResult:
    goodputs: Tuple[Tuple[float, float, int], ...]   # per SLO scale: (scale, goodput req/s, probes)
    simulations: int
    cpu_s: float


def run_task(task: Task) -> TaskResult:
    """Every SLO point's rate search of `task`, simulating each probed rate once (records keyed by rate)."""
    start = time.process_time()
    records: Dict[float, Any] = {}
    base = task.problems[0][1]

    def ok_for(problem: PlacementProblem):
        def ok(rate: float) -> Tuple[bool, float]:
            if rate not in records:
                records[rate] = simulate_placement(base, task.placement, rate)
            return slo_rule_passes(records[rate], problem.ttft_s, problem.tpot_s, problem.slo_rule,
                                   problem.attainment)
        return ok

    out = []
    for scale, problem in task.problems:
        good, probes = rate_search(ok_for(problem), task.placement.num_gpus, base.rel_tol, base.max_probes)
        out.append((scale, good, len(probes)))
    return TaskResult(tuple(out), len(records), time.process_time() - start)


# --------------------------------------------------------------------------------------------------- the map
def _rank_key(name: str, num_gpus: int, per_gpu: float, rebalance: bool = False) -> tuple:
    """placement.rank's order: best per-GPU goodput first; ties: fewer GPUs, a fixed design before a rebalancing
    one, then name."""
    return (-round(per_gpu, 9), num_gpus, rebalance, name)


def _best(entries: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    return min(entries, key=lambda e: _rank_key(e["placement"], e["num_gpus"], e["per_gpu_goodput_rps"],
                                                e.get("rebalance", False)), default=None)


def _entry(placement: Placement, goodput: float, probes: int, **extra) -> Dict[str, Any]:
    design = {"rebalance": True} if placement.rebalance else {}     # as placement's rows mark it
    return {"placement": placement.name, "kind": placement.kind, "policy": placement.policy,
            "num_gpus": placement.num_gpus, "goodput_rps": goodput, "per_gpu_goodput_rps": goodput / placement.num_gpus,
            "num_probes": probes, **design, **extra}


def _design_columns(entries: Sequence[Dict[str, Any]], best: Dict[str, Any]) -> Dict[str, Any]:
    """A rebalancing grid's row columns: which design won the disaggregated side ('fixed' | 'rebalance'), and the
    best of each design (None: the design has no candidate, e.g. no swappable placement)."""
    fixed = _best([e for e in entries if not e.get("rebalance")])
    rebal = _best([e for e in entries if e.get("rebalance")])
    return {"disagg_design": "rebalance" if best.get("rebalance") else "fixed",
            "best_fixed_disaggregated": fixed and fixed["placement"],
            "fixed_disagg_per_gpu_rps": fixed and fixed["per_gpu_goodput_rps"],
            "best_rebalance_disaggregated": rebal and rebal["placement"],
            "rebalance_disagg_per_gpu_rps": rebal and rebal["per_gpu_goodput_rps"]}


class _MemoStep:
    """budget -> hybrid_step_time of one (problem, layout, means), each budget computed once."""

    def __init__(self, problem: PlacementProblem, layout: Layout, means: Tuple[float, float]):
        self.problem, self.layout, self.means = problem, layout, means
        self.memo: Dict[int, float] = {}

    def __call__(self, budget: int) -> float:
        if budget not in self.memo:
            self.memo[budget] = hybrid_step_time(self.problem, self.layout, budget, self.means)
        return self.memo[budget]


def sarathi_budgets(grid: RegimeGrid) -> Dict[Tuple[str, float, Layout], Dict[str, Any]]:
    """(workload, SLO scale, layout) -> sarathi_budget for every colocated Sarathi layout (step times memoized per
    (workload, layout, budget): they depend on neither the SLO nor the link)."""
    layouts = sorted({p.prefill for p in colocated_candidates(grid) if p.policy == "sarathi"},
                     key=lambda lay: (lay.tp, lay.pp))
    out = {}
    for w in grid.workloads:
        problem = grid.problem("colocated", w, grid.slo_scales[0], None)
        means = workload_means(problem.workload)
        for layout in layouts:
            step = _MemoStep(problem, layout, means)
            for s in grid.slo_scales:
                out[(w, s, layout)] = sarathi_budget(grid.problem("colocated", w, s, None), layout, means, step)
    return out


def point_problems(grid: RegimeGrid, workload: str, scale: float, link: str,
                   budgets: Optional[Mapping] = None) -> Dict[str, List[Tuple[PlacementProblem, Placement]]]:
    """The (problem, candidate) pairs of one point: {'colocated': [...], 'disaggregated': [...]}; a colocated
    Sarathi candidate's problem carries its layout's budget (`sarathi_budgets`). `placement.evaluate(problem,
    candidate)` on each is what the map reports (the uncached path runs exactly that)."""
    budgets = sarathi_budgets(grid) if budgets is None else budgets
    coloc = []
    for p in colocated_candidates(grid):
        b = budgets[(workload, scale, p.prefill)]["budget"] if p.policy == "sarathi" else 512
        coloc.append((grid.problem("colocated", workload, scale, None, b), p))
    disagg_problem = grid.problem("disaggregated", workload, scale, link)
    return {"colocated": coloc, "disaggregated": [(disagg_problem, p) for p in disaggregated_candidates(grid, link)]}


def _tasks(grid: RegimeGrid, budgets: Mapping) -> List[Task]:
    """The cached path's tasks: colocated per (workload, candidate, Sarathi budget) over the SLO points that chose
    that budget (links share them); disaggregated per (workload, link, candidate) over every SLO point."""
    tasks = []
    coloc = colocated_candidates(grid)
    for w in grid.workloads:
        for p in coloc:
            groups: Dict[int, List[float]] = {}
            for s in grid.slo_scales:
                b = budgets[(w, s, p.prefill)]["budget"] if p.policy == "sarathi" else 512
                groups.setdefault(b, []).append(s)
            for b, scales in groups.items():
                tasks.append(Task(w, None, p, tuple((s, grid.problem("colocated", w, s, None, b)) for s in scales)))
        for k in grid.links:
            for p in disaggregated_candidates(grid, k):
                points = tuple((s, grid.problem("disaggregated", w, s, k)) for s in grid.slo_scales)
                if p.rebalance and grid.rebalance_trigger in SLO_TRIGGERS:    # its runs read the point's SLOs
                    tasks += [Task(w, k, p, (point,)) for point in points]
                else:
                    tasks.append(Task(w, k, p, points))
    return tasks


def _map(fn, items: Sequence, workers: int, progress: Optional[Callable[[int, int], None]] = None) -> List[Any]:
    """[fn(x) for x in items] on `workers` processes (1: here), in order; progress(done, total) after each."""
    finished = []

    def done(i: int, result: Any) -> None:
        finished.append(i)
        if progress is not None:
            progress(len(finished), len(items))
    return parallel_map(fn, items, workers=workers, done=done)


def _evaluate_pair(pair: Tuple[PlacementProblem, Placement]) -> Tuple[float, int]:
    e = evaluate(*pair)    # the uncached reference: the placement search's own evaluation
    return e.goodput_rps, len(e.probes)


def _link_gbps(placements: Sequence[Placement]) -> Optional[float]:
    links = [bw for p in placements for bw, _, _ in p.links]
    return round(min(links) / 1e9, 3) if links else None


def _grid_rows(grid: RegimeGrid, coloc, disagg, disagg_cands):
    """(CSV rows, points) of `run_grid`: per point the best colocated placement (overall and per policy), the best
    disaggregated one, and the winner by goodput per GPU."""
    rows, points = [], []
    for w, s, k in grid.points:
        ttft, tpot = grid.slo(s)
        by_policy = {pol: _best([e for e in coloc[(w, s)] if e["policy"] == pol]) for pol in grid.colocated}
        best_c = _best([e for e in by_policy.values() if e])
        best_d = _best(disagg[(w, s, k)])
        c, d = best_c["per_gpu_goodput_rps"], best_d["per_gpu_goodput_rps"]
        winner = "neither" if c == d == 0 else "tie" if c == d else "disaggregated" if d > c else "colocated"
        row = {"link": k, "workload": w, "slo_scale": s, "ttft_s": ttft, "tpot_s": tpot,
               "kv_link_gbps": _link_gbps(disagg_cands[k]),
               "best_colocated": best_c["placement"], "colocated_per_gpu_rps": c,
               "colocated_goodput_rps": best_c["goodput_rps"],
               "sarathi_budget": (by_policy.get("sarathi") or {}).get("sarathi_budget"),
               **{f"{pol}_per_gpu_rps": by_policy[pol]["per_gpu_goodput_rps"] for pol in grid.colocated},
               "best_disaggregated": best_d["placement"], "disagg_per_gpu_rps": d,
               "disagg_goodput_rps": best_d["goodput_rps"],
               "ratio": d / c if c > 0 else None, "winner": winner}
        if grid.rebalance:
            row.update(_design_columns(disagg[(w, s, k)], best_d))
        rows.append(row)
        points.append({"link": k, "workload": w, "slo_scale": s, "best_colocated_by_policy": by_policy,
                       "best_disaggregated": best_d})
    return rows, points


def _check_candidates(grid: RegimeGrid, coloc_cands, disagg_cands) -> None:
    """A side without a single placement that holds the model is refused before anything is simulated."""
    empty = (["colocated"] if not coloc_cands else []) + [f"disaggregated over {k}" for k, c in disagg_cands.items()
                                                          if not c]
    if empty:
        raise UserError(f"no {' / '.join(empty)} placement of model {grid.model!r} fits {grid.gpu_budget} GPU(s) of "
                        f"{grid.hardware!r} (weights + KV per GPU over its memory at every (tp, pp) the budget "
                        f"allows); expected a larger --budget, more memory per GPU or a smaller model")
    if grid.rebalance and not any(p.rebalance for cands in disagg_cands.values() for p in cands):
        raise UserError(f"rebalance=True, but no disaggregated placement of model {grid.model!r} on {grid.gpu_budget} "
                        f"GPU(s) of {grid.hardware!r} can flip roles (a flip needs one layout on both sides, equal "
                        "role budgets and a side with two instances); expected a larger --budget (room for 1P2D or "
                        "2P1D of one layout) or rebalance=False")


def run_grid(grid: RegimeGrid, workers: int = 1, cache: bool = True,
             progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
    """Every point of the grid: {"rows": [CSV row per point, `grid.points` order], "points": [per point the best
    of each side and each colocated policy], "timing": {...}}. cache=False: every (point, candidate) through
    `placement.evaluate` on its own (the reference the cached path must equal). progress(done, total): called
    as tasks finish."""
    wall, cpu = time.perf_counter(), time.process_time()
    coloc_cands = colocated_candidates(grid)
    disagg_cands = {k: disaggregated_candidates(grid, k) for k in grid.links}
    _check_candidates(grid, coloc_cands, disagg_cands)
    budgets = sarathi_budgets(grid)
    coloc: Dict[Tuple[str, float], List[Dict[str, Any]]] = {}
    disagg: Dict[Tuple[str, float, str], List[Dict[str, Any]]] = {}
    stats = {"tasks": 0, "simulations": 0, "probes": 0, "worker_cpu_s": 0.0}

    def budget_extra(w: str, s: float, p: Placement) -> Dict[str, Any]:
        if p.policy != "sarathi":
            return {}
        b = budgets[(w, s, p.prefill)]
        return {"sarathi_budget": b["budget"], "sarathi_budget_fits": b["fits"]}

    if cache:
        tasks = _tasks(grid, budgets)
        results = _map(run_task, tasks, workers, progress)
        for task, res in zip(tasks, results):
            stats["simulations"] += res.simulations
            stats["worker_cpu_s"] += res.cpu_s
            for s, good, n in res.goodputs:
                stats["probes"] += n
                e = _entry(task.placement, good, n, **budget_extra(task.workload, s, task.placement))
                if task.link is None:
                    coloc.setdefault((task.workload, s), []).append(e)
                else:
                    disagg.setdefault((task.workload, s, task.link), []).append(e)
        stats["tasks"] = len(tasks)
    else:
        jobs = []     # (side key, placement, (problem, placement)) in a fixed order; colocated once per (w, s)
        for w in grid.workloads:
            for s in grid.slo_scales:
                pairs = point_problems(grid, w, s, grid.links[0], budgets)["colocated"]
                jobs += [(("c", w, s), p, pair) for pair, p in zip(pairs, coloc_cands)]
                for k in grid.links:
                    pairs = point_problems(grid, w, s, k, budgets)["disaggregated"]
                    jobs += [(("d", w, s, k), p, pair) for pair, p in zip(pairs, disagg_cands[k])]
        results = _map(_evaluate_pair, [j[2] for j in jobs], workers, progress)
        for (key, p, _), (good, n) in zip(jobs, results):
            stats["probes"] += n
            stats["simulations"] += n
            e = _entry(p, good, n, **budget_extra(key[1], key[2], p))
            (coloc.setdefault(key[1:], []) if key[0] == "c" else disagg.setdefault(key[1:], [])).append(e)
        stats["tasks"] = len(jobs)
    rows, points = _grid_rows(grid, coloc, disagg, disagg_cands)
    stats["worker_cpu_s"] = round(stats["worker_cpu_s"], 2)
    timing = {"wall_s": round(time.perf_counter() - wall, 2), "main_cpu_s": round(time.process_time() - cpu, 2),
              "workers": workers, "cache": cache, "num_points": len(rows),
              "num_candidates": {"colocated": len(coloc_cands), **{k: len(v) for k, v in disagg_cands.items()}},
              **stats}
    return {"rows": rows, "points": points, "timing": timing}


# --------------------------------------------------------------------------------------------------- outputs
CSV_COLUMNS = ("link", "workload", "slo_scale", "ttft_s", "tpot_s", "kv_link_gbps", "best_colocated",
               "colocated_per_gpu_rps", "colocated_goodput_rps", "sarathi_budget", "sarathi_per_gpu_rps",
               "vllm_v0_per_gpu_rps", "best_disaggregated", "disagg_per_gpu_rps", "disagg_goodput_rps", "ratio",
               "winner")
REBALANCE_COLUMNS = ("disagg_design", "best_fixed_disaggregated", "fixed_disagg_per_gpu_rps",
                     "best_rebalance_disaggregated", "rebalance_disagg_per_gpu_rps")   # grids with rebalance=True


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per point, CSV_COLUMNS (a policy not in the grid leaves its column empty), then REBALANCE_COLUMNS
    when the rows have them (a rebalancing grid); floats to 6 digits."""
    columns = CSV_COLUMNS + (REBALANCE_COLUMNS if any("disagg_design" in r for r in rows) else ())
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for r in rows:
        writer.writerow([_fmt(r.get(c)) for c in columns])
    return buf.getvalue()


def summary(grid: RegimeGrid, result: Mapping[str, Any]) -> Dict[str, Any]:
    """The JSON summary: the grid, timing, and per link where disaggregation wins and by how much."""
    by_link = {}
    for k in grid.links:
        rows = [r for r in result["rows"] if r["link"] == k]
        wins = [r for r in rows if r["winner"] == "disaggregated"]
        ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
        best = max(wins, key=lambda r: r["ratio"] if r["ratio"] is not None else math.inf, default=None)
        by_link[k] = {"winners": {w: sum(r["winner"] == w for r in rows) for w in WINNERS},
                      "disaggregated_wins_at": [{"workload": r["workload"], "slo_scale": r["slo_scale"],
                                                 "ratio": r["ratio"]} for r in wins],
                      "max_ratio": max(ratios, default=None), "min_ratio": min(ratios, default=None),
                      "best_disaggregated_point": ({"workload": best["workload"], "slo_scale": best["slo_scale"],
                                                    "ratio": best["ratio"], "placement": best["best_disaggregated"],
                                                    "versus": best["best_colocated"]} if best else None)}
        if grid.rebalance:
            by_link[k]["disagg_design"] = {d: sum(r["disagg_design"] == d for r in rows)
                                           for d in ("fixed", "rebalance")}
    return {"grid": {f.name: getattr(grid, f.name) for f in dataclasses.fields(grid)},
            "kv_links": {k: dataclasses.asdict(kv_link_preset(k)) for k in grid.links},
            "timing": result["timing"], "by_link": by_link, "points": result["points"]}


def heatmap_png(grid: RegimeGrid, rows: Sequence[Mapping[str, Any]]) -> bytes:
    """PNG: one heatmap per KV link (workload across, SLO scale up), colour log2(disaggregated / colocated
    per-GPU goodput) on a diverging scale (red: disaggregation wins), each cell its ratio and the winner
    (D / C / = / none; ' r' when the disaggregated side's best design rebalances online); grey: undefined ratio
    (colocated goodput 0)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (1 s; only when plotting)
    from matplotlib.figure import Figure  # noqa: PLC0415 (matplotlib only when plotting)
    nw, ns, nk = len(grid.workloads), len(grid.slo_scales), len(grid.links)
    fig = Figure(figsize=(1.6 + (0.95 * nw + 0.6) * nk, 2.2 + 0.55 * ns), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    index = {(r["link"], r["workload"], r["slo_scale"]): r for r in rows}
    finite = [abs(math.log2(r["ratio"])) for r in rows if r["ratio"]]
    span = max([1.0] + finite)
    mark = {"disaggregated": "D", "colocated": "C", "tie": "=", "neither": "none"}
    axes = fig.subplots(1, nk, squeeze=False)[0]
    image = None
    for ax, k in zip(axes, grid.links):
        values = np.full((ns, nw), np.nan)
        for i, s in enumerate(grid.slo_scales):
            for j, w in enumerate(grid.workloads):
                r = index[(k, w, s)]
                if r["ratio"]:
                    values[i, j] = math.log2(r["ratio"])
                elif r["ratio"] == 0:
                    values[i, j] = -span
                text = (f"{r['ratio']:.2f}\n{mark[r['winner']]}" if r["ratio"] is not None
                        else mark[r["winner"]] if r["winner"] == "neither" else f"inf\n{mark[r['winner']]}")
                if r.get("disagg_design") == "rebalance":
                    text += " r"          # the disaggregated side's best design rebalances online
                dark = not math.isnan(values[i, j]) and abs(values[i, j]) > 0.6 * span
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        ax.set_facecolor("#cccccc")
        image = ax.imshow(values, cmap="RdBu_r", vmin=-span, vmax=span, origin="lower", aspect="auto")
        ax.set_xticks(range(nw), labels=list(grid.workloads), fontsize=7)
        ax.set_yticks(range(ns), labels=[f"{s:g}" for s in grid.slo_scales], fontsize=7)
        ax.set_xlabel("workload (prompt:output or trace)", fontsize=7)
        ax.set_title(f"KV link: {k}", fontsize=9)
    axes[0].set_ylabel(f"SLO scale (x TTFT {grid.base_ttft_s:g} s, TPOT {grid.base_tpot_s:g} s)", fontsize=8)
    bar = fig.colorbar(image, ax=list(axes), shrink=0.9)
    bar.set_label("log2(disagg / colocated\nper-GPU goodput)", fontsize=7)
    fig.suptitle(f"{grid.model}, {grid.gpu_budget} x {grid.hardware}: disagg / colocated per-GPU goodput "
                 "(D: disaggregation wins, C: colocated)", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_outputs(grid: RegimeGrid, result: Mapping[str, Any], out_dir: str) -> Dict[str, str]:
    """regime_map.csv, regime_map.png and regime_map.json under `out_dir`, each written atomically."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"regime_map.{ext}") for ext in ("csv", "png", "json")}
    atomic_write_text(paths["csv"], csv_text(result["rows"]))
    atomic_write_bytes(paths["png"], heatmap_png(grid, result["rows"]))
    atomic_write_text(paths["json"], json.dumps(summary(grid, result), indent=1, default=str) + "\n")
    return paths
