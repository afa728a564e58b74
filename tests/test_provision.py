"""Provisioning (pdjax.sim.provision, experiments.provision): on a small synthetic problem the reported cheapest,
least-power and fewest-machine clusters meet the SLOs and nothing cheaper in the search space does (every
candidate simulated: brute force); the iso-budget answers hold against brute force; serial, process-parallel and
Ray give the same answer; the PNGs are drawn; bad inputs fail in one line."""
import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

from pdjax.config.serving import serve_config_from_dict
from pdjax.sim import provision as pv
from pdjax.sim.machines import get_machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = {"kind": "synthetic", "arrival": "poisson", "num_requests": 30, "seed": 0,
            "prompt_len": {"kind": "uniform", "low": 200, "high": 3000},
            "output_len": {"kind": "uniform", "low": 10, "high": 200}}


def small_problem(**changes):
    base = dict(model="llama-2-7b", workload=WORKLOAD, target_rate=20.0, max_machines=3,
                cost_budget=2 * get_machine("dgx-h100").cost_per_hour,
                power_budget=2 * get_machine("dgx-h100").tdp_w)
    return pv.ProvisionProblem(**{**base, **changes})


def every_cluster(problem):
    top = problem.max_machines
    for system in problem.systems:
        if system.kind == "colocated":
            yield from (pv.Cluster(system, n) for n in range(1, top + 1))
        else:
            yield from (pv.Cluster(system, p, t) for p in range(1, top + 1) for t in range(1, top + 1))


@pytest.fixture(scope="module")
def problem():
    return small_problem(cost_budget=0.0, power_budget=0.0)      # the iso-throughput questions


@pytest.fixture(scope="module")
def result(problem):
    return pv.provision(problem, workers=1)


@pytest.fixture(scope="module")
def brute(problem):
    """Every candidate of the search space at the target rate, simulated."""
    return {c.key(): (c, pv.probe(problem, c, problem.target_rate)) for c in every_cluster(problem)}


def test_the_cheapest_least_power_and_fewest_machine_answers_are_those_of_brute_force(result, brute):
    passing = [c for c, p in brute.values() if p.passes]
    assert passing and len(passing) < len(brute)      # the problem has both kinds
    for question, figure, of in (("cheapest", "cost_per_hour", lambda c: c.cost_per_hour),
                                 ("least_power", "power_kw", lambda c: c.power_w / 1e3),
                                 ("fewest_machines", "num_machines", lambda c: c.num_machines)):
        got = result["answers"][question]
        cluster, probe = brute[(got["system"], got["num_prompt"], got["num_token"])]
        assert probe.passes, question                       # it meets the SLOs when simulated again
        assert got[figure] == pytest.approx(min(of(c) for c in passing)), question   # nothing passing is better
        # and per system: its best is the brute-force best of that system (or none passes)
        for name, entry in result["systems"].items():
            mine = [c for c in passing if c.system.name == name]
            if not mine:
                assert entry.get(question) is None, (question, name)
            else:
                assert entry[question][figure] == pytest.approx(min(of(c) for c in mine)), (question, name)


def test_iso_budget_answers_pass_when_simulated_again():
    problem = small_problem(designs=("Baseline-A100", "Splitwise-HA"))
    result = pv.provision(problem)
    best_rate = max(e["iso_cost"]["rate"] for e in result["systems"].values())
    assert result["answers"]["iso_cost"]["rate"] == pytest.approx(best_rate, rel=1e-6)
    for question in ("iso_cost", "iso_power"):
        budget = problem.cost_budget if question == "iso_cost" else problem.power_budget
        for name, entry in result["systems"].items():
            answer = entry[question]
            assert answer["budget"] == budget
            if answer["best"] is None:
                continue
            system = next(s for s in problem.systems if s.name == name)
            best = pv.Cluster(system, answer["best"]["num_prompt"], answer["best"]["num_token"])
            figure = best.cost_per_hour if question == "iso_cost" else best.power_w
            assert figure <= budget * (1 + 1e-9) and answer["rate"] > 0
            assert pv.probe(problem, best, answer["rate"]).passes, (question, name)


def _capacity_oracle(problem, cluster, rate):
    """A synthetic oracle, monotone in pool sizes and rate: colocated n holds 3n req/s, P+T holds min(5P, 4T)."""
    if cluster.system.kind == "colocated":
        capacity = 3.0 * cluster.num_prompt
    else:
        capacity = min(5.0 * cluster.num_prompt, 4.0 * cluster.num_token)
    ok = rate <= capacity
    return pv.Probe(cluster, rate, ok, {}, ok, None, 1, None, 1.0)


def test_iso_budget_search_is_exact_against_brute_force_on_a_monotone_oracle():
    a100 = get_machine("dgx-a100")
    problem = small_problem(designs=("Splitwise-AA", "Baseline-A100", "Splitwise-HA"), target_rate=2.0,
                            cost_budget=4.3 * a100.cost_per_hour, power_budget=0.0, rel_tol=0.01, max_probes=30)
    for system in problem.systems:
        out = pv.run_unit(problem, pv.Unit("iso_cost", system), _capacity_oracle)
        clusters = pv.budget_clusters(problem, system, "iso_cost")
        truth = max(_capacity_oracle_capacity(c) for c in clusters)
        assert truth * (1 - problem.rel_tol) <= out["rate"] <= truth, system.name
        got = pv.Cluster(system, out["best"]["num_prompt"], out["best"]["num_token"])
        assert _capacity_oracle_capacity(got) == truth
        assert len(out["probes"]) < 30 * len(clusters)
    aa = pv.run_unit(problem, pv.Unit("iso_cost", problem.systems[0]), _capacity_oracle)
    assert aa["best"]["cluster"] == "2P+2T" and aa["rate"] == pytest.approx(8.0, rel=0.01)


def _capacity_oracle_capacity(cluster):
    lo, hi = 0.0, 1e3
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _capacity_oracle(None, cluster, mid).passes else (lo, mid)
    return round(lo, 6)


def test_serial_and_parallel_give_the_same_answer(problem, result):
    parallel = pv.provision(problem, workers=2)
    assert parallel["answers"] == result["answers"]
    assert parallel["systems"] == result["systems"] and parallel["table"] == result["table"]
    assert parallel["num_simulations"] == result["num_simulations"] > 0


@pytest.mark.slow
def test_ray_gives_the_same_answer():
    pytest.importorskip("ray")
    problem = small_problem(designs=("Baseline-H100", "Splitwise-HH"), cost_budget=0.0)
    assert pv.provision(problem, executor="ray", workers=2)["answers"] == pv.provision(problem)["answers"]


def test_the_staircase_prunes_and_uses_monotonicity():
    """A synthetic oracle (no simulator): (P, T) passes iff P >= 2 and T >= 4 - P (and colocated n >= 3). The
    search finds the staircase {(2, 2), (3, 1)} with fewer probes than the 16 candidates."""
    def fake(problem, cluster, rate):
        if cluster.system.kind == "colocated":
            ok = cluster.num_prompt >= 3
        else:
            ok = cluster.num_prompt >= 2 and cluster.num_token >= 4 - cluster.num_prompt and rate <= 10
        return pv.Probe(cluster, rate, ok, {}, ok, None, 1, None, 1.0)

    problem = small_problem(designs=("Splitwise-HH", "Baseline-A100"), max_machines=4, cost_budget=0.0,
                            power_budget=0.0, target_rate=10.0)
    out = pv.run_unit(problem, pv.Unit("throughput", problem.systems[0]), fake)
    assert [f["cluster"] for f in out["frontier"]] == ["2P+2T", "3P+1T"]
    assert len(out["probes"]) < 16
    assert out["best"]["cheapest"]["cluster"] == "2P+2T" and out["best"]["fewest_machines"]["cluster"] == "2P+2T"
    colocated = pv.run_unit(problem, pv.Unit("throughput", problem.systems[1]), fake)
    assert colocated["best"]["cheapest"]["cluster"] == "3"
    assert pv._least_passing(lambda n: n >= 11, 1, 16) == 11 and pv._least_passing(lambda n: False, 1, 16) is None


def test_budget_clusters_are_the_maximal_ones():
    h100, a100 = get_machine("dgx-h100"), get_machine("dgx-a100")
    problem = small_problem(cost_budget=2 * h100.cost_per_hour + 0.5 * a100.cost_per_hour)
    ha = next(s for s in problem.systems if s.design == "Splitwise-HA")
    got = [(c.num_prompt, c.num_token) for c in pv.budget_clusters(problem, ha, "iso_cost")]
    # an H100 machine costs 2.15 A100s: P=1 leaves 1 H100 + 0.5 A100 = 2.65 A100s -> T=2; P=2 leaves 0.5 -> none
    assert got == [(1, 2)]
    coloc = next(s for s in problem.systems if s.design == "Baseline-A100")
    assert [c.num_prompt for c in pv.budget_clusters(problem, coloc, "iso_cost")] == [4]


def test_a_trace_is_replayed_at_its_own_times_scaled_to_the_rate():
    path = os.path.join(REPO, os.pardir, "shared", "data", "traces", "azure_llm_2023_code.csv")
    if not os.path.exists(path):
        pytest.skip("the Azure traces are not here")
    from pdjax.workload import WorkloadConfig, make_workload
    wl = pv.trace_workload(path, 50)
    for rate in (2.0, 8.0):
        reqs = make_workload(WorkloadConfig.from_dict(pv.workload_at(wl, rate)), 0)
        times = sorted(r.arrival_time for r in reqs)
        assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(rate)
    own = pv.replay_rate(path, 0, 50)
    base = make_workload(WorkloadConfig.from_dict(pv.workload_at(wl, own)), 0)
    fast = make_workload(WorkloadConfig.from_dict(pv.workload_at(wl, 2 * own)), 0)
    assert [r.num_prompt_tokens for r in base] == [r.num_prompt_tokens for r in fast]
    assert [2 * f.arrival_time for f in fast] == pytest.approx([b.arrival_time for b in base])


def test_the_capped_token_machine_is_slower_at_prefill_only_and_draws_less():
    """Splitwise-HHcap vs -HH, same pools: the capped machine runs a prefill-carrying step at 0.7 of the H100's
    compute and a decode-only step at full speed, so token machines that only decode serve exactly as fast; the
    cluster provisions 0.7 of the H100's power for them (the energy drawn is the same)."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.scheduler.output import SchedulerOutput
    from pdjax.sim.build import build_setup, group_step_time
    problem = small_problem()
    hh = pv.Cluster(next(s for s in problem.systems if s.design == "Splitwise-HH"), 1, 2)
    cap = pv.Cluster(next(s for s in problem.systems if s.design == "Splitwise-HHcap"), 1, 2)
    assert cap.power_w == pytest.approx(get_machine("dgx-h100").tdp_w * (1 + 2 * 0.7))
    assert cap.cost_per_hour == pytest.approx(hh.cost_per_hour)
    setup = build_setup(serve_config_from_dict(pv.serve_config(problem, cap, 5.0)))
    capped_setup = pv.capped(setup, pv.role_machines(cap))
    assert capped_setup.groups["decode"].hardware.peak_flops_bf16 == pytest.approx(
        0.7 * setup.hardware.peak_flops_bf16)
    assert capped_setup.groups["prefill"].hardware is None
    instances = {"decode": [types.SimpleNamespace(step_time=group_step_time(setup, "decode"),
                                                  timer=types.SimpleNamespace(step_time=None))]}
    pv.cap_instances(setup, pv.role_machines(cap))(instances)
    step = instances["decode"][0].step_time
    assert instances["decode"][0].timer.step_time is step
    full, slow = group_step_time(setup, "decode"), group_step_time(capped_setup, "decode")
    prefill = SchedulerOutput(0, ["a"], [[0] * 4], [0], [2000], [[0]], [True], [], [True], 2000, 0)
    decode = SchedulerOutput(0, [str(i) for i in range(64)], [[0]] * 64, [900] * 64, [1] * 64, [[0]] * 64,
                             [True] * 64, [], [False] * 64, 0, 64)
    assert step(prefill) == slow(prefill) > 1.05 * full(prefill)
    assert step(decode) == full(decode) < slow(decode)
    a, b = pv.probe(problem, hh, 5.0), pv.probe(problem, cap, 5.0)
    assert b.slowdowns == a.slowdowns
    # decode-only token machines draw the H100's token and idle power under the cap (pdjax.sim.machines)
    assert b.energy_per_request_j == pytest.approx(a.energy_per_request_j)
    assert pv.cap_instances(setup, pv.role_machines(hh)) is None


def test_mixed_on_sets_the_borrow_key():
    problem = small_problem(mixed=("on",))
    s = problem.systems[-1]
    cfg = pv.serve_config(problem, pv.Cluster(s, 1, 1), 5.0)
    assert cfg["deployment"]["mixed_pool"] == "borrow"
    assert serve_config_from_dict(cfg).deployment.mixed_pool == "borrow"


@pytest.mark.parametrize("changes,match", [
    ({"designs": ("Splitwise-XY",)}, "unknown design 'Splitwise-XY', expected one of"),
    ({"target_rate": 0.0}, "target_rate=0.0, expected a rate > 0"),
    ({"target_rate": -3}, "target_rate=-3, expected a rate > 0"),
    ({"colocated_policies": ("orca",)}, "unknown colocated policy 'orca'"),
    ({"slo": "distserve"}, "slo='distserve', expected one of"),
    ({"slo": "pdjax"}, "slo='pdjax' needs at least one of ttft_s"),
    ({"max_machines": 0}, "max_machines=0, expected a positive int"),
])
def test_bad_problems_are_one_line_errors(changes, match):
    with pytest.raises(ValueError, match=match) as info:
        small_problem(**changes)
    assert "\n" not in str(info.value)


def test_the_cli_writes_json_and_one_png_per_question_and_refuses_bad_flags(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    args = [sys.executable, "-m", "experiments.provision", "--model=llama-2-7b", "--trace=", "--preset=chat",
            "--num_requests=20", "--rate=20", "--max_model_len=4096", "--max_machines=2",
            "--designs=Baseline-H100,Splitwise-HH", "--budget_machines=2", f"--out={tmp_path}"]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cheapest:" in done.stdout
    result = json.loads((tmp_path / "provision.json").read_text())
    assert set(result["answers"]) == set(pv.QUESTIONS)
    for fname, _, _ in pv.PLOTS.values():
        png = tmp_path / fname
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fname
    for bad, match in (("--designs=Splitwise-XY", "unknown design 'Splitwise-XY'"),):
        done = subprocess.run(args[:-1] + [bad, f"--out={tmp_path / 'bad'}"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and match in done.stderr, done.stderr[-2000:]
        assert len([ln for ln in done.stderr.splitlines() if ln.strip()]) == 1, done.stderr


def test_problem_is_a_plain_record():
    d = pv.describe(small_problem())
    assert d["reference"]["hardware"] == "a100-80gb-sxm" and d["reference"]["tp"] == 8
    assert set(d["machines"]) == {"dgx-a100", "dgx-h100", "dgx-h100-pcap"}
    json.dumps(d)
    assert dataclasses.replace(small_problem(), target_rate=3.0).target_rate == 3.0


@pytest.mark.parametrize("flag, message", [
    ("--budget_machines=-1", "error: flag --budget_machines=-1: -1 is not a non-negative integer"),
    ("--num_requests=0", "error: flag --num_requests=0: 0 is not integer >= 2")])
def test_provision_flags_name_themselves(flag, message):
    """issue 27: --budget_machines=-1 named a derived 'cost_budget'; --num_requests=0 spoke of trace rows."""
    out = subprocess.run([sys.executable, "-m", "experiments.provision", flag], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 2 and out.stderr.strip() == message, out.stderr


def test_provision_mixed_both_is_off_and_on(shared_data):
    """issue 27: --mixed=both was refused though the help offers it."""
    out = subprocess.run([sys.executable, "-m", "experiments.provision", "--mixed=both", "--num_requests=20",
                          "--max_machines=2", "--designs=Splitwise-HA"], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "4 simulations" in out.stdout       # the design with the mixed pool off and on
