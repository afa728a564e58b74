"""Before you book a pod: compile every step a serving config would run, for the accelerators it names, on this host.

`compile_deployment(cfg, devices_by_role)` takes a validated ServeConfig (the same file and deployment block as
`experiments.serve`) and, per deployment group, the devices its instances take (a TPU topology's compile-only
devices: pdjax.runtime.aot.topology_devices), and compiles what the real engine would compile at warm-up: every
(T, S, P) bucket of the group's step (pdjax.config.buckets.engine_buckets of the group's scheduler settings),
every pipeline stage, with abstract weights of the model's spec (nothing is loaded or allocated). Replicas of a
group run the same program on other devices, so the group's first instance is compiled for all of them.

Per group it reports the per-device HBM of each compiled step (weights, KV cache, temporaries, total) against the
hardware's HBM (pdjax.sim.hardware, the simulator's own specs), whether it fits, and the KV pages that fit at
`utilization` (vLLM's gpu_memory_utilization): the group's num_pages when the config sets it, else the planned
value, with which the steps are then compiled. A group whose weights (plus one max-length request's KV) cannot fit
is refused in one line naming the model, the group, the bytes needed and the bytes there are, without compiling.
Nothing stops at the first failure: every group and bucket is reported.

`compare_with_sim` puts XLA's per-device FLOPs and bytes next to the cost model's exact counts of the same work
(pdjax.sim.cost_model.step_counts) and XLA's optimal_seconds next to the simulator's step time of the bucket's
ceiling batch (`ceiling_batch`).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import jax

from pdjax.config.buckets import engine_buckets
from pdjax.config.deployment import check_group_against_model, instance_scheduler_config
from pdjax.config.model_specs import resolve_dtype
from pdjax.config.pipeline import stage_layer_ranges
from pdjax.config.serving import ServeConfig
from pdjax.config.validate import check_max_model_len, hardware_name_of, model_spec_for
from pdjax.models.llama import jnp_dtype
from pdjax.runtime import aot
from pdjax.runtime import mesh as mesh_lib
from pdjax.sim import cost_model
from pdjax.sim.hardware import get_hardware_spec

GiB = 2 ** 30


def instance_devices(cfg: ServeConfig, devices_by_role: Dict[str, Sequence]) -> Dict[str, List]:
    """Instance name -> its devices. When every role has the same device list (one topology), the deployment's own
    assignment places them, as the real engine does (deployment.device_assignment: explicit `devices`, else
    prefill first, then decode); otherwise each role's instances take the next free devices of their role's list."""
    dep = cfg.deployment
    lists = [devices_by_role[r] for r in dep.roles]
    if all(devices is lists[0] for devices in lists):
        return {name: [lists[0][i] for i in ids] for name, ids in dep.device_assignment(len(lists[0])).items()}
    out: Dict[str, List] = {}
    taken: Dict[int, int] = {}       # id(device list) -> devices already given out
    for role, devices in zip(dep.roles, lists):
        group, start = dep.group(role), taken.get(id(devices), 0)
        if start + group.num_devices > len(devices):
            raise ValueError(f"deployment.{role}: {group.num_instances} instance(s) x pp {group.pp} x tp {group.tp} "
                             f"need {group.num_devices} devices, its topology has {len(devices) - start} left")
        k = group.devices_per_instance
        out.update({name: list(devices[start + i * k:start + (i + 1) * k])
                    for i, name in enumerate(dep.instance_names(role))})
        taken[id(devices)] = start + group.num_devices
    return out


def ceiling_batch(bucket, page_size: int) -> cost_model.BatchComposition:
    """The batch a (T, S, P) bucket's declared attention cost describes (pdjax.kernels.ragged_blocks.bucket_cost):
    every sequence's page table full (K = P · page_size keys). T <= S: T decodes at context K - 1; else S - 1 decodes
    and one chunk of the remaining tokens ending at K."""
    tokens, seqs, pages = bucket
    keys = pages * page_size
    if tokens <= seqs:
        return cost_model.BatchComposition(decodes=((tokens, keys - 1),))
    chunk = tokens - (seqs - 1)
    decodes = ((seqs - 1, keys - 1),) if seqs > 1 else ()
    return cost_model.BatchComposition(prefills=((chunk, max(0, keys - chunk)),), decodes=decodes)


def compare_with_sim(step: dict, spec, hardware, *, tp: int, pp: int, page_size: int) -> dict:
    """XLA's counts of one compiled step beside the cost model's (per device, the step's stage)."""
    tokens, seqs, pages = step["bucket"]
    lo, hi = stage_layer_ranges(spec.num_layers, pp)[step["stage"]]
    counts = cost_model.step_counts(spec, tp, tokens=tokens, seqs=seqs, keys=pages * page_size, layers=hi - lo,
                                    lm_head=step["stage"] == pp - 1)
    sim_s = cost_model.iteration_time(ceiling_batch(step["bucket"], page_size), spec, hardware, tp=tp, pp=pp).total
    ratio = (lambda a, b: None if not a or not b else a / b)   # noqa: E731
    out = {"sim_flops": counts["flops"], "sim_bytes": counts["bytes"], "sim_step_s": sim_s,
           "flops_ratio": ratio(step["flops"], counts["flops"]),
           "bytes_ratio": ratio(step["bytes_accessed"], counts["bytes"]),
           "time_ratio": ratio(step["optimal_seconds"], sim_s)}
    out["flops_off"] = out["flops_ratio"] is not None and abs(out["flops_ratio"] - 1) > 0.10
    # XLA:TPU prices some ops at -1 s (optimal_seconds then comes out negative); the roofline of XLA's own counts
    # on the simulator's peak rates is always defined.
    peak = hardware.peak_flops(spec.dtype)
    out["xla_roofline_s"] = max((step["flops"] or 0) / peak, (step["bytes_accessed"] or 0) / hardware.hbm_bandwidth)
    out["roofline_ratio"] = ratio(out["xla_roofline_s"], sim_s)
    return out


def compile_group(cfg: ServeConfig, role: str, devices: Sequence, *, utilization: float = 0.9, jobs: int = 1,
                  attention_impl: Optional[str] = None, compare_sim: bool = False,
                  on_step: Optional[Callable[[dict], None]] = None) -> dict:
    """The report of one deployment group (module docstring), its first instance on `devices` (pp·tp of them)."""
    group = cfg.deployment.group(role)
    spec = model_spec_for(cfg, simulator=False, required=True)
    dtype = jnp_dtype(resolve_dtype(cfg.model.dtype, spec.dtype, cpu=devices[0].platform == "cpu"))
    sc = instance_scheduler_config(cfg.scheduler, group, role)   # the group's overrides applied
    buckets = engine_buckets(sc.token_budget, sc.max_num_seqs, sc.max_model_len, sc.page_size,
                             cfg.engine.token_buckets, cfg.engine.seq_buckets, cfg.engine.page_buckets)
    device_kind = devices[0].device_kind
    hardware_name = hardware_name_of(device_kind)
    hardware = get_hardware_spec(hardware_name) if hardware_name else None
    hbm = aot.device_memory_bytes(devices) or (hardware.hbm_capacity if hardware else None)
    report = {"role": role, "instances": group.num_instances, "pp": group.pp, "tp": group.tp,
              "devices": [d.id for d in devices], "device_kind": device_kind, "hardware": hardware_name,
              "hbm_bytes": hbm, "num_pages": None, "num_pages_source": None, "max_num_pages": None,
              "buckets": [list(b) for b in buckets.all_shapes()], "error": "", "steps": []}
    try:
        check_group_against_model(role, group, spec)
        check_max_model_len(sc.max_model_len, spec, key="scheduler.max_model_len")
    except ValueError as e:
        report["error"] = str(e)
        return report
    mesh = mesh_lib.make_mesh(list(devices), pp=group.pp, tp=group.tp)
    per_stage = aot.stage_bytes(spec, mesh, dtype, sc.page_size)
    impl = attention_impl or cfg.model.attention_impl
    where = f"deployment.{role} (pp={group.pp}, tp={group.tp}, {device_kind})"
    try:
        num_pages, source = aot.kv_cache_pages(spec, impl, mesh, buckets, num_pages=sc.num_pages,
                                               page_size=sc.page_size, max_model_len=sc.max_model_len, dtype=dtype,
                                               utilization=utilization, hbm_bytes=hbm, where=where)
    except ValueError as e:
        report["error"] = str(e)
        return report
    report.update(num_pages=num_pages, num_pages_source=source)
    common = dict(page_size=sc.page_size, dtype=dtype, max_seqs=buckets.max_seqs)
    page_bytes = {s: page for s, (_, page) in enumerate(per_stage)}

    def finish(step: aot.CompiledStep) -> dict:
        row = step.as_dict()
        row["bucket"] = list(step.bucket)
        row["fits"] = bool(step.compiled and hbm is not None and step.total_bytes <= hbm)
        if compare_sim and step.compiled and hardware is not None:
            row.update(compare_with_sim(row, spec.replace(dtype=str(dtype)), hardware, tp=group.tp, pp=group.pp,
                                        page_size=sc.page_size))    # costed at the dtype compiled
        if on_step is not None:
            on_step(dict(row, role=role))
        return row

    steps = aot.compile_instance(spec, impl, mesh, buckets.all_shapes(), num_pages=num_pages, jobs=jobs, **common)
    report["steps"] = [finish(s) for s in steps]
    if hbm is not None and any(s.compiled for s in steps):
        report["max_num_pages"] = aot.max_num_pages(steps, num_pages=num_pages, page_bytes=page_bytes,
                                                    hbm_bytes=hbm, utilization=utilization)
    if hardware is not None:   # the simulator's own estimate of the same cache, for comparison
        report["sim_num_pages"] = _sim_num_pages(spec, dtype, hardware, group, buckets, sc.page_size, utilization)
    return report


def _sim_num_pages(spec, dtype, hardware, group, buckets, page_size: int, utilization: float) -> int:
    """The simulator's KV pages for the same group (0 when its cost model finds no room)."""
    try:
        tokens = cost_model.kv_cache_capacity_tokens(spec.replace(dtype=str(dtype)), hardware, tp=group.tp,
                                                     pp=group.pp, mem_util=utilization,
                                                     max_num_batched_tokens=buckets.max_tokens,
                                                     max_num_seqs=buckets.max_seqs)
    except ValueError:
        return 0
    return tokens // page_size


def compile_deployment(cfg: ServeConfig, devices_by_role: Dict[str, Sequence], *, utilization: float = 0.9,
                       jobs: int = 1, attention_impl: Optional[str] = None, compare_sim: bool = False,
                       on_step: Optional[Callable[[dict], None]] = None) -> dict:
    """The report of every group of cfg.deployment (module docstring): {'groups': [...], 'compiled', 'failed',
    'fits', 'ok', 'compile_s'}; `ok` is True only when every step of every group compiled and fits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization={utilization!r}, expected a fraction in (0, 1]")
    start = time.perf_counter()
    placed = instance_devices(cfg, devices_by_role)
    groups = []
    for role in cfg.deployment.roles:
        first = cfg.deployment.instance_names(role)[0]
        groups.append(compile_group(cfg, role, placed[first], utilization=utilization, jobs=jobs,
                                    attention_impl=attention_impl, compare_sim=compare_sim, on_step=on_step))
    steps = [s for g in groups for s in g["steps"]]
    compiled = sum(s["compiled"] for s in steps)
    ok = bool(steps) and all(s["compiled"] and s["fits"] for s in steps) and not any(g["error"] for g in groups)
    return {"groups": groups, "compiled": compiled, "failed": len(steps) - compiled,
            "fits": all(s["fits"] for s in steps) and bool(steps), "ok": ok,
            "compile_s": time.perf_counter() - start, "jax_version": jax.__version__}


def format_report(report: dict) -> str:
    """The report as a table: one line per group, one per compiled step."""
    lines = []
    for g in report["groups"]:
        hbm = "?" if g["hbm_bytes"] is None else f"{g['hbm_bytes'] / GiB:.2f}"
        lines.append(f"group {g['role']}: {g['instances']} x (pp {g['pp']}, tp {g['tp']}) on {g['device_kind']} "
                     f"(HBM {hbm} GiB/device); num_pages {g['num_pages']} ({g['num_pages_source']}), "
                     f"max at utilization: {g['max_num_pages']}, simulator's estimate: {g.get('sim_num_pages')}")
        if g["error"]:
            lines.append(f"  error: {g['error']}")
            continue
        lines.append(f"  {'bucket (T,S,P)':<18} {'stage':>5} {'ok':>3} {'compile_s':>9} {'weights':>8} {'kv':>8} "
                     f"{'temp':>8} {'total':>8} {'fits':>4}  GiB per device" + ("   flops x sim  roofline x sim"
                                                                                  if any("flops_ratio" in s for s in
                                                                                         g["steps"]) else ""))
        for s in g["steps"]:
            gib = lambda n: f"{n / GiB:8.3f}"   # noqa: E731
            row = (f"  {str(tuple(s['bucket'])):<18} {s['stage']:>5} {'yes' if s['compiled'] else 'NO':>3} "
                   f"{s['compile_s']:9.1f} {gib(s['weights_bytes'])} {gib(s['kv_bytes'])} {gib(s['temp_bytes'])} "
                   f"{gib(s['total_bytes'])} {'yes' if s['fits'] else 'NO':>4}")
            if "flops_ratio" in s:
                fr, tr = s["flops_ratio"], s["roofline_ratio"]
                row += (f"   {'-' if fr is None else f'{fr:.3f}':>10}{' !' if s['flops_off'] else '  '}"
                        f"{'-' if tr is None else f'{tr:.2f}':>13}")
            if s["error"]:
                row += f"  {s['error']}"
            lines.append(row)
    lines.append(f"{report['compiled']} step(s) compiled, {report['failed']} failed; every step fits: "
                 f"{report['fits']}; {report['compile_s']:.1f} s")
    return "\n".join(lines)


__all__ = ["ceiling_batch", "compare_with_sim", "compile_deployment", "compile_group", "format_report",
           "instance_devices"]
