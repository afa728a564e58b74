"""Sweeps: a grid of serve configs, one workdir per point, resumable, with one summary.csv.

A sweep config (configs/sweeps/*.py) is a dict with
    base: a full serve config dict (configs/serve.py's layout)
    grid: {column: (dotted config key, [values...])}, e.g. {"policy": ("scheduler.policy", ["orca", "sarathi"])};
        an axis may set several keys together: ((key_a, key_b), [(a1, b1), (a2, b2)]); each key then becomes
        its own column, named by its last dotted part (e.g. policy, token_budget)
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
            if isinstance(key, (list, tuple)):
                if not isinstance(v, (list, tuple)) or len(v) != len(key):
                    raise ValueError(f"sweep grid[{col!r}]: value {v!r} must give one value per key of {key!r}")
                for k, x in zip(key, v):
                    set_dotted(cfg, k, x)
                    values[k.rsplit(".", 1)[-1]] = x
            else:
                set_dotted(cfg, key, v)
                values[col] = v
        name = ",".join(f"{col}={_safe(v)}" for col, v in values.items())
        points.append((name, values, cfg))
    names = [p[0] for p in points]
    if len(set(names)) != len(names):
        raise ValueError("sweep grid gives two points the same name; values must differ after sanitizing")
    return points


def sweep_columns(sweep: Mapping[str, Any]) -> List[str]:
    """The swept columns of summary.csv, in grid order (a multi-key axis gives one column per key)."""
    return list(expand_grid(sweep)[0][1])


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
              parallel: int = 1, validate: Optional[Callable[[Dict[str, Any]], Any]] = None,
              log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run every unfinished point (in `parallel` spawned processes when > 1), then write summary.csv.

    run_fn(config_dict, point_workdir) must write results.json into point_workdir; it must be picklable
    (a module-level function) when parallel > 1. `validate(config_dict)` runs on every point before any
    point runs, so a bad point fails the sweep at start-up. Returns the summary rows.
    """
    points = expand_grid(sweep)
    if validate is not None:
        for name, _, cfg in points:
            try:
                validate(cfg)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"sweep point {name}: {e}") from e
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
    write_summary_csv(os.path.join(workdir, "summary.csv"), rows, sweep_columns(sweep))
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


PLOT_METRICS = (("ttft_p50", "P50 TTFT (s)"), ("ttft_p99", "P99 TTFT (s)"), ("tbt_p99", "P99 TBT (s)"),
                ("throughput_tok_s", "throughput (tokens/s)"))


def write_sweep_plots(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], workdir: str) -> str:
    """comparison.png: each metric against the last numeric swept column (or the point index), one line per
    combination of the other columns."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from pdjax.metrics import atomic_write_bytes  # noqa: PLC0415

    numeric = [c for c in columns if all(isinstance(r[c], (int, float)) and not isinstance(r[c], bool)
                                         for r in rows)]
    x_col = numeric[-1] if numeric else None
    group_cols = [c for c in columns if c != x_col]
    groups: Dict[Tuple, List[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[c] for c in group_cols), []).append(r)
    fig, axes = plt.subplots(1, len(PLOT_METRICS), figsize=(4.2 * len(PLOT_METRICS), 3.6))
    for ax, (metric, label) in zip(axes, PLOT_METRICS):
        for key, rs in groups.items():
            xs = [r[x_col] for r in rs] if x_col else list(range(len(rs)))
            ys = [r.get(metric) if r.get(metric) is not None else float("nan") for r in rs]
            name = ",".join(f"{c}={v}" for c, v in zip(group_cols, key)) or "all"
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel(x_col or "point")
        if x_col and all(r[x_col] > 0 for r in rows):
            ax.set_xscale("log", base=2)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path = os.path.join(workdir, "comparison.png")
    atomic_write_bytes(path, buf.getvalue())
    return path
