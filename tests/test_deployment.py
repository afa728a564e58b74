"""One deployment block for both backends (pdjax.config.deployment): removed keys fail naming their replacement (in
a config dict and on the command line), start-up validation of every group, device assignment, per-instance
scheduler configs, the shared instance/role/router vocabulary, and the simulator running exactly the deployment
(colocated replicas of (pp, tp) behind the router). No JAX."""
from __future__ import annotations

import pathlib

import pytest

from pdjax.config.deployment import (DeploymentConfig, InstanceGroupConfig, deployment_from_dict, instance_name,
                                     instance_scheduler_config, validate_deployment)
from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import REMOVED_SIM_KEYS, serve_config_from_dict
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.instances import Instance, check_instance
from pdjax.scheduler.routing import InstanceRouter

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sim_config(deployment=None, **sim):
    return {
        "backend": "sim", "seed": 2, "model": {"checkpoint": "llama-2-7b"},
        "engine": {"mode": "online", "progress": False},
        "scheduler": {"policy": "sarathi", "token_budget": 512, "max_num_seqs": 64, "max_model_len": 4096,
                      "page_size": 16, "num_pages": 1024},
        "workload": {"preset": "chat", "num_requests": 24, "rate": 4.0, "vocab_size": 32000, "fit_to_model": True},
        "slo": {"ttft": 2.0, "tbt": 0.2},
        "sim": {"hardware": "a100-80gb-sxm", **sim},
        "deployment": dict(deployment or {}),
    }


# --------------------------------------------------------------------------------------------------- removed keys
@pytest.mark.parametrize("key,value,replacement", [
    ("tp", 2, "set deployment.colocated.tp"),
    ("pp", 2, "set deployment.colocated.pp"),
    ("num_replicas", 2, "set deployment.colocated.num_instances"),
    ("router", "least_outstanding_tokens", "set deployment.router"),
    ("num_microbatches", 4, "pipeline batches in flight come from the schedule: up to pp batches, see "
                            "deployment.<group>.pp"),
])
def test_old_sim_keys_fail_naming_their_replacement(key, value, replacement):
    assert key in REMOVED_SIM_KEYS
    with pytest.raises(ValueError, match=f"^sim.{key} is not a key any more: {replacement}"):
        serve_config_from_dict(sim_config(**{key: value}))


def test_every_removed_sim_key_is_tested():
    assert set(REMOVED_SIM_KEYS) == {"tp", "pp", "num_replicas", "router", "num_microbatches"}


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_group_dp_fails_naming_num_instances(role):
    with pytest.raises(ValueError, match=f"^deployment.{role}.dp is not a key any more: replicas are "
                                         f"deployment.{role}.num_instances"):
        serve_config_from_dict(sim_config({role: {"dp": 2}}))
    with pytest.raises(ValueError, match=f"deployment.{role}.dp is not a key"):
        deployment_from_dict({role: {"dp": 1}})


def _parse_command_line(*overrides):
    from absl import flags
    from ml_collections import config_flags
    fv = flags.FlagValues()
    argv = ["prog", f"--config={ROOT / 'configs/serve.py'}", *overrides]
    config_flags.DEFINE_config_file("config", str(ROOT / "configs/serve.py"), flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config


@pytest.mark.parametrize("flag,message", [
    ("--config.sim.tp=2", "sim.tp is not a key any more: set deployment.colocated.tp"),
    ("--config.sim.num_replicas=2", "sim.num_replicas is not a key any more: set deployment.colocated.num_instances"),
    ("--config.sim.router=least_loaded", "sim.router is not a key any more: set deployment.router"),
    ("--config.sim.num_microbatches=2", "sim.num_microbatches is not a key any more"),
    ("--config.deployment.prefill.dp=2", r"deployment.<group>.dp is not a key any more: replicas are "
                                         r"deployment.<group>.num_instances"),
])
def test_old_keys_on_the_command_line_name_their_replacement(flag, message):
    with pytest.raises((AttributeError, KeyError), match=message):
        _parse_command_line(flag)


def test_new_keys_on_the_command_line():
    c = _parse_command_line("--config.deployment.colocated.num_instances=2", "--config.deployment.colocated.pp=2",
                            "--config.deployment.router=least_loaded", "--config.sim.hardware=a100-80gb-sxm")
    from pdjax.experiment.run import to_plain_dict
    cfg = serve_config_from_dict(to_plain_dict(c))
    dep = cfg.deployment
    assert (dep.kind, dep.router, dep.colocated.num_instances, dep.colocated.pp) == ("colocated", "least_loaded", 2, 2)


# --------------------------------------------------------------------------------------------------- validation
def test_colocated_device_assignment_and_names():
    dep = deployment_from_dict({"colocated": {"num_instances": 2, "pp": 2, "tp": 2},
                                "prefill": {"tp": 8}})               # the other kind's groups are unused
    assert dep.roles == ("colocated",) and dep.num_devices == 8
    assert dep.instance_names("colocated") == ["replica0", "replica1"]
    assert dep.device_assignment(8) == {"replica0": (0, 1, 2, 3), "replica1": (4, 5, 6, 7)}
    explicit = deployment_from_dict({"colocated": {"num_instances": 2, "devices": [6, 3]}})
    assert explicit.device_assignment(8) == {"replica0": (6,), "replica1": (3,)}
    disagg = deployment_from_dict({"kind": "disaggregated", "colocated": {"num_instances": 4}})
    assert disagg.roles == ("prefill", "decode") and disagg.device_assignment(2) == {"prefill0": (0,),
                                                                                     "decode0": (1,)}
    assert [instance_name(r, 1) for r in ("colocated", "prefill", "decode", "mixed")] == \
        ["replica1", "prefill1", "decode1", "mixed1"]
    # The mixed pool (Splitwise) is placed after the decode group; a colocated deployment cannot have one.
    mixed = deployment_from_dict({"kind": "disaggregated", "decode": {"tp": 2}, "mixed": {"num_instances": 2}})
    assert mixed.roles == ("prefill", "decode", "mixed") and mixed.num_devices == 5
    assert mixed.device_assignment(5) == {"prefill0": (0,), "decode0": (1, 2), "mixed0": (3,), "mixed1": (4,)}
    with pytest.raises(ValueError, match="the mixed pool is part of a disaggregated deployment"):
        deployment_from_dict({"mixed": {"num_instances": 1}})


@pytest.mark.parametrize("kind,role", [("colocated", "colocated"), ("disaggregated", "prefill"),
                                       ("disaggregated", "decode")])
def test_bad_layouts_fail_at_start_up_naming_the_value(kind, role):
    spec = get_model_spec("tiny-llama")      # 2 layers, 4 heads, 2 KV heads, MLP 384

    def check(**group):
        validate_deployment(DeploymentConfig(kind=kind, **{role: InstanceGroupConfig(**group)}), spec, 64)

    with pytest.raises(ValueError, match=rf"^deployment.{role}.pp=3 exceeds num_layers=2"):
        check(pp=3)
    with pytest.raises(ValueError, match=rf"^deployment.{role}.tp=4 does not divide num_kv_heads=2 of model "
                                         r"'tiny-llama'"):
        check(tp=4)
    with pytest.raises(ValueError, match=rf"^deployment.{role}.tp=3 does not divide num_heads=4"):
        check(tp=3)
    check(pp=2, tp=2)      # fits
    need = 12 + (kind == "disaggregated")      # the other disaggregated group takes one device
    with pytest.raises(ValueError, match=rf"deployment needs {need} devices \(.*{role} 3 x pp 2 x tp 2.*\), only 8 "
                                         r"available"):
        validate_deployment(DeploymentConfig(kind=kind, **{role: InstanceGroupConfig(num_instances=3, pp=2, tp=2)}),
                            spec, 8)
    with pytest.raises(ValueError, match=rf"deployment.{role}.devices lists device 8, only 8 available"):
        validate_deployment(DeploymentConfig(kind=kind, **{role: InstanceGroupConfig(devices=(8,))}), spec, 8)
    with pytest.raises(ValueError, match=rf"deployment.{role}: devices=\(0,\) has 1 entries, expected "
                                         r"num_instances x pp x tp = 1 x 2 x 1 = 2"):
        deployment_from_dict({"kind": kind, role: {"pp": 2, "devices": [0]}})


def test_bad_group_values_fail_naming_the_key():
    for block, match in (({"colocated": {"num_instances": 0}},
                          "deployment.colocated.num_instances=0, expected a positive int"),
                         ({"colocated": {"pp": 0}}, "deployment.colocated.pp=0, expected a positive int"),
                         ({"colocated": {"chips": 2}}, "unknown config key.*deployment.colocated.chips"),
                         ({"router": "least_outstanding_tokens"}, "now 'least_loaded'")):
        with pytest.raises(ValueError, match=match):
            deployment_from_dict(block)


def test_simulator_validates_the_deployment_at_start_up():
    from pdjax.sim.build import build_setup
    with pytest.raises(ValueError, match="deployment.colocated.pp=33 exceeds num_layers=32"):
        build_setup(serve_config_from_dict(sim_config({"colocated": {"pp": 33}})))
    with pytest.raises(ValueError, match="deployment.colocated.tp=3 does not divide num_heads=32"):
        build_setup(serve_config_from_dict(sim_config({"colocated": {"tp": 3}})))


def test_simulator_refuses_role_policies_on_colocated_replicas():
    from pdjax.sim.build import build_setup
    config = sim_config()
    config["scheduler"]["policy"] = "prefill_only"
    with pytest.raises(ValueError, match="scheduler.policy='prefill_only' with deployment.kind='colocated'"):
        build_setup(serve_config_from_dict(config))


def test_instance_scheduler_config_per_role():
    base = SchedulerConfig(policy="vllm_v0", token_budget=4096, max_num_seqs=16, max_model_len=4096)
    group = InstanceGroupConfig(token_budget=8192, num_pages=999)
    colocated = instance_scheduler_config(base, group, "colocated")
    assert (colocated.policy, colocated.token_budget, colocated.num_pages, colocated.max_num_seqs) == \
        ("vllm_v0", 8192, 999, 16)
    assert instance_scheduler_config(base, InstanceGroupConfig(), "colocated") == base
    assert instance_scheduler_config(base, group, "prefill").policy == "prefill_only"
    # A mixed-pool instance (Splitwise; pdjax.scheduler.mixed) records the base of both role policies.
    mixed = instance_scheduler_config(base, group, "mixed")
    assert (mixed.policy, mixed.token_budget, mixed.num_pages) == ("sarathi", 8192, 999)
    with pytest.raises(ValueError, match="role='split'"):
        instance_scheduler_config(base, group, "split")


# --------------------------------------------------------------------------------------------------- vocabulary
SCHED = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=8, max_model_len=512, num_pages=256)


def _req(rid, prompt, max_tokens=4, t=0.0):
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), t)


def test_instances_check_role_and_policy():
    inst = Instance("replica0", "colocated", make_scheduler(SCHED))
    assert (inst.name, inst.role, inst.num_steps) == ("replica0", "colocated", 0)
    with pytest.raises(ValueError, match="needs a 'prefill_only' scheduler, got 'sarathi'"):
        check_instance("prefill0", "prefill", make_scheduler(SCHED))
    with pytest.raises(ValueError, match="role='split'"):
        Instance("x", "split", make_scheduler(SCHED))
    with pytest.raises(ValueError, match="'x' \\(mixed\\) needs a 'mixed' scheduler"):
        Instance("x", "mixed", make_scheduler(SCHED))
    with pytest.raises(ValueError, match="'replica0' \\(colocated\\) needs a colocated policy, got 'decode_only'"):
        check_instance("replica0", "colocated", make_scheduler(SchedulerConfig(policy="decode_only")))


def test_colocated_least_loaded_router_counts_tokens_still_to_compute():
    from collections import deque
    insts = [Instance(f"replica{i}", "colocated", make_scheduler(SCHED)) for i in range(3)]
    router = InstanceRouter("least_loaded", insts)
    assert router.role == "colocated" and router.pick() is insts[0]      # ties: the first
    insts[0].scheduler.add_request(_req("a", 100, max_tokens=10))        # 100 + 9 tokens to compute
    insts[1].scheduler.add_request(_req("b", 20, max_tokens=50))         # 20 + 49
    assert [router.load(i) for i in insts] == [109, 69, 0]
    insts[2].inbox = deque([_req("c", 80, max_tokens=1)])                 # routed, not yet admitted
    assert router.load(insts[2]) == 80 and router.pick() is insts[1]
    # A step computes tokens: the load falls by what was computed.
    s = insts[0].scheduler
    out = s.schedule(0.0)
    s.update(out, [0 if x else -1 for x in out.do_sample], 0.01)
    assert router.load(insts[0]) == 109 - out.total_tokens
    rr = InstanceRouter("round_robin", insts)
    assert [rr(None, insts).name for _ in range(4)] == ["replica0", "replica1", "replica2", "replica0"]


def test_router_needs_one_role():
    with pytest.raises(ValueError, match="pass role="):
        InstanceRouter("round_robin", [object()])
    mixed = [Instance("replica0", "colocated", make_scheduler(SCHED)),
             Instance("prefill0", "prefill", make_scheduler(SchedulerConfig(policy="prefill_only")))]
    with pytest.raises(ValueError, match="expected one role"):
        InstanceRouter("round_robin", mixed)
    with pytest.raises(ValueError, match="router='least_outstanding_tokens'"):
        InstanceRouter("least_outstanding_tokens", mixed[:1])


# --------------------------------------------------------------------------------------------------- simulation
def test_two_colocated_tp2_replicas_simulate_as_two_instances(tmp_path):
    import json
    from pdjax.experiment.run import run_experiment
    from pdjax.sim.build import build_setup
    config = sim_config({"router": "least_loaded", "colocated": {"num_instances": 2, "tp": 2}})
    run_experiment(config, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["iterations"]["per_instance"]) == {"replica0", "replica1"}
    engine, sim = results["engine"], results["sim"]
    assert {n: (i["role"], i["devices"], i["tp"], i["pp"]) for n, i in engine["instances"].items()} == {
        "replica0": ("colocated", [0, 1], 2, 1), "replica1": ("colocated", [2, 3], 2, 1)}
    assert all(i["num_iterations"] > 0 for i in engine["instances"].values())
    assert sim["groups"]["colocated"]["num_instances"] == 2 and sim["router"] == "least_loaded"
    assert results["num_completed"] == 24
    # TP2 per replica: more KV room than TP1 (params and KV heads split over two devices).
    tp1 = build_setup(serve_config_from_dict(sim_config()))
    assert sim["num_pages"] > 2 * tp1.scheduler_config.num_pages


def test_colocated_pp2_validates_and_simulates():
    from pdjax.sim.run import simulate_config
    cfg = serve_config_from_dict(sim_config({"colocated": {"pp": 2}}))
    assert cfg.deployment.colocated.pp == 2
    result, setup = simulate_config(cfg)
    g = setup.groups["colocated"]
    assert (g.pp, g.tp, g.devices, g.names) == (2, 1, ((0, 1),), ("replica0",))
    assert len(result.requests) == 24 and all(r.completed for r in result.requests)
    base, _ = simulate_config(serve_config_from_dict(sim_config()))
    assert result.num_iterations > 0 and base.num_iterations > 0


def test_round_robin_replicas_split_the_requests():
    from pdjax.sim.run import simulate_config
    cfg = serve_config_from_dict(sim_config({"colocated": {"num_instances": 3}}))
    result, setup = simulate_config(cfg)
    assert setup.groups["colocated"].names == ("replica0", "replica1", "replica2")
    assert {it.instance for it in result.iterations} == {"replica0", "replica1", "replica2"}
