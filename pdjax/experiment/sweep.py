"""Sweeps: a grid of serve configs, one workdir per point, resumable, with one summary.csv.

A sweep config (configs/sweeps/*.py) is a dict with
    base: a full serve config dict (configs/serve.py's layout)
    grid: {column: (dotted config key, [values...])}, e.g. {"policy": ("scheduler.policy", ["orca", "sarathi"])};
        an axis may set several keys together: ((key_a, key_b), [(a1, b1), (a2, b2)]); each key then becomes
        its own column, named by its last dotted part (e.g. policy, token_budget)
    name: optional sweep name
The points are the Cartesian product of the grid axes, in the order given. Each point runs into a fresh, empty
temporary directory that is renamed to its final name only when complete, so a killed sweep leaves no half point
behind. A rerun skips every finished point whose stored config.json equals its config now; a finished point whose
config changed stops the sweep before anything runs (naming the point and the keys) unless `rerun_changed`.

A failing point does not stop the sweep: its directory gets error.txt (the traceback) and no results.json,
summary.csv marks it status=failed with the error line, the other points run, and SweepFailed is raised at the
end; a rerun retries it. With parallel > 1 the points run in spawned worker processes that die with the sweep
process (even on SIGKILL) and are terminated when it is interrupted (see pdjax.sim.capacity.die_with_parent).
"""
from __future__ import annotations

import concurrent.futures
import copy
import csv
import io
import itertools
import json
import os
import re
import shutil
import traceback
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


STATUS_COLUMNS = ("status", "error")
ERROR_FILE = "error.txt"


class SweepConfigChanged(ValueError):
    """A finished point was run with another config than the one the sweep gives it now."""


class SweepFailed(RuntimeError):
    """Some points failed (each has error.txt in its directory); the others ran and summary.csv lists all."""

    def __init__(self, failed: Sequence[str], rows: List[Dict[str, Any]], total: int):
        self.failed = list(failed)
        self.rows = rows
        super().__init__(f"sweep: {len(self.failed)} of {total} points failed: {', '.join(self.failed)} "
                         f"(traceback in each point's {ERROR_FILE})")


def _normalized(cfg: Any) -> Any:
    """`cfg` as it reads back from config.json (tuples become lists, ...)."""
    return json.loads(json.dumps(cfg, default=str))


def config_diff(stored: Any, current: Any, prefix: str = "") -> List[str]:
    """Dotted keys whose values differ between two (normalized) config dicts, as 'key: stored -> current'."""
    if isinstance(stored, dict) and isinstance(current, dict):
        out = []
        for k in list(stored) + [k for k in current if k not in stored]:
            key = f"{prefix}{k}"
            if k not in current:
                out.append(f"{key}: {stored[k]!r} -> (absent)")
            elif k not in stored:
                out.append(f"{key}: (absent) -> {current[k]!r}")
            else:
                out.extend(config_diff(stored[k], current[k], key + "."))
        return out
    if stored == current and isinstance(stored, bool) == isinstance(current, bool):   # 4 == 4.0, True != 1
        return []
    return [f"{prefix.rstrip('.') or '(config)'}: {stored!r} -> {current!r}"]


def _short(items: Sequence[str], n: int = 3, width: int = 80) -> str:
    shown = [s if len(s) <= width else s[:width - 3] + "..." for s in items[:n]]
    return "; ".join(shown) + (f"; and {len(items) - n} more" if len(items) > n else "")


def point_state(point_dir: str, cfg: Mapping[str, Any]) -> Tuple[str, List[str]]:
    """('done' | 'changed' | 'todo', differing keys) of a point directory for the config it runs now.

    done: results.json is there and config.json equals `cfg`; changed: results.json is there but config.json
    differs (or is missing or unreadable); todo: never finished (absent, or failed: error.txt, no results.json)."""
    if not os.path.isfile(os.path.join(point_dir, "results.json")):
        return "todo", []
    try:
        with open(os.path.join(point_dir, "config.json")) as f:
            stored = json.load(f)
    except FileNotFoundError:
        return "changed", ["its config.json is missing"]
    except (OSError, ValueError) as e:
        return "changed", [f"its config.json is unreadable ({e})"]
    diff = config_diff(stored, _normalized(cfg))
    return ("changed" if diff else "done"), diff


def _install(src_dir: str, final_dir: str) -> None:
    """Move a completed (or failed) temporary point directory to its final name, replacing an older one."""
    if os.path.lexists(final_dir):
        shutil.rmtree(final_dir)
    os.replace(src_dir, final_dir)


def _write_text(path: str, text: str) -> None:
    from pdjax.metrics import atomic_write_text  # noqa: PLC0415
    atomic_write_text(path, text)


def _record_failure(point_dir: str, cfg: Mapping[str, Any], error_text: str) -> None:
    """Make `point_dir` a failed point: error.txt and config.json, no results.json (so a rerun retries it)."""
    os.makedirs(point_dir, exist_ok=True)
    results = os.path.join(point_dir, "results.json")
    if os.path.exists(results):
        os.remove(results)
    _write_text(os.path.join(point_dir, "config.json"), json.dumps(_normalized(cfg), indent=2) + "\n")
    _write_text(os.path.join(point_dir, ERROR_FILE), error_text)


def _error_line(error_text: str) -> str:
    """The last non-empty line of a traceback ('ValueError: ...'), for the log and summary.csv."""
    lines = [ln.strip() for ln in error_text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "unknown error"
    return line if len(line) <= 300 else line[:297] + "..."


def _run_point(run_fn: Callable[[Dict[str, Any], str], Any], cfg: Dict[str, Any],
               final_dir: str) -> Tuple[str, Optional[str]]:
    """Run one point into a fresh temporary directory, renamed to final_dir when done. Returns ('ok', None), or
    ('failed', error line) after an exception: the traceback goes to final_dir/error.txt (no results.json)."""
    tmp_dir = f"{final_dir}.partial-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        os.makedirs(tmp_dir)      # empty, created right before the run
        run_fn(cfg, tmp_dir)
        if not os.path.isfile(os.path.join(tmp_dir, "results.json")):
            raise RuntimeError(f"the point's run returned without writing results.json into {tmp_dir}")
        if not os.path.isfile(os.path.join(tmp_dir, "config.json")):   # the rerun check compares against it
            _write_text(os.path.join(tmp_dir, "config.json"), json.dumps(_normalized(cfg), indent=2) + "\n")
    except Exception:   # noqa: BLE001  (record any failure of the point; KeyboardInterrupt/SystemExit pass)
        text = traceback.format_exc()
        _record_failure(tmp_dir, cfg, text)
        _install(tmp_dir, final_dir)
        return "failed", _error_line(text)
    _install(tmp_dir, final_dir)
    return "ok", None


def _run_parallel(todo: Sequence[Tuple[str, Dict[str, Any]]], workdir: str, run_fn, parallel: int,
                  log: Callable[[str], None]) -> None:
    from pdjax.sim.capacity import process_pool, stop_pool  # noqa: PLC0415  (no JAX)

    pool = process_pool(min(parallel, len(todo)), "spawn")   # JAX does not survive fork
    try:
        futures = {pool.submit(_run_point, run_fn, cfg, os.path.join(workdir, name)): (name, cfg)
                   for name, cfg in todo}
        for fut in concurrent.futures.as_completed(futures):
            name, cfg = futures[fut]
            try:
                status, error = fut.result()
            except Exception:   # noqa: BLE001  (the worker died, or the call could not be pickled)
                text = traceback.format_exc()
                _record_failure(os.path.join(workdir, name), cfg,
                                "the point's worker process failed (killed, or out of memory?):\n" + text)
                status, error = "failed", _error_line(text)
            _log_point(log, name, status, error)
    except BaseException:   # an error, Ctrl-C or SystemExit (SIGTERM): stop the workers, do not wait for them
        stop_pool(pool, abort=True)
        raise
    stop_pool(pool, abort=False)


def _log_point(log: Callable[[str], None], name: str, status: str, error: Optional[str]) -> None:
    log(f"sweep: finished {name}" if status == "ok" else f"sweep: FAILED {name}: {error}")


def run_sweep(sweep: Mapping[str, Any], workdir: str, run_fn: Callable[[Dict[str, Any], str], Any], *,
              parallel: int = 1, validate: Optional[Callable[[Dict[str, Any]], Any]] = None,
              rerun_changed: bool = False, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run every unfinished point (in `parallel` spawned processes when > 1), then write summary.csv.

    run_fn(config_dict, point_workdir) must write results.json (and config.json, the config it ran) into
    point_workdir, which exists and is empty; it must be picklable (a module-level function) when parallel > 1.
    `validate(config_dict)` runs on every point before any point runs, so a bad point fails the sweep at start-up.

    A point is done when its directory has results.json and its config.json equals the point's config now. A
    finished point whose config changed (e.g. another --config.base... override) raises SweepConfigChanged
    before anything runs, naming the point and the differing keys, unless `rerun_changed`: then it is rerun.
    A point that raises is recorded (error.txt with the traceback in its directory, status 'failed' in
    summary.csv), the other points still run, and SweepFailed is raised at the end, after summary.csv is
    written; a failed point is retried on the next run. Returns the summary rows (all points ok).
    """
    points = expand_grid(sweep)
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}, expected an int >= 1")
    if validate is not None:
        for name, _, cfg in points:
            try:
                validate(cfg)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"sweep point {name}: {e}") from e
    os.makedirs(workdir, exist_ok=True)
    todo, changed, retried = [], [], 0
    for name, _, cfg in points:
        state, diff = point_state(os.path.join(workdir, name), cfg)
        if state == "changed":
            changed.append((name, diff))
        if state != "done":
            todo.append((name, cfg))
            retried += os.path.isfile(os.path.join(workdir, name, ERROR_FILE))
    if changed and not rerun_changed:
        name, diff = changed[0]
        more = f" (and {len(changed) - 1} more points)" if len(changed) > 1 else ""
        raise SweepConfigChanged(
            f"point {name} in {workdir} was run with a different config ({_short(diff)}){more}; pass "
            f"--rerun_changed to rerun changed points, or use another --workdir")
    for entry in os.listdir(workdir):   # leftovers of a killed run
        if ".partial-" in entry:
            shutil.rmtree(os.path.join(workdir, entry), ignore_errors=True)
    for name, diff in changed:
        log(f"sweep: rerunning {name}: config changed ({_short(diff)})")
    log(f"sweep: {len(points)} points, {len(points) - len(todo)} already done, {len(todo)} to run"
        + (f" ({retried} failed before, retried)" if retried else ""))
    if parallel > 1 and len(todo) > 1:
        _run_parallel(todo, workdir, run_fn, parallel, log)
    else:
        for name, cfg in todo:
            status, error = _run_point(run_fn, cfg, os.path.join(workdir, name))
            _log_point(log, name, status, error)
    rows, failed = [], []
    for name, values, _ in points:
        point_dir = os.path.join(workdir, name)
        row = {"point": name, **values}
        try:
            with open(os.path.join(point_dir, "results.json")) as f:
                row.update(flatten_summary(json.load(f)), status="ok", error=None)
        except FileNotFoundError:
            try:
                with open(os.path.join(point_dir, ERROR_FILE)) as f:
                    error = _error_line(f.read())
            except OSError:
                error = "no results.json"
            row.update(flatten_summary({}), status="failed", error=error)
            failed.append(name)
        rows.append(row)
    write_summary_csv(os.path.join(workdir, "summary.csv"), rows, sweep_columns(sweep))
    if failed:
        raise SweepFailed(failed, rows, len(points))
    return rows


def write_summary_csv(path: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    from pdjax.metrics import atomic_write_text  # noqa: PLC0415
    buf = io.StringIO()
    writer = csv.writer(buf)
    header = list(columns) + list(SUMMARY_COLUMNS) + list(STATUS_COLUMNS)
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
