"""Metric functions on hand-built timelines, SLOs/goodput, telemetry, capacity search, run outputs (atomic writes,
read-back, recomputation from token_times.csv)."""
import dataclasses
import json
import math
import os
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pdjax.metrics import (IterationRecord, RequestRecord, SLOs, atomic_write_text, capacity_search, e2es,
                           goodput_rps, holds, load_run, meets_slos, normalized_latencies, recompute_summary,
                           request_record, run_duration, sched_delays, slo_attainment, stats, summarize_iterations,
                           summarize_run, summarize_table, tbts, tpots, ttfts, write_csv, write_json,
                           write_run_outputs)


def _req(rid, arrival, sched, times, reason="length", prompt=10, preemptions=0):
    return RequestRecord(rid, arrival, sched, times[0] if times else None, times[-1] if times else None, prompt,
                         len(times), preemptions, reason, list(times))


@pytest.fixture
def timeline():
    """a: 3 tokens; b: 1 token (no gaps); c: preempted once (a 1.0 s gap); d: rejected; e: unfinished."""
    return [
        _req("a", 0.0, 0.5, [1.0, 1.25, 1.75]),
        _req("b", 1.0, 1.0, [2.0], reason="stop"),
        _req("c", 2.0, 2.25, [2.5, 2.75, 3.75, 4.0], preemptions=1),
        _req("d", 3.0, None, [], reason="rejected", prompt=5000),
        _req("e", 3.5, 3.75, [4.5], reason="unfinished"),
    ]


def test_known_latencies(timeline):
    assert ttfts(timeline) == [1.0, 1.0, 0.5]
    assert tbts(timeline) == [0.25, 0.5, 0.25, 1.0, 0.25]
    assert tpots(timeline) == [0.375, 0.5]        # b has 1 token: no TPOT
    assert e2es(timeline) == [1.75, 1.0, 2.0]
    assert sched_delays(timeline) == [0.5, 0.0, 0.25]
    assert normalized_latencies(timeline) == [1.75 / 3, 1.0, 0.5]


def test_stats_known_percentiles():
    s = stats(list(range(1, 101)))
    assert s == {"mean": 50.5, "p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert stats([2.0]) == {"mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}


def test_summary_counts_and_exclusions(timeline):
    s = summarize_run(timeline)
    assert (s["num_requests"], s["num_completed"], s["num_rejected"], s["num_unfinished"]) == (5, 3, 1, 1)
    assert (s["num_preempted_requests"], s["num_preemptions"]) == (1, 1)
    assert s["duration_s"] == 4.5                     # arrival 0 .. last token 4.5 (of the unfinished request)
    assert s["total_output_tokens"] == 9              # every produced token, the unfinished one's included
    assert s["throughput_tok_s"] == pytest.approx(9 / 4.5)
    assert s["throughput_req_s"] == pytest.approx(3 / 4.5)
    assert s["ttft"]["mean"] == pytest.approx(2.5 / 3)
    assert s["tbt"]["p50"] == 0.25 and s["tbt_max"] == 1.0
    assert s["total_prompt_tokens"] == 30             # rejected prompt of 5000 not counted
    assert s["slo_attainment"] == pytest.approx(3 / 5) and s["goodput_rps"] == pytest.approx(3 / 4.5)


def test_slo_semantics(timeline):
    a, b, c, d, e = timeline
    # TTFT bound 0.9 s: only c (0.5 s).
    assert [meets_slos(r, SLOs(ttft_s=0.9)) for r in timeline] == [False, False, True, False, False]
    # Max-gap TBT bound 0.6: a (max 0.5) and b (1 token) meet; c has the 1.0 s stall.
    assert [meets_slos(r, SLOs(tbt_s=0.6)) for r in timeline] == [True, True, False, False, False]
    # The request's own p50 gap instead of its max: c's gaps 0.25, 1.0, 0.25 -> p50 0.25.
    assert meets_slos(c, SLOs(tbt_s=0.6, tbt_quantile=0.5))
    # TPOT bound 0.4: a (0.375) meets, c (0.5) does not, b trivially.
    assert [meets_slos(r, SLOs(tpot_s=0.4)) for r in timeline[:3]] == [True, True, False]
    slos = SLOs(ttft_s=1.0, tbt_s=0.6)
    assert slo_attainment(timeline, slos) == pytest.approx(2 / 5)
    assert goodput_rps(timeline, slos, duration_s=4.0) == pytest.approx(0.5)
    assert slo_attainment([], slos) is None and goodput_rps([], slos, 0.0) == 0.0


def test_slo_aliases_and_zero_means_no_bound(timeline):
    assert SLOs.from_dict({"ttft": 1.0, "tbt": 0, "tpot": 0.4}) == SLOs(ttft_s=1.0, tpot_s=0.4)

    @dataclasses.dataclass(frozen=True)
    class ServeSLO:          # the shape of pdjax.config's SLOConfig
        ttft: float = 0.9
        tbt: float = 0.0
        tpot: float = 0.0
    assert summarize_run(timeline, slos=ServeSLO())["slo_attainment"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="given twice"):
        SLOs.from_dict({"ttft": 1.0, "ttft_s": 2.0})


def test_request_record_from_scheduler_like_object():
    req = types.SimpleNamespace(request_id="x", arrival_time=1, first_scheduled_time=1.5, first_token_time=2.0,
                                finish_time=None, num_prompt_tokens=4, num_output_tokens=1, num_preemptions=0,
                                finish_reason=None, token_times=[2.0])
    rec = request_record(req)
    assert rec == RequestRecord("x", 1.0, 1.5, 2.0, None, 4, 1, 0, "unfinished", [2.0])
    assert not rec.completed


def test_slo_errors():
    with pytest.raises(ValueError, match="slo.ttft_s=-1"):
        SLOs(ttft_s=-1)
    with pytest.raises(ValueError, match="tbt_quantile=0"):
        SLOs(tbt_quantile=0)
    with pytest.raises(ValueError, match="unknown config key.*slo.p99_tbt"):
        SLOs.from_dict({"p99_tbt": 0.1})


def test_duration_includes_iterations():
    recs = [_req("a", 1.0, 1.0, [2.0])]
    assert run_duration(recs) == 1.0
    assert run_duration(recs, [IterationRecord(0, 1.0, 3.5)]) == 2.5
    assert run_duration([]) == 0.0


def test_record_validation():
    bad = _req("a", 0.0, 0.0, [1.0, 2.0])
    bad.num_output_tokens = 3
    with pytest.raises(ValueError, match="'a'.*num_output_tokens=3"):
        bad.validate()
    with pytest.raises(ValueError, match="not non-decreasing"):
        _req("b", 0.0, 0.0, [2.0, 1.0]).validate()
    with pytest.raises(ValueError, match="before arrival"):
        _req("c", 5.0, 5.0, [4.0]).validate()


def test_iteration_summary():
    its = [IterationRecord(0, 0.0, 0.1, 100, 0, 1, "p"), IterationRecord(1, 0.1, 0.15, 20, 4, 5, "p"),
           IterationRecord(0, 0.0, 0.02, 0, 8, 8, "d")]
    s = summarize_iterations(its)
    assert s["num_iterations"] == 3 and s["step_time_max"] == pytest.approx(0.1)
    assert (s["total_prefill_tokens"], s["total_decode_tokens"], s["num_mixed_iterations"]) == (120, 12, 1)
    assert s["mean_seqs_per_iteration"] == pytest.approx(14 / 3)
    assert s["busy_time_s"] == pytest.approx(0.17)
    assert s["per_instance"]["p"]["num_iterations"] == 2 and s["per_instance"]["d"]["total_decode_tokens"] == 8
    assert summarize_iterations([]) == {"num_iterations": 0}


# ---- capacity search -----------------------------------------------------------------------------------------

def _fake_run(tbt_knee, delay_knee):
    """A system whose P99 TBT = 0.01 * rate / tbt_knee * 0.1 ... : P99 TBT crosses 0.1 s at tbt_knee req/s, and
    median scheduling delay crosses 2 s at delay_knee req/s."""
    calls = []

    def run(rate):
        calls.append(rate)
        return {"tbt": {"p99": 0.1 * rate / tbt_knee}, "sched_delay": {"p50": 2.0 * rate / delay_knee},
                "slo_attainment": 1.0}
    return run, calls


def test_capacity_found_by_bisection():
    run, calls = _fake_run(tbt_knee=7.3, delay_knee=100.0)
    result = capacity_search(run, lo=1.0, hi=20.0, tbt_p99_s=0.1, rel_tol=0.01, max_probes=30)
    assert 7.3 * 0.99 <= result.capacity_rps <= 7.3
    assert [p[0] for p in result.probes] == calls and calls[:2] == [1.0, 20.0]


def test_capacity_limited_by_sched_delay():
    run, _ = _fake_run(tbt_knee=100.0, delay_knee=4.0)
    result = capacity_search(run, lo=1.0, hi=20.0, tbt_p99_s=0.1, rel_tol=0.01, max_probes=30)
    assert 4.0 * 0.99 <= result.capacity_rps <= 4.0


def test_capacity_edges():
    run, _ = _fake_run(tbt_knee=0.5, delay_knee=100.0)
    assert capacity_search(run, 1.0, 2.0, tbt_p99_s=0.1).capacity_rps is None
    run, calls = _fake_run(tbt_knee=50.0, delay_knee=100.0)
    assert capacity_search(run, 1.0, 2.0, tbt_p99_s=0.1).capacity_rps == 2.0 and len(calls) == 2
    with pytest.raises(ValueError, match="lo=3"):
        capacity_search(run, 3.0, 2.0)


def test_holds_with_missing_stats_and_attainment():
    empty = {"tbt": {"p99": None}, "sched_delay": {"p50": None}, "slo_attainment": None}
    assert not holds(empty, {"tbt.p99": 1.0})
    ok = {"tbt": {"p99": 0.05}, "sched_delay": {"p50": 0.5}, "slo_attainment": 0.8}
    assert holds(ok, {"tbt.p99": 0.1}) and not holds(ok, {"tbt.p99": 0.1}, min_slo_attainment=0.9)
    with pytest.raises(KeyError, match="ttft.p95"):
        holds(ok, {"ttft.p95": 1.0})


# ---- run outputs ---------------------------------------------------------------------------------------------

def test_write_and_read_back(tmp_path, timeline):
    its = [IterationRecord(i, 0.5 * i, 0.5 * i + 0.25, 10 * (i % 2), 3, 3) for i in range(9)]
    config = {"scheduler": {"policy": "sarathi", "token_budget": 512}, "buckets": (1, 2)}
    summary = write_run_outputs(str(tmp_path), config, timeline, its, slos={"ttft_s": 1.0, "tbt_s": 0.6})
    names = set(os.listdir(tmp_path))
    assert names == {"config.json", "results.json", "requests.csv", "token_times.csv", "iterations.csv",
                     "ttft_cdf.png", "tbt_cdf.png", "iteration_timeline.png"}
    for png in ("ttft_cdf.png", "tbt_cdf.png", "iteration_timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "results.json").read_text())
    assert results == json.loads(json.dumps(summary))
    for key in ("ttft", "tbt", "tpot", "e2e", "sched_delay"):
        assert set(results[key]) == {"mean", "p50", "p90", "p99"}
    assert results["slo_attainment"] == pytest.approx(2 / 5)
    run = load_run(str(tmp_path))
    assert run.requests == timeline and run.iterations == its
    assert run.config == {"scheduler": {"policy": "sarathi", "token_budget": 512}, "buckets": [1, 2]}
    table = summarize_table(summary)
    assert "ttft" in table and "1000.0" in table.splitlines()[2]      # TTFT p50 = 1.0 s = 1000.0 ms


def test_recomputation_matches_on_hand_timeline(tmp_path, timeline):
    summary = write_run_outputs(str(tmp_path), {}, timeline, [], plots=False)
    again = recompute_summary(str(tmp_path))
    assert again["num_requests"] == 5 and again["num_completed"] == 3 and again["total_output_tokens"] == 9
    for key in ("ttft", "tbt", "tpot", "e2e", "sched_delay"):
        assert again[key] == pytest.approx(summary[key], rel=1e-12, abs=0)


@st.composite
def _timelines(draw):
    records = []
    for i in range(draw(st.integers(1, 12))):
        arrival = draw(st.floats(0, 100, allow_nan=False))
        reason = draw(st.sampled_from(["length", "length", "stop", "rejected", "aborted"]))
        if reason == "rejected":
            records.append(_req(f"q{i}", arrival, None, [], reason=reason))
            continue
        sched = arrival + draw(st.floats(0, 5))
        gaps = draw(st.lists(st.floats(0, 2, allow_nan=False), min_size=1, max_size=15))
        times = list(np.cumsum([sched - arrival + draw(st.floats(0, 3))] + gaps[1:]) + arrival)
        records.append(_req(f"q{i}", arrival, sched, [float(t) for t in times], reason=reason,
                            preemptions=draw(st.integers(0, 2))))
    return records


@given(records=_timelines())
@settings(max_examples=30, deadline=None)
def test_recomputation_matches_random_timelines(tmp_path_factory, records):
    workdir = str(tmp_path_factory.mktemp("run"))
    summary = write_run_outputs(workdir, {}, records, [], plots=False)
    again = recompute_summary(workdir)
    assert again["num_completed"] == summary["num_completed"]
    for key in ("ttft", "tbt", "tpot", "e2e", "sched_delay"):
        for stat in ("mean", "p50", "p90", "p99"):
            if summary[key][stat] is None:
                assert again[key][stat] is None
            else:
                assert math.isclose(again[key][stat], summary[key][stat], rel_tol=1e-9, abs_tol=1e-9)
    assert load_run(workdir).requests == records


def test_atomic_csv_leaves_old_file_on_error(tmp_path):
    path = str(tmp_path / "x.csv")
    write_csv(path, ("a",), iter([(1,), (2,)]))
    before = open(path, "rb").read()

    def rows():
        yield (3,)
        raise RuntimeError("engine crashed mid-write")
    with pytest.raises(RuntimeError, match="mid-write"):
        write_csv(path, ("a",), rows())
    assert open(path, "rb").read() == before == b"a\n1\n2\n"
    assert os.listdir(tmp_path) == ["x.csv"]


def test_atomic_write_text(tmp_path):
    path = str(tmp_path / "s.csv")
    atomic_write_text(path, "a,b\n1,2\n")
    assert open(path).read() == "a,b\n1,2\n" and os.listdir(tmp_path) == ["s.csv"]


def test_atomic_open_fsyncs_the_file_then_its_directory(tmp_path, monkeypatch):
    """Durable, not just atomic: the data is on disk before the rename, and the rename before it returns."""
    import pdjax.metrics.report as report
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(report.os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")),
                                                         real_fsync(fd)))
    path = tmp_path / "p.json"                          # a pathlib.Path too
    with report.atomic_open(path, "w") as f:
        f.write("{}")
    assert synced == [os.path.realpath(f"{path}.tmp-{os.getpid()}"), os.path.realpath(tmp_path)]
    assert path.read_text() == "{}" and os.listdir(tmp_path) == ["p.json"]


def test_atomic_json_leaves_no_file_on_error(tmp_path):
    with pytest.raises(TypeError, match="object"):
        write_json(str(tmp_path / "r.json"), {"ok": 1, "bad": object()})
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError):
        write_json(str(tmp_path / "r.json"), {"nan": float("nan")})
    assert os.listdir(tmp_path) == []


def test_results_json_is_written_last(tmp_path, timeline, monkeypatch):
    """If a plot fails, there is no results.json, so a sweep reruns the point instead of skipping it."""
    import pdjax.metrics.report as report

    def broken_plot(*args, **kwargs):
        raise RuntimeError("plot failed")
    monkeypatch.setattr(report, "plot_iteration_timeline", broken_plot)
    with pytest.raises(RuntimeError, match="plot failed"):
        write_run_outputs(str(tmp_path), {}, timeline, [])
    assert "results.json" not in os.listdir(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]


def test_load_rejects_bad_token_index(tmp_path, timeline):
    write_run_outputs(str(tmp_path), {}, timeline, [], plots=False)
    path = tmp_path / "token_times.csv"
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace("a,1,", "a,2,")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"token_times.csv:3: token_index=2, expected 1"):
        load_run(str(tmp_path))


# ---------------------------------------------------------------- SLO rules: pdjax's and DistServe's
def test_distserve_rule_is_two_separate_p90s_against_numpy():
    from pdjax.metrics.latency import distserve_slo_check
    rng = np.random.default_rng(0)
    recs = []
    for i in range(50):
        arrival, first = float(i), float(i) + rng.uniform(0.05, 0.4)
        times = list(first + np.cumsum(np.r_[0.0, rng.uniform(0.01, 0.2, size=int(rng.integers(1, 9)))]))
        recs.append(_req(f"r{i}", arrival, arrival, times))
    want_ttft = float(np.percentile([r.token_times[0] - r.arrival_time for r in recs], 90))
    want_tpot = float(np.percentile([(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                                     for r in recs if len(r.token_times) > 1], 90))
    got = distserve_slo_check(recs, SLOs(ttft_s=want_ttft + 1e-9, tpot_s=want_tpot - 1e-9))
    assert got["ttft_p90_s"] == pytest.approx(want_ttft) and got["tpot_p90_s"] == pytest.approx(want_tpot)
    assert got["ttft_ok"] and not got["tpot_ok"] and not got["passes"]


def test_the_two_rules_disagree_where_the_paper_says_they_do():
    """16% of requests miss one bound each, 8% the TTFT and 8% the TPOT: pdjax's attainment is 0.84 (below a 90%
    target), yet each P90 holds (DistServe's rule passes); unserved requests in the P90's tail fail it."""
    fast_start_slow_tokens = [_req(f"a{i}", 0.0, 0.0, [0.1, 0.6, 1.1]) for i in range(8)]    # TPOT 0.5
    slow_start_fast_tokens = [_req(f"b{i}", 0.0, 0.0, [2.0, 2.01, 2.02]) for i in range(8)]   # TTFT 2.0
    ok_ones = [_req(f"c{i}", 0.0, 0.0, [0.1, 0.11, 0.12]) for i in range(84)]
    recs = fast_start_slow_tokens + slow_start_fast_tokens + ok_ones
    slos = SLOs(ttft_s=1.0, tpot_s=0.1)
    summary = summarize_run(recs, slos=slos)
    assert summary["slo_rules"]["pdjax"]["attainment"] == summary["slo_attainment"] == pytest.approx(0.84)
    assert summary["slo_rules"]["distserve"]["passes"] is True
    assert "output tokens - 1" in summary["tpot_definition"]
    rejected = [_req(f"d{i}", 0.0, None, [], reason="rejected") for i in range(20)]
    late = summarize_run(ok_ones + rejected, slos=slos)["slo_rules"]["distserve"]
    assert late["ttft_p90_s"] is None and not late["ttft_ok"] and not late["passes"]
    json.dumps(late)   # no inf/NaN in results.json


def test_one_rate_search_brackets_then_bisects():
    from pdjax.metrics.capacity import bisect_rate, bracket_rate
    seen = []

    def ok(rate):
        seen.append(rate)
        return rate <= 3.3

    good, bad = bracket_rate(ok, 1.0, more=lambda: True)
    assert (good, bad) == (2.0, 4.0) and seen == [1.0, 2.0, 4.0]
    good, bad = bisect_rate(ok, good, bad, rel_tol=0.01, more=lambda: True)
    assert good <= 3.3 < bad and bad - good <= 0.01 * good
    assert bracket_rate(ok, 8.0, more=lambda: True, halve=False) == (0.0, 8.0)      # no halving: nothing held
    assert bisect_rate(ok, 0.0, 8.0, rel_tol=0.01, more=lambda: True) == (0.0, 8.0)  # nothing to bisect
    # a round of three rates at once divides the bracket by four
    rounds = []
    g, b = bisect_rate(lambda rates: (rounds.append(rates), [r <= 3.3 for r in rates])[1], 2.0, 6.0, rel_tol=0.5,
                       more=lambda: len(rounds) < 1, split=lambda g, b: [g + (b - g) * i / 4 for i in (1, 2, 3)])
    assert rounds == [[3.0, 4.0, 5.0]] and (g, b) == (3.0, 4.0)


def test_one_slo_type_with_one_alias_rule():
    """Issue 28 item 5: metrics.SLOs is the serve config's SLOConfig; ttft_s/tbt_s/tpot_s are its aliases (0 or
    None: no bound) wherever SLOs are given, and results.json's "slos" entry keeps the metrics' spelling."""
    from pdjax.config.parse import dataclass_from_dict
    from pdjax.config.serving import SLOConfig
    assert SLOs is SLOConfig
    assert SLOs(ttft_s=1.0, tbt_s=None) == SLOConfig(ttft=1.0) == dataclass_from_dict(SLOConfig, {"ttft_s": 1.0}, "slo")
    assert SLOs(tpot=0.1).tpot_s == 0.1 and SLOs().ttft_s is None and SLOs().empty
    assert SLOs(ttft=1.0).summary_dict() == {"ttft_s": 1.0, "tbt_s": None, "tpot_s": None, "tbt_quantile": 1.0}
    with pytest.raises(ValueError, match="given twice"):
        SLOs(ttft=1.0, ttft_s=2.0)
