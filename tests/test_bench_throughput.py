"""experiments/bench_throughput (pdjax.experiment.throughput) on a tiny setting: the JSON's counts agree with its
definitions (module docstring)."""
import pathlib
import subprocess
import sys

import pytest

from pdjax.experiment import throughput as bench_throughput

CEILINGS = {"matmul_flops": 1e11, "copy_bandwidth_Bps": 1e10}  # fixed, so the test skips measuring them


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tiny_run_fields_are_consistent(async_scheduling):
    p, l, n = 3, 21, 4
    d = bench_throughput.run("tiny-llama", p, l, n, token_budget=32, ceilings=CEILINGS,
                             async_scheduling=async_scheduling)
    assert d["async_scheduling"] is async_scheduling
    assert d["completed"] == p and d["compiles_during_run"] == 0 and d["num_compiled_shapes"] == len(d["shapes"])
    assert d["prompt_tokens"] == p * l and d["output_tokens"] == p * n and d["tokens"] == p * (l + n)
    assert d["prefill_tokens_fed"] == p * l and d["decode_tokens_fed"] == p * (n - 1)
    assert d["fed_tokens"] == p * (l + n - 1)
    assert d["num_steps"] >= -(-p * l // 32) + n - 1
    assert d["tokens_per_s"] == pytest.approx(d["tokens"] / d["serving_s"])
    assert d["output_tokens_per_s"] == pytest.approx(p * n / d["serving_s"])
    assert d["roofline_s"] == pytest.approx(d["ratio"] * d["serving_s"])
    assert max(d["roofline_compute_s"], d["roofline_memory_s"]) <= d["roofline_s"] + 1e-12
    assert d["roofline_s"] <= d["roofline_compute_s"] + d["roofline_memory_s"] + 1e-12
    assert d["compile_s"] > 0 and d["serving_s"] > 0 and d["serving_cpu_s"] > 0
    assert d["output_tokens_per_cpu_s"] == pytest.approx(p * n / d["serving_cpu_s"])
    assert d["ceilings"]["matmul_flops_per_s"] == CEILINGS["matmul_flops"]


@pytest.mark.parametrize("flag", ["num_prompts", "prompt_len", "output_len"])
def test_flags_validated_with_one_line_error(flag):
    with pytest.raises(ValueError, match=f"^--{flag}=0: expected an integer >= 1$"):
        bench_throughput.run("tiny-llama", **{"num_prompts": 2, "prompt_len": 4, "output_len": 2, flag: 0})


def test_cli_rejects_bad_flag_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_throughput", "--output_len=0"],
                          capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).resolve().parents[1])
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if "output_len" in line]   # cli.run's one-line error
    assert errors == ["error: --output_len=0: expected an integer >= 1"]


def test_side_by_side_with_hf_gives_the_same_greedy_tokens():
    """--backend=hf (needs the 'hf' extra): the same weights and prompts on HF transformers give pdjax's tokens."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    d = bench_throughput.run("", 4, 16, 6, token_budget=64, ceilings=CEILINGS, backend="hf", repeats=1,
                             hf_threads=1)
    hf = d["hf"]
    assert hf["requests_with_equal_tokens"] == hf["num_requests"] == 4
    assert set(hf["hf_output_tokens_per_s"]) == {"ACTIVE", "PASSIVE"}
    assert hf["hf_best"] == max(max(v) for v in hf["hf_output_tokens_per_s"].values())
    assert hf["speedup_vs_hf"] == pytest.approx(hf["pdjax_best"] / hf["hf_best"])
    assert len(hf["load_avg_1min"]) == 2
    assert set(hf["hf_output_tokens_per_cpu_s"]) == {"ACTIVE", "PASSIVE"}
    assert len(hf["pdjax_output_tokens_per_cpu_s"]) == 1
    assert hf["cpu_speedup_vs_hf"] == pytest.approx(
        max(hf["pdjax_output_tokens_per_cpu_s"]) / max(max(v) for v in hf["hf_output_tokens_per_cpu_s"].values()))


def test_hf_backend_without_the_extra_is_one_line(monkeypatch):
    import importlib.util
    from pdjax.runtime import hf_baseline
    real = importlib.util.find_spec
    # One text whether or not transformers is installed: the extra, what it holds, then what is missing.
    for absent, listed in ((("torch",), "torch"), (("torch", "transformers"), "torch, transformers")):
        def find_spec(name, *a, absent=absent):   # transformers present unless listed, installed or not
            return None if name in absent else object() if name == "transformers" else real(name, *a)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        with pytest.raises(hf_baseline.MissingExtraError) as e:
            bench_throughput.run("tiny-llama", 2, 4, 2, backend="hf")
        assert str(e.value) == (f"--backend=hf needs the optional extra 'hf' (torch and transformers; not installed: "
                                f"{listed}): pip install -e \".[hf]\"")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    with pytest.raises(ValueError, match=r"^--backend='tf', expected one of \('pdjax', 'hf'\)$"):
        bench_throughput.run("tiny-llama", 2, 4, 2, backend="tf")
