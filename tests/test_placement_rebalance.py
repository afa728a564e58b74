"""Online XpYd rebalancing as a design of the placement search and the regime map (issue 30 item 5): variants only for
placements whose instances can swap roles and only when asked; a variant is its serve config with
deployment.rebalance=True, evaluated through that config; the regime map reports which design won; misuse is one
line."""
import csv
import dataclasses
import subprocess
import sys

import pytest

from pdjax.config.deployment import deployment_from_dict
from pdjax.config.serving import serve_config_from_dict
from pdjax.sim import placement as pl
from pdjax.sim import regime as rg
from pdjax.sim.run import simulate_config

WORKLOAD = {"kind": "synthetic", "num_requests": 24, "seed": 0, "max_model_len": 1024,
            "prompt_len": {"kind": "uniform", "low": 64, "high": 512},
            "output_len": {"kind": "uniform", "low": 8, "high": 64}}
# thresholds low enough that a 1P2D deployment flips a decode instance to prefill within a 24-request run
EAGER = dict(rebalance_prefill_queue_tokens=256, rebalance_decode_load=0.05, rebalance_window_s=0.0)


def problem(budget=3, per_node=2, **kw):
    kw = {"ttft_s": 0.08, "tpot_s": 0.025, **kw}
    return pl.PlacementProblem(model="opt-13b", node=pl.NodeType("a100-80gb-sxm", gpus_per_node=per_node),
                               gpu_budget=budget, workload=WORKLOAD, max_model_len=1024, max_probes=8, rel_tol=0.25,
                               **kw)


def _base(variant):
    return dataclasses.replace(variant, rebalance=False, pair_links=())


@pytest.mark.parametrize("budget,per_node", [(3, 2), (4, 2), (4, 8)])
def test_variants_only_for_swappable_placements_and_only_when_asked(budget, per_node):
    prob = problem(budget, per_node)
    fixed = pl.enumerate_placements(prob)
    both = pl.enumerate_placements(prob, rebalance=True)
    assert not any(p.rebalance for p in fixed)
    assert both[:len(fixed)] == fixed                      # the fixed designs, unchanged and in their order
    variants = both[len(fixed):]
    assert variants and all(v.rebalance and v.name.endswith(" +rebalance") for v in variants)
    assert len({p.key() for p in both}) == len(both)       # still deduplicated
    bases = [_base(v) for v in variants]
    assert all(b in fixed for b in bases)
    for b in bases:                                        # one layout, a side with two instances to spare one
        assert b.kind != "colocated" and b.prefill == b.decode and max(b.num_prefill, b.num_decode) >= 2
    swappable = [p for p in fixed if p.kind != "colocated" and p.prefill == p.decode
                 and max(p.num_prefill, p.num_decode) >= 2]
    assert sorted(map(str, swappable)) == sorted(map(str, bases))   # and every such placement has its variant
    for v in variants:       # every ordered pair's link, as the simulator prices a flipped instance's transfers
        n = len(v.devices)
        assert len(v.pair_links) == n * (n - 1)
        assert set(v.links) <= set(v.pair_links)


def test_unequal_role_budgets_are_not_swappable():
    """pdjax.config.overload refuses rebalancing between groups with other token budgets: a decode instance that
    must hold more sequences than the prefill token budget (decode budget = max of the two) gets no variant."""
    prob = problem(4, 2, prefill_token_budget=128, decode_max_num_seqs=256)
    assert pl.enumerate_placements(prob, rebalance=True) == pl.enumerate_placements(prob)
    some = next(p for p in pl.enumerate_placements(prob) if p.kind == "high" and p.prefill == p.decode
                and p.num_decode == 2)
    with pytest.raises(ValueError, match="cannot rebalance") as info:
        pl.rebalance_variant(prob, some)
    assert "\n" not in str(info.value)


def test_variant_deployment_carries_rebalancing_and_the_problem_thresholds():
    prob = problem(**EAGER, rebalance_flip_s=0.5)
    v = next(p for p in pl.enumerate_placements(prob, rebalance=True) if p.rebalance)
    dep = deployment_from_dict(v.deployment(prob))      # a valid deployment block (same-machine groups)
    assert dep.kind == "disaggregated" and dep.rebalance
    assert (dep.rebalance_prefill_queue_tokens, dep.rebalance_decode_load, dep.rebalance_window_s,
            dep.rebalance_flip_s) == (256, 0.05, 0.0, 0.5)
    assert not deployment_from_dict(_base(v).deployment(prob)).rebalance


def test_rebalance_variant_is_evaluated_as_its_serve_config_runs():
    """evaluate(variant) probe by probe == simulate_config(serve_config) directly; the run really rebalances (flips
    recorded) and so differs from the fixed design it starts from."""
    prob = problem(**EAGER)
    v = next(p for p in pl.enumerate_placements(prob, rebalance=True)
             if p.rebalance and p.num_prefill == 1 and p.num_decode == 2)
    e = pl.evaluate(prob, v)
    flips = 0
    for rate, share in e.probes:
        result, _ = simulate_config(serve_config_from_dict(pl.serve_config(prob, v, rate)), hardware=prob.node.spec())
        assert result.mixed_pool["mode"] == "rebalance"
        flips += result.mixed_pool["num_flips"]
        assert pl.slo_rule_passes(result.requests, prob.ttft_s, prob.tpot_s)[1] == share
    assert flips > 0
    fixed = pl.evaluate(prob, _base(v))
    assert e.goodput_rps > fixed.goodput_rps      # 1P2D is prefill-bound here; a flip makes it 2P1D
    row = pl.search(prob, placements=[_base(v), v])["best_disaggregated"]
    assert row["placement"] == v.name and row["rebalance"] is True and row["deployment"]["rebalance"] is True


def test_rebalance_needs_a_disaggregated_family():
    prob = problem()
    for call in (lambda: pl.enumerate_placements(prob, affinities=(), rebalance=True),
                 lambda: pl.search(prob, affinities=(), rebalance=True)):
        with pytest.raises(ValueError, match=r"rebalance=True with affinities=\(\)") as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("change,message", [
    ({"rebalance_window_s": -1.0}, "rebalance_window_s=-1.0"),
    ({"rebalance_decode_load": 0.0}, "rebalance_decode_load=0.0"),
    ({"rebalance_prefill_queue_tokens": 0}, "rebalance_prefill_queue_tokens=0"),
])
def test_bad_thresholds_are_named(change, message):
    with pytest.raises(ValueError, match=message) as info:
        problem(**change)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------------- regime map
GRID = dict(model="opt-13b", hardware="a100-80gb-sxm", gpu_budget=3, workloads=("16:1",), slo_scales=(0.4, 1.0),
            links=("nvlink", "ethernet-25g"), num_requests=24, total_tokens=384, max_model_len=1024, max_probes=8,
            rel_tol=0.25, max_num_seqs=64, max_pp=1, colocated=("sarathi",), rebalance=True,
            rebalance_prefill_queue_tokens=256, rebalance_decode_load=0.05, rebalance_window_s=0.0)


@pytest.fixture(scope="module")
def rebal_grid():
    return rg.RegimeGrid(**GRID)


@pytest.fixture(scope="module")
def rebal_result(rebal_grid):
    return rg.run_grid(rebal_grid, workers=1)


def test_regime_rows_report_the_winning_design_and_equal_a_direct_search(rebal_grid, rebal_result, tmp_path):
    rows = {(r["workload"], r["slo_scale"], r["link"]): r for r in rebal_result["rows"]}
    differs = []
    for w, s, k in rebal_grid.points:
        row = rows[(w, s, k)]
        pairs = rg.point_problems(rebal_grid, w, s, k)["disaggregated"]
        cands = [p for _, p in pairs]
        assert any(p.rebalance for p in cands) and not all(p.rebalance for p in cands)
        direct = pl.search(pairs[0][0], placements=cands)
        best = direct["best_disaggregated"]
        assert row["best_disaggregated"] == best["placement"]
        assert row["disagg_per_gpu_rps"] == pytest.approx(best["per_gpu_goodput_rps"], abs=1e-4)
        assert row["disagg_design"] == ("rebalance" if best.get("rebalance") else "fixed")
        fixed = next(r for r in direct["ranking"] if r["kind"] != "colocated" and not r.get("rebalance"))
        rebal = next(r for r in direct["ranking"] if r.get("rebalance"))
        assert row["best_fixed_disaggregated"] == fixed["placement"]
        assert row["fixed_disagg_per_gpu_rps"] == pytest.approx(fixed["per_gpu_goodput_rps"], abs=1e-4)
        assert row["best_rebalance_disaggregated"] == rebal["placement"]
        assert row["rebalance_disagg_per_gpu_rps"] == pytest.approx(rebal["per_gpu_goodput_rps"], abs=1e-4)
        differs.append(row["fixed_disagg_per_gpu_rps"] != row["rebalance_disagg_per_gpu_rps"])
    assert any(differs)          # the variants are simulated as another design, not as their fixed base
    paths = rg.write_outputs(rebal_grid, rebal_result, str(tmp_path))
    written = list(csv.DictReader(open(paths["csv"])))
    assert [r["disagg_design"] for r in written] == [rows[p]["disagg_design"] for p in rebal_grid.points]


def test_design_columns_name_the_winning_design():
    def entry(name, per_gpu, rebalance=False):
        return {"placement": name, "num_gpus": 3, "per_gpu_goodput_rps": per_gpu, **({"rebalance": True} if rebalance
                                                                                      else {})}
    fixed, rebal = entry("P 1x + D 2x", 1.0), entry("P 1x + D 2x +rebalance", 2.0, True)
    for entries, design in (([fixed, rebal], "rebalance"), ([dict(fixed, per_gpu_goodput_rps=2.0), rebal], "fixed"),
                            ([fixed], "fixed")):
        cols = rg._design_columns(entries, rg._best(entries))    # a tie goes to the fixed design
        assert cols["disagg_design"] == design
        assert cols["best_fixed_disaggregated"] == "P 1x + D 2x"
        assert cols["rebalance_disagg_per_gpu_rps"] == (2.0 if len(entries) == 2 else None)


def test_regime_without_the_option_has_no_rebalance_candidates_or_columns(rebal_grid):
    plain = rg.RegimeGrid(**{**GRID, "rebalance": False})
    for k in plain.links:
        assert not any(p.rebalance for p in rg.disaggregated_candidates(plain, k))
        with_option = rg.disaggregated_candidates(rebal_grid, k)
        assert [p for p in with_option if not p.rebalance] == rg.disaggregated_candidates(plain, k)
    rows = [{"link": "nvlink", "winner": "tie"}]
    assert rg.csv_text(rows).splitlines()[0] == ",".join(rg.CSV_COLUMNS)


def test_separate_pools_reprice_every_pair_link(rebal_grid):
    """On a network link the pools sit on separate nodes: a flipped instance's transfers to the other pool cross
    the network, and within its own pool stay on the node."""
    hw = rebal_grid.node("ethernet-25g").spec()
    variants = [p for p in rg.disaggregated_candidates(rebal_grid, "ethernet-25g") if p.rebalance]
    assert variants
    for v in variants:
        node = [devs[0] // hw.devices_per_node for devs in v.devices]
        pairs = [(i, j) for i in range(len(node)) for j in range(len(node)) if i != j]
        for (i, j), (bw, _, _) in zip(pairs, v.pair_links):
            assert bw == (hw.intra_node_bandwidth if node[i] == node[j] else hw.inter_node_bandwidth)


def test_regime_rebalance_where_no_placement_can_flip_is_refused():
    grid = rg.RegimeGrid(**{**GRID, "gpu_budget": 2})     # 1P1D only: neither side can spare an instance
    with pytest.raises(rg.UserError, match="rebalance=True, but no disaggregated placement") as info:
        rg.run_grid(grid)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="rebalance_window_s=-2"):
        rg.RegimeGrid(**{**GRID, "rebalance_window_s": -2.0})


def test_shifting_workload_replays_its_phases_in_order():
    grid = rg.RegimeGrid(**{**GRID, "workloads": ("1:8>16:1",), "num_requests": 40})
    assert rg.parse_workload("1:8>16:1") == ("shift", ((1.0, 8.0), (16.0, 1.0)))
    from pdjax.workload.config import WorkloadConfig
    from pdjax.workload.generate import make_workload
    cfg = WorkloadConfig.from_dict(dict(grid.workload("1:8>16:1"), rate=2.0))
    reqs = make_workload(cfg, cfg.seed)
    assert len(reqs) == 40
    first, second = reqs[:20], reqs[20:]
    mean = lambda rs, f: sum(map(f, rs)) / len(rs)  # noqa: E731
    assert mean(first, lambda r: r.max_tokens) > 4 * mean(first, lambda r: len(r.prompt_token_ids))
    assert mean(second, lambda r: len(r.prompt_token_ids)) > 8 * mean(second, lambda r: r.max_tokens)
    assert [r.arrival_time for r in reqs] == sorted(r.arrival_time for r in reqs)
    for bad in ("1:8>", "1:8>chat", "1:8>2:1>4:1"):
        with pytest.raises(ValueError, match="workload") as info:
            rg.RegimeGrid(**{**GRID, "workloads": (bad,)})
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv,message", [
    (["experiments.placement", "--rebalance", "--affinity=", "--num_requests=8"],
     "rebalance=True with affinities=()"),
    (["experiments.regime_map", "--rebalance", "--budget=2", "--workloads=1:1", "--slo_scales=1", "--links=nvlink"],
     "rebalance=True, but no disaggregated placement"),
])
def test_cli_rebalance_where_it_cannot_apply_is_one_line(argv, message, tmp_path):
    out = ["--out_dir", str(tmp_path)] if argv[0] == "experiments.regime_map" else []
    proc = subprocess.run([sys.executable, "-m", *argv, *out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0]
