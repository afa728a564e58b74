"""Every error a user's input can cause is one `error: ...` line with exit status 2, found before anything
compiles (issue 16, items 7-8): a serve config that cannot be built (deployment against the model and the
devices, model spec, dtype, buckets, checkpoint, async scheduling where it cannot run, simulator hardware and
profile) raises pdjax.errors.UserError before warm-up; the entry points print it as one line; placement,
generate and capacity do the same for their own inputs, and a flag of the wrong type is one line too.

The serve cases run in this process (one JAX import for all); the subprocess cases are the few that check what
the user sees (one line, status 2, no traceback, no usage text), mostly entry points that import no JAX."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from pdjax.errors import UserError

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = REPO / "checkpoints" / "tiny-byte"
TRACE = REPO.parent / "shared" / "data" / "traces" / "vidur_splitwise_conv.csv"


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def _one_line(out) -> str:
    """The single stderr line of a user error (status 2, no traceback); fails showing stderr otherwise."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------------ serve, in process
@pytest.fixture(scope="module")
def bad_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    truncated = root / "truncated"
    shutil.copytree(TINY, truncated)
    data = max((p for p in (truncated / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(data, data.stat().st_size // 2)
    not_a_spec = root / "not_a_spec"
    shutil.copytree(TINY, not_a_spec)
    (not_a_spec / "pdjax_spec.json").write_text(json.dumps({"name": "x"}))
    (root / "empty").mkdir()
    return root


def _serve_config(overrides: dict) -> dict:
    """configs/serve.py (tiny-byte) with a 4-request offline workload and `overrides` ('block.key': value)."""
    sys.path.insert(0, str(REPO))
    try:
        from configs.serve import get_config
    finally:
        sys.path.remove(str(REPO))
    from pdjax.experiment.run import to_plain_dict
    config = to_plain_dict(get_config())
    config["engine"].update(mode="offline", progress=False, compilation_cache=False)
    config["workload"]["num_requests"] = 4
    for key, value in overrides.items():
        *blocks, leaf = key.split(".")
        node = config
        for b in blocks:
            node = node[b]
        node[leaf] = value
    return config


SERVE_CASES = {
    "pp beyond the layers": ({"deployment.colocated.pp": 8}, "deployment.colocated.pp=8 exceeds num_layers=4"),
    "tp not dividing heads": ({"deployment.colocated.tp": 3}, "deployment.colocated.tp=3 does not divide num_heads=4"),
    "too many devices": ({"deployment.colocated.num_instances": 5, "deployment.colocated.tp": 2}, "8 available"),
    "device out of range": ({"deployment.colocated.devices": (9,)}, "lists device 9, only 8 available"),
    "overlapping devices": ({"deployment.kind": "disaggregated", "deployment.prefill.devices": (0,),
                             "deployment.decode.devices": (0,)}, "device 0 is in both"),
    "unknown model spec": ({"model.checkpoint": "nope-model"}, "unknown model spec 'nope-model'"),
    "unknown dtype": ({"model.dtype": "float8"}, "dtype='float8', expected one of"),
    "token buckets below the budget": ({"engine.token_buckets": (64,)},
                                       "engine.token_buckets=(64,): the largest, 64, is below the token budget 256"),
    "missing checkpoint": ({"model.checkpoint": "/nonexistent/ckpt"}, "'/nonexistent/ckpt' is not a directory"),
    "empty checkpoint directory": ({"model.checkpoint": "CKPTS/empty"}, "has neither pdjax_spec.json"),
    "malformed checkpoint spec": ({"model.checkpoint": "CKPTS/not_a_spec"}, "reading pdjax_spec.json failed"),
    "truncated checkpoint": ({"model.checkpoint": "CKPTS/truncated"}, "is truncated or corrupt"),
    "async with stop tokens": ({"engine.async_scheduling": True, "model.eos_token_id": 10},
                               "async scheduling needs requests that finish at max_tokens"),
    "async with a disaggregated deployment": ({"engine.async_scheduling": True, "deployment.kind": "disaggregated"},
                                              "engine.async_scheduling=True runs one colocated instance"),
    "sim: unknown hardware": ({"backend": "sim", "sim.hardware": "nope"}, "unknown hardware 'nope'"),
    "sim: unknown profile": ({"backend": "sim", "sim.profile": "nope"}, "machine profile 'nope' not found"),
    "sim: pp beyond the layers": ({"backend": "sim", "deployment.colocated.pp": 8}, "exceeds num_layers=4"),
}


@pytest.mark.parametrize("case", sorted(SERVE_CASES))
def test_serve_input_errors_are_user_errors_before_warm_up(case, bad_checkpoints, tmp_path, monkeypatch):
    from pdjax.experiment.run import prepare_experiment, run_prepared
    from pdjax.serving import run as serving_run

    def no_warm_up(*args, **kwargs):
        raise AssertionError("warm-up ran: the error must be found before anything compiles")
    monkeypatch.setattr(serving_run, "_warm_up", no_warm_up)
    overrides, expected = SERVE_CASES[case]
    overrides = {k: v.replace("CKPTS", str(bad_checkpoints)) if isinstance(v, str) else v
                 for k, v in overrides.items()}
    with pytest.raises(UserError) as info:    # what serve.py turns into one line
        run_prepared(prepare_experiment(_serve_config(overrides), str(tmp_path / "w")))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_fail_on_compile_is_a_user_error():
    """The compile it stops at is the one the user asked to fail on: one line (still a RuntimeError, as before)."""
    from pdjax.serving.engine import CompileTracker
    counts = iter([0, 1])
    tracker = CompileTracker(lambda: next(counts), fail=True)
    with pytest.raises(UserError, match=r"^1 XLA compile\(s\) during iteration 0 after warm-up") as info:
        tracker.new("iteration 0")
    assert isinstance(info.value, RuntimeError)


def test_serve_cli_prints_a_build_error_in_one_line(tmp_path):
    out = _run("experiments.serve", "--config.deployment.colocated.pp=8", "--config.workload.num_requests=2",
               f"--workdir={tmp_path / 'w'}")
    assert _one_line(out) == ("error: deployment.colocated.pp=8 exceeds num_layers=4: every pipeline stage needs at "
                              "least one layer (model 'tiny-byte')")


def test_serve_cli_prints_a_truncated_checkpoint_in_one_line(bad_checkpoints, tmp_path):
    out = _run("experiments.serve", f"--config.model.checkpoint={bad_checkpoints / 'truncated'}",
               "--config.workload.num_requests=2", f"--workdir={tmp_path / 'w'}")
    assert _one_line(out).startswith(f"error: checkpoint '{bad_checkpoints / 'truncated'}' is truncated or corrupt")


# ------------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize("args,expected", [
    (["experiments.generate", "--max_new_tokens=abc", "--prompts=p.json", "--out=o.json"],
     "error: flag --max_new_tokens=abc: expected an integer, got 'abc'"),
    (["experiments.capacity", "--slo_tbt_p99=abc"], "error: flag --slo_tbt_p99=abc: expected a number, got 'abc'"),
    (["experiments.serve", "--config.scheduler.token_budget=abc"],
     "error: flag --config.scheduler.token_budget=abc: expected an integer, got 'abc'"),
])
def test_flag_type_errors_are_one_line_with_status_2(args, expected):
    assert _one_line(_run(*args)) == expected


# ------------------------------------------------------------------------------------------------ generate
def test_generate_refuses_an_output_directory_before_generating(tmp_path):
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = _run("experiments.generate", "--checkpoint=checkpoints/tiny-byte", f"--prompts={tmp_path / 'p.json'}",
               f"--out={out_dir}", "--max_new_tokens=2")
    assert _one_line(out) == f"error: --out='{out_dir}' is a directory; expected the path of a file to write"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "p.json"]    # no gen.tmp left behind
    assert list(out_dir.iterdir()) == []


# ------------------------------------------------------------------------------------------------ capacity
def test_capacity_checks_the_simulator_setup_before_probing():
    out = _run("experiments.capacity", "--slo_tbt_p99=0.1", "--config.backend=sim", "--config.sim.hardware=nope")
    assert _one_line(out).startswith("error: unknown hardware 'nope'; known: ")


# ------------------------------------------------------------------------------------------------ placement
@pytest.mark.parametrize("name,args,expected", [
    ("missing trace", ["--trace=TMP/none.csv"], "error: TMP/none.csv: No such file or directory"),
    ("trace of another format", ["--trace=TMP/other.csv"], "error: TMP/other.csv:1: header ['a', 'b'] is not a known "
                                                           "trace format"),
    ("empty trace", ["--trace=TMP/empty.csv"], "error: TMP/empty.csv:1: empty file, expected a CSV header line"),
    ("binary trace", ["--trace=TMP/binary.csv"], "error: TMP/binary.csv: not a text CSV file (byte 0x89 is not "
                                                 "UTF-8)"),
    ("unknown policy", ["--colocated=fifo"], "error: flag --colocated=['fifo']: unknown 'fifo'; expected some of "
                                             "sarathi, vllm_v0"),
    ("unknown model", ["--model=nope"], "error: unknown model spec 'nope'"),
])
def test_placement_errors_are_one_line_without_usage(tmp_path, name, args, expected):
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "binary.csv").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    line = _one_line(_run("experiments.placement", "--budget=2", "--num_requests=10", "--workers=1", *args))
    assert line.startswith(expected.replace("TMP", str(tmp_path))), name


# ------------------------------------------------------------------------------------------------ messages
def test_a_binary_trace_is_named(tmp_path):
    from pdjax.workload.traces import load_trace
    path = tmp_path / "trace.csv"
    path.write_bytes(b"num_prefill_tokens,num_decode_tokens\n" + bytes(range(128, 256)))
    with pytest.raises(ValueError, match=rf"^{path}: not a text CSV file \(byte 0x80 is not UTF-8\)"):
        load_trace(str(path))


def test_trace_start_beyond_the_trace_says_so(shared_data):
    from pdjax.workload import WorkloadConfig, make_workload
    cfg = WorkloadConfig(kind="trace", trace_path=str(TRACE), num_requests=4, trace_start=100_000, preset="")
    with pytest.raises(ValueError) as info:
        make_workload(cfg, seed=0)
    message = str(info.value)
    assert message.startswith(f"workload.trace_start=100000 is beyond the end of {TRACE}, which has ")
    assert "-" not in message.split("expected")[-1]    # no negative bound


def test_a_missing_config_file_is_one_line(tmp_path):
    """issue 27: `serve --config=<missing file>` printed a 42-line double traceback."""
    out = _run("experiments.serve", "--config=configs/no_such_config.py", f"--workdir={tmp_path / 'w'}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("error: bad command-line flag: --config: [Errno 2] No such file or directory: "
                                  "'configs/no_such_config.py'")


def test_ctrl_c_mid_run_is_one_line(tmp_path):
    """issue 27: SIGINT mid-run printed a 33-line KeyboardInterrupt traceback; now one line and status 130."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-m", "experiments.serve", "--config=configs/serve.py",
                             f"--workdir={tmp_path / 'w'}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(6)     # past start-up, into warm-up or serving
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted (SIGINT); this run's results are not written"
    assert "Traceback" not in err
    assert not (tmp_path / "w" / "results.json").exists()
