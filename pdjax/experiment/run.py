"""Run one serving experiment from a config dict on the backend it names, writing the standard run outputs.

Two phases, so every user error surfaces in the first second, before anything is compiled or simulated:
`prepare_experiment` validates the config, makes the workdir ready (pdjax.metrics.prepare_run_dir) and builds
the workload (reading trace and text files); `run_prepared` runs it. Both backends get the same workload and
record in results.json under "workload" what was done to the source's lengths (scaling, caps).

Several processes (multi-controller JAX, pdjax.serving.distributed): every process prepares and runs the same
experiment; only process 0 touches the workdir (`prepare_experiment(..., is_main=False)` leaves it alone) and
writes the outputs; a simulator run happens on process 0 only.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, List, Mapping

from pdjax.config.serving import ServeConfig, serve_config_from_dict
from pdjax.config.validate import check_config_against_model, check_max_model_len, model_spec_for
from pdjax.errors import user_errors
from pdjax.metrics import prepare_run_dir
from pdjax.sim.build import build_setup
from pdjax.sim.run import run_sim
from pdjax.workload import length_report, make_workload


def to_plain_dict(config: Any) -> dict:
    """A ConfigDict (or mapping) as nested plain dicts and lists."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        return {k: to_plain_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_plain_dict(v) for v in config]
    return config


@dataclasses.dataclass
class PreparedExperiment:
    cfg: ServeConfig
    config: Dict[str, Any]          # the plain config dict, written to config.json
    workdir: str
    workload: List[Any]             # WorkloadRequests
    length_report: Dict[str, Any]   # pdjax.workload.length_report


def resolve_config(config: Any) -> ServeConfig:
    """The validated ServeConfig of `config` (configs/serve.py layout): every block, the cross-block rules, and the
    model rules when the config alone tells the model (pdjax.config.validate). ValueError naming the bad key; a
    context beyond the model's positions is named as such even where a block's own rule fails first on it (the
    scheduler's pages for one max-length request)."""
    d = to_plain_dict(config)
    try:
        cfg = serve_config_from_dict(d)
    except ValueError:
        _context_beyond_the_model(d)
        raise
    check_config_against_model(cfg)
    return cfg


def _context_beyond_the_model(d: Mapping[str, Any]) -> None:
    """Raise the model's position limit when the raw config's scheduler.max_model_len exceeds it (and the config
    alone tells the model); nothing otherwise."""
    max_len = (d.get("scheduler") or {}).get("max_model_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool):
        return
    view = types.SimpleNamespace(backend=d.get("backend", "real"),
                                 sim=types.SimpleNamespace(model=(d.get("sim") or {}).get("model", "")),
                                 model=types.SimpleNamespace(checkpoint=(d.get("model") or {}).get("checkpoint", "")))
    try:
        spec = model_spec_for(view)
    except (ValueError, TypeError):
        return
    if spec is not None:
        check_max_model_len(max_len, spec)


def prepare_experiment(config: Any, workdir: str, *, is_main: bool = True) -> PreparedExperiment:
    """Validate `config` (configs/serve.py layout; for the simulator also its setup: hardware, cost profile, the
    deployment against the model), ready `workdir` (only when `is_main`: process 0 of a multi-process run), build
    the workload. Raises UserError (pdjax.errors; a ValueError) naming the bad key, value or path; nothing has
    been run or compiled then. (The real backend's checkpoint and deployment are checked when its engine is
    built, before warm-up: pdjax.serving.build.build_engine raises UserError too.)"""
    with user_errors():
        config = to_plain_dict(config)
        cfg = resolve_config(config)   # every block, the cross-block rules, the model's when the config tells it
        if cfg.backend == "sim":     # hardware, cost profile (missing or malformed: named), the deployment vs. model
            build_setup(cfg)
        if is_main:
            prepare_run_dir(workdir)
        workload = make_workload(cfg.workload, seed=cfg.seed)
    return PreparedExperiment(cfg, config, workdir, workload, length_report(cfg.workload, workload))


def run_prepared(prep: PreparedExperiment, coordinator=None) -> dict:
    """Run a prepared experiment on its backend, write its outputs; returns the summary (results.json).
    coordinator: a multi-process run's (pdjax.serving.distributed); None: one process."""
    extra = {"workload": prep.length_report}
    if prep.cfg.backend == "real":
        from pdjax.serving.run import run_real  # noqa: PLC0415 (loads JAX; the sim path must not)
        return run_real(prep.cfg, prep.config, prep.workdir, workload=prep.workload, extra=extra,
                        coordinator=coordinator)
    if coordinator is not None and not coordinator.is_main:
        return {}    # the simulator runs on process 0 only
    return run_sim(prep.cfg, prep.config, prep.workdir, workload=prep.workload, extra=extra)


def run_experiment(config: Any, workdir: str) -> dict:
    """prepare_experiment then run_prepared; returns the summary."""
    return run_prepared(prepare_experiment(config, workdir))
