"""The regime map (pdjax.sim.regime): every point's winner and goodputs equal a direct placement search at that
point; caching and parallelism change nothing; the KV link presets put the KV where they say; Sarathi's budget is
the largest that fits the TPOT target on the simulator's step time; the outputs are written; bad axes are named."""
import csv
import json
import subprocess
import sys

import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.sim import placement as pl
from pdjax.sim import regime as rg
from pdjax.sim.cost_model import kv_cache_capacity_tokens
from pdjax.sim.profile import profile_for
from pdjax.sim.step_cost import make_step_time

# a tiny map: 2 workloads x 2 SLO scales x 2 links on 2 GPUs, few requests, a short rate search
TINY = dict(model="opt-13b", hardware="a100-80gb-sxm", gpu_budget=2, workloads=("1:1", "16:1"),
            slo_scales=(0.8, 2.0), links=("nvlink", "ethernet-25g"), num_requests=16, total_tokens=384,
            max_model_len=1024, max_probes=6, rel_tol=0.25, max_num_seqs=64, max_pp=1)


@pytest.fixture(scope="module")
def grid():
    return rg.RegimeGrid(**TINY)


@pytest.fixture(scope="module")
def cached(grid):
    return rg.run_grid(grid, workers=2, cache=True)


def _direct_best_colocated(pairs):
    """The best colocated placement by placement.search: one search per distinct problem (a Sarathi budget)."""
    groups = {}
    for problem, p in pairs:
        groups.setdefault(problem.sarathi_token_budget if p.policy == "sarathi" else None, []).append((problem, p))
    rows = []
    for members in groups.values():
        result = pl.search(members[0][0], placements=[p for _, p in members],
                           colocated=tuple({p.policy for _, p in members}))
        rows += [r for r in result["best_colocated"].values() if r]
    return min(rows, key=lambda r: (-round(r["per_gpu_goodput_rps"], 9), r["num_gpus"], r["placement"]))


def test_every_point_equals_a_direct_placement_search(grid, cached):
    budgets = rg.sarathi_budgets(grid)
    rows = {(r["workload"], r["slo_scale"], r["link"]): r for r in cached["rows"]}
    assert len(rows) == len(grid.points) == 8
    winners = set()
    colocated = {}      # the colocated side is searched once per (workload, SLO): no link enters it
    for w, s, k in grid.points:
        row = rows[(w, s, k)]
        pairs = rg.point_problems(grid, w, s, k, budgets)
        for problem, _ in pairs["colocated"] + pairs["disaggregated"]:   # the point's SLOs, as the grid says
            assert (problem.ttft_s, problem.tpot_s) == pytest.approx((s * grid.base_ttft_s, s * grid.base_tpot_s))
        d_problem = pairs["disaggregated"][0][0]
        direct_d = pl.search(d_problem, placements=[p for _, p in pairs["disaggregated"]])["best_disaggregated"]
        if (w, s) not in colocated:
            colocated[(w, s)] = _direct_best_colocated(pairs["colocated"])
        direct_c = colocated[(w, s)]
        assert row["best_disaggregated"] == direct_d["placement"]
        assert row["disagg_per_gpu_rps"] == pytest.approx(direct_d["per_gpu_goodput_rps"], abs=1e-4)
        assert row["best_colocated"] == direct_c["placement"]
        assert row["colocated_per_gpu_rps"] == pytest.approx(direct_c["per_gpu_goodput_rps"], abs=1e-4)
        c, d = direct_c["per_gpu_goodput_rps"], direct_d["per_gpu_goodput_rps"]
        expected = "neither" if c == d == 0 else "tie" if c == d else "disaggregated" if d > c else "colocated"
        assert row["winner"] == expected
        winners.add(expected)
        if c > 0:
            assert row["ratio"] == pytest.approx(d / c, rel=1e-3)
        else:
            assert row["ratio"] is None
    assert any(r["colocated_per_gpu_rps"] > 0 for r in rows.values())   # the map is not all-empty


def test_caching_and_workers_change_nothing():
    """On a one-workload map: cached in 2 processes == cached serially == uncached (placement.evaluate per
    point and candidate)."""
    small = rg.RegimeGrid(**{**TINY, "workloads": ("16:1",)})
    parallel = rg.run_grid(small, workers=2, cache=True)
    serial = rg.run_grid(small, workers=1, cache=True)
    uncached = rg.run_grid(small, workers=1, cache=False)
    assert parallel["rows"] == serial["rows"] == uncached["rows"]
    assert parallel["points"] == uncached["points"]
    # sharing is real: fewer simulations than probes answered
    assert parallel["timing"]["simulations"] < parallel["timing"]["probes"] == uncached["timing"]["probes"]


def test_colocated_results_do_not_depend_on_the_link(cached):
    by_point = {}
    for r in cached["rows"]:
        by_point.setdefault((r["workload"], r["slo_scale"]), set()).add(
            (r["best_colocated"], r["colocated_per_gpu_rps"]))
    assert all(len(v) == 1 for v in by_point.values())


def test_kv_link_presets_put_the_kv_where_they_say(grid):
    nvlink = rg.disaggregated_candidates(grid, "nvlink")
    hw = grid.node(None).spec()
    assert nvlink and all(bw == hw.intra_node_bandwidth for p in nvlink for bw, _, _ in p.links)
    for name, gbps in (("ethernet-25g", 25), ("infiniband", 200), ("40gbps", 40)):
        sep = rg.disaggregated_candidates(grid, name)
        per_node = hw.devices_per_node
        assert len(sep) == len(nvlink)
        for p in sep:
            pre, dec = p.devices[:p.num_prefill], p.devices[p.num_prefill:]
            assert {d // per_node for x in pre for d in x}.isdisjoint({d // per_node for x in dec for d in x})
            assert p.num_gpus <= grid.gpu_budget
            assert {bw for bw, _, _ in p.links} == {gbps * 1e9 / 8}
    # a bigger budget: every separated candidate still keeps each stage's TP group in one node
    big = rg.RegimeGrid(**{**TINY, "gpu_budget": 4, "gpus_per_node": 2})
    for p in rg.disaggregated_candidates(big, "infiniband"):
        layouts = [p.prefill] * p.num_prefill + [p.decode] * p.num_decode
        for layout, devs in zip(layouts, p.devices):
            for st in range(layout.pp):
                assert len({d // 2 for d in devs[st * layout.tp:(st + 1) * layout.tp]}) == 1


def test_sarathi_budget_is_the_largest_that_fits_the_tpot_target(grid):
    model, hw = get_model_spec(grid.model), grid.node(None).spec()
    params = profile_for("", grid.hardware).params
    problem = grid.problem("colocated", "1:1", 1.0, None)
    means = rg.workload_means(problem.workload)
    checked = 0
    for layout in (pl.Layout(1, 1), pl.Layout(2, 1)):
        step = make_step_time(model, hw, layout.tp, layout.pp, params)   # independent of the serve-config path
        def seconds(b, layout=layout, step=step):   # the KV cache leaves room for a b-token batch's activations
            cap = kv_cache_capacity_tokens(model, hw, layout.tp, layout.pp, problem.mem_util,
                                           max_num_batched_tokens=b, max_num_seqs=problem.decode_max_num_seqs)
            return step(rg.hybrid_batch(b, *means, problem.decode_max_num_seqs, cap))
        assert rg.hybrid_step_time(problem, layout, 512, means) == pytest.approx(seconds(512), rel=1e-9)
        for tpot in (0.02, seconds(256) * 1.001, seconds(512) * 1.001, 10.0):
            got = rg.sarathi_budget(pl.PlacementProblem(**{**_fields(problem), "tpot_s": tpot}), layout, means)
            fits = [b for b in range(128, grid.max_model_len + 1, 128) if b >= problem.decode_max_num_seqs
                    and seconds(b) <= tpot]
            if fits:
                assert got["fits"] and got["budget"] == max(fits)
            else:
                assert not got["fits"] and got["budget"] == 128
            checked += 1
    assert checked == 8


def _fields(problem):
    return {f: getattr(problem, f) for f in problem.__dataclass_fields__}


def test_outputs_are_written(grid, cached, tmp_path):
    paths = rg.write_outputs(grid, cached, str(tmp_path))
    data = open(paths["png"], "rb").read()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(paths["csv"])))
    assert len(rows) == len(grid.points)
    assert [(r["workload"], float(r["slo_scale"]), r["link"]) for r in rows] == list(grid.points)
    assert all(r["winner"] in rg.WINNERS for r in rows)
    summary = json.load(open(paths["json"]))
    assert set(summary["by_link"]) == set(grid.links)
    assert sum(summary["by_link"]["nvlink"]["winners"].values()) == len(grid.workloads) * len(grid.slo_scales)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_heatmap_handles_undefined_ratios(grid, cached):
    rows = [dict(r, ratio=None, winner="neither") for r in cached["rows"]]
    rows[0] = dict(rows[0], ratio=3.0, winner="disaggregated")
    rows[1] = dict(rows[1], ratio=None, winner="disaggregated")    # colocated 0, disaggregated > 0
    rows[2] = dict(rows[2], ratio=0.0, winner="colocated")
    assert rg.heatmap_png(grid, rows)[:4] == b"\x89PNG"


@pytest.mark.parametrize("change,message", [
    ({"workloads": ("4-1",)}, "workload '4-1'"),
    ({"workloads": ("0:1",)}, "workload '0:1'"),
    ({"workloads": ("nosuchtrace",)}, "named trace"),
    ({"slo_scales": (0.0,)}, "SLO scale 0.0"),
    ({"slo_scales": (1.0, 1.0)}, "repeat"),
    ({"links": ("wifi",)}, "KV link 'wifi'"),
    ({"links": ()}, "links=()"),
    ({"gpu_budget": 1}, "gpu_budget=1"),
    ({"stack": "nosuch"}, "stack='nosuch'"),
    ({"colocated": ("orca",)}, "colocated policies"),
])
def test_bad_axis_values_are_named(change, message):
    with pytest.raises(ValueError, match=message) as info:
        rg.RegimeGrid(**{**TINY, **change})
    assert "\n" not in str(info.value)


def test_cli_bad_axis_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.regime_map", "--links=nvlink,wifi",
                           f"--out_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "KV link 'wifi'" in lines[0]


def test_a_model_that_fits_no_placement_is_refused_before_simulating(monkeypatch):
    """Llama-2-70B on 2 A100-80GB: TP 2 holds it colocated, one GPU per side does not; refused in one line naming
    the side, model and hardware, before a single simulation (it was a KeyError after simulating)."""
    monkeypatch.setattr(rg, "sarathi_budgets", lambda grid: pytest.fail("simulated before refusing"))
    grid = rg.RegimeGrid(**{**TINY, "model": "llama-2-70b", "links": ("nvlink",)})
    with pytest.raises(rg.UserError, match="no disaggregated over nvlink placement of model 'llama-2-70b'") as info:
        rg.run_grid(grid)
    assert "a100-80gb-sxm" in str(info.value) and "\n" not in str(info.value)
