"""The Sarathi-Serve paper configs as the OSDI'24 artifact ran them (configs/sim/paper_base.py,
configs/sweeps/sarathi_ablation_paper.py, configs/sim/capacity_paper.py): every variant validates and simulates a
few requests of exactly its deployment, the setups are the artifact's, and trace replay reproduces the trace's
lengths exactly (checked against the CSV read here, independently of pdjax's loader)."""
import csv
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pdjax.config.files import config_file
from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.run import to_plain_dict
from pdjax.experiment.sweep import expand_grid

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRACES_DIR = ROOT.parent / "shared" / "data" / "traces"
CHAT_CSV = TRACES_DIR / "sarathi_sharegpt_8k_filtered_llama2_tok.csv"
ARXIV_CSV = TRACES_DIR / "vidur_arxiv_summarization_llama2_tok_filtered_v2.csv"
needs_traces = pytest.mark.skipif(not (CHAT_CSV.is_file() and ARXIV_CSV.is_file()),
                                  reason=f"shared trace data absent ({TRACES_DIR})")

MODELS = ("mistral7b", "yi34b", "llama70b")
TRACES = ("chat", "arxiv")
BASE_ARGS = [m for m in MODELS] + [f"{m}-{t}" for m in MODELS for t in TRACES]
CAPACITY_ARGS = [f"{m}-{p}-{s}" + (f"-{t}" if t else "") for m in MODELS for p in ("sarathi", "vllm_v0", "orca")
                 for s in ("strict", "relaxed") for t in ("", "chat", "arxiv")]


def load(path, arg):
    return to_plain_dict(config_file(str(ROOT / "README.md"), path, arg))


def points(config):
    return [cfg for _, _, cfg in expand_grid(config)] if "grid" in config else [config]


def paper_configs():
    """(id, serve config dict) of every paper config variant (every sweep point)."""
    out = [(f"paper_base:{a}", load("configs/sim/paper_base.py", a)) for a in BASE_ARGS]
    out += [(f"capacity_paper:{a}", load("configs/sim/capacity_paper.py", a)) for a in CAPACITY_ARGS]
    for trace in TRACES:
        sweep = load("configs/sweeps/sarathi_ablation_paper.py", trace)
        out += [(f"sarathi_ablation_paper:{trace}:{cfg['scheduler']['policy']}-{cfg['scheduler']['token_budget']}",
                 cfg) for cfg in points(sweep)]
    return out


def read_csv_lengths(path, start, count):
    """(prompt lengths, output lengths) of rows start .. start+count of a Vidur-format length trace."""
    prompts, outputs = [], []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if i >= start + count:
                break
            prompts.append(int(row["num_prefill_tokens"]))
            outputs.append(int(row["num_decode_tokens"]))
    return np.array(prompts), np.array(outputs)


@pytest.mark.parametrize("name,config", paper_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_paper_config_validates(name, config):
    cfg = serve_config_from_dict(config)
    assert cfg.backend == "sim" and cfg.sim.hardware == "a100-80gb-pcie"
    assert cfg.workload.kind == "trace" and cfg.workload.arrival == "poisson"
    assert pathlib.Path(cfg.workload.trace_path).is_absolute()


@needs_traces
@pytest.mark.parametrize("name,config", paper_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_paper_config_simulates_a_few_requests(name, config):
    from pdjax.sim.run import simulate_config
    config = dict(config, workload=dict(config["workload"], num_requests=4))
    cfg = serve_config_from_dict(config)
    result, setup = simulate_config(cfg)
    assert len(result.requests) == 4 and all(r.completed for r in result.requests)
    g, want = setup.groups["colocated"], cfg.deployment.colocated
    assert (setup.kind, g.num_instances, g.pp, g.tp) == ("colocated", 1, want.pp, want.tp)


def assert_same_file(config_path, expected):
    """The config's trace path (absolute, as the config wrote it: ../shared is not resolved) names `expected`."""
    assert pathlib.Path(config_path).is_absolute()
    assert pathlib.Path(config_path).resolve() == pathlib.Path(expected).resolve()


@pytest.mark.parametrize("trace,path,max_len", [("chat", CHAT_CSV, 8192), ("arxiv", ARXIV_CSV, 16384)])
def test_traces_resolve_relative_to_the_repo(trace, path, max_len):
    c = load("configs/sim/paper_base.py", f"yi34b-{trace}")
    assert_same_file(c["workload"]["trace_path"], path)
    assert c["scheduler"]["max_model_len"] == max_len


def test_traces_resolve_through_a_symlinked_shared_dir(tmp_path):
    """A checkout whose ../shared is a symbolic link (and is reached through one): the paper configs' trace paths
    go through it and name the linked files."""
    data = tmp_path / "elsewhere"
    (data / "data" / "traces").mkdir(parents=True)
    (data / "data" / "traces" / CHAT_CSV.name).write_text("num_prefill_tokens,num_decode_tokens\n5,3\n")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "repo").symlink_to(ROOT, target_is_directory=True)
    (workspace / "shared").symlink_to(data, target_is_directory=True)
    code = ("import sys; from pdjax.config.files import config_file; "
            "print(config_file(sys.argv[1], 'configs/sim/paper_base.py', 'yi34b-chat').workload.trace_path)")
    out = subprocess.run([sys.executable, "-c", code, str(workspace / "repo" / "README.md")], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(workspace / "repo")}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    trace_path = out.stdout.strip()
    assert trace_path == str(workspace / "shared" / "data" / "traces" / CHAT_CSV.name)   # through both links
    assert_same_file(trace_path, data / "data" / "traces" / CHAT_CSV.name)


def test_every_paper_context_fits_its_model():
    """max_model_len within the model's positions (the real engine refuses more, and so does the simulator): Yi is
    the artifact's Yi-34B-200K, not the 4096-position base."""
    from pdjax.config.model_specs import get_model_spec
    for name, config in paper_configs():
        spec = get_model_spec(config["model"]["checkpoint"])
        assert config["scheduler"]["max_model_len"] <= spec.max_position_embeddings, name
    spec = get_model_spec(load("configs/sim/paper_base.py", "yi34b")["model"]["checkpoint"])
    assert (spec.name, spec.max_position_embeddings, spec.rope_theta) == ("yi-34b-200k", 200000, 5000000.0)
    assert spec.replace(name="yi-34b", max_position_embeddings=4096) == get_model_spec("yi-34b")


def test_ablation_is_the_artifacts():
    """table-6/scheduling_ablation.sh: Yi-34B TP2, 128 requests, chat 1 req/s at 8192, arxiv 0.5 req/s at 16384,
    batch 128; hybrid-only = whole prompts; chunked-only and Sarathi at 512 (and the paper's 1024)."""
    for trace, rate, max_len in (("chat", 1.0, 8192), ("arxiv", 0.5, 16384)):
        cfgs = [serve_config_from_dict(c) for c in points(load("configs/sweeps/sarathi_ablation_paper.py", trace))]
        for cfg in cfgs:
            assert cfg.model.checkpoint == "yi-34b-200k" and cfg.deployment.colocated.tp == 2
            assert cfg.deployment.colocated.pp == 1 and cfg.deployment.colocated.num_instances == 1
            assert (cfg.workload.num_requests, cfg.workload.rate) == (128, rate)
            assert cfg.scheduler.max_model_len == max_len and cfg.scheduler.max_num_seqs == 128
            assert cfg.workload.scale == 1.0 and not cfg.workload.fit_to_model and cfg.workload.max_output_len == 0
        schemes = {(c.scheduler.policy, c.scheduler.token_budget) for c in cfgs}
        assert schemes == {("orca", max_len + 128), ("chunked_only", 512), ("chunked_only", 1024),
                           ("sarathi", 512), ("sarathi", 1024)}


@pytest.mark.parametrize("model,tp,pp,strict,relaxed,budgets,orca_seqs", [
    ("mistral7b", 1, 1, 0.1, 0.5, (512, 2048), 16),
    ("yi34b", 2, 1, 0.2, 1.0, (512, 2048), 16),
    ("llama70b", 4, 2, 1.0, 5.0, (512, 1536), 8),
])
def test_capacity_is_the_artifacts(model, tp, pp, strict, relaxed, budgets, orca_seqs):
    """figure-5-6/*.yml: SLOs, Sarathi budgets, vLLM batch 128, Orca's smaller batch cap."""
    for trace, max_len in (("chat", 8192), ("arxiv", 16384)):
        for slo, limit, budget in (("strict", strict, budgets[0]), ("relaxed", relaxed, budgets[1])):
            by_policy = {p: serve_config_from_dict(load("configs/sim/capacity_paper.py", f"{model}-{p}-{slo}-{trace}"))
                         for p in ("sarathi", "vllm_v0", "orca")}
            for cfg in by_policy.values():
                assert cfg.slo.tbt == limit and cfg.scheduler.max_model_len == max_len
                assert (cfg.deployment.colocated.tp, cfg.deployment.colocated.pp) == (tp, pp)
            assert by_policy["sarathi"].scheduler.token_budget == budget
            assert by_policy["sarathi"].scheduler.max_num_seqs == 128
            assert by_policy["vllm_v0"].scheduler.token_budget == max_len
            assert by_policy["vllm_v0"].scheduler.max_num_seqs == 128
            assert by_policy["orca"].scheduler.max_num_seqs == orca_seqs
            assert by_policy["orca"].scheduler.token_budget >= max_len


@needs_traces
def test_llama70b_pipeline_spans_two_nodes():
    """TP4 x PP2 on 4-GPU nodes: each stage's TP group inside one node, the two stages on different nodes."""
    from pdjax.sim.build import build_setup
    cfg = serve_config_from_dict(load("configs/sim/capacity_paper.py", "llama70b-sarathi-strict"))
    setup = build_setup(cfg)
    (devices,) = setup.groups["colocated"].devices
    per_node = setup.hardware.devices_per_node
    assert per_node == 4 and len(devices) == 8
    stages = [devices[:4], devices[4:]]
    assert [{d // per_node for d in s} for s in stages] == [{0}, {1}]


@needs_traces
@pytest.mark.parametrize("path,arg", [
    ("configs/sim/paper_base.py", "yi34b-chat"), ("configs/sim/paper_base.py", "yi34b-arxiv"),
    ("configs/sweeps/sarathi_ablation_paper.py", "chat"), ("configs/sweeps/sarathi_ablation_paper.py", "arxiv"),
    ("configs/sim/capacity_paper.py", "llama70b-sarathi-strict-chat"),
    ("configs/sim/capacity_paper.py", "mistral7b-orca-relaxed-arxiv"),
])
def test_trace_replay_reproduces_the_trace_lengths(path, arg):
    """kind='trace' replays rows trace_start .. +num_requests as they are: the generated workload's prompt and
    output lengths (all of them) have the median and P90 of those CSV rows; in fact the same multiset."""
    from pdjax.workload import make_workload
    config = points(load(path, arg))[0]
    cfg = serve_config_from_dict(config)
    w = cfg.workload
    csv_prompts, csv_outputs = read_csv_lengths(w.trace_path, w.trace_start, w.num_requests)
    assert len(csv_prompts) == w.num_requests
    requests = make_workload(w, cfg.seed)
    prompts = np.array([r.num_prompt_tokens for r in requests])
    outputs = np.array([r.max_tokens for r in requests])
    for got, want in ((prompts, csv_prompts), (outputs, csv_outputs)):
        for q in (50, 90):
            assert np.percentile(got, q) == np.percentile(want, q)
        assert sorted(got.tolist()) == sorted(want.tolist())


@needs_traces
def test_chat_trace_is_the_papers_table2_row():
    """SOURCES.md: the chat trace's statistics match Sarathi-Serve's Table 2 (openchat_sharegpt4): prompt median
    1730, P90 5696; output median 415, P90 834 (whole file; nearest-rank percentiles differ by at most a token)."""
    prompts, outputs = read_csv_lengths(CHAT_CSV, 0, 10**9)
    assert len(prompts) == 30731 and (prompts + outputs).max() <= 8192
    assert abs(np.median(prompts) - 1730) <= 1 and abs(np.percentile(prompts, 90) - 5696) <= 1
    assert abs(np.median(outputs) - 415) <= 1 and abs(np.percentile(outputs, 90) - 834) <= 1
