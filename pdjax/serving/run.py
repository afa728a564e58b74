"""One real-engine run of a validated ServeConfig: build the requests (files read, nothing compiled yet), build
the engine, warm up every compiled function the run will call, serve, write the outputs.

The run's "engine" block in results.json counts compiles as JAX reports them (pdjax.runtime.compiles): the
shapes built at warm-up, and `compiles_during_run`, which is 0 unless something escaped warm-up (the
iterations that compiled are flagged in iterations.csv).

Multi-controller runs (`coordinator`, pdjax.serving.distributed): every process builds, warms up and serves the
same engine (the coordinator makes their decisions identical; the request list is checked equal at the start);
all meet after warm-up (`wait_for_peers`: process 1 may compile far longer, JAX's persistent cache serving
process 0 only) and at a barrier after serving, so a process that died mid-run fails the others before anything is
written; then only process 0 writes the outputs (each file atomically), the others return the same summary.
"""
from __future__ import annotations

import hashlib

import os
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence

import jax
from tqdm import tqdm

import pdjax
from pdjax.config.deployment import instance_name, uses_host_kv
from pdjax.config.serving import ServeConfig
from pdjax.scheduler.admission import admission_report
from pdjax.scheduler.overload import has_overload
from pdjax.metrics import summarize_run, write_json, write_run_outputs
from pdjax.runtime import compiles
from pdjax.serving.build import build_engine, build_requests, default_buckets, resolve_checkpoint
from pdjax.serving.distributed import Coordinator
from pdjax.serving.online import WarmupCancelled

__all__ = ["run_real", "default_buckets", "resolve_checkpoint", "enable_compilation_cache"]


def enable_compilation_cache(cache_dir: str) -> str:
    """Turn on JAX's persistent compilation cache in `cache_dir` ('' = a per-user default), caching every
    executable however fast it compiled, so a second run with the same shapes loads instead of compiling.
    Returns the directory used."""
    if not cache_dir:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = os.path.join(base, "pdjax", "xla")
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


def progress_bar(cfg: ServeConfig, total: int, desc: str, unit: str):
    """A tqdm bar on a terminal when cfg.engine.progress; None otherwise (logs and pipes stay clean)."""
    if not (cfg.engine.progress and sys.stderr.isatty()):
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def _tick(bar) -> Optional[Callable[[int], None]]:
    return bar.update if bar is not None else None


def _instances(engine) -> list:
    """(name, role, runner, scheduler, num_iterations) of every instance of `engine` (a ColocatedEngine is one
    instance, 'replica0'; num_iterations is None there: the run's iteration count)."""
    if hasattr(engine, "instances"):
        return [(i.name, i.role, i.runner, i.scheduler, i.num_steps) for i in engine.instances]
    return [(instance_name("colocated", 0), "colocated", engine.runner, engine.scheduler, None)]


def _warm_up(engine, cfg: ServeConfig, cancelled: Callable[[], bool] = lambda: False) -> float:
    """Compile everything the run will execute: every step shape of every instance's runner (every pipeline
    stage), the swap copies when preemption swaps, and the KV transfer's page counts between every
    prefill/decode pair (every source stage's gather, every destination stage's scatter). Seconds taken.
    WarmupCancelled after the shape during which `cancelled()` turned true."""
    runners = [runner for _, _, runner, _, _ in _instances(engine)]
    swap = cfg.scheduler.preemption_mode == "swap" or uses_host_kv(cfg.deployment)   # host KV tier: swap copies
    bar = progress_bar(cfg, sum(r.buckets.num_shapes for r in runners), "warm-up", "shape")

    def progress(n: int) -> None:
        if cancelled():
            raise WarmupCancelled("stopped during warm-up: nothing was served")
        if bar is not None:
            bar.update(n)

    seconds = sum(r.warmup(swap=swap, progress=progress) for r in runners)
    if hasattr(engine, "warmup_transfers"):
        seconds += engine.warmup_transfers(cfg.scheduler.max_model_len)
    if bar is not None:
        bar.close()
    return seconds


def _request_fingerprint(requests) -> str:
    h = hashlib.sha256()
    for r in requests:
        h.update(repr((r.request_id, float(r.arrival_time), list(r.prompt_token_ids), r.sampling.max_tokens)).encode())
    return h.hexdigest()


def run_real(cfg: ServeConfig, config_dict: Dict[str, Any], workdir: str, *, workload: Optional[Sequence] = None,
             extra: Optional[Dict[str, Any]] = None, coordinator=None, online=None, hooks=None,
             plots: bool = True) -> Dict[str, Any]:
    """Serve `workload` (WorkloadRequests; default cfg's) on the real engine and write the run outputs to
    `workdir` (see pdjax.experiment.run for the checks before); `extra` joins results.json. Returns the summary.
    coordinator: pdjax.serving.distributed's, for a multi-process run (module docstring); None: one process.
    online: a front end serving requests as they come (pdjax.serving.api.bridge.EngineBridge; one process): the
    run's requests are those of `online.source` (pdjax.serving.online.OnlineSource) instead of `workload`,
    `online.on_token` gets every token, and `online.attach(engine)` is called once warm-up is done; the run ends
    when the source is closed and its requests finished, and `extra` is then read (the front end may fill it).
    hooks: an object with `after_warmup(engine)` (called once warm-up is done, outside the compile counts and the
    timed run) and `after_serve(engine, result)` (the EngineResult, before anything is written), e.g.
    pdjax.experiment.fidelity's calibration that brackets the run. plots: write the run's plots."""
    coordinator = coordinator if coordinator is not None else Coordinator()
    requests = build_requests(cfg, workload) if online is None else []
    coordinator.check_same("request list", _request_fingerprint(requests))
    if cfg.engine.compilation_cache:
        enable_compilation_cache(cfg.engine.compilation_cache_dir)
    engine = build_engine(cfg, compile_counter=compiles.count,    # a UserError for anything cfg cannot build
                          on_token=online.on_token if online else None)
    if hasattr(engine, "check_requests"):
        engine.check_requests(requests)      # before warm-up compiles anything
    engine.coordinator = coordinator
    mark = compiles.count()
    cancelled = (lambda: online.source.closed) if online is not None else (lambda: False)
    compile_s = _warm_up(engine, cfg, cancelled) if cfg.engine.warmup else 0.0
    num_shapes = compiles.count() - mark
    if hooks is not None:
        hooks.after_warmup(engine)
    # Serving starts together: a peer still compiling would stall the first step that needs it (distributed).
    peer_wait_s = coordinator.wait_for_peers("warmed-up", "its warm-up compiles")
    warm_mark = compiles.count()
    bar = progress_bar(cfg, len(requests), f"serve {cfg.scheduler.policy}", "req") if online is None else None
    startup_s = time.time() - pdjax.IMPORT_TIME
    start = time.perf_counter()
    if online is not None:
        online.attach(engine)
        result = engine.run([], source=online.source)
    else:
        result = engine.run(requests, progress=_tick(bar))
    if bar is not None:
        bar.close()
    coordinator.barrier("served")    # every process finished serving (a dead one fails this): results may go out
    coordinator.done()               # processes may now end at different times (pdjax.serving.distributed)
    during = compiles.since(warm_mark)
    info = {
        "backend": "real", "deployment": cfg.deployment.kind, "policy": cfg.scheduler.policy,
        "mode": cfg.engine.mode, "async_scheduling": cfg.engine.async_scheduling, "compile_s": compile_s,
        "startup_s": startup_s, "num_compiled_shapes": num_shapes, "compiles_during_run": len(during),
        "compiled_during_run": sorted({e.fun_name for e in during}),
        "wall_s": time.perf_counter() - start, "host_overlap_s": result.host_overlap_s,
        "num_iterations": len(result.iterations), **_layout_info(cfg, engine, result, coordinator)}
    if coordinator.num_processes > 1:
        info["peer_warmup_wait_s"] = peer_wait_s     # this process waited for its peers' warm-up
    if hooks is not None:
        hooks.after_serve(engine, result)
    return _write(cfg, config_dict, workdir, result, {**(extra or {}), "engine": info}, coordinator, plots)


def _layout_info(cfg: ServeConfig, engine, result, coordinator) -> Dict[str, Any]:
    """The engine block's instances, KV transfers, mixed pool and process count."""
    info: Dict[str, Any] = {"instances": {
        name: {"role": role, "devices": [d.id for d in runner.mesh.devices.flat],
               "tp": int(runner.mesh.shape["tensor"]), "pp": int(runner.mesh.shape["stage"]),
               "num_pages": sched.config.num_pages, "token_budget": sched.config.token_budget,
               "num_iterations": len(result.iterations) if steps is None else steps}
        for name, role, runner, sched, steps in _instances(engine)}}
    cost = getattr(getattr(engine, "entry_router", None), "cost", None)
    if hasattr(cost, "describe"):     # kv_centric's measured cost: the fitted step model per instance
        info["router_cost"] = cost.describe()
    if cfg.deployment.kind == "disaggregated":
        info["kv_transfer"] = result.transfer_summary()
        pool = getattr(engine, "pool", None)
        if pool is not None and (pool.active or has_overload(cfg.deployment)):   # phase changes / moves / flips
            info["mixed_pool"] = pool.summary()
        if has_overload(cfg.deployment):    # early rejection / rebalancing counts (pdjax.scheduler.admission)
            info["overload"] = admission_report(result.requests, result.iterations,
                                                cfg.deployment.instance_names("decode"))
    if coordinator.num_processes > 1:
        info["num_processes"] = coordinator.num_processes
    return info


def _write(cfg: ServeConfig, config_dict, workdir: str, result, extra: Dict[str, Any], coordinator,
           plots: bool) -> Dict[str, Any]:
    """Process 0 writes the outputs and returns the summary; the others return the same summary unwritten."""
    if not coordinator.is_main:    # only process 0 writes
        summary = summarize_run(result.requests, result.iterations, cfg.slo.as_dict())
        summary.update(extra)
        return summary
    # Before results.json (written last, the "run is complete" marker): the generated token ids per request.
    os.makedirs(workdir, exist_ok=True)
    write_json(os.path.join(workdir, "outputs.json"), result.output_tokens)
    return write_run_outputs(workdir, config_dict, result.requests, result.iterations, cfg.slo.as_dict(),
                             plots=plots, extra=extra)
