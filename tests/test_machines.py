"""Machine SKUs, phase energy and cost (pdjax.sim.machines): the sums the provisioning results stand on."""
import types

import pytest

from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.machines import MACHINES, busy_seconds_by_phase, energy_report, get_machine, machine_for_hardware


def _it(instance, start, end, prefill):
    return types.SimpleNamespace(instance=instance, start_time=start, end_time=end, num_prefill_tokens=prefill)


def test_every_machine_names_known_hardware_and_splitwise_ratios_hold():
    for m in MACHINES.values():
        get_hardware_spec(m.hardware)
    a100, h100, cap = get_machine("dgx-a100"), get_machine("dgx-h100"), get_machine("dgx-h100-pcap")
    assert 86 * a100.cost_per_hour == pytest.approx(40 * h100.cost_per_hour, rel=0.01)   # splitwise-sim isocost
    assert cap.tdp_w == pytest.approx(0.7 * h100.tdp_w) and cap.prompt_w == pytest.approx(0.7 * h100.prompt_w)
    assert machine_for_hardware("h100-sxm") is h100
    with pytest.raises(ValueError, match="machine='dgx-b200', expected one of"):
        get_machine("dgx-b200")
    with pytest.raises(ValueError, match="hardware='tpu-v5e'"):
        machine_for_hardware("tpu-v5e")


def test_one_request_energy_is_its_phases_times_the_phase_powers():
    """One request on a 2-GPU instance: a 0.3 s prefill step then four 0.05 s decode steps, run lasting 1.0 s."""
    m = get_machine("dgx-a100")
    its = [_it("p0", 0.0, 0.3, 128)] + [_it("p0", 0.3 + 0.05 * k, 0.35 + 0.05 * k, 0) for k in range(4)]
    report = energy_report(its, {"p0": (m, 2)}, duration_s=1.0, num_completed=1)
    want = 2 * (0.3 * m.prompt_w + 0.2 * m.token_w + 0.5 * m.idle_w)
    assert report["energy_j"] == pytest.approx(want) and report["energy_per_request_j"] == pytest.approx(want)
    inst = report["per_instance"]["p0"]
    assert (inst["prompt_s"], inst["token_s"], inst["idle_s"]) == pytest.approx((0.3, 0.2, 0.5))


def test_cluster_cost_is_machines_times_rate_times_time():
    a100, h100 = get_machine("dgx-a100"), get_machine("dgx-h100")
    instances = {"prefill0": (h100, 8), "prefill1": (h100, 8), "decode0": (a100, 4), "decode1": (a100, 4)}
    report = energy_report([], instances, duration_s=1800.0, num_completed=0)
    assert report["machine_hours"] == pytest.approx(3 * 0.5)
    assert report["cost_usd"] == pytest.approx((2 * h100.cost_per_hour + 1 * a100.cost_per_hour) * 0.5)
    assert report["energy_per_request_j"] is None
    assert report["energy_j"] == pytest.approx(1800.0 * (16 * h100.idle_w + 8 * a100.idle_w))


def test_overlapping_steps_count_once_and_prompt_wins_the_overlap():
    prompt, token = busy_seconds_by_phase([(0.0, 1.0, 0), (0.5, 1.5, 10), (1.2, 2.0, 0), (3.0, 3.5, 0)])
    assert prompt == pytest.approx(1.0) and token == pytest.approx(2.5 - 1.0)


def test_bad_machine_values_are_named():
    from pdjax.sim.machines import MachineSpec
    with pytest.raises(ValueError, match="token_w <= prompt_w"):
        MachineSpec("x", "a100-80gb-sxm", 8, tdp_w=1, cost_per_hour=1, idle_w=1, prompt_w=2, token_w=3)
    with pytest.raises(ValueError, match="gpus=0"):
        MachineSpec("x", "a100-80gb-sxm", 0, tdp_w=1, cost_per_hour=1, idle_w=1, prompt_w=3, token_w=2)


def _serve(deployment, num_requests=1, rate=1.0, hardware="a100-80gb-sxm", policy="vllm_v0"):
    from pdjax.config.serving import serve_config_from_dict
    return serve_config_from_dict({
        "backend": "sim", "seed": 1, "model": {"checkpoint": "llama-2-7b"},
        "engine": {"mode": "online", "progress": False},
        "scheduler": {"policy": policy, "token_budget": 4096, "max_num_seqs": 64, "max_model_len": 4096,
                      "page_size": 16, "num_pages": 4096},
        "workload": {"prompt_len": {"kind": "fixed", "value": 900}, "output_len": {"kind": "fixed", "value": 12},
                     "num_requests": num_requests, "rate": rate, "vocab_size": 32000},
        "sim": {"hardware": hardware}, "deployment": deployment})


def test_a_simulated_one_request_run_draws_its_phase_durations_times_the_phase_powers():
    """The real simulator, one request on an 8-GPU DGX-A100 instance: prompt seconds = its TTFT, token seconds =
    its decode steps (the request's own unloaded run, pdjax.sim.reference), idle = the rest of the run."""
    from pdjax.config.model_specs import get_model_spec
    from pdjax.sim.reference import ReferenceMachine, UnloadedRuns
    from pdjax.sim.run import sim_info, simulate_config
    cfg = _serve({"kind": "colocated", "colocated": {"tp": 8}}, rate=0.25)
    result, setup = simulate_config(cfg)
    (record,) = result.requests
    ttft, _, e2e = UnloadedRuns.on(get_model_spec("llama-2-7b"), ReferenceMachine(tp=8)).latencies(900, 12)
    energy = sim_info(result, setup, cfg)["energy"]
    m = get_machine("dgx-a100")
    idle = result.duration_s - e2e
    assert result.duration_s == pytest.approx(record.arrival_time + e2e) and idle > 0
    inst = energy["per_instance"]["replica0"]
    assert (inst["prompt_s"], inst["token_s"], inst["idle_s"]) == pytest.approx((ttft, e2e - ttft, idle))
    want = 8 * (ttft * m.prompt_w + (e2e - ttft) * m.token_w + idle * m.idle_w)
    assert energy["energy_j"] == pytest.approx(want) and energy["energy_per_request_j"] == pytest.approx(want)
    assert energy["machine_hours"] == pytest.approx(result.duration_s / 3600)


def test_a_simulated_cluster_costs_machines_times_rate_times_time():
    """Splitwise-HA: 2 DGX-H100 prompt machines + 1 DGX-A100 token machine (TP 8 each) for a simulated run."""
    from pdjax.sim.run import sim_info, simulate_config
    cfg = _serve({"kind": "disaggregated", "prefill": {"num_instances": 2, "tp": 8, "hardware": "h100-sxm"},
                  "decode": {"num_instances": 1, "tp": 8}}, num_requests=6, rate=4.0, policy="sarathi")
    result, setup = simulate_config(cfg)
    energy = sim_info(result, setup, cfg)["energy"]
    a100, h100 = get_machine("dgx-a100"), get_machine("dgx-h100")
    hours = result.duration_s / 3600
    assert energy["machine_hours"] == pytest.approx(3 * hours)
    assert energy["cost_usd"] == pytest.approx((2 * h100.cost_per_hour + a100.cost_per_hour) * hours)
    assert {k: v["machine"] for k, v in energy["per_instance"].items()} == {
        "prefill0": "dgx-h100", "prefill1": "dgx-h100", "decode0": "dgx-a100"}
