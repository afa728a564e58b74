"""Nothing is served from non-finite numbers: a checkpoint whose weights hold NaN or inf fails to load, naming the
tensor (orbax and HF safetensors, including a corrupted file that still decodes), and the engines never emit a
token drawn from non-finite logits: that request is aborted with the step named, the others finish."""
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.config.buckets import Buckets
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.models.checkpoint import (NonFiniteWeightsError, load_model, save_hf_checkpoint, save_params)
from pdjax.runtime import compiles
from pdjax.runtime.generate import NonFiniteLogitsError, generate
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.output import NONFINITE_LOGITS
from pdjax.serving.cluster import ClusterEngine, Instance
from pdjax.serving.engine import ColocatedEngine

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = REPO / "checkpoints" / "tiny-byte"
MAX_LEN, PAGE = 128, 16
POISON = 7          # the token whose embedding row is NaN: only a prompt holding it reads non-finite values


def _flip_bytes(path: pathlib.Path, start: int, length: int = 2048) -> None:
    """XOR 0x5a into every 7th byte of [start, start + length): the corruption of issue 16."""
    data = bytearray(path.read_bytes())
    for i in range(start, min(start + length, len(data)), 7):
        data[i] ^= 0x5a
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory):
    """A copy of tiny-byte with the corruption of issue 16 in a range of its largest data file that still decodes
    (zstd keeps it raw) into NaN/inf in layers[0].w_up: flips that break the compression fail in the reader
    instead (tests/test_checkpoint_errors.py)."""
    ckpt = tmp_path_factory.mktemp("corrupted") / "tiny-byte"
    shutil.copytree(TINY, ckpt)
    data = max((ckpt / "params").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    _flip_bytes(data, int(0.7 * data.stat().st_size))
    return ckpt


def test_a_corrupted_orbax_file_that_still_decodes_is_refused_naming_the_tensor(corrupted):
    with pytest.raises(NonFiniteWeightsError) as info:
        load_model(str(corrupted))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {str(corrupted)!r}: params layers[0].w_up has 3 non-finite values")


def _cli(module, *args):
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stderr.strip().splitlines()


def test_serve_and_generate_refuse_the_corrupted_checkpoint_in_one_line(tmp_path, corrupted):
    """Both served it before: 8/8 requests completed, attainment 1.000, every output token 0."""
    expected = f"error: checkpoint {str(corrupted)!r}: params layers[0].w_up has 3 non-finite values"
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2, 3, 4, 5], [9, 8, 7]]")
    out = tmp_path / "out.json"
    rc, lines = _cli("generate", f"--checkpoint={corrupted}", f"--prompts={prompts}", f"--out={out}",
                     "--max_new_tokens=4")
    assert rc == 2 and lines[-1].startswith(expected), lines[-5:]
    assert not out.exists()
    rc, lines = _cli("serve", "--config=configs/serve.py", f"--config.model.checkpoint={corrupted}",
                     "--config.engine.mode=offline", "--config.workload.num_requests=8",
                     f"--workdir={tmp_path / 'serve'}")
    assert rc == 2 and lines[-1].startswith(expected), lines[-5:]
    assert not (tmp_path / "serve" / "results.json").exists()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama", seed=1)


def _poisoned(params, token=POISON):
    return params.replace(embed=params.embed.at[token].set(jnp.nan))


def test_nan_weights_in_saved_orbax_and_hf_checkpoints_are_named(tmp_path, model):
    spec, params = model
    bad = params.replace(layers=(params.layers[0].replace(w_gate=params.layers[0].w_gate.at[1, 2].set(jnp.inf)),)
                         + tuple(params.layers[1:]))
    save_params(tmp_path / "orbax", spec, bad)
    with pytest.raises(NonFiniteWeightsError, match=r"params layers\[0\]\.w_gate has 1 non-finite values"):
        load_model(str(tmp_path / "orbax"))
    save_hf_checkpoint(tmp_path / "hf", spec, _poisoned(bad), num_shards=2)
    with pytest.raises(NonFiniteWeightsError) as info:
        load_model(str(tmp_path / "hf"))
    assert (f"params embed (model.embed_tokens.weight) has {spec.hidden_size} non-finite values"
            in str(info.value))
    assert "(and 1 more tensor(s) with non-finite values)" in str(info.value)
    save_hf_checkpoint(tmp_path / "good", spec, params)
    load_model(str(tmp_path / "good"))    # finite weights load


@pytest.fixture(scope="module")
def poisoned_runner(model):
    """One runner for the module (compiled once; every run starts from a fresh scheduler)."""
    spec, params = model
    return _runner(spec, _poisoned(params))


def _runner(spec, params):
    buckets = Buckets(tokens=(64,), seqs=(8,), pages=(MAX_LEN // PAGE,))   # one shape: one compile
    return ModelRunner(spec, params, num_pages=40, page_size=PAGE, buckets=buckets, max_model_len=MAX_LEN)


def _scheduler():
    return make_scheduler(SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=MAX_LEN,
                                          page_size=PAGE, num_pages=40))


def _prompts(spec):
    """Four prompts; only 'r2' holds the poisoned token."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, spec.vocab_size, size=9 + 5 * i)] for i in range(4)]
    prompts[2][3] = POISON
    return prompts


def _requests(prompts, max_tokens=6):
    return [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens), 0.0) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def clean_tokens(model):
    spec, params = model
    result = ColocatedEngine(_runner(spec, params), _scheduler()).run(_requests(_prompts(spec)))
    assert all(r.finish_reason == "length" for r in result.requests)
    assert not any(POISON in toks for toks in result.output_tokens.values())   # nobody samples the poison
    return result.output_tokens


def test_the_step_flags_non_finite_logits_instead_of_sampling(model, poisoned_runner):
    spec, _ = model
    runner = poisoned_runner
    scheduler = _scheduler()
    for req in _requests(_prompts(spec)):
        scheduler.add_request(req)
    out = scheduler.schedule(0.0)
    sampled = runner.execute(out)
    rows = {rid: int(t) for rid, t, s in zip(out.req_ids, sampled, out.do_sample) if s}
    assert rows.pop("r2") == NONFINITE_LOGITS
    assert rows and min(rows.values()) >= 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_request_with_non_finite_logits_is_aborted_the_others_finish(model, poisoned_runner, clean_tokens, caplog,
                                                                         async_scheduling):
    spec, _ = model
    runner = poisoned_runner
    runner.warmup()
    engine = ColocatedEngine(runner, _scheduler(), async_scheduling=async_scheduling,
                             compile_counter=compiles.count, fail_on_compile=True)    # the flag adds no compile
    with caplog.at_level("WARNING"):
        result = engine.run(_requests(_prompts(spec)))
    records = {r.request_id: r for r in result.requests}
    bad = records["r2"]
    assert bad.finish_reason == "aborted" and not bad.completed
    assert bad.num_output_tokens == 0 and bad.token_times == [] and result.output_tokens["r2"] == []
    assert bad.reject_reason.startswith("non-finite logits (NaN or inf) at step ")
    for rid in ("r0", "r1", "r3"):
        assert records[rid].finish_reason == "length"
        assert result.output_tokens[rid] == clean_tokens[rid]
    lines = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("request 'r2': non-finite logits (NaN or inf) at step ")


def test_the_multi_instance_engine_aborts_the_request_too(model, poisoned_runner, clean_tokens):
    spec, _ = model
    instances = [Instance("replica0", "colocated", poisoned_runner, _scheduler())]
    result = ClusterEngine(instances).run(_requests(_prompts(spec)))
    records = {r.request_id: r for r in result.requests}
    assert records["r2"].finish_reason == "aborted"
    assert records["r2"].reject_reason.startswith("non-finite logits (NaN or inf) at replica")
    for rid in ("r0", "r1", "r3"):
        assert records[rid].finish_reason == "length"
        assert result.output_tokens[rid] == clean_tokens[rid]


def test_generate_stops_naming_the_prompt_and_step(model, poisoned_runner):
    spec, _ = model
    prompts = _prompts(spec)
    for return_logits in (False, True):
        with pytest.raises(NonFiniteLogitsError, match=r"prompt 2: non-finite logits \(NaN or inf\) at step \d+: "):
            generate(poisoned_runner, prompts, 4, chunk_size=16, return_logits=return_logits)
    tokens, _ = generate(poisoned_runner, [prompts[0], prompts[1]], 4, chunk_size=16)
    assert all(len(t) == 4 and min(t) >= 0 for t in tokens)


def test_uncache_turns_free_cached_pages_into_plain_free_pages():
    from pdjax.scheduler.block_manager import BlockManager, extend_page_keys
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=True)
    table, keys = [], []
    bm.allocate(table, 2)
    extend_page_keys(keys, [1, 2, 3, 4], 2, 2)
    bm.register(table, keys, 0, 2)
    bm.free(table)
    assert bm.match_prefix(keys, 2) == table and bm.num_cached_pages == 2
    bm.uncache(table)
    assert bm.match_prefix(keys, 2) == [] and bm.num_cached_pages == 0 and bm.num_free_pages == 4
    bm.check_invariants()
    used = []
    bm.allocate(used, 1)
    with pytest.raises(RuntimeError, match="in use"):
        bm.uncache(used)
