"""From a validated ServeConfig to the parts the real engines take: weights, runners on their meshes, schedulers,
the requests. The engines (engine.py, cluster.py, disagg.py) take built parts and know nothing of configs; run.py
composes build -> warm-up -> engine -> outputs.

Every instance of a deployment group (num_instances, pp, tp) gets a (data=1, stage=pp, tensor=tp) mesh of its
assigned devices: a PipelineRunner when pp > 1 (each stage a TP group holding its layers), a ModelRunner when
pp == 1. One colocated instance runs on ColocatedEngine; colocated replicas and disaggregated groups run on the
one multi-instance loop (pdjax.serving.cluster.ClusterEngine; DisaggregatedEngine is its prefill/decode form, with
the mixed group, when deployment.mixed has instances, as its Splitwise mixed pool: MixedScheduler instances
'mixed0', ... and the deployment's thresholds; with deployment.mixed_pool='borrow', no mixed group: the prefill and
decode instances run BorrowingSchedulers and are borrowed into the mixed pool, pdjax.scheduler.mixed).
Batches in flight: every pipelined instance keeps up to pp batches
in flight, on either engine (ColocatedEngine's max_in_flight = the runner's pp, except with async scheduling,
which keeps one; ClusterEngine's per-instance batch queues default to each runner's pp, one without
engine.overlap).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import List, Optional, Sequence

import jax

from pdjax.config.buckets import Buckets, engine_buckets
from pdjax.config.deployment import instance_scheduler_config, uses_kv_centric
from pdjax.config.serving import ServeConfig
from pdjax.config.validate import check_against_model, check_group_hardware, model_spec_for
from pdjax.errors import user_errors
from pdjax.models.checkpoint import load_model
from pdjax.runtime import aot
from pdjax.runtime.mesh import make_mesh
from pdjax.runtime.pipeline import PipelineRunner
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, request_from_workload
from pdjax.scheduler.instances import make_role_scheduler
from pdjax.scheduler.mixed import make_borrowing_scheduler
from pdjax.scheduler.overload import has_overload, overload_pool_factory, overload_scheduler_maker
from pdjax.serving.cluster import ClusterEngine, Instance
from pdjax.serving.disagg import DisaggregatedEngine
from pdjax.serving.engine import ColocatedEngine, TokenCallback
from pdjax.serving.kv_tier import attach_engine_kv, router_options
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
    """The step's shape buckets for `cfg` (pdjax.config.buckets.engine_buckets; the simulator pads the same). An
    explicit list holds every step the scheduler can make: a ServeConfig guarantees it
    (pdjax.config.validate.check_buckets_hold, for both backends)."""
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
    # model.dtype 'auto': the checkpoint's own dtype (load_model's None), float32 on the CPU engine (resolve_dtype)
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else None
    return load_model(resolve_checkpoint(cfg.model.checkpoint), dtype=dtype, seed=cfg.seed,
                      verify_checksums=cfg.model.verify_checksums)


def _scheduler_config(cfg: ServeConfig, spec):
    """cfg.scheduler with vocab_size filled from the model, so out-of-vocabulary prompts are rejected by the
    scheduler instead of failing the step."""
    if cfg.scheduler.vocab_size:
        return cfg.scheduler
    return dataclasses.replace(cfg.scheduler, vocab_size=spec.vocab_size)


def build_runner(cfg: ServeConfig, *, seed: Optional[int] = None, spec=None, params=None, mesh=None):
    """The runner of `cfg` (checkpoint or dummy weights), KV cache sized by cfg.scheduler: a PipelineRunner when
    `mesh` has stage > 1 (pp pipeline stages, each a TP group), else a ModelRunner (default mesh: one device)."""
    if params is None:
        spec, params = load_weights(cfg if seed is None else dataclasses.replace(cfg, seed=seed))
    sc = cfg.scheduler
    cls = PipelineRunner if mesh is not None and int(mesh.shape["stage"]) > 1 else ModelRunner
    return cls(spec, params, num_pages=sc.num_pages, page_size=sc.page_size, buckets=default_buckets(cfg),
               attention_impl=cfg.model.attention_impl, max_model_len=sc.max_model_len, mesh=mesh)


def fit_kv_cache(cfg: ServeConfig, spec, mesh, dtype, *, where: str) -> ServeConfig:
    """cfg with its KV cache sized for `mesh`'s devices, before anything of the run compiles: scheduler.num_pages = 0
    becomes the most pages that fit engine.kv_memory_utilization of the devices' memory (pdjax.runtime.aot
    .plan_num_pages: compiles of the largest bucket); a given num_pages is checked against the devices' memory
    (weights + KV; `aot.kv_cache_pages`). ValueError (one line: model, group, bytes needed and available) when it cannot
    fit. Devices that report no memory size (CPU) check nothing, and refuse num_pages = 0."""
    sc = cfg.scheduler
    pages, _ = aot.kv_cache_pages(spec, cfg.model.attention_impl, mesh, default_buckets(cfg), num_pages=sc.num_pages,
                                  page_size=sc.page_size, max_model_len=sc.max_model_len, dtype=dtype,
                                  utilization=cfg.engine.kv_memory_utilization, where=where)
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(sc, num_pages=pages))


def build_instances(cfg: ServeConfig, *, devices: Optional[Sequence] = None, params=None, spec=None
                    ) -> List[Instance]:
    """Every instance of cfg.deployment (colocated replicas, or prefill, decode, then mixed instances), in name order:
    each a runner on a (data=1, stage=pp, tensor=tp) mesh of exactly its assigned devices
    (`deployment.device_assignment`; every device runs a stage's TP shard, none holds an idle copy) and a
    scheduler from `instance_scheduler_config`. Raises ValueError naming the group when a layout cannot run
    (pp above the layer count, tp not dividing heads / KV heads / MLP width).

    devices: the device list indices refer to (default jax.devices()). params/spec: weights to use instead of
    loading cfg.model.checkpoint (tests share one set)."""
    dep = cfg.deployment
    devices = list(jax.devices() if devices is None else devices)
    check_group_hardware(dep, devices[0].device_kind)
    if params is None:
        spec, params = load_weights(cfg)
    elif spec is None:
        raise ValueError("params given without their spec")
    assignment = check_against_model(cfg, spec, len(devices))   # max_model_len, pp <= layers, tp | heads, devices
    base = _scheduler_config(cfg, spec)
    make_sched = make_borrowing_scheduler if dep.borrows else make_role_scheduler
    if has_overload(dep):
        make_sched = overload_scheduler_maker(dep)      # rebalancing: BorrowingSchedulers kept in their role's pool
    instances = []
    for role in dep.roles:
        group = dep.group(role)
        inst_cfg = dataclasses.replace(cfg, scheduler=instance_scheduler_config(base, group, role))
        for name in dep.instance_names(role):
            ids = list(assignment[name])
            if len(ids) != group.pp * group.tp:
                raise ValueError(f"{name}: assigned devices {ids}, expected pp x tp = {group.pp} x {group.tp} = "
                                 f"{group.pp * group.tp} (every device must run a stage's TP shard)")
            mesh = make_mesh([devices[d] for d in ids], dp=1, pp=group.pp, tp=group.tp)
            inst_cfg = fit_kv_cache(inst_cfg, spec, mesh, params.embed.dtype, where=f"deployment.{role}")
            runner = build_runner(inst_cfg, spec=spec, params=params, mesh=mesh)
            instances.append(Instance(name, role, runner, make_sched(role, inst_cfg.scheduler)))
    return instances


def build_engine(cfg: ServeConfig, *, devices: Optional[Sequence] = None, params=None, spec=None,
                 on_token: Optional[TokenCallback] = None, compile_counter=None):
    """The engine of cfg.deployment: a ColocatedEngine (sync or async scheduling) for one colocated instance,
    a ClusterEngine of colocated replicas behind the router for several, a DisaggregatedEngine (the
    ClusterEngine of prefill and decode instances) for a disaggregated deployment. Arguments as build_instances.

    Nothing is compiled yet, so whatever in `cfg` cannot be built is the user's input, and raises UserError (the
    ValueError or OSError found, as its __cause__): the checkpoint (missing, malformed, truncated), the model
    spec or dtype, the deployment against the model and the devices, the buckets, async scheduling where it
    cannot run."""
    with user_errors():
        return _build_engine(cfg, devices=devices, params=params, spec=spec, on_token=on_token,
                             compile_counter=compile_counter)


def _build_engine(cfg: ServeConfig, *, devices, params, spec, on_token, compile_counter):
    dep, ec = cfg.deployment, cfg.engine
    instances = build_instances(cfg, devices=devices, params=params, spec=spec)
    if uses_kv_centric(dep):     # host KV tiers, partial transfer, the routers' options (issue 30; serving.kv_tier)
        spec = spec if spec is not None else model_spec_for(cfg, simulator=False)
        attach_engine_kv(instances, dep, spec)
    common = dict(on_token=on_token, compile_counter=compile_counter, fail_on_compile=ec.fail_on_compile)
    if dep.kind == "colocated" and len(instances) == 1:
        (inst,) = instances
        # A pipelined instance keeps one batch in flight per stage (async scheduling keeps one: see engine.py).
        in_flight = 1 if ec.async_scheduling else getattr(inst.runner, "pp", 1)
        return ColocatedEngine(inst.runner, inst.scheduler, async_scheduling=ec.async_scheduling,
                               max_in_flight=in_flight, **common)
    # Multi-instance loop: each instance keeps up to its runner's pp batches in flight (max_in_flight=None).
    if dep.kind == "colocated":
        return ClusterEngine(instances, router=dep.router, overlap=ec.overlap,
                             router_options=router_options(dep, spec=spec), **common)
    return DisaggregatedEngine([i for i in instances if i.role == "prefill"],
                               [i for i in instances if i.role == "decode"], router=dep.router,
                               router_options=router_options(dep, spec=spec),
                               overlap=ec.overlap, mixed=[i for i in instances if i.role == "mixed"],
                               mixed_prefill_queue_tokens=dep.mixed_prefill_queue_tokens,
                               mixed_decode_load=float(dep.mixed_decode_load), mixed_pool=dep.mixed_pool,
                               pool_factory=overload_pool_factory(dep, cfg.slo), **common)


def build_colocated_engine(cfg: ServeConfig, *, on_token: Optional[TokenCallback] = None, compile_counter=None,
                           **kwargs):
    """build_engine for a 'colocated' deployment: ColocatedEngine (one instance) or ClusterEngine (replicas)."""
    if cfg.deployment.kind != "colocated":
        raise ValueError(f"deployment.kind={cfg.deployment.kind!r}: build_colocated_engine needs 'colocated'")
    return build_engine(cfg, on_token=on_token, compile_counter=compile_counter, **kwargs)


def build_disaggregated_engine(cfg: ServeConfig, *, devices: Optional[Sequence] = None, params=None, spec=None,
                               on_token: Optional[TokenCallback] = None,
                               compile_counter=None) -> DisaggregatedEngine:
    """build_engine for a 'disaggregated' deployment: one runner per instance on its own (1, pp, tp) mesh
    (devices from `deployment.device_assignment`), schedulers from `instance_scheduler_config`."""
    if cfg.deployment.kind != "disaggregated":
        raise ValueError(f"deployment.kind={cfg.deployment.kind!r}: build_disaggregated_engine needs 'disaggregated'")
    return build_engine(cfg, devices=devices, params=params, spec=spec, on_token=on_token,
                        compile_counter=compile_counter)
