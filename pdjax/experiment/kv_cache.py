"""KV-cache-centric scheduling experiments (issue 30, Mooncake FAST'25), in the simulator. The command line is
experiments/kv_cache.py; each part returns JSON rows.

Setting (Mooncake's simulated one, at a size this machine runs in minutes): Llama-2-70B dimensions
('llama-2-70b-16k': the 70B model with a 16k context, so the long Mooncake prompts fit; prompts clipped to 15,000
tokens, outputs to 1,000) on A100-80GB SXM (or H100) nodes, TP4 per instance, Sarathi chunked prefill (budget
2048), prefix caching on (page 16). Colocated: 4 instances; disaggregated: 2 prefill + 2 decode (16 GPUs each).
Traces: the Mooncake conversation and synthetic traces (shared data/traces/mooncake_fast25_*.csv, their hash_ids
become shared token blocks: pdjax.workload), the first `num_requests` rows, arrivals from the trace scaled to the
asked rate.

Parts:
- `hit_ratio`: prefix-cache hit ratio (prompt tokens served from a device prefix cache or a host KV tier /
  prompt tokens of served requests) vs host capacity per instance (0, then multiples of the device's KV pages),
  local host tiers vs one shared pool, under round_robin and kv_centric routing; colocated, at `rate`.
- `routers`: TTFT / TBT percentiles at `rate`, and the highest rate of `rates` meeting the SLOs (attainment >=
  `min_attainment`: TTFT <= `slo_ttft`, TPOT <= `slo_tpot`), for round_robin / least_loaded / prefix_affinity /
  kv_centric, colocated and disaggregated (partial transfer and host tiers on for every router, so the routers
  are what differs).
- `speed`: simulated iterations per second of the simulation alone on a chat10k-size run (configs/sim/chat10k.py,
  10,000 requests) spread over 4 replicas: each router without prefix caching, round_robin and kv_centric with it,
  kv_centric with it and host tiers (`SPEED_CASES`); with caching, the page moves and their least cost
  (`bookkeeping_floor`); every speed also over the machine's interpreter ceiling (sim_bench.interpreter_rate).
- `replication`: hot-block replication in the shared pool (`deployment.host_kv_replicate_after`, 0 = off): per
  router and setting, the hit ratio, local / remote host fetches, copies made and served, and TTFT; colocated.
"""
from __future__ import annotations

import copy
import itertools
import os
import random
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

from pdjax.config.files import REPO_ROOT, config_file
from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.sim_bench import interpreter_rate
from pdjax.scheduler.block_manager import extend_page_keys
from pdjax.scheduler.kv_tier import HostKVTier
from pdjax.metrics import summarize_run
from pdjax.sim.build import build_pending_requests, build_setup
from pdjax.sim.run import simulate_setup
from pdjax.workload.traces import load_trace

TRACES = {"conversation": "mooncake_fast25_conversation.csv", "synthetic": "mooncake_fast25_synthetic.csv"}
ROUTERS = ("round_robin", "least_loaded", "prefix_affinity", "kv_centric")
KINDS = ("colocated", "disaggregated")


def trace_path(trace: str) -> str:
    return os.path.normpath(os.path.join(REPO_ROOT, os.pardir, "shared", "data", "traces", TRACES[trace]))


def base_config(trace: str, *, kind: str = "colocated", router: str = "round_robin", num_requests: int = 1000,
                time_scale: float = 1.0, hardware: str = "a100-80gb-sxm", host_blocks: int = 0,
                host_pool: str = "local", num_pages: int = 0, replicate_after: int = 0) -> Dict[str, Any]:
    """The serve config dict of one simulated run (module docstring). host_blocks: host KV tier pages per instance;
    num_pages: device KV pages per instance (0: what the GPUs hold, the cost model's capacity); replicate_after:
    deployment.host_kv_replicate_after (shared pool; 0 = off)."""
    group = {"tp": 4, "host_kv_blocks": host_blocks, "num_pages": num_pages}
    config = _base_config(trace, kind, router, num_requests, time_scale, hardware, host_pool, group)
    if replicate_after:
        config["deployment"]["host_kv_replicate_after"] = replicate_after
    return config


def _base_config(trace: str, kind: str, router: str, num_requests: int, time_scale: float, hardware: str,
                 host_pool: str, group: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "backend": "sim", "seed": 0,
        "model": {"checkpoint": "llama-2-70b-16k"},
        "engine": {"mode": "online", "progress": False},
        "scheduler": {"policy": "sarathi", "token_budget": 2048, "max_num_seqs": 128, "max_model_len": 16384,
                      "page_size": 16, "num_pages": 4096, "enable_prefix_caching": True},
        "workload": {"kind": "trace", "trace_path": trace_path(trace), "arrival": "trace", "num_requests": num_requests,
                     "trace_time_scale": time_scale, "max_prompt_len": 15000, "max_output_len": 1000,
                     "vocab_size": 32000},
        "slo": {},
        "sim": {"hardware": hardware},
        "deployment": {"kind": kind, "router": router, "host_kv_pool": host_pool,
                       "partial_transfer": kind == "disaggregated",
                       "colocated": {"num_instances": 4, **group},
                       "prefill": {"num_instances": 2, **group}, "decode": {"num_instances": 2, **group}},
    }


def simulate_dict(config: Dict[str, Any]):
    """(SimResult, {role: instances}, wall seconds) of one config dict."""
    cfg = serve_config_from_dict(config)
    setup = build_setup(cfg)
    held = {}
    start = time.perf_counter()
    result = simulate_setup(setup, build_pending_requests(cfg), adjust_instances=held.update)
    return result, held, time.perf_counter() - start


def hit_stats(result, instances: Dict[str, List[Any]]) -> Dict[str, Any]:
    """Prompt tokens served from a device cache / a host tier (local, remote) over the prompt tokens every
    admission looked up (a request re-admitted after a preemption looks up again; prefill side only for a
    disaggregated run: the decode side's reuse is partial transfer's)."""
    roles = ("colocated", "prefill")
    bms = [i.scheduler.block_manager for r in roles for i in instances.get(r, ())]
    ps = bms[0].page_size
    queried = sum(b.num_query_pages for b in bms) * ps
    device = sum(b.num_cache_hit_pages for b in bms) * ps
    host = sum(b.num_host_hit_pages for b in bms) * ps
    remote = sum(b.num_remote_hit_pages for b in bms) * ps
    return {"queried_tokens": queried, "device_hit_tokens": device, "host_hit_tokens": host,
            "remote_hit_tokens": remote, "hit_ratio": (device + host) / queried if queried else 0.0,
            "num_preemptions": sum(r.num_preemptions for r in result.requests)}


def device_pages(config: Dict[str, Any]) -> int:
    """KV pages per instance the cost model gives the config's group (its GPUs' memory)."""
    setup = build_setup(serve_config_from_dict(config))
    return next(iter(setup.groups.values())).scheduler_config.num_pages


def time_scale_for(trace: str, rate: float, num_requests: int) -> float:
    """trace_time_scale that replays the trace's first rows at `rate` requests/s on average."""
    rows = load_trace(trace_path(trace)).rows[:num_requests]
    span = rows[-1].arrival_time - rows[0].arrival_time
    return (len(rows) / rate) / span if span > 0 else 1.0


def hit_ratio(traces: Sequence[str], num_requests: int, rate: float, host_multiples: Sequence[float],
              routers: Sequence[str] = ("round_robin", "kv_centric"), hardware: str = "a100-80gb-sxm",
              num_pages: int = 0) -> List[Dict[str, Any]]:
    """Rows of part `hit_ratio` (module docstring)."""
    rows = []
    for trace in traces:
        scale = time_scale_for(trace, rate, num_requests)
        pages = num_pages or device_pages(base_config(trace, num_requests=num_requests, hardware=hardware))
        for router in routers:
            for pool in ("local", "shared"):
                for m in host_multiples:
                    if pool == "shared" and not m:
                        continue                        # no host memory: nothing to share
                    host = int(m * pages)
                    config = base_config(trace, router=router, num_requests=num_requests, time_scale=scale,
                                         hardware=hardware, host_blocks=host, host_pool=pool, num_pages=num_pages)
                    result, instances, wall = simulate_dict(config)
                    rows.append({"trace": trace, "router": router, "pool": pool, "device_pages": pages,
                                 "host_pages": host, "host_multiple": m, "rate": rate, "wall_s": round(wall, 2),
                                 **hit_stats(result, instances)})
    return rows


def _latency(summary: Dict[str, Any]) -> Dict[str, Any]:
    pick = lambda d: {k: (round(v, 4) if v is not None else None) for k, v in d.items() if k != "mean"}  # noqa: E731
    return {"ttft": pick(summary["ttft"]), "tbt": pick(summary["tbt"]), "slo_attainment": summary["slo_attainment"]}


def routers(traces: Sequence[str], num_requests: int, rate: float, rates: Sequence[float],
            kinds: Sequence[str] = KINDS, routers_: Sequence[str] = ROUTERS, hardware: str = "a100-80gb-sxm",
            host_multiple: float = 1.0, slo_ttft: float = 30.0, slo_tpot: float = 0.1,
            min_attainment: float = 0.9) -> List[Dict[str, Any]]:
    """Rows of part `routers` (module docstring): per (trace, kind, router) the latencies at `rate` and the
    highest of `rates` whose SLO attainment reaches `min_attainment`."""
    rows = []
    slos = {"ttft": slo_ttft, "tpot": slo_tpot}
    for trace in traces:
        pages = device_pages(base_config(trace, num_requests=num_requests, hardware=hardware))
        for kind in kinds:
            for router in routers_:
                row: Dict[str, Any] = {"trace": trace, "kind": kind, "router": router, "rate": rate,
                                       "slo": slos, "host_pages": int(host_multiple * pages)}
                best: Optional[float] = None
                for r in sorted(set(rates) | {rate}):
                    config = base_config(trace, kind=kind, router=router, num_requests=num_requests,
                                         time_scale=time_scale_for(trace, r, num_requests), hardware=hardware,
                                         host_blocks=int(host_multiple * pages))
                    result, instances, wall = simulate_dict(config)
                    summary = summarize_run(result.requests, result.iterations, slos)
                    if r == rate:
                        row.update(_latency(summary), wall_s=round(wall, 2), **hit_stats(result, instances))
                    if r in rates and (summary["slo_attainment"] or 0) >= min_attainment:
                        best = r if best is None else max(best, r)
                row["max_slo_rate"] = best
                rows.append(row)
    return rows


def replication(traces: Sequence[str], num_requests: int, rate: float, host_multiple: float,
                replicate_afters: Sequence[int], routers_: Sequence[str] = ("round_robin", "kv_centric"),
                hardware: str = "a100-80gb-sxm", num_pages: int = 0) -> List[Dict[str, Any]]:
    """Rows of part `replication` (module docstring): one shared pool of host_multiple x the device pages per
    instance, per router and replicate_after (0 = off)."""
    rows = []
    for trace in traces:
        scale = time_scale_for(trace, rate, num_requests)
        pages = num_pages or device_pages(base_config(trace, num_requests=num_requests, hardware=hardware))
        host = int(host_multiple * pages)
        for router in routers_:
            for after in replicate_afters:
                config = base_config(trace, router=router, num_requests=num_requests, time_scale=scale,
                                     hardware=hardware, host_blocks=host, host_pool="shared", num_pages=num_pages,
                                     replicate_after=after)
                result, instances, wall = simulate_dict(config)
                tier = instances["colocated"][0].scheduler.block_manager.host_tier
                summary = summarize_run(result.requests, result.iterations, {})
                rows.append({"trace": trace, "router": router, "replicate_after": after, "device_pages": pages,
                             "host_pages": host, "rate": rate, "wall_s": round(wall, 2),
                             **hit_stats(result, instances), "replicas": tier.num_replicas,
                             "copy_hits": tier.num_copy_hits, "host_evictions": tier.num_evictions,
                             "ttft": _latency(summary)["ttft"]})
    return rows


# speed's rows: (router, prefix caching, host KV tier as large as each device)
SPEED_CASES = (("round_robin", False, False), ("least_loaded", False, False), ("prefix_affinity", False, False),
               ("kv_centric", False, False), ("round_robin", True, False), ("kv_centric", True, False),
               ("kv_centric", True, True))


def speed(num_requests: int = 10_000, replicas: int = 4,
          cases: Sequence[tuple] = SPEED_CASES) -> List[Dict[str, Any]]:
    """Rows of part `speed`: configs/sim/chat10k.py over `replicas` replicas at replicas x its rate, per case of
    `cases` (router, prefix caching, a host tier with as many pages as the device); wall and CPU seconds of the
    simulation alone (the config, instances and requests built first), and with caching the cache's page moves
    (device evictions, host offloads) and the least CPU time they can cost as the cache keeps its pages today
    (`bookkeeping_floor`): the fastest the case could run, at the CPU time of its router without caching plus that.
    iterations_per_interpreter_loop: iterations per CPU second over the machine's interpreter_rate (measured once,
    first), which compares across days."""
    rows, floor = [], None
    ceiling = interpreter_rate()
    for router, caching, host in cases:
        chat10k = os.path.join(REPO_ROOT, "configs", "sim", "chat10k.py")
        config = copy.deepcopy(config_file(chat10k, "chat10k.py").to_dict())
        config["workload"].update(num_requests=num_requests, rate=config["workload"]["rate"] * replicas)
        config["scheduler"]["enable_prefix_caching"] = caching
        config["deployment"].update(kind="colocated", router=router)
        config["deployment"]["colocated"].update(num_instances=replicas)
        if host:
            config["deployment"]["colocated"]["host_kv_blocks"] = device_pages(config)
        cfg = serve_config_from_dict(config)
        setup, requests, held = build_setup(cfg), build_pending_requests(cfg), {}
        cpu = time.process_time()
        result = simulate_setup(setup, requests, adjust_instances=held.update)
        cpu = time.process_time() - cpu       # steadier than wall time on a shared machine
        row = {"router": router, "prefix_caching": caching,
               "host_kv_blocks": config["deployment"]["colocated"].get("host_kv_blocks", 0),
               "num_requests": num_requests, "replicas": replicas, "num_iterations": result.num_iterations,
               "wall_s": round(result.wall_s, 2), "iterations_per_s": round(result.iterations_per_s),
               "cpu_s": round(cpu, 2), "iterations_per_cpu_s": round(result.num_iterations / max(cpu, 1e-9)),
               "load_average": os.getloadavg()[0], "interpreter_loops_per_s": round(ceiling),
               "iterations_per_interpreter_loop": round(result.num_iterations / max(cpu, 1e-9) / ceiling, 4)}
        if caching:
            floor = floor or bookkeeping_floor()
            row.update(_page_moves(held["colocated"], floor))
            plain = [r["cpu_s"] for r in rows if r["router"] == router and not r["prefix_caching"]]
            if plain:
                row["floor_iterations_per_cpu_s"] = round(result.num_iterations / (plain[0] + row["floor_s"]))
        rows.append(row)
    return rows


def _page_moves(instances, floor: Dict[str, float]) -> Dict[str, Any]:
    """A caching run's page moves and the least cost of those made page by page (bookkeeping_floor's per-page
    seconds; a dead segment's pages, pdjax.scheduler.block_manager.BlockManager.free_dead, move as one list slice
    each and count 0)."""
    bms = [inst.scheduler.block_manager for inst in instances]
    tiers = {id(b.host_tier): b.host_tier for b in bms if b.host_tier is not None}.values()
    evicted, dead = sum(b.num_evictions for b in bms), sum(b.num_dead_evictions for b in bms)
    offloads, dead_offloads = sum(t.num_offloads for t in tiers), sum(t.num_dead_offloads for t in tiers)
    per_evicted = floor["key_s"] + floor["register_s"] + floor["free_and_evict_s"] + floor["unregister_s"]
    return {"device_evictions": evicted, "dead_evictions": dead, "host_offloads": offloads,
            "dead_offloads": dead_offloads, "host_evictions": sum(t.num_evictions for t in tiers),
            "floor_s": round((evicted - dead) * per_evicted
                             + (offloads - dead_offloads) * floor["host_offload_and_evict_s"], 2)}


def bookkeeping_floor(pages: int = 100_000, page_size: int = 16, repeat: int = 3) -> Dict[str, float]:
    """Seconds per page of the prefix cache's per-page work, each step in the fewest Python operations the block
    manager's structures allow (pdjax.scheduler.block_manager: a key per page, a key -> page dict, an LRU of free
    cached pages; pdjax.scheduler.kv_tier: an LRU of host pages by key): make the key (extend_page_keys: `key_s`),
    register it (`register_s`), free the page into the LRU and evict it (`free_and_evict_s`), drop its key
    (`unregister_s`), offload it into a host tier that evicts as it fills (`host_offload_and_evict_s`: the tier's own
    batched offload_many). `pages` random pages, best of `repeat`."""
    rng = random.Random(0)
    tokens = [rng.randrange(32000) for _ in range(pages * page_size)]
    ids = list(range(pages))

    def make_keys():
        keys: list = []
        extend_page_keys(keys, tokens, page_size, pages)
        return keys


    keys = make_keys()

    def register():
        key_to_page, page_key = {}, [None] * pages
        key_to_page.update(zip(keys, ids))
        any(map(page_key.__setitem__, ids, keys))

    def free_and_evict():
        lru = OrderedDict.fromkeys(ids)
        pop = lru.popitem
        return [pop(last=False)[0] for _ in ids]

    registered = dict(zip(keys, ids))

    def unregister():
        key_to_page, page_key = dict(registered), list(keys)
        start = time.perf_counter()
        any(map(key_to_page.__delitem__, keys))
        any(map(page_key.__setitem__, ids, itertools.repeat(None)))
        return time.perf_counter() - start

    def host():
        HostKVTier(pages // 2).offload_many(keys, "i0")

    def best(fn):
        out = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - start)
        return out / pages

    return {"key_s": best(make_keys), "register_s": best(register),
            "free_and_evict_s": best(free_and_evict),
            "unregister_s": min(unregister() for _ in range(repeat)) / pages, "host_offload_and_evict_s": best(host)}
