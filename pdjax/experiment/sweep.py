"""Sweeps: a grid of serve configs, one workdir per point, resumable, with one summary.csv.

A sweep config (configs/sweeps/*.py) is a dict with
    base: a full serve config dict (configs/serve.py's layout)
    grid: {column: (dotted config key, [values...])}, e.g. {"policy": ("scheduler.policy", ["orca", "sarathi"])}
    name: optional sweep name
The points are the Cartesian product of the grid axes, in the order given. Each point runs into a temporary
directory that is renamed to its final name only when complete, so a killed sweep leaves no half point behind and
a rerun skips every finished point.
"""
from __future__ import annotations

import concurrent.futures
import copy
import csv
import io
import itertools
import json
import multiprocessing
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

SUMMARY_COLUMNS = ("ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p99", "tpot_p50", "e2e_p50",
                   "sched_delay_p50", "throughput_tok_s", "slo_attainment", "goodput_rps")


def set_dotted(d: Dict[str, Any], dotted: str, value: Any) -> None:
    """Set d['a']['b'] = value for dotted='a.b'; the path must already exist (a typo fails here)."""
    keys = dotted.split(".")
    node = d
    for i, k in enumerate(keys[:-1]):
        if not isinstance(node, dict) or k not in node:
            raise KeyError(f"sweep key {dotted!r}: {'.'.join(keys[:i + 1])!r} is not in the base config")
        node = node[k]
    if not isinstance(node, dict) or keys[-1] not in node:
        raise KeyError(f"sweep key {dotted!r} is not in the base config")
    node[keys[-1]] = value


def _safe(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(value))


def expand_grid(sweep: Mapping[str, Any]) -> List[Tuple[str, Dict[str, Any], Dict[str, Any]]]:
    """[(point name, {column: value}, full serve config dict)] for every point of the grid."""
    base = sweep["base"]
    grid = sweep.get("grid") or {}
    if not grid:
        raise ValueError("sweep config has an empty 'grid': nothing to sweep")
    columns = list(grid)
    axes = []
    for col in columns:
        entry = grid[col]
        if len(entry) != 2 or isinstance(entry[1], (str, bytes)) or not len(entry[1]):
            raise ValueError(f"sweep grid[{col!r}]={entry!r}, expected (dotted key, non-empty list of values)")
        axes.append([(col, entry[0], v) for v in entry[1]])
    points = []
    for combo in itertools.product(*axes):
        cfg = copy.deepcopy(base)
        values = {}
        for col, key, v in combo:
            set_dotted(cfg, key, v)
            values[col] = v
        name = ",".join(f"{col}={_safe(v)}" for col, v in values.items())
        points.append((name, values, cfg))
    names = [p[0] for p in points]
    if len(set(names)) != len(names):
        raise ValueError("sweep grid gives two points the same name; values must differ after sanitizing")
    return points


def flatten_summary(summary: Mapping[str, Any]) -> Dict[str, Any]:
    """The SUMMARY_COLUMNS of one point's results.json."""
    row = {}
    for col in SUMMARY_COLUMNS:
        if col in summary:
            row[col] = summary[col]
            continue
        metric, _, pct = col.rpartition("_")
        value = summary.get(metric, {})
        row[col] = value.get(pct) if isinstance(value, Mapping) else None
    return row


def _run_point(run_fn: Callable[[Dict[str, Any], str], Any], cfg: Dict[str, Any], final_dir: str) -> str:
    tmp_dir = f"{final_dir}.partial-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    run_fn(cfg, tmp_dir)
    os.replace(tmp_dir, final_dir)
    return final_dir


def run_sweep(sweep: Mapping[str, Any], workdir: str, run_fn: Callable[[Dict[str, Any], str], Any], *,
              parallel: int = 1, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run every unfinished point (in `parallel` spawned processes when > 1), then write summary.csv.

    run_fn(config_dict, point_workdir) must write results.json into point_workdir; it must be picklable
    (a module-level function) when parallel > 1. Returns the summary rows.
    """
    points = expand_grid(sweep)
    os.makedirs(workdir, exist_ok=True)
    for entry in os.listdir(workdir):   # leftovers of a killed run
        if ".partial-" in entry:
            shutil.rmtree(os.path.join(workdir, entry), ignore_errors=True)
    todo = [(name, cfg) for name, _, cfg in points
            if not os.path.exists(os.path.join(workdir, name, "results.json"))]
    log(f"sweep: {len(points)} points, {len(points) - len(todo)} already done, {len(todo)} to run")
    if parallel > 1 and len(todo) > 1:
        ctx = multiprocessing.get_context("spawn")   # JAX does not survive fork
        with concurrent.futures.ProcessPoolExecutor(max_workers=parallel, mp_context=ctx) as pool:
            futures = {pool.submit(_run_point, run_fn, cfg, os.path.join(workdir, name)): name
                       for name, cfg in todo}
            for fut in concurrent.futures.as_completed(futures):
                fut.result()
                log(f"sweep: finished {futures[fut]}")
    else:
        for name, cfg in todo:
            _run_point(run_fn, cfg, os.path.join(workdir, name))
            log(f"sweep: finished {name}")
    rows = []
    for name, values, _ in points:
        with open(os.path.join(workdir, name, "results.json")) as f:
            summary = json.load(f)
        rows.append({"point": name, **values, **flatten_summary(summary)})
    write_summary_csv(os.path.join(workdir, "summary.csv"), rows, list(points[0][1]))
    return rows


def write_summary_csv(path: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    from pdjax.metrics import atomic_write_text  # noqa: PLC0415
    buf = io.StringIO()
    writer = csv.writer(buf)
    header = list(columns) + list(SUMMARY_COLUMNS)
    writer.writerow(header)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in header])
    atomic_write_text(path, buf.getvalue())
