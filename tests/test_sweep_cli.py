"""`python -m experiments.sweep` on bad input: one `error:` line, exit 2, before any point runs, nothing written;
the sweep's workdir rule is the serve run's (pdjax.metrics.report.ready_workdir)."""
import os
import subprocess
import sys

import pytest

from pdjax.experiment import sweep as sweep_lib
from pdjax.metrics import prepare_run_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep(*flags):
    cmd = [sys.executable, "-m", "experiments.sweep", *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def _one_error_line(out):
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_a_missing_config_file_is_one_line(tmp_path):
    line = _one_error_line(_sweep("--config=configs/sweeps/no_such.py", f"--workdir={tmp_path / 'w'}"))
    assert line.startswith("error: --config=configs/sweeps/no_such.py: 'configs/sweeps/no_such.py' does not exist")
    assert not (tmp_path / "w").exists()


def test_a_bad_config_argument_is_one_line(tmp_path):
    line = _one_error_line(_sweep("--config=configs/sweeps/budget.py:nope", f"--workdir={tmp_path / 'w'}"))
    assert "--config=configs/sweeps/budget.py:nope" in line
    assert line.endswith("ValueError: budget: ARG='nope', expected 'real' or 'sim'")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--config=configs/serve.py"], "error: sweep config with keys ['backend', "),       # a serve config
    (["--config=README.md"], "error: bad command-line flag: config file README.md:"),   # not Python
    (["--config=configs/sweeps", ], "error: --config=configs/sweeps: 'configs/sweeps' is a directory"),
    (["--config=configs/sweeps/budget.py:sim", "stray"], "error: unexpected arguments ['stray']"),
])
def test_other_config_mistakes_are_one_line(tmp_path, flags, expected):
    line = _one_error_line(_sweep(*flags, f"--workdir={tmp_path / 'w'}"))
    assert line.startswith(expected)
    assert not (tmp_path / "w").exists()


def test_a_workdir_that_is_a_file_or_cannot_be_created_is_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    line = _one_error_line(_sweep("--config=configs/sweeps/budget.py:sim", f"--workdir={a_file}"))
    assert line == f"error: workdir={str(a_file)!r} exists and is not a directory; expected a directory (new or empty)"
    below = a_file / "w"
    line = _one_error_line(_sweep("--config=configs/sweeps/budget.py:sim", f"--workdir={below}"))
    assert line.startswith(f"error: workdir={str(below)!r} cannot be created: ")
    assert a_file.read_text() == "mine"


def test_a_workdir_of_foreign_files_is_refused_as_serve_refuses_it(tmp_path):
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("mine")
    line = _one_error_line(_sweep("--config=configs/sweeps/budget.py:sim", f"--workdir={workdir}"))
    assert line.startswith(f"error: workdir={str(workdir)!r} holds files that are not a pdjax sweep's point "
                           "directories, summary.csv or comparison.png (notes.txt); expected a new or empty "
                           "directory")
    assert os.listdir(workdir) == ["notes.txt"]


def _fake_run(cfg, workdir):
    with open(os.path.join(workdir, "results.json"), "w") as f:
        f.write("{}")


SWEEP = {"base": {"scheduler": {"token_budget": 512}}, "grid": {"b": ("scheduler.token_budget", [256, 512])}}


def test_one_workdir_rule_for_sweeps_and_runs(tmp_path):
    run_dir, sweep_dir = tmp_path / "run", tmp_path / "sweep"
    run_dir.mkdir()
    (run_dir / "results.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds files that are not a pdjax sweep's .*\(results.json\)"):
        sweep_lib.run_sweep(SWEEP, str(run_dir), _fake_run, log=lambda s: None)
    sweep_lib.run_sweep(SWEEP, str(sweep_dir), _fake_run, log=lambda s: None)
    with pytest.raises(ValueError, match=r"holds files that are not a pdjax run's outputs \(b=256, b=512, "
                                         r"summary.csv\)"):
        prepare_run_dir(str(sweep_dir))
    # A sweep's directory stays its own on a rerun, also with a smaller grid (the earlier points are kept).
    smaller = {"base": SWEEP["base"], "grid": {"b": ("scheduler.token_budget", [256])}}
    sweep_lib.run_sweep(smaller, str(sweep_dir), _fake_run, log=lambda s: None)
    assert sorted(os.listdir(sweep_dir)) == ["b=256", "b=512", "summary.csv"]
    (sweep_dir / "b=512" / "config.json").unlink()      # no longer a run's directory: foreign
    with pytest.raises(ValueError, match=r"\(b=512\)"):
        sweep_lib.run_sweep(smaller, str(sweep_dir), _fake_run, log=lambda s: None)


POINT_DEPENDENT = '''
from pdjax.config.files import config_file
import ml_collections


def get_config():
    base = config_file({readme!r}, "configs/serve.py")
    base.backend = {backend!r}
    base.workload.num_requests = 4
    c = ml_collections.ConfigDict()
    c.base = base
    c.grid = {{{axis!r}: ({key!r}, {values!r})}}
    return c
'''


@pytest.mark.parametrize("backend, axis, key, values, expected", [
    # a workload that cannot be built: a text file that is not there
    ("sim", "text", "workload.text_path", ["", "/no/such/text.txt"],
     "error: sweep point text=-no-such-text.txt: text_path='/no/such/text.txt' is not a file; expected a text file "
     "(or '' for the stdlib pydoc topics text)"),
    # a deployment the model cannot take: more pipeline stages than tiny-byte's 4 layers, on either backend
    *[(backend, "pp", "deployment.colocated.pp", [1, 8],
       "error: sweep point pp=8: deployment.colocated.pp=8 exceeds num_layers=4: every pipeline stage needs at "
       "least one layer (model 'tiny-byte')") for backend in ("sim", "real")],
])
def test_every_point_is_checked_before_the_first_runs(tmp_path, backend, axis, key, values, expected):
    """A point that serve would refuse at start-up fails the sweep at start-up, before the points before it ran
    (they ran, and the bad point failed after them)."""
    config = tmp_path / "sweep_cfg.py"
    config.write_text(POINT_DEPENDENT.format(readme=os.path.join(REPO, "README.md"), backend=backend, axis=axis,
                                             key=key, values=values))
    workdir = tmp_path / "w"
    assert _one_error_line(_sweep(f"--config={config}", f"--workdir={workdir}")) == expected
    assert not workdir.exists()
