"""`run_sim`: one serving experiment on the simulator backend, writing the same outputs as a real run.

    build (pdjax.sim.build: config -> model, hardware, cost setup, instances, router, transfer times)
      -> simulate (colocated: pdjax.sim.simulator.simulate; disaggregated: pdjax.sim.disagg.simulate_disaggregated)
      -> outputs (write_run_outputs)

The deployment simulated is exactly `cfg.deployment` (see pdjax.sim.build for every resolution rule): colocated
replicas of (pp, tp) behind the router, with the engine's synchronous loop or, with engine.async_scheduling=True,
its asynchronous one; or disaggregated prefill and decode groups with one KV transfer per request.

Outputs: `write_run_outputs` (results.json, CSVs, plots) with
- "engine": as the real engine writes it (backend, deployment, policy, mode, wall_s, num_iterations; per instance
  its role, devices, pp, tp, num_pages, token_budget, num_iterations; disaggregated: `kv_transfer` with the real
  engine's keys num_transfers, kv_bytes, moved_bytes, seconds, bandwidth_bytes_per_s);
- "sim": the simulator's own (speed in simulated iterations per wall second, model, hardware, profile, router,
  per group its layout, pages and KV capacity; colocated: pipeline-stage occupancy when the simulator reports it;
  disaggregated: per-transfer time and link-queue percentiles; `energy`: energy per request, machine-hours and
  cost on the hardware's machine SKU, pdjax.sim.machines; `slowdown_slo`: Splitwise's slowdown SLO check against
  each request's unloaded run on this run's own instances, pdjax.sim.reference, beside the absolute SLO
  attainment of the summary).
No JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Tuple

from pdjax.metrics import write_run_outputs

from pdjax.sim.build import (SimSetup, build_instances, build_pending_requests, build_router, build_setup,
                             build_transfer_time, disaggregated_kwargs, group_hardware)
from pdjax.sim.disagg import simulate_disaggregated
from pdjax.metrics.slowdown import splitwise_slo_check
from pdjax.scheduler.admission import admission_report
from pdjax.sim.machines import MachineSpec, energy_report, machine_for_hardware
from pdjax.sim.reference import UnloadedRuns
from pdjax.sim.simulator import SimResult, gc_paused, simulate


def is_disaggregated(cfg) -> bool:
    return cfg.deployment.kind == "disaggregated"


def simulate_setup(setup: SimSetup, requests, adjust_instances: Optional[Callable[[dict], None]] = None
                   ) -> SimResult:
    """Simulate the built deployment `setup` on `requests` (scheduler Requests or PendingRequests).
    adjust_instances: called with the built instances ({role: [instance, ...]}) before the run (e.g. a
    power-capped machine's phase-dependent step time, pdjax.sim.provision)."""
    instances = build_instances(setup)
    if adjust_instances is not None:
        adjust_instances(instances)
    if setup.kind == "colocated":
        replicas = instances["colocated"]
        return simulate(requests, replicas, build_router(setup, replicas), async_scheduling=setup.async_scheduling)
    return simulate_disaggregated(requests, instances["prefill"], instances["decode"], build_transfer_time(setup),
                                  **disaggregated_kwargs(setup, instances))


def simulate_config(cfg, workload=None, hardware=None) -> Tuple[SimResult, SimSetup]:
    """Simulate a ServeConfig (workload: WorkloadRequests, default make_workload(cfg.workload, cfg.seed)); returns
    the result (a DisaggSimResult for a disaggregated deployment) and the setup it was built from. The one
    simulate path: `--config.backend=sim` (run_sim) and every placement candidate (pdjax.sim.placement) come
    through here. hardware: a HardwareSpec overriding the config's (build_setup)."""
    setup, requests = build_simulation(cfg, workload, hardware)
    return simulate_setup(setup, requests), setup


def build_simulation(cfg, workload=None, hardware=None) -> Tuple[SimSetup, list]:
    """simulate_config's first half: the setup and the requests (PendingRequests) simulate_setup takes."""
    setup = build_setup(cfg, hardware)
    with gc_paused():     # the requests' page keys (numbered_keys) make many short-lived objects and no cycles
        return setup, build_pending_requests(cfg, workload)


def iterations_per_instance(result: SimResult, setup: SimSetup) -> dict:
    """Instance name -> simulated iterations (one colocated instance records its iterations under '')."""
    counts = {name: 0 for g in setup.groups.values() for name in g.names}
    for it in result.iterations:
        name = it.instance or next(iter(counts))
        counts[name] = counts.get(name, 0) + 1
    return counts


def engine_info(result: SimResult, setup: SimSetup, cfg) -> dict:
    """results.json's "engine" block, keyed as the real engine's (pdjax.serving.run)."""
    steps = iterations_per_instance(result, setup)
    info = {"backend": "sim", "deployment": setup.kind, "policy": cfg.scheduler.policy, "mode": cfg.engine.mode,
            "async_scheduling": setup.async_scheduling, "wall_s": result.wall_s,
            "num_iterations": result.num_iterations,
            "instances": {name: {"role": role, "devices": list(devs), "pp": g.pp, "tp": g.tp,
                                 "num_pages": g.scheduler_config.num_pages,
                                 "token_budget": g.scheduler_config.token_budget, "num_iterations": steps[name]}
                          for role, g in setup.groups.items() for name, devs in zip(g.names, g.devices)}}
    if setup.kind == "disaggregated":
        info["policy"] = "prefill_only+decode_only"
        info["kv_transfer"] = result.transfer_summary()
        if result.mixed_pool is not None:
            info["mixed_pool"] = result.mixed_pool
        if setup.overload is not None:    # early rejection / rebalancing (pdjax.scheduler.overload)
            info["overload"] = admission_report(result.requests, result.iterations, setup.groups["decode"].names)
    return info


def energy_info(result: SimResult, setup: SimSetup, machines: Optional[Mapping[str, MachineSpec]] = None) -> dict:
    """results.json's sim.energy block: energy (J, and per completed request), machine-hours and cost of the
    run on each group's hardware's machine SKU (pdjax.sim.machines), each instance using pp x tp of its GPUs; a reason
    instead where the hardware has no SKU (e.g. host-cpu). `machines`: {role: MachineSpec} given instead of the
    hardware's default SKU (a cluster design's machines, e.g. a power-capped one: pdjax.sim.provision)."""
    try:
        machines = {role: (machines or {}).get(role) or machine_for_hardware(group_hardware(setup, role).name)
                    for role in setup.groups}
    except ValueError as e:
        return {"available": False, "reason": str(e)}
    names = [(name, machines[role], g.pp * g.tp) for role, g in setup.groups.items() for name in g.names]
    unnamed = len(names) == 1   # one colocated instance records its iterations under ''
    instances = {("" if unnamed else name): (machine, gpus) for name, machine, gpus in names}
    num_completed = sum(1 for r in result.requests if r.completed)
    report = energy_report(result.iterations, instances, result.duration_s, num_completed)
    if unnamed:
        report["per_instance"] = {names[0][0]: report["per_instance"][""]}
    return {"available": True, **report}


def slowdown_info(result: SimResult, setup: SimSetup, reference: Optional[UnloadedRuns] = None) -> dict:
    """results.json's sim.slowdown_slo block: Splitwise's slowdown SLO check (pdjax.metrics.slowdown: P50/P90/P99
    of the TTFT, mean-TBT and E2E slowdowns, all nine within Splitwise's factors) against each request's unloaded
    run on `reference` (pdjax.sim.reference.UnloadedRuns; default: this run's own instances, `of_setup`)."""
    try:
        reference = reference if reference is not None else UnloadedRuns.of_setup(setup)
        check = splitwise_slo_check(result.requests, reference.for_records(result.requests))
    except ValueError as e:     # a step-time function that cannot cost the request alone (e.g. outside its fit)
        return {"available": False, "reason": str(e)}
    return {"available": True, "reference": reference.description, **check}


def sim_info(result: SimResult, setup: SimSetup, cfg=None) -> dict:
    """results.json's "sim" block: the simulator's speed and what it resolved, the energy and machine-hours of
    the run (`energy`), and Splitwise's slowdown SLO check (`slowdown_slo`) beside the absolute SLO attainment
    results.json reports at its top level."""
    info = {
        "iterations_per_s": result.iterations_per_s,
        "wall_s": result.wall_s,
        "num_iterations": result.num_iterations,
        "simulated_duration_s": result.duration_s,
        "model": setup.model.name,
        "hardware": setup.hardware.name,
        "profile": setup.profile,
        "deployment": setup.kind,
        "router": setup.router,
        "groups": {role: {"num_instances": g.num_instances, "pp": g.pp, "tp": g.tp,
                          "devices": [list(d) for d in g.devices], "num_pages": g.scheduler_config.num_pages,
                          "kv_capacity_tokens": g.kv_capacity_tokens,
                          "token_budget": g.scheduler_config.token_budget,
                          "max_num_seqs": g.scheduler_config.max_num_seqs,
                          "padding": dataclasses.asdict(g.padding) if g.padding else None,
                          "stack": g.stack.describe(),
                          "hardware": group_hardware(setup, role).name}
                   for role, g in setup.groups.items()},
        "iterations_per_instance": iterations_per_instance(result, setup),
        "energy": energy_info(result, setup),
        "slowdown_slo": slowdown_info(result, setup),
    }
    if setup.kind == "colocated":   # the one group's figures at the top, as before
        g = setup.groups["colocated"]
        info.update(num_pages=g.scheduler_config.num_pages, kv_capacity_tokens=g.kv_capacity_tokens)
    else:
        info["serialize_transfers"] = setup.serialize_transfers
        info["kv_transfer_stats"] = result.transfer_stats()
    if getattr(result, "pipeline", None):      # pipeline-stage occupancy (pdjax.sim.pipeline), any deployment
        info["pipeline"] = result.pipeline
    return info


def run_sim(cfg, config_dict, workdir: str, *, plots: bool = True, workload=None, extra=None) -> dict:
    """Simulate `cfg` (a ServeConfig) on `workload` (WorkloadRequests; default cfg's) and write the standard run
    outputs to `workdir`; `extra` joins results.json. Returns the summary."""
    result, setup = simulate_config(cfg, workload)
    extra = {**(extra or {}), "engine": engine_info(result, setup, cfg), "sim": sim_info(result, setup, cfg)}
    return write_run_outputs(workdir, config_dict, result.requests, result.iterations, cfg.slo.as_dict(),
                             plots=plots, extra=extra)
