"""From a validated ServeConfig to the parts the real engines take: weights, runners on their meshes, schedulers,
the requests. The engines (engine.py, disagg.py) take built parts and know nothing of configs; run.py composes
build -> warm-up -> engine -> outputs.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import List, Optional, Sequence

from pdjax.config.buckets import Buckets, engine_buckets
from pdjax.config.serving import ServeConfig
from pdjax.scheduler import Request, make_scheduler, request_from_workload
from pdjax.serving.disagg import DisaggregatedEngine, Instance
from pdjax.serving.engine import ColocatedEngine, TokenCallback
from pdjax.workload import make_workload

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def resolve_checkpoint(checkpoint: str) -> str:
    """A relative checkpoint path is looked up in the working directory, then in the repo root (so the
    default config works from anywhere); anything else (a spec name) is returned unchanged."""
    if os.path.isabs(checkpoint) or os.path.exists(checkpoint):
        return checkpoint
    candidate = REPO_ROOT / checkpoint
    return str(candidate) if candidate.exists() else checkpoint


def default_buckets(cfg: ServeConfig) -> Buckets:
    """The step's shape buckets for `cfg` (pdjax.config.buckets.engine_buckets; the simulator pads the same)."""
    sc, ec = cfg.scheduler, cfg.engine
    return engine_buckets(sc.token_budget, sc.max_num_seqs, sc.max_model_len, sc.page_size,
                          ec.token_buckets, ec.seq_buckets, ec.page_buckets)


def build_requests(cfg: ServeConfig, workload: Optional[Sequence] = None) -> List[Request]:
    """The scheduler Requests of `workload` (WorkloadRequests; default: cfg's workload, built here, reading the
    trace / text files, so a bad path fails before anything compiles)."""
    offline = cfg.engine.mode == "offline"
    if workload is None:
        workload = make_workload(cfg.workload, seed=cfg.seed)
    return [request_from_workload(w, eos_token_id=cfg.model.eos_token_id, offline=offline, seed=cfg.seed)
            for w in workload]


def load_weights(cfg: ServeConfig):
    """(spec, params) of cfg.model: a checkpoint directory, or dummy weights for a registry spec name."""
    from pdjax.models.checkpoint import load_model  # noqa: PLC0415
    return load_model(resolve_checkpoint(cfg.model.checkpoint), dtype=cfg.model.dtype, seed=cfg.seed)


def _scheduler_config(cfg: ServeConfig, spec):
    """cfg.scheduler with vocab_size filled from the model, so out-of-vocabulary prompts are rejected by the
    scheduler instead of failing the step."""
    if cfg.scheduler.vocab_size:
        return cfg.scheduler
    return dataclasses.replace(cfg.scheduler, vocab_size=spec.vocab_size)


def build_runner(cfg: ServeConfig, *, seed: Optional[int] = None, spec=None, params=None, mesh=None):
    """The ModelRunner of `cfg` (checkpoint or dummy weights), KV cache sized by cfg.scheduler."""
    from pdjax.runtime.runner import ModelRunner  # noqa: PLC0415
    if params is None:
        spec, params = load_weights(cfg if seed is None else dataclasses.replace(cfg, seed=seed))
    sc = cfg.scheduler
    return ModelRunner(spec, params, num_pages=sc.num_pages, page_size=sc.page_size,
                       buckets=default_buckets(cfg), attention_impl=cfg.model.attention_impl,
                       max_model_len=sc.max_model_len, mesh=mesh)


def build_colocated_engine(cfg: ServeConfig, *, on_token: Optional[TokenCallback] = None,
                           compile_counter=None) -> ColocatedEngine:
    runner = build_runner(cfg)
    return ColocatedEngine(runner, make_scheduler(_scheduler_config(cfg, runner.spec)), on_token=on_token,
                           async_scheduling=cfg.engine.async_scheduling, compile_counter=compile_counter,
                           fail_on_compile=cfg.engine.fail_on_compile)


def build_disaggregated_engine(cfg: ServeConfig, *, devices: Optional[Sequence] = None, params=None, spec=None,
                               on_token: Optional[TokenCallback] = None,
                               compile_counter=None) -> DisaggregatedEngine:
    """The engine of a ServeConfig whose `deployment.kind` is 'disaggregated': one ModelRunner per instance on
    its own mesh (devices from `deployment.device_assignment`), schedulers from `instance_scheduler_config`.

    devices: the device list indices refer to (default jax.devices()). params/spec: weights to use instead of
    loading cfg.model.checkpoint (tests share one set)."""
    import jax  # noqa: PLC0415
    from pdjax.config.deployment import instance_scheduler_config, validate_deployment  # noqa: PLC0415
    from pdjax.runtime.mesh import make_mesh  # noqa: PLC0415

    dep = cfg.deployment
    if dep.kind != "disaggregated":
        raise ValueError(f"deployment.kind={dep.kind!r}: build_disaggregated_engine needs 'disaggregated'")
    if params is None:
        spec, params = load_weights(cfg)
    elif spec is None:
        raise ValueError("params given without their spec")
    devices = list(jax.devices() if devices is None else devices)
    assignment = validate_deployment(dep, spec, len(devices))
    base = _scheduler_config(cfg, spec)
    groups = {"prefill": [], "decode": []}
    for role in ("prefill", "decode"):
        group = getattr(dep, role)
        inst_cfg = dataclasses.replace(cfg, scheduler=instance_scheduler_config(base, group, role))
        for name in dep.instance_names(role):
            mesh = make_mesh([devices[i] for i in assignment[name]], dp=group.dp, pp=group.pp, tp=group.tp)
            runner = build_runner(inst_cfg, spec=spec, params=params, mesh=mesh)
            groups[role].append(Instance(name, role, runner, make_scheduler(inst_cfg.scheduler)))
    return DisaggregatedEngine(groups["prefill"], groups["decode"], router=dep.router,
                               overlap=cfg.engine.overlap, on_token=on_token, compile_counter=compile_counter,
                               fail_on_compile=cfg.engine.fail_on_compile)
