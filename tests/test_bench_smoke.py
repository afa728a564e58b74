"""Smoke tests of the benchmark and experiment entry points at their smallest sizes: each runs its main path end to
end (`python -m experiments.X`, as a user does) and checks the JSON's keys and invariants, never its timings.
(bench_throughput, bench_scheduler and sim_fidelity have theirs in test_bench_throughput.py,
test_cli_validation.py and test_fidelity.py; fit_profile and calibrate in test_profile_fit.py and
test_calibration.py.) Subprocesses: the entry points define absl flags of the same names, which one process
cannot import side by side."""
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(module: str, *args: str, timeout: int = 600):
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_bench_engine():
    requests, output_len = 2, 3
    d, _ = _run("bench_engine", "--checkpoint=tiny-llama", f"--requests={requests}", "--prompt_len=8",
                f"--output_len={output_len}", "--token_budget=16", "--repeat=1")
    assert d["tokens_identical"] is True
    assert d["steps"] >= output_len and d["ceiling_device_only_s"] > 0 and d["compile_s"] >= 0
    for mode in ("sync", "async"):
        m = d[mode]
        assert set(m) == {"wall_s", "us_per_step", "host_overhead_us_per_step", "ratio_to_ceiling", "output_tok_s"}
        assert _close(m["output_tok_s"], requests * output_len / m["wall_s"])
        assert _close(m["us_per_step"], 1e6 * m["wall_s"] / d["steps"])
        assert _close(m["ratio_to_ceiling"], d["ceiling_device_only_s"] / m["wall_s"])
    assert _close(d["async_saves_s"], d["sync"]["wall_s"] - d["async"]["wall_s"])


def test_bench_step():
    d, _ = _run("bench_step", "--decode_batches=1", "--decode_contexts=32", "--prefill_tokens=16", "--repeats=1",
                "--impls=reference,blocked")
    assert d["impls"] == ["reference", "blocked"] and set(d["results"]) == {"reference", "blocked"}
    for res in d["results"].values():
        (dec,), (pre,) = res["decode"], res["prefill"]
        assert (dec["batch"], dec["context"], pre["tokens"]) == (1, 32, 16)
        assert dec["bytes_moved"] > res["param_bytes"] and pre["flops"] > 0
        assert _close(dec["ratio"], dec["bytes_moved"] / d["memory_bandwidth_bytes_per_s"] / dec["step_s"])
        assert _close(pre["ratio"], pre["flops"] / d["matmul_flops_per_s"] / pre["step_s"])
        assert res["targets"] == {}                   # the targets are points of the full grid
        assert res["compile_count"] == 2              # one decode and one prefill shape
    assert set(d["comparison"]) == {"decode_1x32", "prefill_16", "compile_s"}


def test_bench_attention():
    d, _ = _run("bench_attention", "--quick", "--reps=1")
    assert d["backend"] == "cpu" and d["ceilings"]["copy_bandwidth_Bps"] > 0 and d["ceilings"]["matmul_flops"] > 0
    assert [(c["batch"], c["context"]) for c in d["decode"]] == [(1, 256), (8, 256)]
    assert [(c["chunk"], c["offset"]) for c in d["prefill"]] == [(128, 0)]
    shape = d["shape"]
    per_token = 2 * shape["num_kv_heads"] * shape["head_dim"] * 4          # K and V, float32
    for case in d["decode"] + d["prefill"]:
        assert case["impl"] == "reference" and case["max_abs_diff_vs_reference"] == 0.0
        assert _close(case["bandwidth_Bps"], case["kv_bytes"] / case["time_s"])
    for case in d["decode"]:
        assert case["kv_bytes"] == case["batch"] * case["context"] * per_token and case["peak_kind"] == "copy_bandwidth"
    assert d["prefill"][0]["peak_kind"] == "matmul_flops"


def _check_transfer_cases(d):
    assert d["cases"] and d["ceiling"]["bytes_per_s"] > 0
    for c in d["cases"]:
        assert c["num_pages"] == -(-c["tokens"] // d["model_kv"]["page_size"])
        assert c["moved_bytes"] == c["kv_bytes"] > 0
        assert set(c["src_devices"]).isdisjoint(c["dst_devices"]) or d["same_device"]
        assert len(c["src_devices"]) == c["src_tp"] and len(c["dst_devices"]) == c["dst_tp"]
        assert _close(c["transfer_bytes_per_s"], c["moved_bytes"] / c["transfer_s"])


def test_bench_kv_transfer_cases():
    d, _ = _run("bench_kv_transfer", "--quick", "--reps=1", "--engine=false", "--cross_process=false")
    _check_transfer_cases(d)
    assert d["engine"] is None and d["cross_process"] is None


@pytest.mark.slow
def test_bench_kv_transfer_engine_and_cross_process():
    d, _ = _run("bench_kv_transfer", "--quick", "--reps=1", "--engine_reps=1")
    _check_transfer_cases(d)
    assert d["engine"] and d["cross_process"]


def test_bench_pipeline_cpu():
    d, _ = _run("bench_pipeline", "--checkpoint=tiny-llama", "--pp=1,2", "--requests=2", "--prompt_len=8",
                "--output_len=3", "--token_budget=16", "--max_num_seqs=2")
    assert [r["pp"] for r in d["runs"]] == [1, 2]
    for r in d["runs"]:
        assert r["tokens_equal_pp1"] is True
        assert sum(r["layers_per_stage"]) == 2 and len(r["stage_busy_fraction"]) == r["pp"]
        assert r["iterations"] >= 3 and 0 < r["mean_batches_in_flight"] <= r["max_in_flight"]
        assert all(0 <= b <= 1.0 + 1e-3 for b in r["stage_busy_fraction"])


def test_bench_pipeline_sim():
    d, _ = _run("bench_pipeline", "--sim", "--sim_requests=8")
    assert d["workload"]["requests"] == 8 and (d["tp"], d["pp"], d["max_in_flight"]) == (4, 2, 2)
    assert {name: p["token_budget"] for name, p in d["policies"].items()} == {"vllm_v0": 4096, "orca": 4224,
                                                                              "sarathi": 512}
    for p in d["policies"].values():
        busy = p["stage_busy_fraction"]
        assert len(busy) == 2 and all(0 <= b <= 1 for b in busy)
        assert abs(p["bubble_fraction"] - (1 - sum(busy) / 2)) < 2e-3      # idle share of the stages' time
        assert 1 <= p["mean_batches_in_flight"] <= 2 and p["iterations"] > 0 and p["output_tokens_per_s"] > 0


@pytest.mark.parametrize("table", ["chunking", "mixing", "tile"])
def test_sim_paper_analytic_tables(tmp_path, table):
    d, err = _run("sim_paper", f"--table={table}", f"--workdir={tmp_path}")
    rows = d[table]
    assert rows and f"### {table}" in err
    if table == "chunking":
        assert [r["prompt"] for r in rows] == [2048, 4096, 8192, 16384]
        for r in rows:   # each chunk re-reads the earlier chunks' KV: chunking never makes a prefill cheaper
            assert all(r[f"chunk{c}_relative"] >= 1.0 - 1e-9 for c in (512, 1024, 2048))
            assert r["chunk512_relative"] >= r["chunk2048_relative"] - 1e-9
    elif table == "mixing":
        for r in rows:
            assert r["chunk_tokens"] == 512 - r["decodes"]
            assert _close(r["whole_prefill_slowdown"], r["with_whole_prefill_2048_s"] / r["decode_only_s"])
            assert _close(r["chunk_slowdown"], r["with_chunk_s"] / r["decode_only_s"])
            assert 1 < r["chunk_slowdown"] < r["whole_prefill_slowdown"]
    else:
        assert {r["batch_tokens"] for r in rows} == {128, 256, 512}
        for r in rows:
            assert r["batch_tokens_plus_1"] == r["batch_tokens"] + 1 and r["time_plus_1_s"] > r["time_s"]
            assert _close(r["ratio"], r["time_plus_1_s"] / r["time_s"])


def test_placement():
    d, _ = _run("placement", "--budget=2", "--num_requests=20", "--workers=1", "--top=0", "--affinity=high",
                "--colocated=sarathi")
    assert d["problem"]["budget"] == 2 and d["problem"]["num_requests"] == 20
    ranking = d["ranking"]
    assert len(ranking) == d["num_candidates"] > 0
    assert [r["per_gpu_goodput_rps"] for r in ranking] == sorted((r["per_gpu_goodput_rps"] for r in ranking),
                                                                 reverse=True)
    for r in ranking:
        assert 1 <= r["num_gpus"] <= 2 and r["kind"] in ("high", "colocated")
        assert abs(r["per_gpu_goodput_rps"] - r["goodput_rps"] / r["num_gpus"]) < 1e-3
        assert sum(len(d) for d in r["devices"]) == r["num_gpus"]
    assert set(d["best_colocated"]) == {"sarathi"} and d["best_disaggregated"]["kind"] == "high"


def test_sim_paper_disagg_table_small():
    d, err = _run("sim_paper", "--table=disagg", "--num_requests=16")
    assert "Llama-2-13B" in err
    for t in d["disagg"].values():
        assert {r["layout"] for r in t["rows"]} == {"2xtp1", "1xtp2", "1p1d"}
        for r in t["rows"]:
            assert 0 <= r["slo_attainment"] <= 1 and r["goodput_rps"] >= 0
            assert (r["kv_transfer_p99_s"] is not None) == (r["layout"] == "1p1d")   # only disaggregated moves KV
        for layout, best in t["max_rate_at_90pct"].items():
            ok = [r["rate_rps"] for r in t["rows"] if r["layout"] == layout and r["slo_attainment"] >= 0.9]
            assert best["rate_rps"] == max(ok, default=0.0) and best["per_gpu_rps"] == best["rate_rps"] / 2


def test_sim_paper_ablation_table_small(tmp_path, shared_data):
    """The sweep path (the artifact's trace lengths from ../shared/data): JSON alone on stdout."""
    d, err = _run("sim_paper", "--table=ablation", "--num_requests=10", "--parallel=1", f"--workdir={tmp_path}")
    assert "sweep: 5 points" in err
    for trace in ("chat", "arxiv"):
        rows = d["ablation"][trace]
        assert [r["scheme"] for r in rows] == ["orca", "chunked_only", "chunked_only", "sarathi", "sarathi"]
        assert [r["token_budget"] for r in rows][1:] == [512, 1024, 512, 1024]
        assert all(r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tbt_p50_s"] <= r["tbt_p99_s"] for r in rows)
        assert (tmp_path / f"ablation_{trace}" / "summary.csv").is_file()


def test_overload_experiment(tmp_path):
    d, _ = _run("overload", "--num_requests=60", "--phase_rows=30", f"--out={tmp_path}")
    rej, mix = d["early_rejection"]["rows"], d["shifting_mix"]["rows"]
    assert list(rej) == ["none", "late", "current_load", "predicted_load"]
    assert rej["none"]["rejected_before_prefill"] == rej["none"]["prefill_wasted"] == 0
    assert rej["late"]["rejected_before_prefill"] == 0
    for row in list(rej.values()) + list(mix.values()):
        assert 0 <= row["slo_attainment"] <= 1 and row["num_met_slo"] <= row["num_requests"]
    assert set(mix) == {"fixed-2P2D", "fixed-1P3D", "fixed-3P1D", "borrow-2P2D", "rebalance-2P2D"}
    assert all(row["num_requests"] == 60 and set(row["phases"]) == {"sharegpt", "code"} for row in mix.values())
    assert (tmp_path / "overload.json").exists() and (tmp_path / "early_rejection_decode_batch.png").exists()


def test_bench_logprobs():
    d, _ = _run("bench_logprobs", "--batches=1,2", "--repeats=1", "--vocab_size=0", "--context=32")
    assert d["vocab_size"] == 512 and d["top_logprobs"] == 20 and d["memory_bandwidth_bytes_per_s"] > 0
    assert [p["batch"] for p in d["points"]] == [1, 2]
    for p in d["points"]:
        assert p["compiles_after_warmup"] == 0                     # asking for logprobs compiles nothing
        assert _close(p["overhead_all"], p["all_s"] / p["none_s"])
        assert _close(p["none_vs_baseline"], p["none_s"] / p["baseline_s"])
        assert _close(p["logprobs_roofline_s"], 3 * p["batch"] * 512 * 4 / d["memory_bandwidth_bytes_per_s"])
    assert d["compile_count"] == 2                                  # one shape per batch bucket
