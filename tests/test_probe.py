"""Runner probing for calibration (pdjax.runtime.probe): the grid and the step-context compositions stay inside the
config's and the runner's limits, the runtime's padded shape of a composition is the simulator's
(pdjax.sim.step_cost.padded_shape, which the profile's raw measurements and its fit use), and the runner's padding
entry is what the simulator reads back. No step runs here (nothing compiles)."""
from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("jax")

from pdjax.config.files import config_file
from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.calibrate import engine_padding
from pdjax.experiment.run import to_plain_dict
from pdjax.runtime import probe
from pdjax.serving.build import build_runner
from pdjax.sim.step_cost import EnginePadding, padded_shape

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "sim" / "fidelity_cpu.py"


@pytest.fixture(scope="module")
def small():
    cfg = serve_config_from_dict({**to_plain_dict(config_file(str(CONFIG), CONFIG.name, "small")), "backend": "real"})
    return cfg, build_runner(cfg)


def test_grid_points_fit_the_limits_and_pad_as_the_simulator_pads(small):
    cfg, runner = small
    grid = probe.engine_grid(cfg, runner, quick=True)
    assert {kind for kind, _, _ in grid} == {"prefill", "decode", "mixed"}
    padding = engine_padding(runner)
    sc = cfg.scheduler
    max_len = min(sc.max_model_len, runner.buckets.max_pages * runner.page_size)
    for kind, prefills, decodes in grid:
        out = probe.synthetic_output(prefills, decodes, page_size=runner.page_size, num_pages=runner.num_pages,
                                     vocab_size=runner.spec.vocab_size)
        assert sum(out.num_new_tokens) <= min(sc.token_budget, runner.buckets.max_tokens), (kind, prefills, decodes)
        assert len(out.num_new_tokens) <= min(sc.max_num_seqs, runner.buckets.max_seqs)
        assert all(c + n <= max_len for c, n in zip(out.num_computed_tokens, out.num_new_tokens))
        assert all(p < runner.num_pages for table in out.page_tables for p in table)
        assert probe.padded_shape(runner, out) == padded_shape(out, padding)
    contexts = probe.context_outputs(cfg, runner)
    shapes = [probe.padded_shape(runner, out) for out in contexts]
    assert len(contexts) >= 2 and len(set(shapes)) == len(shapes)
    assert shapes == [padded_shape(out, padding) for out in contexts]


def test_runner_padding_is_the_profile_entry_the_simulator_reads(small):
    _, runner = small
    entry = probe.runner_padding(runner)
    assert probe.attention_impl(runner) == entry["attention"] == "blocked"     # the CPU default
    padding = engine_padding(runner)
    assert padding == EnginePadding(runner.buckets, runner.page_size, False, "blocked", entry["decode_keys"])
    assert padding.profile_dict() == {"dense_attention": False, "attention": "blocked", "decode_keys": 128}


@pytest.mark.slow
def test_calibrate_entry_point_writes_a_loadable_profile(tmp_path):
    """Smoke test of `python -m experiments.calibrate` at its smallest size (~1 minute on 2 loaded cores: two bucket
    shapes, the quick grid, one repeat, the engine-loop probe)."""
    import json
    import os
    import subprocess
    import sys
    from pdjax.sim.profile import load_profile
    out_path = tmp_path / "cpu.json"
    out = subprocess.run([sys.executable, "-m", "experiments.calibrate", f"--config={CONFIG}:small", "--quick",
                          "--repeats=1", f"--out={out_path}"], capture_output=True, text=True,
                         cwd=CONFIG.parents[2], timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    profile = load_profile(out_path)
    assert report["profile"] == str(out_path) and report["attention_impl"] == "blocked"
    assert profile.padding == {"dense_attention": False, "attention": "blocked", "decode_keys": 128}
    assert profile.hardware_spec is not None and profile.fit["num_measurements"] == len(profile.extra["measurements"])
    assert profile.extra["step_context"]["switch"]
    assert report["step_noise"] is not None
