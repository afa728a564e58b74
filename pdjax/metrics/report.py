"""Run outputs in a workdir, written atomically, and read back.

`write_run_outputs` writes, each through a temporary file and os.replace (a crash leaves either the old file or
none, never a partial one): config.json, requests.csv, token_times.csv, iterations.csv, ttft_cdf.png,
tbt_cdf.png, iteration_timeline.png and, last, results.json, so a workdir with results.json is a finished run
(sweeps skip those). Floats go to CSV as repr() so they read back bit-exact.
`recompute_summary` rebuilds the latency statistics from requests.csv + token_times.csv with its own code (no
use of latency.py), as a cross-check of the metric functions.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import json
import math
import os
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from pdjax.metrics.latency import STAT_KEYS, summarize_run, tbts, ttfts
from pdjax.metrics.plots import plot_cdf, plot_iteration_timeline
from pdjax.metrics.records import IterationRecord, RequestRecord

REQUEST_COLUMNS = ("request_id", "arrival_time", "first_scheduled_time", "first_token_time", "finish_time",
                   "num_prompt_tokens", "num_output_tokens", "num_preemptions", "finish_reason", "reject_reason")
TOKEN_COLUMNS = ("request_id", "token_index", "time")
ITERATION_COLUMNS = ("step", "start_time", "end_time", "step_time", "num_prefill_tokens", "num_decode_tokens",
                     "num_seqs", "instance", "num_compiles")
PLOT_FILES = ("ttft_cdf.png", "tbt_cdf.png", "iteration_timeline.png")


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", **kwargs) -> Iterator[Any]:
    """Open a temporary file next to `path` (a str or os.PathLike); on clean exit fsync it, os.replace it onto
    `path` and fsync the directory (so the rename itself survives a power loss); on an exception delete it
    (leaving `path` as it was) and re-raise. The one atomic file writer of pdjax: every file a run, a sweep, a
    checkpoint, a stack fit or a generation writes goes through it."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    f = open(tmp, mode, **kwargs)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
    except BaseException:
        f.close()
        os.remove(tmp)
        raise
    f.close()
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(directory: str) -> None:
    """fsync a directory, making a rename in it durable (POSIX; Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path, text: str) -> None:
    """Write `text` to `path` atomically (see atomic_open)."""
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):          # numpy scalars
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot write {type(obj).__name__} {obj!r} to JSON")


def write_json(path: str, obj: Any) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_json_default, allow_nan=False)
        f.write("\n")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_csv(path: str, columns: Sequence[str], rows: Iterator[Sequence[Any]]) -> None:
    with atomic_open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(v) for v in row])


def _save_png(path: str):
    def save(fig) -> None:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png")
    return save


def write_run_outputs(workdir: str, config_dict: Any, request_records: Sequence[RequestRecord],
                      iteration_records: Sequence[IterationRecord], slos: Any = None,
                      plots: bool = True, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write every output of a run into `workdir` (created if needed) and return the summary (results.json).

    `extra`: backend-specific facts merged into the summary (e.g. {"engine": {"compile_s": ...}}); it may not
    overwrite a metric key."""
    os.makedirs(workdir, exist_ok=True)
    request_records = list(request_records)
    iteration_records = list(iteration_records)
    for record in request_records:
        record.validate()
    summary = summarize_run(request_records, iteration_records, slos)
    clash = sorted(set(extra or {}) & set(summary))
    if clash:
        raise ValueError(f"extra keys {clash} would overwrite metric keys of results.json")
    summary.update(extra or {})
    write_json(os.path.join(workdir, "config.json"), config_dict)
    write_csv(os.path.join(workdir, "requests.csv"), REQUEST_COLUMNS, (
        (r.request_id, float(r.arrival_time), r.first_scheduled_time, r.first_token_time, r.finish_time,
         r.num_prompt_tokens, r.num_output_tokens, r.num_preemptions, r.finish_reason, r.reject_reason)
        for r in request_records))
    write_csv(os.path.join(workdir, "token_times.csv"), TOKEN_COLUMNS, (
        (r.request_id, i, float(t)) for r in request_records for i, t in enumerate(r.token_times)))
    write_csv(os.path.join(workdir, "iterations.csv"), ITERATION_COLUMNS, (
        (it.step, float(it.start_time), float(it.end_time), float(it.step_time), it.num_prefill_tokens,
         it.num_decode_tokens, it.num_seqs, it.instance, it.num_compiles) for it in iteration_records))
    if plots:
        plot_cdf(ttfts(request_records), "TTFT (s)", "TTFT CDF", _save_png(os.path.join(workdir, PLOT_FILES[0])))
        plot_cdf([1e3 * g for g in tbts(request_records)], "TBT (ms)", "TBT CDF (all gaps pooled)",
                 _save_png(os.path.join(workdir, PLOT_FILES[1])))
        plot_iteration_timeline(iteration_records, _save_png(os.path.join(workdir, PLOT_FILES[2])))
    write_json(os.path.join(workdir, "results.json"), summary)
    return summary


RUN_FILES = ("config.json", "results.json", "requests.csv", "token_times.csv", "iterations.csv", "outputs.json",
             "error.txt") + PLOT_FILES


def written_name(entry: str) -> str:
    """The file an entry of a workdir is, or is becoming: `entry` without atomic_open's '.tmp-PID' suffix."""
    return entry.split(".tmp-")[0]


def ready_workdir(workdir: str, owns: Callable[[str], bool], contents: str, reuse: str) -> List[str]:
    """The one workdir rule of every pdjax run and sweep: `workdir` must be (or become) a writable directory
    holding nothing but what this kind of run writes there (`owns(entry)`; for the message, `contents` says what
    that is and `reuse` what an already used workdir may hold), so a typo'd path never mixes outputs into (or, on
    a rerun, deletes from) a directory of someone else's files.
    Returns its entries (all owned). Raises ValueError naming the path and the problem, leaving its files alone."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"workdir={workdir!r} exists and is not a directory; expected a directory (new or empty)")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"workdir={workdir!r} cannot be created: {e.strerror}") from None
    entries = sorted(os.listdir(workdir))
    foreign = [e for e in entries if not owns(e)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"workdir={workdir!r} holds files that are not {contents} ({shown}); expected a new or "
                         f"empty directory, or {reuse}")
    try:
        probe = tempfile.NamedTemporaryFile(dir=workdir, prefix=".probe", suffix=".tmp")
        probe.close()
    except OSError as e:
        raise ValueError(f"workdir={workdir!r} is not writable: {e.strerror}") from None
    return entries


LOCK_FILE = ".pdjax.lock"   # held (flock) by the process running in a workdir, for as long as it lives
_HELD_LOCKS: Dict[str, Any] = {}


def is_run_file(entry: str) -> bool:
    """Whether a workdir entry is one of a run's outputs (RUN_FILES), a crash's temporary file of one, or the
    run's lock."""
    return entry == LOCK_FILE or written_name(entry) in RUN_FILES


def lock_run_dir(workdir: str) -> None:
    """Hold an exclusive lock on `workdir` for the rest of this process (flock on its LOCK_FILE; the OS releases it
    when the process ends, however it ends), so two runs never write one workdir: the second refuses, naming the
    holder. Re-entrant within a process (a test or a notebook may run twice in one workdir)."""
    key = os.path.realpath(workdir)
    if key in _HELD_LOCKS:
        return
    f = open(os.path.join(workdir, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"workdir={workdir!r} is in use by another run ({holder}); expected a workdir no running "
                         f"pdjax run holds") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    _HELD_LOCKS[key] = f


def prepare_run_dir(workdir: str) -> None:
    """Make `workdir` ready for a run before anything runs, so a bad path fails in the first second, not after
    the run (`ready_workdir`: a writable directory holding nothing but a run's outputs). A run owns its files: an
    earlier run's outputs there are removed (a stale outputs.json must never be read as this run's); any other
    file makes it refuse, and so does a workdir another running process holds (`lock_run_dir`). Raises ValueError
    naming the path and the problem."""
    ours = ready_workdir(workdir, is_run_file, "a pdjax run's outputs",
                         "one holding an earlier run's outputs (they are replaced)")
    lock_run_dir(workdir)   # before anything is removed: a run in progress there keeps its files
    # results.json first: a crash in between leaves an unfinished run, never a finished stale one.
    for name in sorted((e for e in ours if e != LOCK_FILE), key=lambda e: e != "results.json"):
        os.remove(os.path.join(workdir, name))


def is_finished_run(workdir: str) -> bool:
    """A run is finished when its results.json exists (it is written last)."""
    return os.path.isfile(os.path.join(workdir, "results.json"))


@dataclasses.dataclass
class RunData:
    config: Any
    summary: Optional[Dict[str, Any]]
    requests: List[RequestRecord]
    iterations: List[IterationRecord]


def _opt_float(s: str) -> Optional[float]:
    return float(s) if s != "" else None


def _read_rows(path: str, columns: Sequence[str]) -> Iterator[Dict[str, str]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != tuple(columns):
            raise ValueError(f"{path}:1: header {reader.fieldnames!r}, expected {list(columns)}")
        for row in reader:
            yield reader.line_num, row


def _read_token_times(workdir: str) -> Dict[str, List[float]]:
    path = os.path.join(workdir, "token_times.csv")
    times: Dict[str, List[float]] = {}
    for line, row in _read_rows(path, TOKEN_COLUMNS):
        seq = times.setdefault(row["request_id"], [])
        if int(row["token_index"]) != len(seq):
            raise ValueError(f"{path}:{line}: token_index={row['token_index']}, expected {len(seq)} "
                             f"(indices of request {row['request_id']!r} must run 0, 1, 2, ... in order)")
        seq.append(float(row["time"]))
    return times


def load_run(workdir: str) -> RunData:
    """Read a workdir written by write_run_outputs back into records (summary None if results.json is absent)."""
    token_times = _read_token_times(workdir)
    requests = []
    for _, row in _read_rows(os.path.join(workdir, "requests.csv"), REQUEST_COLUMNS):
        requests.append(RequestRecord(
            request_id=row["request_id"], arrival_time=float(row["arrival_time"]),
            first_scheduled_time=_opt_float(row["first_scheduled_time"]),
            first_token_time=_opt_float(row["first_token_time"]), finish_time=_opt_float(row["finish_time"]),
            num_prompt_tokens=int(row["num_prompt_tokens"]), num_output_tokens=int(row["num_output_tokens"]),
            num_preemptions=int(row["num_preemptions"]), finish_reason=row["finish_reason"],
            token_times=token_times.get(row["request_id"], []), reject_reason=row.get("reject_reason") or ""))
    iterations = [IterationRecord(
        step=int(row["step"]), start_time=float(row["start_time"]), end_time=float(row["end_time"]),
        num_prefill_tokens=int(row["num_prefill_tokens"]), num_decode_tokens=int(row["num_decode_tokens"]),
        num_seqs=int(row["num_seqs"]), instance=row["instance"], num_compiles=int(row.get("num_compiles") or 0))
        for _, row in _read_rows(os.path.join(workdir, "iterations.csv"), ITERATION_COLUMNS)]
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    summary = None
    if is_finished_run(workdir):
        with open(os.path.join(workdir, "results.json")) as f:
            summary = json.load(f)
    return RunData(config, summary, requests, iterations)


def _percentile(sorted_values: List[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method), written out."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _recomputed_stats(values: List[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {k: None for k in STAT_KEYS}
    s = sorted(values)
    return {"mean": math.fsum(s) / len(s), "p50": _percentile(s, 50), "p90": _percentile(s, 90),
            "p99": _percentile(s, 99)}


def recompute_summary(workdir: str) -> Dict[str, Any]:
    """ttft/tbt/tpot/e2e/sched_delay stats and counts straight from requests.csv and token_times.csv."""
    token_times = _read_token_times(workdir)
    ttft, tbt, tpot, e2e, sched = [], [], [], [], []
    num_requests = num_completed = 0
    for _, row in _read_rows(os.path.join(workdir, "requests.csv"), REQUEST_COLUMNS):
        num_requests += 1
        times = token_times.get(row["request_id"], [])
        if row["finish_reason"] in ("rejected", "aborted", "unfinished") or not times:
            continue
        num_completed += 1
        arrival = float(row["arrival_time"])
        ttft.append(times[0] - arrival)
        e2e.append(times[-1] - arrival)
        sched.append(float(row["first_scheduled_time"]) - arrival)
        tbt.extend(b - a for a, b in zip(times, times[1:]))
        if len(times) >= 2:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
    return {"num_requests": num_requests, "num_completed": num_completed,
            "total_output_tokens": sum(len(t) for t in token_times.values()),
            "ttft": _recomputed_stats(ttft), "tbt": _recomputed_stats(tbt), "tpot": _recomputed_stats(tpot),
            "e2e": _recomputed_stats(e2e), "sched_delay": _recomputed_stats(sched)}


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def summarize_table(summary: Mapping[str, Any]) -> str:
    """A small text table of a summary (latencies in ms) for the CLI."""
    lines = [
        f"requests {summary['num_requests']} (completed {summary['num_completed']}, rejected "
        f"{summary['num_rejected']}, preempted {summary['num_preempted_requests']})  duration "
        f"{summary['duration_s']:.2f} s  throughput {summary['throughput_tok_s']:.1f} tok/s "
        f"{summary['throughput_req_s']:.2f} req/s",
        f"{'metric (ms)':<12}" + "".join(f"{k:>10}" for k in STAT_KEYS),
    ]
    for name in ("ttft", "tbt", "tpot", "e2e", "sched_delay"):
        lines.append(f"{name:<12}" + "".join(f"{_ms(summary[name][k]):>10}" for k in STAT_KEYS))
    attainment = summary.get("slo_attainment")
    slos = {k: v for k, v in (summary.get("slos") or {}).items() if v is not None and k.endswith("_s")}
    lines.append(f"SLOs {slos or 'none (completion only)'}: attainment "
                 f"{'-' if attainment is None else f'{attainment:.3f}'}  goodput {summary['goodput_rps']:.2f} req/s")
    for kind, n in (summary.get("rejections") or {}).items():
        lines.append(f"rejected {n}: {kind}")
    for role, group in ((summary.get("sim") or {}).get("groups") or {}).items():
        stack = group.get("stack") or {}
        if stack.get("kind") == "step_fit":   # a fitted serving stack: its overhead terms with every run
            lines.append(f"stack {stack['stack']!r} on {role}: {stack['source']}; step_floor_s={stack['step_floor_s']} "
                         f"per_context_token_s={stack['per_context_token_s']}")
    compiles = (summary.get("iterations") or {}).get("num_compiles")
    if compiles:
        lines.append(f"WARNING: {compiles} XLA compile(s) during the run; the iterations that compiled are flagged "
                     "in iterations.csv (num_compiles) and their latencies include compile time")
    return "\n".join(lines)
