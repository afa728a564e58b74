"""Fixtures of the simulator's outputs: every shipped sim config at a small request count, run through the
`--config.backend=sim` path (pdjax.experiment.run.prepare_experiment -> pdjax.sim.run.run_sim), its
requests.csv, iterations.csv and token_times.csv stored by SHA-256 (tests/fixtures/sim/digests.json) and, for
some cases, whole (xz-compressed, tests/fixtures/sim/<case>/).
tests/test_sim_fixtures.py re-runs every case and compares the files byte for byte, so an optimization or
refactor of the simulator that changes any record (a single float bit) fails there.

    python tests/make_sim_fixtures.py               # (re)write every fixture (only when a change is meant)
    python tests/make_sim_fixtures.py CASE ...      # some of them

The cases (CASES): configs/serve.py on the simulator (host-cpu, the tiny-byte model) and variants that reach
every loop (asynchronous scheduling, replicas behind each router, pipeline stages, disaggregation with and
without pipeline stages, vllm_v0 with swap preemption, offline); configs/sim/chat10k.py; every paper config
(paper_base, capacity_paper, disagg_paper), fidelity_cpu and splitwise (its dedicated mixed group, no mixed pool, and
the borrowing preset: `_borrow` cases).
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import pathlib
import sys
import tempfile
from typing import Dict, Tuple

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "sim"
DIGESTS = FIXTURES / "digests.json"
FILES = ("requests.csv", "iterations.csv", "token_times.csv")

SERVE = "configs/serve.py"
NUM_REQUESTS = 40        # per case unless the case says otherwise


def _serve(**overrides) -> Tuple[str, None, dict]:
    return SERVE, None, {"backend": "sim", **overrides}


def _cases() -> Dict[str, Tuple[str, object, dict]]:
    """case name -> (config file, its ARG or None, dotted overrides)."""
    cases = {
        "serve": _serve(),
        "serve_async": _serve(**{"engine.async_scheduling": True}),
        "serve_2rep_rr": _serve(**{"deployment.colocated.num_instances": 2, "workload.rate": 8.0}),
        "serve_2rep_least_loaded": _serve(**{"deployment.colocated.num_instances": 2, "workload.rate": 8.0,
                                             "deployment.router": "least_loaded"}),
        "serve_pp2": _serve(**{"deployment.colocated.pp": 2, "workload.rate": 8.0}),
        "serve_vllm_swap": _serve(**{"scheduler.policy": "vllm_v0", "scheduler.preemption_mode": "swap",
                                     "scheduler.token_budget": 1024, "scheduler.num_pages": 80,
                                     "scheduler.num_host_pages": 256, "workload.rate": 8.0}),
        "serve_offline": _serve(**{"engine.mode": "offline"}),
        "serve_disagg": _serve(**{"deployment.kind": "disaggregated", "workload.rate": 8.0}),
        "serve_disagg_pp2": _serve(**{"deployment.kind": "disaggregated", "deployment.prefill.pp": 2,
                                      "deployment.decode.pp": 2, "workload.rate": 8.0}),
        "serve_disagg_2p2d_least_loaded": _serve(**{
            "deployment.kind": "disaggregated", "deployment.prefill.num_instances": 2,
            "deployment.decode.num_instances": 2, "deployment.router": "least_loaded", "workload.rate": 16.0}),
        "chat10k": ("configs/sim/chat10k.py", None, {"workload.num_requests": 100}),
        "fidelity_cpu_full": ("configs/sim/fidelity_cpu.py", "full", {}),
        "fidelity_cpu_small": ("configs/sim/fidelity_cpu.py", "small", {}),
    }
    for model in ("mistral7b", "yi34b", "llama70b"):
        for trace in ("chat", "arxiv"):
            cases[f"paper_{model}_{trace}"] = ("configs/sim/paper_base.py", f"{model}-{trace}", {})
            # sarathi-strict is paper_base itself; the SLO sets only sarathi's budget (vllm_v0 and orca's
            # relaxed configs equal their strict ones)
            for policy, slo in (("sarathi", "relaxed"), ("vllm_v0", "strict"), ("orca", "strict")):
                cases[f"capacity_{model}_{policy}_{slo}_{trace}"] = (
                    "configs/sim/capacity_paper.py", f"{model}-{policy}-{slo}-{trace}", {})
    for layout in ("2xtp1", "1xtp2", "1p1d"):
        for trace in ("chat", "arxiv"):
            cases[f"disagg_paper_{layout}_{trace}"] = ("configs/sim/disagg_paper.py", f"{layout}-{trace}", {})
    for machines in ("aa", "hh"):
        for trace in ("code", "conv"):
            # The dedicated mixed group (the preset before borrowing: its fixtures are that code's records).
            cases[f"splitwise_{machines}_{trace}"] = ("configs/sim/splitwise.py", f"{machines}-{trace}-dedicated", {})
            cases[f"splitwise_{machines}_{trace}_borrow"] = ("configs/sim/splitwise.py", f"{machines}-{trace}", {})
    cases["splitwise_aa_code_nomixed"] = ("configs/sim/splitwise.py", "aa-code-off", {})
    return cases


CASES = _cases()
# Stored whole (every file), so that a failure shows the first record that differs; every other case stores its
# requests.csv whole and the other two files by SHA-256 (the fixtures stay well under 1 MB).
FULL_CASES = ("serve", "serve_async", "serve_2rep_least_loaded", "serve_pp2", "serve_disagg_pp2", "chat10k",
              "paper_llama70b_chat", "splitwise_aa_code")
# Run by the default test suite (the rest with -m slow): every loop, router and deployment kind, one case of each
# paper config family.
FAST_CASES = tuple(n for n in CASES if n.startswith("serve")) + (
    "chat10k", "fidelity_cpu_small", "paper_llama70b_chat", "capacity_yi34b_orca_strict_chat",
    "disagg_paper_1p1d_chat", "splitwise_aa_code", "splitwise_aa_code_borrow")


def case_config(name: str):
    """The case's ConfigDict: its config file (with ARG), the overrides, NUM_REQUESTS unless overridden."""
    from pdjax.config.files import config_file
    path, arg, overrides = CASES[name]
    config = config_file(str(REPO / "x"), path, arg)
    overrides = {"workload.num_requests": NUM_REQUESTS, **overrides}
    for key, value in overrides.items():
        *blocks, field = key.split(".")
        block = config
        for b in blocks:
            block = block[b]
        block[field] = value
    return config


def run_case(name: str) -> Dict[str, bytes]:
    """Simulate case `name` as `experiments.serve --config.backend=sim` does; returns {file name: bytes}."""
    from pdjax.experiment.run import prepare_experiment
    from pdjax.sim.run import run_sim
    with tempfile.TemporaryDirectory() as tmp:
        workdir = os.path.join(tmp, "run")
        prep = prepare_experiment(case_config(name), workdir)
        run_sim(prep.cfg, prep.config, workdir, plots=False, workload=prep.workload)
        return {f: pathlib.Path(workdir, f).read_bytes() for f in FILES}


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fixture_path(name: str, file: str) -> pathlib.Path:
    return FIXTURES / name / f"{file}.xz"


def stored_files(name: str) -> Tuple[str, ...]:
    """The files stored whole for case `name` (the others by digest only)."""
    return FILES if name in FULL_CASES else ("requests.csv",)


def read_digests() -> Dict[str, Dict[str, str]]:
    return json.loads(DIGESTS.read_text())


def read_fixture(name: str, file: str) -> bytes:
    return lzma.decompress(fixture_path(name, file).read_bytes())


def write_case(name: str, digests: Dict[str, Dict[str, str]]) -> int:
    """Run case `name`, store its digests and whole files; returns the bytes stored."""
    from pdjax.metrics.report import atomic_write_bytes   # pdjax is on sys.path once main() runs
    files = run_case(name)
    digests[name] = {file: digest(data) for file, data in files.items()}
    size = 0
    for file in stored_files(name):
        path = fixture_path(name, file)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, lzma.compress(files[file]))
        size += path.stat().st_size
    return size


def main(argv) -> int:
    names = argv or list(CASES)
    bad = [n for n in names if n not in CASES]
    if bad:
        print(f"error: unknown cases {bad}, expected some of {sorted(CASES)}", file=sys.stderr)
        return 2
    digests = read_digests() if DIGESTS.is_file() else {}
    for name in names:
        print(f"{name}: {write_case(name, digests)} bytes")
    from pdjax.metrics.report import atomic_write_text
    atomic_write_text(DIGESTS, json.dumps({n: digests[n] for n in CASES if n in digests}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
