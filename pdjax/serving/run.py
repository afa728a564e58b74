"""From a validated ServeConfig to a finished real-engine run: model, runner, scheduler, workload, outputs."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Any, Dict, Optional

from pdjax.config.buckets import Buckets, engine_buckets
from pdjax.config.serving import ServeConfig
from pdjax.metrics import write_json, write_run_outputs
from pdjax.scheduler import make_scheduler
from pdjax.scheduler import request_from_workload
from pdjax.serving.engine import ColocatedEngine
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


def build_runner(cfg: ServeConfig, *, seed: Optional[int] = None):
    """The ModelRunner of `cfg` (checkpoint or dummy weights), KV cache sized by cfg.scheduler."""
    from pdjax.models.checkpoint import load_model  # noqa: PLC0415
    from pdjax.runtime.runner import ModelRunner  # noqa: PLC0415
    spec, params = load_model(resolve_checkpoint(cfg.model.checkpoint), dtype=cfg.model.dtype,
                              seed=cfg.seed if seed is None else seed)
    sc = cfg.scheduler
    return ModelRunner(spec, params, num_pages=sc.num_pages, page_size=sc.page_size,
                       buckets=default_buckets(cfg), attention_impl=cfg.model.attention_impl,
                       max_model_len=sc.max_model_len)


def run_real(cfg: ServeConfig, config_dict: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    """Serve cfg's workload on the real engine and write the run outputs to `workdir`; returns the summary."""
    if cfg.deployment.kind == "disaggregated":
        from pdjax.serving.disagg import run_disaggregated  # noqa: PLC0415
        return run_disaggregated(cfg, config_dict, workdir)
    runner = build_runner(cfg)
    compile_s = runner.warmup() if cfg.engine.warmup else 0.0
    compiles_at_start = runner.compile_count
    sched_cfg = cfg.scheduler
    if not sched_cfg.vocab_size:   # reject out-of-vocabulary prompts instead of failing the step
        sched_cfg = dataclasses.replace(sched_cfg, vocab_size=runner.spec.vocab_size)
    scheduler = make_scheduler(sched_cfg)
    offline = cfg.engine.mode == "offline"
    workload = make_workload(cfg.workload, seed=cfg.seed)
    requests = [request_from_workload(w, eos_token_id=cfg.model.eos_token_id, offline=offline, seed=cfg.seed)
                for w in workload]
    engine = ColocatedEngine(runner, scheduler, async_scheduling=cfg.engine.async_scheduling)
    bar = None
    if cfg.engine.progress:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=len(requests), desc=f"serve {cfg.scheduler.policy}", unit="req")
    start = time.perf_counter()
    result = engine.run(requests, progress=bar.update if bar is not None else None)
    if bar is not None:
        bar.close()
    extra = {"engine": {
        "backend": "real", "policy": cfg.scheduler.policy, "mode": cfg.engine.mode,
        "async_scheduling": cfg.engine.async_scheduling, "compile_s": compile_s, "num_compiled_shapes": compiles_at_start,
        "compiles_during_run": runner.compile_count - compiles_at_start,
        "wall_s": time.perf_counter() - start, "host_overlap_s": result.host_overlap_s,
        "num_iterations": len(result.iterations)}}
    # Before results.json (written last, the "run is complete" marker): the generated token ids per request.
    os.makedirs(workdir, exist_ok=True)
    write_json(os.path.join(workdir, "outputs.json"), result.output_tokens)
    return write_run_outputs(workdir, config_dict, result.requests, result.iterations, cfg.slo.as_dict(),
                             extra=extra)
