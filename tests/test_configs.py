"""Every shipped config file loads and validates (each sweep point too) and simulates a few requests of exactly its
deployment, and bad values fail at start-up."""
import pathlib

import pytest

from pdjax.config.files import config_file
from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.run import to_plain_dict
from pdjax.experiment.sweep import expand_grid

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = [("configs/serve.py", None), ("configs/sweeps/budget.py", "real"), ("configs/sweeps/budget.py", "sim"),
           ("configs/sweeps/sarathi_ablation.py", "chat"), ("configs/sweeps/sarathi_ablation.py", "arxiv"),
           ("configs/sweeps/sarathi_ablation_paper.py", "chat"), ("configs/sweeps/sarathi_ablation_paper.py", "arxiv"),
           ("configs/sim/chat10k.py", None), ("configs/sim/chat10k.py", "replicas-kv_centric"),
           ("configs/sim/fidelity_cpu.py", None),
           ("configs/sim/paper_base.py", "yi34b"), ("configs/sim/paper_base.py", "mistral7b"),
           ("configs/sim/capacity_paper.py", "mistral7b-sarathi-strict"),
           ("configs/sim/capacity_paper.py", "yi34b-orca-relaxed"),
           ("configs/sim/disagg_paper.py", "1p1d-chat"), ("configs/sim/disagg_paper.py", "2xtp1-arxiv")]
# The Sarathi-Serve paper configs as the artifact ran them (every variant: tests/test_paper_configs.py).
CONFIGS += [("configs/sim/paper_base.py", "llama70b"), ("configs/sim/paper_base.py", "yi34b-arxiv"),
            ("configs/sim/capacity_paper.py", "llama70b-sarathi-strict"),
            ("configs/sim/capacity_paper.py", "yi34b-vllm_v0-strict-arxiv")]
# Splitwise-style layouts with a mixed pool (tests/test_mixed_pool.py covers the pool itself).
CONFIGS += [("configs/sim/splitwise.py", "aa-code"), ("configs/sim/splitwise.py", "hh-conv")]
# Configs that replay a trace from ../shared/data/traces: their simulation is skipped where that data is absent.
TRACE_CONFIGS = {"configs/sim/paper_base.py", "configs/sim/capacity_paper.py",
                 "configs/sweeps/sarathi_ablation_paper.py", "configs/sim/splitwise.py"}
TRACES_DIR = ROOT.parent / "shared" / "data" / "traces"


@pytest.fixture(autouse=True)
def _skip_trace_configs_without_data(request):
    callspec = getattr(request.node, "callspec", None)
    if (callspec is not None and callspec.params.get("path") in TRACE_CONFIGS and not TRACES_DIR.is_dir()
            and request.node.originalname == "test_shipped_config_simulates_a_few_requests"):
        pytest.skip(f"shared trace data absent ({TRACES_DIR})")


@pytest.mark.parametrize("path,arg", CONFIGS)
def test_shipped_config_validates(path, arg):
    config = to_plain_dict(config_file(str(ROOT / "README.md"), path, arg))
    points = [cfg for _, _, cfg in expand_grid(config)] if "grid" in config else [config]
    for cfg in points:
        serve_config_from_dict(cfg)


@pytest.mark.parametrize("path,arg", CONFIGS)
def test_shipped_config_simulates_a_few_requests(path, arg):
    """Any serve config runs with --config.backend=sim (configs/README.md): its deployment, simulated."""
    from pdjax.sim.run import simulate_config
    config = to_plain_dict(config_file(str(ROOT / "README.md"), path, arg))
    if "grid" in config:
        config = next(cfg for _, _, cfg in expand_grid(config))
    config["backend"] = "sim"
    config["workload"]["num_requests"] = 4
    cfg = serve_config_from_dict(config)
    result, setup = simulate_config(cfg)
    assert len(result.requests) == 4 and all(r.completed for r in result.requests)
    dep = cfg.deployment
    assert setup.kind == dep.kind and set(setup.groups) == set(dep.roles)
    for role in dep.roles:
        g, want = setup.groups[role], dep.group(role)
        assert (g.num_instances, g.pp, g.tp) == (want.num_instances, want.pp, want.tp)


def test_every_config_file_is_covered():
    shipped = {str(p.relative_to(ROOT)) for p in ROOT.glob("configs/**/*.py") if p.name != "__init__.py"}
    assert shipped == {p for p, _ in CONFIGS}


@pytest.mark.parametrize("key,value,match", [
    ("scheduler.token_budget", 0, "token_budget"),
    ("scheduler.policy", "fifo", "policy"),
    ("workload.rate", -1.0, "rate"),
    ("engine.mode", "batch", "engine.mode"),
    ("slo.tbt", -0.1, "slo.tbt"),
])
def test_bad_values_fail_naming_the_key(key, value, match):
    config = to_plain_dict(config_file(str(ROOT / "README.md"), "configs/serve.py"))
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ValueError, match=match):
        serve_config_from_dict(config)


def test_missing_config_file_is_a_clear_error():
    with pytest.raises(ValueError, match="does not exist"):
        config_file(str(ROOT / "README.md"), "configs/nope.py")
