"""Command-line tools reject bad values up front with one line naming the flag (generate, bench_scheduler, cost),
and launch/sweep.sh resolves relative paths against the caller's directory."""
import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(args, cwd=REPO, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300, **kw)


# ------------------------------------------------------------------------------------------------ generate
@pytest.mark.parametrize("flags,expected", [
    (["--chunk_size=0"], "flag --chunk_size=0: 0 is not a positive integer"),
    (["--page_size=0"], "flag --page_size=0: 0 is not a positive integer"),
    (["--token_budget=-1"], "flag --token_budget=-1: -1 is not a non-negative integer"),
    (["--max_new_tokens=-1"], "flag --max_new_tokens=-1: -1 is not a non-negative integer"),
    (["--token_budget=8", "--chunk_size=16"], "--token_budget must be 0 (automatic) or >= --chunk_size"),
    (["--attention_impl=fast"], "flag --attention_impl=fast: value should be one of"),
])
def test_generate_rejects_bad_flags_before_loading(tmp_path, flags, expected):
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    out = _run(["experiments.generate", "--checkpoint=checkpoints/tiny-byte", f"--prompts={tmp_path / 'p.json'}",
                f"--out={tmp_path / 'o.json'}", *flags])
    assert out.returncode != 0
    assert expected in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "o.json").exists()


# ------------------------------------------------------------------------------------------------ bench_scheduler
@pytest.mark.parametrize("flag,expected", [
    ("--requests=0", "flag --requests=0: 0 is not a positive integer"),
    ("--repeat=0", "flag --repeat=0: 0 is not a positive integer"),
    ("--prompt_len=0", "flag --prompt_len=0: 0 is not a positive integer"),
    ("--output_len=0", "flag --output_len=0: 0 is not a positive integer"),
    ("--token_budget=0", "flag --token_budget=0: 0 is not a positive integer"),
    ("--max_num_seqs=-2", "flag --max_num_seqs=-2: -2 is not a positive integer"),
    ("--page_size=0", "flag --page_size=0: 0 is not a positive integer"),
    ("--num_pages=-1", "flag --num_pages=-1: -1 is not a non-negative integer"),
    ("--requests=ten", "flag --requests=ten: expected an integer, got 'ten'"),
    ("--policy=fifo", "flag --policy=fifo: value should be one of"),
    ("--num_pages=1", "num_pages=1"),      # too few pages for one request: the config's own check, one line
])
def test_bench_scheduler_rejects_bad_flags(flag, expected):
    out = _run(["experiments.bench_scheduler", "--requests=2", "--prompt_len=64", "--output_len=2", "--repeat=1",
                flag])
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0]   # no usage text before it


def test_bench_scheduler_still_runs():
    from pdjax.experiment import scheduler_bench
    result = scheduler_bench.run(requests=3, prompt_len=8, output_len=2, repeat=1)
    assert result["steps"] > 0 and result["generated_tokens"] == 6


def test_bench_scheduler_cli_prints_the_json():
    out = _run(["experiments.bench_scheduler", "--requests=3", "--prompt_len=8", "--output_len=2", "--repeat=1"])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_tokens"] == 6


# ------------------------------------------------------------------------------------------------ cost
@pytest.mark.parametrize("batch,ok", [("decode:1@4095", True), ("decode:1@4096", False),
                                      ("prefill:4000@96", True), ("prefill:4000@97", False),
                                      ("prefill:16@0,decode:2@9000", False)])
def test_cost_refuses_a_context_beyond_the_model_maximum(batch, ok):
    from pdjax.experiment import cost
    if ok:
        assert cost.run("llama-2-7b", "a100-80gb-sxm", 1, 1, [batch])["batches"][0]["time_s"] > 0
        return
    with pytest.raises(ValueError, match=r"expected <= max_position_embeddings=4096 of llama-2-7b"):
        cost.run("llama-2-7b", "a100-80gb-sxm", 1, 1, [batch])


def test_cost_cli_context_error_is_one_line():
    out = _run(["experiments.cost", "--model=yi-34b", "--batch=decode:8@100", "--batch=prefill:4096@1"])
    assert out.returncode != 0
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "error: batch 'prefill:4096@1': prefill:4096@1 reaches context 4097, expected <= max_position_embeddings=4096 "
        "of yi-34b")


# ------------------------------------------------------------------------------------------------ launch/sweep.sh
def test_sweep_sh_resolves_relative_paths_against_the_callers_directory(tmp_path):
    caller = tmp_path / "here"
    caller.mkdir()
    config = os.path.relpath(REPO / "configs" / "sweeps" / "budget.py", caller)
    out = subprocess.run(["bash", str(REPO / "launch" / "sweep.sh"), f"{config}:sim", "out", "1",
                          "--config.base.workload.num_requests=6"], cwd=caller, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    with open(caller / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["token_budget"] for r in rows] == ["256", "512", "1024", "2048", "4096"]
    assert all(r["status"] == "ok" for r in rows)
    assert not (REPO / "out").exists()


def test_sweep_sh_dry_run_and_argument_errors(tmp_path):
    env = {**os.environ, "SWEEP_DRY_RUN": "1"}
    sh = str(REPO / "launch" / "sweep.sh")
    (tmp_path / "s.py").write_text('backend = "sim"\n')
    out = subprocess.run(["bash", sh, "s.py:x", "w", "3", "--rerun_changed"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["python3", "-m", "experiments.sweep", f"--config={tmp_path}/s.py:x",
                                  f"--workdir={tmp_path}/w", "--parallel=3", "--rerun_changed"]
    out = subprocess.run(["bash", sh, "/abs/w.py", "/abs/w"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "config file '/abs/w.py' not found" in out.stderr
    out = subprocess.run(["bash", sh, "s.py", "w", "0"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "PARALLEL='0', expected a positive integer" in out.stderr


# ------------------------------------------------------------------------------------------------ experiments.sweep
def test_sweep_cli_refuses_a_changed_config_then_reruns_with_the_flag(tmp_path):
    base = ["experiments.sweep", "--config=configs/sweeps/budget.py:sim", f"--workdir={tmp_path}",
            "--config.base.workload.num_requests=6"]
    first = _run(base)
    assert first.returncode == 0, first.stderr[-2000:]
    changed = _run(base[:-1] + ["--config.base.workload.num_requests=8"])
    assert changed.returncode == 2
    assert changed.stderr.strip().splitlines()[-1] == (
        f"error: point token_budget=256 in {tmp_path} was run with a different config (workload.num_requests: "
        "6 -> 8) (and 4 more points); pass --rerun_changed to rerun changed points, or use another --workdir")
    rerun = _run(base[:-1] + ["--config.base.workload.num_requests=8", "--rerun_changed"])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "sweep: 5 points, 0 already done, 5 to run" in rerun.stdout
    again = _run(base[:-1] + ["--config.base.workload.num_requests=8"])
    assert again.returncode == 0 and "5 already done" in again.stdout
