"""pdjax.sim: the simulator (no JAX): hardware specs, the analytical cost model, calibration, and a discrete-event
simulator that drives the unmodified schedulers.

hardware     HardwareSpec registry (datasheet peaks, links) and host_cpu() measured at call time.
cost_model   BatchComposition, CostParams, iteration_time -> CostBreakdown, kv_bytes, kv_cache_capacity_tokens.
profile      Profile: one machine profile (cost params, padding, step noise), load_profile by name or path.
calibration  the fits that make profiles: whole iterations (engine_profile), operator data (fit_operator_profile).
step_cost    the engine's padding (buckets) on top of the cost model, step noise, make_step_time.
simulator    simulate(requests, instances, router): the engine loop (sync or async) on a virtual clock.
disagg       simulate_disaggregated: prefill and decode pools with KV transfers over the hardware's links.
build        config -> parts: model, hardware, cost setup, instances of cfg.deployment, router, transfer times.
run          run_sim(cfg, config_dict, workdir): build -> simulate -> outputs, the `backend=sim` of
             experiments.serve and sweeps.
capacity     parallel_capacity_search: DESIGN.md §4 capacity by bisection, probes in parallel processes.
profiles/    shipped machine profiles (a100.json: `python -m experiments.fit_a100`; host-cpu.json:
             `python -m experiments.calibrate`).
"""
from pdjax.sim.calibration import fit_cost_params
from pdjax.sim.capacity import parallel_capacity_search
from pdjax.sim.cost_model import (BatchComposition, CostBreakdown, CostParams, iteration_time, kv_bytes,
                                  kv_cache_capacity_tokens, step_time_fn)
from pdjax.sim.build import build_setup
from pdjax.sim.disagg import simulate_disaggregated
from pdjax.sim.hardware import HARDWARE_SPECS, HardwareSpec, get_hardware_spec, host_cpu
from pdjax.sim.run import run_sim
from pdjax.sim.simulator import SimInstance, SimResult, simulate
from pdjax.sim.profile import Profile, load_profile, save_profile
from pdjax.sim.step_cost import make_step_time

__all__ = ["BatchComposition", "CostBreakdown", "CostParams", "HARDWARE_SPECS", "HardwareSpec", "Profile",
           "SimInstance", "SimResult", "build_setup", "fit_cost_params", "get_hardware_spec", "host_cpu",
           "iteration_time", "kv_bytes", "kv_cache_capacity_tokens", "load_profile",
           "make_step_time", "parallel_capacity_search", "run_sim", "save_profile", "simulate",
           "simulate_disaggregated", "step_time_fn"]
