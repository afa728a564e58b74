"""What a run checks before it runs, and what it records: the workdir (a run owns its files), every config field
reachable from the command line, one max_model_len, traces replayed as they are (any scaling or cut recorded),
rejections with their reasons, one-line user errors and quiet output from the serve entry point."""
import csv
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from pdjax.config.deployment import DeploymentConfig, InstanceGroupConfig
from pdjax.config.files import config_file
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import EngineConfig, ModelConfig, SimConfig, SLOConfig, serve_config_from_dict
from pdjax.errors import UserError
from pdjax.experiment.run import prepare_experiment, run_experiment, to_plain_dict
from pdjax.metrics import RUN_FILES, RequestRecord, prepare_run_dir, summarize_table, write_run_outputs
from pdjax.workload import WorkloadConfig, describe_length_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_config():
    return config_file(__file__, "../configs/serve.py")


# ------------------------------------------------------------------------------------------------ workdir
def test_workdir_that_is_a_file_fails_before_anything_runs(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        prepare_run_dir(str(path))
    with pytest.raises(ValueError, match="cannot be created"):
        prepare_run_dir(str(path / "below_a_file"))


def test_workdir_with_foreign_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="notes.txt"):
        prepare_run_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "results.json"]


def test_an_earlier_runs_outputs_are_cleared(tmp_path):
    for name in RUN_FILES + ("results.json.tmp-123",):
        (tmp_path / name).write_text("stale")
    prepare_run_dir(str(tmp_path))
    assert os.listdir(tmp_path) == [".pdjax.lock"]     # the stale outputs are gone; the run holds the workdir


def test_two_runs_never_share_a_workdir(tmp_path):
    """issue 27 item 5: two runs in one workdir both reported success and one's results were lost. The first holds
    the workdir for as long as it runs; the second refuses in one line naming the holder; after the first ends, the
    workdir is free again."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pdjax.metrics import prepare_run_dir; "
                               "prepare_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"is in use by another run \(pid {holder.pid}\)"):
            prepare_run_dir(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    prepare_run_dir(str(tmp_path))        # the lock went with the process
    prepare_run_dir(str(tmp_path))        # and a process may run twice in its own workdir


def test_a_sim_run_never_shows_a_stale_real_run_output(tmp_path):
    """A reused workdir kept outputs.json of an earlier real run; a sim run must not leave it there."""
    (tmp_path / "outputs.json").write_text(json.dumps({"r0": [104, 105]}))
    config = serve_config()
    config.backend = "sim"
    config.workload.num_requests = 4
    run_experiment(config, str(tmp_path))
    assert not (tmp_path / "outputs.json").exists()
    assert (tmp_path / "results.json").exists()


def test_bad_trace_path_fails_before_the_backend_runs(tmp_path, monkeypatch):
    import pdjax.serving.run as serving_run

    def must_not_run(*args, **kwargs):
        raise AssertionError("the backend ran before the trace path was checked")

    monkeypatch.setattr(serving_run, "run_real", must_not_run)
    config = serve_config()
    config.workload.kind = "trace"
    config.workload.preset = ""
    config.workload.trace_path = str(tmp_path / "missing.csv")
    with pytest.raises(UserError, match="missing.csv: No such file or directory"):   # one line at start-up
        run_experiment(config, str(tmp_path / "out"))


# ------------------------------------------------------------------------------------------------ config keys
def _fields(cls, exclude=()):
    return {f.name for f in dataclasses.fields(cls)} - set(exclude)


def test_every_config_field_is_a_key_of_the_serve_config():
    c = serve_config()
    for block, cls, exclude in (("model", ModelConfig, ()), ("engine", EngineConfig, ()),
                                ("scheduler", SchedulerConfig, ()), ("workload", WorkloadConfig, ("max_model_len",)),
                                ("slo", SLOConfig, ("tbt_quantile",)), ("sim", SimConfig, ()),
                                ("deployment", DeploymentConfig, ())):
        assert set(c[block].keys()) == _fields(cls, exclude), block
    for role in ("prefill", "decode"):
        assert set(c.deployment[role].keys()) == _fields(InstanceGroupConfig)


def test_command_line_overrides_of_formerly_missing_knobs_validate():
    """--config.X=... goes through ConfigDict's typed setters; these keys failed with AttributeError before."""
    c = serve_config()
    c.scheduler.preemption_mode = "swap"
    c.scheduler.num_host_pages = 64
    c.scheduler.watermark = 0.05
    c.workload.kind = "trace"
    c.workload.preset = ""
    c.workload.trace_path = "t.csv"
    c.workload.shared_prefix_len = 8
    cfg = serve_config_from_dict(to_plain_dict(c))
    assert cfg.scheduler.preemption_mode == "swap" and cfg.scheduler.watermark == 0.05
    c2 = serve_config()
    c2.workload.prompt_len = "uniform:low=8,high=64"
    c2.workload.output_len = "fixed:value=3"
    w = serve_config_from_dict(to_plain_dict(c2)).workload
    assert (w.prompt_len.kind, w.prompt_len.low, w.prompt_len.high, w.output_len.value) == ("uniform", 8, 64, 3)


def test_one_max_model_len():
    d = to_plain_dict(serve_config())
    d["scheduler"]["max_model_len"] = 512
    assert serve_config_from_dict(d).workload.max_model_len == 512
    d["workload"]["max_model_len"] = 512
    with pytest.raises(ValueError, match="scheduler.max_model_len"):
        serve_config_from_dict(d)


# ------------------------------------------------------------------------------------------------ traces
def test_trace_replay_keeps_the_traces_lengths_and_reports_cuts(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens\n50,7\n80,100\n30,5\n")
    config = serve_config()     # inherits fit_to_model=True and max_output_len=64 from the default run
    config.workload.kind = "trace"
    config.workload.preset = ""
    config.workload.trace_path = str(trace)
    config.workload.num_requests = 3
    config.workload.arrival = "offline"
    prep = prepare_experiment(config, str(tmp_path / "out"))
    by_len = sorted((r.num_prompt_tokens, r.max_tokens) for r in prep.workload)
    assert by_len == [(30, 5), (50, 7), (80, 64)]
    report = prep.length_report
    assert (report["scale"], report["num_prompts_cut"], report["num_outputs_cut"]) == (1.0, 0, 1)
    assert "1 of 3 outputs cut" in describe_length_report(report)


def test_synthetic_fit_is_reported():
    config = serve_config()
    prep_report = prepare_experiment(config, os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                          f"pdjax_fit_{os.getpid()}")).length_report
    assert prep_report["fit_to_model"] and prep_report["scale"] < 1
    assert "scaled" in describe_length_report(prep_report)


# ------------------------------------------------------------------------------------------------ rejections
def test_rejections_are_explained_per_request_and_counted_per_reason(tmp_path):
    records = [RequestRecord("ok", 0.0, 0.0, 0.1, 0.2, 5, 2, token_times=[0.1, 0.2]),
               RequestRecord("a", 0.0, finish_reason="rejected", num_prompt_tokens=900,
                             reject_reason="prompt of 900 tokens exceeds max_model_len=512"),
               RequestRecord("b", 0.0, finish_reason="rejected", num_prompt_tokens=700,
                             reject_reason="prompt of 700 tokens exceeds max_model_len=512"),
               RequestRecord("c", 0.0, finish_reason="rejected", num_prompt_tokens=0,
                             reject_reason="empty prompt: expected at least one token")]
    summary = write_run_outputs(str(tmp_path), {}, records, [], plots=False)
    assert summary["rejections"] == {"prompt of N tokens exceeds max_model_len=N": 2,
                                     "empty prompt: expected at least one token": 1}
    with open(tmp_path / "requests.csv") as f:
        rows = {r["request_id"]: r["reject_reason"] for r in csv.DictReader(f)}
    assert rows == {"ok": "", "a": records[1].reject_reason, "b": records[2].reject_reason,
                    "c": records[3].reject_reason}
    assert "rejected 2: prompt of N tokens exceeds max_model_len=N" in summarize_table(summary)


# ------------------------------------------------------------------------------------------------ the CLI
def _serve(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "experiments.serve", "--config=configs/serve.py", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def test_serve_cli_is_quiet_and_errors_are_one_line(tmp_path):
    bad = _serve("--config.scheduler.polcy=x", f"--workdir={tmp_path / 'x'}")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "polcy" in bad.stderr and "policy" in bad.stderr
    bad = _serve("--config.scheduler.token_budget=-3", f"--workdir={tmp_path / 'x'}")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: scheduler.token_budget=-3, expected a positive int"]
    ok = _serve("--config.backend=sim", "--config.workload.num_requests=6", f"--workdir={tmp_path / 'sim'}")
    assert ok.returncode == 0, ok.stderr
    assert "ttft" in ok.stdout
    noisy = [line for line in ok.stderr.splitlines() if "INFO" in line or "Unable to initialize backend" in line]
    assert noisy == []


def test_serve_on_the_simulator_imports_no_jax(tmp_path):
    """`--config.backend=sim` runs without JAX: an import hook makes any import of jax/jaxlib/flax fail."""
    code = ("import runpy, sys\n"
            "class NoJax:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):\n"
            "            raise ImportError(f'the simulator backend imported {name}')\n"
            "sys.meta_path.insert(0, NoJax())\n"
            "sys.argv = ['serve', '--config=configs/serve.py', '--config.backend=sim',\n"
            f"            '--config.workload.num_requests=4', '--workdir={tmp_path / 'sim'}']\n"
            "try:\n"
            "    runpy.run_module('experiments.serve', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert os.path.isfile(tmp_path / "sim" / "results.json")
