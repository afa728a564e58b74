"""Entry points run through pdjax.experiment.cli: no INFO chatter on stderr, and a user error is one
`error: ...` line with exit status 2 (a typo'd --config key, a bad value, a missing file, a bad flag combination)."""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": ""})


def test_sim_sweep_is_quiet(tmp_path):
    out = _run("experiments.sweep", "--config=configs/sweeps/budget.py:sim", "--config.base.workload.num_requests=4",
               f"--workdir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    noisy = [line for line in out.stderr.splitlines() if "INFO" in line or "Unable to initialize backend" in line]
    assert noisy == []
    assert (tmp_path / "summary.csv").exists()


@pytest.mark.parametrize("args,expected", [
    (["experiments.sweep", "--config=configs/sweeps/budget.py:sim", "--config.base.scheduler.polcy=x",
      "--workdir=WORKDIR"], "error: bad command-line flag: 'polcy' Did you mean \"policy\" instead of \"polcy\"?"),
    (["experiments.sweep", "--config=configs/sweeps/budget.py:sim", "--config.base.scheduler.max_num_seqs=-3",
      "--workdir=WORKDIR"], "error: sweep point token_budget=256: scheduler.max_num_seqs=-3, expected a positive int"),
    (["experiments.sweep", "--config=configs/sweeps/budget.py:sim", "--workdir=WORKDIR", "--max_retries=3"],
     "error: --max_retries is for --executor=ray"),
    (["experiments.capacity", "--slo_tbt_p99=0.1", "--config.scheduler.polcy=x"],
     "error: bad command-line flag: 'polcy' Did you mean \"policy\" instead of \"polcy\"?"),
    (["experiments.capacity"], "error: no limit given: pass --slo_tbt_p99 and/or --slo_ttft_p99 (seconds)"),
    (["experiments.cost", "--model=nope", "--batch=decode:1@2"], None),
    (["experiments.cost", "--model=yi-34b", "--batch=prefill:4096@1"],
     "error: batch 'prefill:4096@1': prefill:4096@1 reaches context 4097, expected <= max_position_embeddings=4096 "
     "of yi-34b"),
    (["experiments.generate", "--checkpoint=/nonexistent/ckpt", "--prompts=/nonexistent.json", "--out=OUT"],
     "error: prompts file '/nonexistent.json' does not exist"),
    (["experiments.train_tiny", "--text_path=/nonexistent.txt"],
     "error: text_path='/nonexistent.txt' is not a file; expected a text file (or '' for the stdlib pydoc topics "
     "text)"),
    (["experiments.sim_fidelity", "--profile=/nonexistent.json"], "error: --profile='/nonexistent.json' is not a file"),
    (["experiments.sim_paper", "extra"], "error: unexpected arguments ['extra']"),
])
def test_user_errors_are_one_line_with_status_2(tmp_path, args, expected):
    args = [a.replace("WORKDIR", str(tmp_path / "w")).replace("OUT", str(tmp_path / "o.json")) for a in args]
    out = _run(*args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: ")
    if expected:
        assert lines[0] == expected
    assert not (tmp_path / "w" / "summary.csv").exists()
