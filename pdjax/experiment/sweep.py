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

Before any point runs, every point is checked (`validate`; for serve points `check_point`, what a serve run
checks at start-up) and the workdir is made ready by the rule of every run's workdir (`ready_sweep_dir`: a
directory holding nothing but a sweep's entries, else the sweep refuses it), so a bad point or path fails the
sweep in its first seconds, naming the point or the path.

A failing point does not stop the sweep: its directory gets error.txt (the traceback) and no results.json,
summary.csv marks it status=failed with the error line, the other points run, and SweepFailed is raised at the
end; a rerun retries it. With parallel > 1 the points run in spawned worker processes that die with the sweep
process (even on SIGKILL) and are terminated when it is interrupted (see pdjax.procs.die_with_parent).

executor='ray' runs each point as a Ray task instead (a local Ray cluster, or an existing one at `ray_address`),
with the resources its deployment needs (`point_resources`; a real-backend point in a fresh worker process); an
address nothing answers at fails at once (`check_ray_address`); everything else is the same: finished points are
skipped by the same config check, a failing point is recorded, summary.csv is written by the same code from the
points' results.json. A point whose worker process dies (killed, out of memory, its node lost) is resubmitted up
to `max_retries` times, then recorded as failed with the error, and the sweep goes on.
"""
from __future__ import annotations

import copy
import functools
import csv
import io
import itertools
import json
import os
import re
import shutil
import socket
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.config.deployment import deployment_from_dict
from pdjax.experiment.cli import one_line
from pdjax.experiment.run import prepare_experiment
from pdjax.metrics import atomic_write_bytes, atomic_write_text
from pdjax.metrics.report import ready_workdir, written_name
from pdjax.procs import (EXECUTORS, check_ray_address, first_line, format_error, import_ray, parallel_map,
                         ray_session, worker_died)

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


SWEEP_KEYS = {"base", "grid", "name"}


def expand_grid(sweep: Mapping[str, Any]) -> List[Tuple[str, Dict[str, Any], Dict[str, Any]]]:
    """[(point name, {column: value}, full serve config dict)] for every point of the grid."""
    keys = set(sweep) if isinstance(sweep, Mapping) else set()
    if not {"base", "grid"} <= keys or keys - SWEEP_KEYS:
        raise ValueError(f"sweep config with keys {sorted(keys)}, expected {sorted(SWEEP_KEYS)} ('name' optional): "
                         "is it a sweep config (configs/sweeps/*.py), not a serve config?")
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
    tmp_dir = f"{final_dir}.partial-{_safe(socket.gethostname())}-{os.getpid()}"   # unique on a shared disk
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


def _run_todo(run_fn, workdir: str, point: Tuple[str, Dict[str, Any]]) -> Tuple[str, Optional[str]]:
    name, cfg = point
    return _run_point(run_fn, cfg, os.path.join(workdir, name))


def _run_parallel(todo: Sequence[Tuple[str, Dict[str, Any]]], workdir: str, run_fn, parallel: int,
                  log: Callable[[str], None]) -> None:
    """The points on `parallel` spawned processes (pdjax.procs.parallel_map, fresh: JAX does not survive fork);
    a point whose worker died (or whose call could not be pickled) is recorded as failed."""
    def done(i: int, result: Any) -> None:
        name, cfg = todo[i]
        if isinstance(result, BaseException):
            text = format_error(result)
            _record_failure(os.path.join(workdir, name), cfg,
                            "the point's worker process failed (killed, or out of memory?):\n" + text)
            result = ("failed", _error_line(text))
        _log_point(log, name, *result)

    parallel_map(functools.partial(_run_todo, run_fn, workdir), todo, workers=parallel, fresh=True,
                 return_exceptions=True, done=done)


# ------------------------------------------------------------------------------------------------ Ray executor
PLATFORMS = ("auto", "cpu", "gpu", "tpu")


def sweep_platform(platform: str, cluster_resources: Mapping[str, float]) -> str:
    """The accelerator platform real-backend points run on: `platform` unless 'auto'; then the first entry of
    $JAX_PLATFORMS when set (cpu; cuda/rocm/gpu -> gpu; tpu), else what the Ray cluster has: GPUs -> gpu, TPU
    chips -> tpu, else cpu."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}, expected one of {PLATFORMS}")
    if platform != "auto":
        return platform
    first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    named = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(first)
    if named:
        return named
    if cluster_resources.get("GPU", 0) > 0:
        return "gpu"
    if cluster_resources.get("TPU", 0) > 0:
        return "tpu"
    return "cpu"


def point_devices(cfg: Mapping[str, Any]) -> int:
    """Accelerator devices a real-backend point uses: its deployment's devices (every instance of the groups its
    kind uses, pp x tp each), or more when an explicit `devices` list names a higher index."""
    deployment = deployment_from_dict(cfg.get("deployment"))
    highest = [max(getattr(deployment, role).devices) + 1 for role in ("colocated", "prefill", "decode")
               if hasattr(deployment, role) and getattr(deployment, role).devices]
    return max([deployment.num_devices] + highest)


def point_resources(cfg: Mapping[str, Any], platform: str, max_node_cpus: Optional[float] = None) -> Dict[str, Any]:
    """The Ray task options (resources) of one point, derived from its config:
    - backend 'sim': 1 CPU (the simulator is one Python process);
    - backend 'real', N devices (`point_devices`: what its deployment uses): on GPU `num_gpus=N` (+ 1 CPU for the
      host loop), on TPU the custom resource 'TPU': N chips (+ 1 CPU), on CPU `num_cpus=N` (its devices are host
      threads), capped at `max_node_cpus` (the biggest node's CPUs) so a point with more fake CPU devices than
      cores still runs."""
    if cfg.get("backend", "real") == "sim":
        return {"num_cpus": 1}
    n = point_devices(cfg)
    if platform == "gpu":
        return {"num_cpus": 1, "num_gpus": n}
    if platform == "tpu":
        return {"num_cpus": 1, "resources": {"TPU": n}}
    return {"num_cpus": min(n, int(max_node_cpus)) if max_node_cpus else n}


def needs_fresh_worker(cfg: Mapping[str, Any]) -> bool:
    """A real-backend point runs in a worker process of its own (Ray's max_calls=1): JAX's device memory and
    XLA_FLAGS are per process."""
    return cfg.get("backend", "real") != "sim"


def _point_task_options(cfg: Mapping[str, Any], platform: str, max_node_cpus: Optional[float]) -> Dict[str, Any]:
    """The `.options()` of one point's Ray task: point_resources plus, for a real-backend point on CPU, as many
    host devices as the deployment uses. (max_calls is not an option there: Ray takes it only in ray.remote, so
    the fresh worker of a real-backend point comes from its remote function, see needs_fresh_worker.)"""
    options = point_resources(cfg, platform, max_node_cpus)
    if needs_fresh_worker(cfg) and platform == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flags = f"{flags} --xla_force_host_platform_device_count={max(point_devices(cfg), 1)}".strip()
        options["runtime_env"] = {"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}}
    return options


def _resource_demand(options: Mapping[str, Any]) -> Dict[str, float]:
    demand = {"CPU": float(options.get("num_cpus", 1))}
    if options.get("num_gpus"):
        demand["GPU"] = float(options["num_gpus"])
    demand.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    return demand


def _check_feasible(todo_options: Sequence[Tuple[str, Mapping[str, Any]]], nodes: Sequence[Mapping[str, Any]],
                    where: str) -> None:
    """Raise ValueError before anything runs when a point asks for more than any node of the cluster has (Ray
    would otherwise keep the task pending forever)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    for name, options in todo_options:
        demand = _resource_demand(options)
        if not any(all(res.get(k, 0) >= v for k, v in demand.items()) for res in alive):
            have = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(r.items()) if k in ("CPU", "GPU", "TPU"))
                             for r in alive) or "no nodes"
            raise ValueError(f"sweep point {name} needs {', '.join(f'{k}={v:g}' for k, v in demand.items())} on "
                             f"one node; no node of the Ray cluster ({where}) has that (nodes: {have})")


def _run_ray(todo: Sequence[Tuple[str, Dict[str, Any]]], workdir: str, run_fn, log: Callable[[str], None], *,
             address: Optional[str], max_retries: int, platform: str, num_cpus: Optional[int]) -> None:
    """Run the points as Ray tasks (pdjax.procs.parallel_map on Ray); see run_sweep. Starts (and stops) a local
    cluster unless Ray is initialized already or `address` names a cluster to join."""
    with ray_session(address, num_cpus, lambda line: log(f"sweep: {line}")) as ray:
        nodes = [n for n in ray.nodes() if n.get("Alive", True)]
        platform = sweep_platform(platform, ray.cluster_resources())
        max_cpus = max((n.get("Resources", {}).get("CPU", 0) for n in nodes), default=0) or None
        options = [(name, _point_task_options(cfg, platform, max_cpus)) for name, cfg in todo]
        _check_feasible(options, nodes, address or ray.get_runtime_context().gcs_address)
        by_name = dict(options)
        errors: Dict[str, List[str]] = {}

        def task_options(point: Tuple[str, Dict[str, Any]]) -> Dict[str, Any]:
            name, cfg = point
            return {**by_name[name], "max_calls": 1} if needs_fresh_worker(cfg) else by_name[name]

        def on_retry(i: int, e: BaseException, attempt: int) -> None:
            name = todo[i][0]
            errors.setdefault(name, []).append(f"attempt {attempt + 1}: {type(e).__name__}: {str(e).strip()}")
            log(f"sweep: the worker of {name} died ({type(e).__name__}: {first_line(e)}); retry {attempt + 1} of "
                f"{max_retries}")
            for leftover in _partial_dirs(workdir, name):   # of the attempt whose worker died
                shutil.rmtree(leftover, ignore_errors=True)

        def done(i: int, result: Any) -> None:
            name, cfg = todo[i]
            if isinstance(result, BaseException):
                result = _ray_failure(result, name, cfg, errors, workdir=workdir)
            _log_point(log, name, *result)

        parallel_map(functools.partial(_run_todo, run_fn, workdir), todo, executor="ray", ray_address=address,
                     return_exceptions=True, task_options=task_options, retries=max_retries, on_retry=on_retry,
                     done=done)


def _ray_failure(e: BaseException, name: str, cfg: Dict[str, Any], errors: Dict[str, List[str]], *,
                 workdir: str) -> Tuple[str, str]:
    """A point's Ray task failed with `e` on its last attempt (its earlier ones: `errors[name]`): the point is
    recorded as failed (error.txt naming every attempt's error) and this returns ('failed', error line)."""
    kind = type(e).__name__
    attempts = errors.setdefault(name, [])
    attempts.append(f"attempt {len(attempts) + 1}: {kind}: {str(e).strip()}")
    for leftover in _partial_dirs(workdir, name):
        shutil.rmtree(leftover, ignore_errors=True)
    what = (f"the point's worker process died on all {len(attempts)} attempts (killed, or out of memory?)"
            if worker_died(e) else "the point's Ray task failed")
    _record_failure(os.path.join(workdir, name), cfg, f"{what}:\n" + "\n".join(attempts) + f"\n{kind}: {what}\n")
    return "failed", f"{kind}: {what}"


def _partial_dirs(workdir: str, name: str) -> List[str]:
    prefix = f"{name}.partial-"
    try:
        return [os.path.join(workdir, e) for e in os.listdir(workdir) if e.startswith(prefix)]
    except FileNotFoundError:
        return []


SWEEP_FILES = ("summary.csv", "comparison.png")


def ready_sweep_dir(workdir: str, point_names: Sequence[str]) -> None:
    """Make `workdir` ready for a sweep before any point runs, by the rule of every run's workdir
    (pdjax.metrics.report.ready_workdir): a writable directory holding nothing but a sweep's entries: its
    SWEEP_FILES, the directories of its points (of this grid, or of an earlier grid: a directory with a run's
    config.json) and the partial point directories of a killed run. Anything else makes it refuse (ValueError),
    as a serve run refuses a directory of foreign files."""
    names = set(point_names)

    def owns(entry: str) -> bool:
        if written_name(entry) in SWEEP_FILES:
            return True
        path = os.path.join(workdir, entry)
        return os.path.isdir(path) and (entry in names or ".partial-" in entry
                                        or os.path.isfile(os.path.join(path, "config.json")))

    ready_workdir(workdir, owns, "a pdjax sweep's point directories, " + " or ".join(SWEEP_FILES),
                  "one holding an earlier run of a sweep (finished points are kept)")


def _log_point(log: Callable[[str], None], name: str, status: str, error: Optional[str]) -> None:
    log(f"sweep: finished {name}" if status == "ok" else f"sweep: FAILED {name}: {error}")


def check_point(cfg: Dict[str, Any]) -> None:
    """Check one serve point as a serve run checks itself at start-up (pdjax.experiment.run.prepare_experiment:
    the config, what of the model and deployment needs no device, the workload and the files it reads), without
    touching a workdir (is_main=False leaves it alone); the `validate` of run_sweep for run_experiment's points.
    Raises UserError (pdjax.errors, a ValueError) naming the bad key, value or path."""
    prepare_experiment(cfg, "", is_main=False)


def run_sweep(sweep: Mapping[str, Any], workdir: str, run_fn: Callable[[Dict[str, Any], str], Any], *,
              parallel: int = 1, validate: Optional[Callable[[Dict[str, Any]], Any]] = None,
              rerun_changed: bool = False, log: Callable[[str], None] = print, executor: str = "local",
              ray_address: Optional[str] = None, max_retries: int = 2, platform: str = "auto",
              ray_num_cpus: Optional[int] = None) -> List[Dict[str, Any]]:
    """Run every unfinished point (in `parallel` spawned processes when > 1, or as Ray tasks with
    executor='ray'), then write summary.csv.

    run_fn(config_dict, point_workdir) must write results.json (and config.json, the config it ran) into
    point_workdir, which exists and is empty; it must be picklable (a module-level function) when parallel > 1.
    `validate(config_dict)` runs on every point before any point runs, so a bad point fails the sweep at start-up;
    then `workdir` must be new, empty or a sweep's own (`ready_sweep_dir`), else ValueError.

    A point is done when its directory has results.json and its config.json equals the point's config now. A
    finished point whose config changed (e.g. another --config.base... override) raises SweepConfigChanged
    before anything runs, naming the point and the differing keys, unless `rerun_changed`: then it is rerun.
    A point that raises is recorded (error.txt with the traceback in its directory, status 'failed' in
    summary.csv), the other points still run, and SweepFailed is raised at the end, after summary.csv is
    written; a failed point is retried on the next run. Returns the summary rows (all points ok).

    executor='ray': each point is a Ray task with `point_resources` (platform: see `sweep_platform`); Ray is
    used as initialized by the caller, else the cluster at `ray_address` is joined, else a local one is started
    (with `ray_num_cpus` CPUs, default all) and stopped at the end. A point whose worker dies is resubmitted up
    to `max_retries` times, then recorded as failed. run_fn must be picklable by Ray (a module-level function of
    an installed module). For a cluster of several machines `workdir` must be on a disk they all share.

    Steps: `plan_sweep` (checks, the points to run), execute (`_run_ray`, `_run_parallel` or in this process),
    `summarize_sweep` (summary.csv).
    """
    points = expand_grid(sweep)
    _check_options(parallel, executor, max_retries, platform, ray_address)
    todo = plan_sweep(points, workdir, validate=validate, rerun_changed=rerun_changed, log=log)
    if executor == "ray" and todo:
        _run_ray(todo, workdir, run_fn, log, address=ray_address, max_retries=max_retries, platform=platform,
                 num_cpus=ray_num_cpus)
    elif parallel > 1 and len(todo) > 1:
        _run_parallel(todo, workdir, run_fn, parallel, log)
    else:
        for name, cfg in todo:
            status, error = _run_point(run_fn, cfg, os.path.join(workdir, name))
            _log_point(log, name, status, error)
    return summarize_sweep(sweep, points, workdir)


def _check_options(parallel: int, executor: str, max_retries: int, platform: str,
                   ray_address: Optional[str]) -> None:
    """run_sweep's options (ValueError naming the bad one); with executor='ray', that Ray is installed and
    `ray_address` reachable."""
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}, expected an int >= 1")
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r}, expected one of {EXECUTORS}")
    if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
        raise ValueError(f"max_retries={max_retries!r}, expected an int >= 0")
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}, expected one of {PLATFORMS}")
    if executor == "ray":
        ray = import_ray()
        if ray_address and not ray.is_initialized():
            check_ray_address(ray_address)


def plan_sweep(points: Sequence[Tuple[str, Dict[str, Any], Dict[str, Any]]], workdir: str, *,
               validate: Optional[Callable[[Dict[str, Any]], Any]] = None, rerun_changed: bool = False,
               log: Callable[[str], None] = print) -> List[Tuple[str, Dict[str, Any]]]:
    """The (name, config) of the points of `expand_grid` still to run, after validating every point and readying
    `workdir` (run_sweep's rules: SweepConfigChanged for a changed finished point unless `rerun_changed`; the
    partial directories of a killed run are removed)."""
    if validate is not None:
        for name, _, cfg in points:
            try:
                validate(cfg)
            except (ValueError, KeyError, TypeError, OSError) as e:
                raise ValueError(f"sweep point {name}: {one_line(e)}") from e
    ready_sweep_dir(workdir, [name for name, _, _ in points])
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
    return todo


def summarize_sweep(sweep: Mapping[str, Any], points: Sequence[Tuple[str, Dict[str, Any], Dict[str, Any]]],
                    workdir: str) -> List[Dict[str, Any]]:
    """One row per point (its results, or status 'failed' and its error line) into workdir/summary.csv; raises
    SweepFailed after writing it when a point failed, else returns the rows."""
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
    import matplotlib  # noqa: PLC0415 (matplotlib: 1 s; only the sweep CLI plots, library callers do not)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib only when plotting; after use('Agg'))


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
