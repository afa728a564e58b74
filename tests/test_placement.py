"""DistServe placement search: candidates respect the budget and the node; serial and parallel rankings agree."""
import pytest

from pdjax.sim import placement as pl

WORKLOAD = {"kind": "synthetic", "num_requests": 16, "seed": 0, "max_model_len": 1024,
            "prompt_len": {"kind": "uniform", "low": 64, "high": 512},
            "output_len": {"kind": "uniform", "low": 8, "high": 64}}


def problem(budget=2, per_node=2, **kw):
    return pl.PlacementProblem(model="opt-13b", node=pl.NodeType("a100-80gb-sxm", gpus_per_node=per_node),
                               gpu_budget=budget, workload=WORKLOAD, ttft_s=0.5, tpot_s=0.1, max_model_len=1024,
                               max_probes=6, rel_tol=0.25, **kw)


@pytest.mark.parametrize("budget,per_node", [(2, 2), (4, 2), (8, 4), (3, 8)])
def test_every_placement_fits_the_budget_and_the_node(budget, per_node):
    prob = problem(budget, per_node)
    cands = pl.enumerate_placements(prob)
    assert cands and len({c.key() for c in cands}) == len(cands)
    for c in cands:
        assert c.num_gpus <= budget
        flat = [d for devs in c.devices for d in devs]
        assert len(set(flat)) == len(flat) and max(flat) < -(-budget // per_node) * per_node
        layouts = [c.prefill] * c.num_prefill + ([c.decode] * c.num_decode if c.decode else [])
        for layout, devs in zip(layouts, c.devices):
            assert layout.tp <= per_node and len(devs) == layout.gpus
            for s in range(layout.pp):              # every stage's TP group inside one node
                assert len({d // per_node for d in devs[s * layout.tp:(s + 1) * layout.tp]}) == 1
        if c.kind == "low":
            for i in range(c.num_prefill):          # each stage's prefill and decode shards share a node
                p, d = c.devices[i], c.devices[c.num_prefill + i]
                for s in range(c.prefill.pp):
                    assert p[s * c.prefill.tp] // per_node == d[s * c.decode.tp] // per_node
    kinds = {c.kind for c in cands}
    assert "colocated" in kinds and "high" in kinds


def test_cross_node_placements_pay_the_network():
    prob = problem(4, 2)
    cands = [c for c in pl.enumerate_placements(prob) if c.kind == "high"]
    hw = prob.node.spec()
    assert any(bw == hw.inter_node_bandwidth for c in cands for bw, _, _ in c.links)
    assert any(bw == hw.intra_node_bandwidth for c in cands for bw, _, _ in c.links)


def test_serial_and_parallel_rankings_agree():
    prob = problem(2, 2)
    cands = [c for c in pl.enumerate_placements(prob, colocated=("sarathi",)) if c.num_gpus <= 2][:4]
    serial = pl.search(prob, workers=1, placements=cands)
    parallel = pl.search(prob, workers=2, placements=cands)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert strip(serial["ranking"]) == strip(parallel["ranking"])
    assert serial["ranking"][0]["per_gpu_goodput_rps"] >= serial["ranking"][-1]["per_gpu_goodput_rps"]
    assert all(r["num_gpus"] <= 2 for r in serial["ranking"])


def test_bad_problems_are_named():
    with pytest.raises(ValueError, match="gpu_budget=0"):
        problem(0)
    with pytest.raises(ValueError, match="attainment"):
        problem(attainment=1.5)
    with pytest.raises(ValueError, match="affinities"):
        pl.search(problem(), affinities=("medium",))


@pytest.mark.parametrize("budget,per_node", [(4, 2), (8, 4)])
def test_every_placement_is_a_deployment_block(budget, per_node):
    """A ranking row's `deployment` runs the same placement from a serve config (same instances and devices)."""
    from pdjax.config.deployment import deployment_from_dict, validate_deployment
    from pdjax.config.model_specs import get_model_spec
    spec = get_model_spec("opt-13b")
    for c in pl.enumerate_placements(problem(budget, per_node)):
        dep = deployment_from_dict(c.deployment())
        assert dep.kind == ("colocated" if c.kind == "colocated" else "disaggregated")
        assignment = validate_deployment(dep, spec, -(-budget // per_node) * per_node)
        names = [n for role in dep.roles for n in dep.instance_names(role)]
        assert [assignment[n] for n in names] == [tuple(d) for d in c.devices]


def test_a_ranked_placement_is_what_its_serve_config_simulates(tmp_path):
    """One simulate path: a candidate's records are those of `experiments.serve --config.backend=sim` run on its
    serve config (the ranking row's deployment block plus the problem's blocks), file for file."""
    import csv
    from pdjax.experiment.run import prepare_experiment, run_prepared
    prob = pl.PlacementProblem(model="opt-13b", node=pl.NodeType("a100-80gb-sxm"), gpu_budget=2, workload=WORKLOAD,
                               ttft_s=0.5, tpot_s=0.1, max_model_len=1024)
    cands = pl.enumerate_placements(prob)
    picked = [next(c for c in cands if c.kind == kind) for kind in ("high", "colocated")]
    picked.append(next(c for c in cands if c.kind == "colocated" and c.policy == "vllm_v0"))
    for i, c in enumerate(picked):
        config = pl.serve_config(prob, c, rate=3.0)
        assert config["deployment"] == pl.Evaluation(c, 0.0, 0.0, (), 0.0).row(prob)["deployment"]
        records = pl.simulate_placement(prob, c, 3.0)
        workdir = tmp_path / f"run{i}"
        run_prepared(prepare_experiment(config, str(workdir)))
        with open(workdir / "requests.csv") as f:
            rows = list(csv.DictReader(f))
        assert [r["request_id"] for r in rows] == [r.request_id for r in records]
        assert [float(r["first_token_time"]) for r in rows] == [r.first_token_time for r in records]
        assert [float(r["finish_time"]) for r in rows] == [r.finish_time for r in records]


def test_disaggregated_groups_carry_their_budgets():
    prob = problem(2, 2)
    c = next(c for c in pl.enumerate_placements(prob) if c.kind != "colocated")
    dep = c.deployment(prob)
    assert (dep["prefill"]["token_budget"], dep["prefill"]["max_num_seqs"]) == (prob.prefill_token_budget,
                                                                               prob.decode_max_num_seqs)
    assert dep["decode"]["token_budget"] == max(prob.decode_max_num_seqs, prob.prefill_token_budget)
    assert "token_budget" not in c.deployment()["prefill"]


def test_placement_links_are_the_simulators():
    """One link model: a candidate's links are kv_link's (equal PP: stage to stage), which the simulator uses."""
    from pdjax.sim.disagg import kv_link
    prob = problem(8, 4, max_pp=2)
    hw = prob.node.spec()
    for c in pl.enumerate_placements(prob):
        if c.kind == "colocated":
            continue
        expect = [kv_link(hw, c.devices[i], c.devices[c.num_prefill + j], c.prefill.pp, c.decode.pp)
                  for i in range(c.num_prefill) for j in range(c.num_decode)]
        assert list(c.links) == expect


def test_stacks_per_role_reach_the_serve_config_and_limit_layouts_to_the_fits():
    import os
    from pdjax.sim.stack import SHARED_PROFILING_DIR
    if not os.path.isdir(os.path.join(SHARED_PROFILING_DIR, "distserve")):
        pytest.skip("../shared/data/profiling/distserve not present")
    prob = problem(budget=8, per_node=8, prefill_stack="distserve", decode_stack="distserve",
                   colocated_stack="distserve-vllm")
    small = problem(budget=2, per_node=1, prefill_stack="distserve", decode_stack="distserve")
    assert small.node.spec().name != "a100-80gb-sxm"      # a node-type variant of the GPU: the fits still apply
    passes, attainment = pl.probe(small, next(p for p in pl.enumerate_placements(small) if p.kind != "colocated"), 1.0)
    assert 0.0 <= attainment <= 1.0
    cands = pl.enumerate_placements(prob)
    tps = {lay.tp for p in cands for lay in (p.prefill, p.decode) if lay is not None}
    assert tps <= {1, 2, 4} and 8 not in tps             # OPT-13B's fits hold TP 1, 2, 4 only
    assert {lay.tp for lay in pl.layouts(pl.get_model_spec("opt-13b"), prob.node.spec(), prob)} >= {8}
    disagg = next(p for p in cands if p.kind != "colocated")
    coloc = next(p for p in cands if p.kind == "colocated")
    dep = pl.serve_config(prob, disagg, 1.0)["deployment"]
    assert dep["prefill"]["stack"] == dep["decode"]["stack"] == "distserve"
    assert pl.serve_config(prob, coloc, 1.0)["deployment"]["colocated"]["stack"] == "distserve-vllm"
    assert "stack" not in pl.serve_config(problem(budget=2), coloc, 1.0)["deployment"]["colocated"]
    with pytest.raises(ValueError, match="decode_stack='vlm', expected one of"):
        problem(decode_stack="vlm")


def test_the_distserve_rule_passes_on_the_p90s_where_pdjax_needs_both_per_request():
    prob_p, prob_d = problem(budget=1, per_node=1), problem(budget=1, per_node=1, slo_rule="distserve")
    cand = next(p for p in pl.enumerate_placements(prob_p) if p.kind == "colocated")
    for rate in (0.5, 4.0, 32.0):
        (pass_p, att_p), (pass_d, att_d) = pl.probe(prob_p, cand, rate), pl.probe(prob_d, cand, rate)
        assert att_p == att_d and pass_p == (att_p >= prob_p.attainment)
        records = pl.simulate_placement(prob_d, cand, rate)
        from pdjax.metrics.latency import SLOs, distserve_slo_check
        assert pass_d == distserve_slo_check(records, SLOs(ttft_s=prob_d.ttft_s, tpot_s=prob_d.tpot_s), 0.9)["passes"]
    with pytest.raises(ValueError, match="slo_rule='p99', expected one of"):
        problem(slo_rule="p99")


def test_decompose_attributes_the_paper_win_to_the_stack(monkeypatch):
    """decompose: the three pairings' ratios, the stack's factor R_paper / R_same and its log share of R_paper."""
    per_gpu = {("pdjax", "pdjax"): (1.0, 2.0), ("distserve", "distserve"): (2.0, 4.0),
               ("distserve-vllm", "distserve"): (2.0, 0.5)}       # (best disagg, best colocated) per GPU

    def fake_search(p, **kw):
        d, c = per_gpu[(p.colocated_stack, p.prefill_stack)]
        return {"best_disaggregated": {"per_gpu_goodput_rps": d},
                "best_colocated": {"sarathi": {"per_gpu_goodput_rps": c / 2}, "vllm_v0": {"per_gpu_goodput_rps": c}},
                "wall_s": 0.0}
    monkeypatch.setattr(pl, "search", fake_search)
    out = pl.decompose(problem())
    assert [v["ratio"] for v in out["pairings"].values()] == [0.5, 0.5, 4.0]
    assert out["stack_factor"] == pytest.approx(8.0)
    assert out["stack_share_of_paper_win"] == pytest.approx(1.5)     # log 8 / log 4: the architecture alone loses
    per_gpu[("distserve-vllm", "distserve")] = (1.0, 2.0)
    assert pl.decompose(problem())["stack_share_of_paper_win"] is None    # no published win to attribute


# ------------------------------------------------------------------------------------------- SLO scale
def _passes_directly(records, ttft_s, tpot_s, rule, attainment):
    """The rule evaluated straight from pdjax.metrics (independent of placement.slo_rule_passes)."""
    from pdjax.metrics.latency import SLOs, distserve_slo_check, meets_slos
    slos = SLOs(ttft_s=ttft_s, tpot_s=tpot_s)
    if rule == "distserve":
        return distserve_slo_check(records, slos, quantile=attainment)["passes"]
    return sum(meets_slos(r, slos) for r in records) / len(records) >= attainment


def _record(i, arrival, ttft, tpot, n_out=5, reason="length"):
    from pdjax.metrics.records import RequestRecord
    times = [arrival + ttft + k * tpot for k in range(n_out)] if reason == "length" else []
    return RequestRecord(f"r{i}", arrival, arrival, times[0] if times else None, times[-1] if times else None,
                         10, len(times), 0, reason, times)


def test_tightest_slo_scale_by_hand():
    """Ten requests with known TTFT / TPOT against SLOs 1 s / 0.1 s: per-request scales max(ttft/1, tpot/0.1)."""
    ttfts = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 3.0]
    tpots = [0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.12, 0.01, 0.01]   # request 7's scale: 1.2
    recs = [_record(i, float(i), a, b) for i, (a, b) in enumerate(zip(ttfts, tpots))]
    # pdjax, 90%: 9 of 10 must pass; sorted scales 0.1..0.7, 0.9, 1.2, 3.0 -> the 9th is 1.2
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "pdjax", 0.9) == pytest.approx(1.2)
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "pdjax", 0.5) == pytest.approx(0.5)
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "pdjax", 1.0) == pytest.approx(3.0)
    # distserve, P90 (numpy linear): TTFT p90 = 0.9 + 0.1 (3.0 - 0.9) = 1.11; TPOT p90 = 0.01 + 0.1 (0.12 - 0.01)
    # = 0.021, so the TTFT binds at SLOs 1 s / 0.1 s (1.11 vs 0.21) and the TPOT at 1 s / 0.01 s (1.11 vs 2.1)
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "distserve", 0.9) == pytest.approx(1.11)
    assert pl.tightest_slo_scale(recs, 1.0, 0.01, "distserve", 0.9) == pytest.approx(2.1)
    # an unserved request counts as infinitely late: one of ten is allowed at 90%, two are not
    recs[9] = _record(9, 9.0, 0, 0, reason="rejected")
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "pdjax", 0.9) == pytest.approx(1.2)
    recs[8] = _record(8, 8.0, 0, 0, reason="unfinished")
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "pdjax", 0.9) is None
    assert pl.tightest_slo_scale(recs, 1.0, 0.1, "distserve", 0.9) is None
    assert pl.tightest_slo_scale([], 1.0, 0.1) is None


@pytest.mark.parametrize("rule", ["pdjax", "distserve"])
def test_the_tightest_scale_passes_and_a_tighter_one_fails(rule):
    """On simulated records (one colocated, one disaggregated candidate, light and heavy load): the scale found
    passes the rule evaluated directly on the records, and 0.1% tighter fails."""
    prob = problem(budget=2, per_node=2, slo_rule=rule)
    cands = pl.enumerate_placements(prob, colocated=("vllm_v0",))
    picked = [next(c for c in cands if c.kind == "colocated"), next(c for c in cands if c.kind != "colocated")]
    for cand in picked:
        for rate in (1.0, 12.0):
            records = pl.simulate_placement(prob, cand, rate)
            s = pl.tightest_slo_scale(records, prob.ttft_s, prob.tpot_s, rule, prob.attainment)
            assert s is not None and s > 0
            assert _passes_directly(records, s * prob.ttft_s, s * prob.tpot_s, rule, prob.attainment)
            t = s * (1 - 1e-3)
            assert not _passes_directly(records, t * prob.ttft_s, t * prob.tpot_s, rule, prob.attainment)


def test_slo_scale_search_simulates_each_candidate_once_and_ranks_tightest_first(monkeypatch):
    prob = problem(budget=2, per_node=2, slo_rule="distserve")
    cands = pl.enumerate_placements(prob, colocated=("vllm_v0",))[:4]
    calls = []
    real = pl.simulate_placement

    def counting(problem_, placement, rate):
        calls.append((placement.name, rate))
        return real(problem_, placement, rate)
    monkeypatch.setattr(pl, "simulate_placement", counting)
    out = pl.slo_scale_search(prob, 2.0, placements=cands)
    assert sorted(calls) == sorted((c.name, 2.0 * c.num_gpus) for c in cands)     # once each, rate per GPU
    scales = [r["tightest_slo_scale"] for r in out["ranking"]]
    held = [s for s in scales if s is not None]
    assert held == sorted(held) and scales[:len(held)] == held
    by_name = {c.name: c for c in cands}
    for row in out["ranking"]:
        records = real(prob, by_name[row["placement"]], row["rate_rps"])
        expect = pl.tightest_slo_scale(records, prob.ttft_s, prob.tpot_s, "distserve", prob.attainment)
        assert row["tightest_slo_scale"] == (None if expect is None else round(expect, 4))
        assert row["passes_at_scale_1"] == (expect is not None and expect <= 1.0)
    with pytest.raises(ValueError, match="per_gpu_rate=0"):
        pl.slo_scale_search(prob, 0.0, placements=cands)


def test_decompose_on_the_slo_scale_axis(monkeypatch):
    """R = best colocated scale / best disaggregated scale (> 1: disaggregation holds tighter SLOs)."""
    scales = {("pdjax", "pdjax"): (2.0, 1.0), ("distserve", "distserve"): (1.0, 0.5),
              ("distserve-vllm", "distserve"): (0.5, 2.0)}        # (best disagg, best colocated) tightest scale

    def fake(p, rate, **kw):
        d, c = scales[(p.colocated_stack, p.prefill_stack)]
        return {"best_disaggregated": {"tightest_slo_scale": d}, "ranking": [],
                "best_colocated": {"sarathi": {"tightest_slo_scale": 2 * c}, "vllm_v0": {"tightest_slo_scale": c}},
                "wall_s": 0.0}
    monkeypatch.setattr(pl, "slo_scale_search", fake)
    out = pl.decompose(problem(), per_gpu_rate=0.5)
    assert [v["ratio"] for v in out["pairings"].values()] == [0.5, 0.5, 4.0]
    assert out["stack_factor"] == pytest.approx(8.0) and out["stack_share_of_paper_win"] == pytest.approx(1.5)


def test_the_slo_scale_cli_prints_a_table_and_writes_the_json(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "scale.json"
    base = [sys.executable, "-m", "experiments.placement", "--budget=1", "--gpus_per_node=1", "--num_requests=10",
            "--workers=1", "--colocated=vllm_v0", "--max_model_len=1024"]
    proc = subprocess.run(base + ["--slo_scale_per_gpu_rate=1.0", f"--output={out}"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["placement", "GPUs"] and "tightest scale" in lines[0]
    result = json.loads(out.read_text())
    assert result["problem"]["slo_scale_per_gpu_rate"] == 1.0 and result["ranking"]
    assert [r["placement"] for r in result["ranking"]] == [line[:44].strip() for line in lines[1:]]
    bad = subprocess.run(base + ["--slo_scale_per_gpu_rate=-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "error: flag --slo_scale_per_gpu_rate=-1.0")


def test_a_stack_that_times_nothing_here_is_refused_up_front():
    """issue 27 item 3: --colocated_stack=distserve on hardware it was not measured on dropped every colocated
    candidate and ranked the disaggregated side the winner (best_colocated null)."""
    from pdjax.sim.placement import NodeType, PlacementProblem
    with pytest.raises(ValueError, match=r"colocated_stack='distserve' has no step times for model 'llama-2-7b' on "
                                         r"hardware 'h100-sxm' at any tp <= 4"):
        PlacementProblem(model="llama-2-7b", node=NodeType("h100-sxm"), gpu_budget=4, workload={"preset": "chat"},
                         ttft_s=1.0, tpot_s=0.1, colocated_stack="distserve")
