"""pdjax.sim: the simulator's foundations (no JAX): hardware specs, the analytical cost model, calibration.

hardware     HardwareSpec registry (datasheet peaks, links) and host_cpu() measured at call time.
cost_model   BatchComposition, CostParams, iteration_time -> CostBreakdown, kv_bytes, kv_cache_capacity_tokens.
calibration  fit_cost_params (whole iterations), fit_vidur_a100 (operator profiles), machine-profile JSON.
profiles/    shipped machine profiles (a100.json from `python -m experiments.fit_a100`).
"""
from pdjax.sim.calibration import MachineProfile, fit_cost_params, load_profile, save_profile
from pdjax.sim.cost_model import (BatchComposition, CostBreakdown, CostParams, iteration_time, kv_bytes,
                                  kv_cache_capacity_tokens, step_time_fn)
from pdjax.sim.hardware import HARDWARE_SPECS, HardwareSpec, get_hardware_spec, host_cpu

__all__ = ["BatchComposition", "CostBreakdown", "CostParams", "HARDWARE_SPECS", "HardwareSpec", "MachineProfile",
           "fit_cost_params", "get_hardware_spec", "host_cpu", "iteration_time", "kv_bytes",
           "kv_cache_capacity_tokens", "load_profile", "save_profile", "step_time_fn"]
