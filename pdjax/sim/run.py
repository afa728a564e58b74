"""`run_sim`: one serving experiment on the simulator backend, writing the same outputs as a real run.

Rules (each chosen so a simulated run answers "what would the real engine do with this config"):
- Model: `sim.model` (a registry spec name) if set, else `model.checkpoint` when it is a spec name, else the
  checkpoint directory's name when that is a spec name, else its `pdjax_spec.json`.
- Hardware and cost profile: `sim.hardware`; the profile is `sim.profile` (a JSON path or a shipped profile
  name) if set, else the shipped profile for the hardware (pdjax/sim/profiles/<hardware>.json, then
  <family>.json: 'a100-80gb-pcie' -> a100.json), else first principles (CostParams defaults). A profile that
  carries a frozen "hardware_spec" (host-cpu calibrations) is costed against that spec, not a re-measurement,
  so results are deterministic. A profile with "padding" costs steps at the engine's padded bucket shapes,
  buckets from the serve config exactly as the engine picks them (pdjax.sim.step_cost.engine_buckets).
- KV pages per replica: `sim.num_pages` when > 0; else, on a GPU/TPU, the cost model's KV capacity
  (`kv_cache_capacity_tokens` with gpu_memory_utilization, activations for token_budget and max_num_seqs) in
  pages; else (host-cpu) `scheduler.num_pages` as given, which is what the CPU engine allocates.
- scheduler.vocab_size 0 becomes the model's vocabulary, as in run_real (out-of-vocabulary prompts rejected).
- Workload: `make_workload(cfg.workload, cfg.seed)`, offline mode puts every arrival at 0, as the engine does.
  Requests carry no stop token (the simulator cannot know when a model would emit EOS): they run to max_tokens.
- Scope: colocated deployments (replicas behind a router), the engine's synchronous loop or, with
  engine.async_scheduling=True, its asynchronous one; deployment.kind='disaggregated' dispatches to
  pdjax.sim.disagg (prefill and decode instances, one KV transfer per request; its rules are documented there).
- Outputs: `write_run_outputs` (results.json, CSVs, plots) plus a "sim" block in results.json (speed in
  simulated iterations per wall second, hardware, profile, pages, KV capacity).
No JAX.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, List, Optional, Tuple

from pdjax.config.model_specs import MODEL_SPECS, ModelSpec, RopeScaling, get_model_spec
from pdjax.scheduler import make_scheduler, request_from_workload
from pdjax.sim.calibration import PROFILES_DIR
from pdjax.sim.cost_model import CostParams, kv_cache_capacity_tokens
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec
from pdjax.sim.simulator import SimInstance, SimResult, make_router, simulate
from pdjax.config.buckets import engine_buckets
from pdjax.sim.step_cost import EnginePadding, SimProfile, load_sim_profile, make_step_time


@dataclasses.dataclass(frozen=True)
class SimSetup:
    """Everything a simulated run is built from (resolved once from a ServeConfig)."""
    model: ModelSpec
    hardware: HardwareSpec
    params: CostParams
    profile: str                 # what profile was used ('' = first principles)
    padding: Optional[EnginePadding]
    scheduler_config: Any        # SchedulerConfig with the resolved num_pages
    kv_capacity_tokens: Optional[int]


# --------------------------------------------------------------------------------------------------- resolution
def resolve_model(cfg) -> ModelSpec:
    """The cost model's ModelSpec (see the module docstring's rule)."""
    if cfg.sim.model:
        return get_model_spec(cfg.sim.model)
    ckpt = cfg.model.checkpoint
    if ckpt in MODEL_SPECS:
        return MODEL_SPECS[ckpt]
    name = pathlib.Path(ckpt).name
    if name in MODEL_SPECS:
        return MODEL_SPECS[name]
    spec_file = pathlib.Path(ckpt) / "pdjax_spec.json"
    if spec_file.is_file():
        data = json.loads(spec_file.read_text())
        if data.get("rope_scaling"):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return ModelSpec(**data)
    raise ValueError(f"sim: cannot tell the model of model.checkpoint={ckpt!r} (not a registry spec name, no "
                     f"pdjax_spec.json there); set sim.model to one of {sorted(MODEL_SPECS)}")


def shipped_profile_for(hardware: str) -> Optional[pathlib.Path]:
    """pdjax/sim/profiles/<hardware>.json, else <family>.json ('a100-80gb-pcie' -> a100.json), else None."""
    key = hardware.strip().lower()
    for name in (key, key.split("-")[0]):
        path = PROFILES_DIR / f"{name}.json"
        if path.is_file():
            return path
    return None


def resolve_profile(cfg) -> Tuple[Optional[SimProfile], str]:
    if cfg.sim.profile:
        return load_sim_profile(cfg.sim.profile), cfg.sim.profile
    path = shipped_profile_for(cfg.sim.hardware)
    if path is None:
        return None, ""
    return load_sim_profile(path), str(path)


def check_supported(cfg) -> None:
    """The simulator replays the colocated engine's loops; say so for anything else."""
    deployment = getattr(cfg, "deployment", None)
    if deployment is not None and deployment.kind != "colocated":
        raise ValueError(f"deployment.kind={deployment.kind!r}: build_setup resolves colocated deployments "
                         f"(expected 'colocated'); a disaggregated one is built by "
                         f"pdjax.sim.disagg.build_disagg_setup (simulate_config dispatches to it)")


def build_setup(cfg) -> SimSetup:
    """Resolve model, hardware, cost parameters, padding and KV pages of a ServeConfig (module docstring)."""
    check_supported(cfg)
    model = resolve_model(cfg)
    profile, profile_name = resolve_profile(cfg)
    sched = cfg.scheduler
    if profile is not None and profile.hardware_spec is not None:
        hw = profile.hardware_spec
    else:
        hw = get_hardware_spec(cfg.sim.hardware)
    params = profile.machine.params if profile is not None else CostParams()
    padding = None
    if profile is not None and profile.padding is not None:
        buckets = engine_buckets(sched.token_budget, sched.max_num_seqs, sched.max_model_len, sched.page_size,
                                 cfg.engine.token_buckets, cfg.engine.seq_buckets, cfg.engine.page_buckets)
        padding = EnginePadding(buckets, sched.page_size, bool(profile.padding.get("dense_attention", True)))
    capacity = None
    num_pages = sched.num_pages
    if cfg.sim.num_pages > 0:
        num_pages = cfg.sim.num_pages
    elif hw.kind != "cpu":
        capacity = kv_cache_capacity_tokens(model, hw, cfg.sim.tp, cfg.sim.pp, cfg.sim.gpu_memory_utilization,
                                            max_num_batched_tokens=sched.token_budget,
                                            max_num_seqs=sched.max_num_seqs)
        num_pages = capacity // sched.page_size
    changes = {}
    if num_pages != sched.num_pages:
        changes["num_pages"] = num_pages
    if hasattr(sched, "vocab_size") and not sched.vocab_size:
        changes["vocab_size"] = model.vocab_size     # as run_real: out-of-vocabulary prompts are rejected
    sched_cfg = dataclasses.replace(sched, **changes) if changes else sched
    return SimSetup(model=model, hardware=hw, params=params, profile=profile_name, padding=padding,
                    scheduler_config=sched_cfg, kv_capacity_tokens=capacity)


def build_instances(cfg, setup: SimSetup) -> List[SimInstance]:
    step_time = make_step_time(setup.model, setup.hardware, cfg.sim.tp, cfg.sim.pp, setup.params, setup.padding,
                               cfg.sim.num_microbatches)
    return [SimInstance(f"replica{i}", make_scheduler(setup.scheduler_config), step_time)
            for i in range(cfg.sim.num_replicas)]


def is_disaggregated(cfg) -> bool:
    deployment = getattr(cfg, "deployment", None)
    return deployment is not None and deployment.kind == "disaggregated"


def simulate_config(cfg, workload=None) -> Tuple[SimResult, SimSetup]:
    """Simulate a ServeConfig (workload: WorkloadRequests, default make_workload(cfg.workload, cfg.seed)).
    A disaggregated deployment returns pdjax.sim.disagg's (DisaggSimResult, DisaggSetup)."""
    from pdjax.workload import make_workload  # noqa: PLC0415

    if is_disaggregated(cfg):
        from pdjax.sim.disagg import simulate_disaggregated_config  # noqa: PLC0415
        return simulate_disaggregated_config(cfg, workload)

    setup = build_setup(cfg)
    if workload is None:
        workload = make_workload(cfg.workload, cfg.seed)
    offline = cfg.engine.mode == "offline"
    requests = [request_from_workload(wr, offline=offline) for wr in workload]
    instances = build_instances(cfg, setup)
    result = simulate(requests, instances, make_router(cfg.sim.router),
                      async_scheduling=bool(getattr(cfg.engine, "async_scheduling", False)))
    return result, setup


def sim_info(result: SimResult, setup: SimSetup, cfg) -> dict:
    if is_disaggregated(cfg):
        from pdjax.sim.disagg import disagg_sim_info  # noqa: PLC0415
        return disagg_sim_info(result, setup, cfg)
    return {
        "iterations_per_s": result.iterations_per_s,
        "wall_s": result.wall_s,
        "num_iterations": result.num_iterations,
        "simulated_duration_s": result.duration_s,
        "model": setup.model.name,
        "hardware": setup.hardware.name,
        "tp": cfg.sim.tp,
        "pp": cfg.sim.pp,
        "num_replicas": cfg.sim.num_replicas,
        "router": cfg.sim.router,
        "profile": setup.profile,
        "padding": dataclasses.asdict(setup.padding) if setup.padding else None,
        "num_pages": setup.scheduler_config.num_pages,
        "kv_capacity_tokens": setup.kv_capacity_tokens,
    }


def run_sim(cfg, config_dict, workdir: str, *, plots: bool = True, workload=None, extra=None) -> dict:
    """Simulate `cfg` (a ServeConfig) on `workload` (WorkloadRequests; default cfg's) and write the standard run
    outputs to `workdir`; `extra` joins results.json. Returns the summary."""
    from pdjax.metrics import write_run_outputs  # noqa: PLC0415

    result, setup = simulate_config(cfg, workload)
    engine = {"backend": "sim", "policy": cfg.scheduler.policy, "mode": cfg.engine.mode,
              "wall_s": result.wall_s, "num_iterations": result.num_iterations}
    if is_disaggregated(cfg):
        engine.update(deployment="disaggregated", policy="prefill_only+decode_only")
    extra = {**(extra or {}), "engine": engine, "sim": sim_info(result, setup, cfg)}
    return write_run_outputs(workdir, config_dict, result.requests, result.iterations, cfg.slo.as_dict(),
                             plots=plots, extra=extra)
