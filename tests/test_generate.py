"""experiments.generate end to end: chunked prefill + mixed batches + greedy decode vs a dense reference."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pdjax.runtime.generate import run_generate as run
from pdjax.config.model_specs import get_model_spec
from pdjax.models.checkpoint import params_to_hf_tensors, save_params, spec_to_hf_config
from pdjax.models.llama import init_params
from pdjax.runtime.generate import load_prompts
from test_model import dense_forward

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = get_model_spec("tiny-llama")
PROMPTS = [list(range(3, 40)), [5, 6, 7], [11] * 18, [400]]  # different lengths -> mixed prefill/decode steps


def dense_greedy(tensors, cfg, prompt, n):
    tokens, first_logits = list(prompt), None
    for _ in range(n):
        logits = dense_forward(tensors, cfg, tokens)[-1]
        first_logits = logits if first_logits is None else first_logits
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):], first_logits


@pytest.fixture(scope="module")
def expected():
    params = init_params(SPEC, 0)
    tensors, cfg = params_to_hf_tensors(params, SPEC), spec_to_hf_config(SPEC)
    return [dense_greedy(tensors, cfg, p, 6) for p in PROMPTS]


@pytest.mark.parametrize("chunk_size,dump", [(5, True), (16, False)])
def test_generate_matches_dense_greedy(tmp_path, expected, chunk_size, dump):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out, logits_path = tmp_path / "out.json", tmp_path / "logits.npy"
    _, _, runner = run("tiny-llama", str(prompts), 6, str(out), chunk_size=chunk_size, page_size=8,
                       dump_logits=str(logits_path) if dump else None, attention_impl="reference")
    tokens = json.loads(out.read_text())["tokens"]
    assert tokens == [e[0] for e in expected]
    assert not list(tmp_path.glob("*.tmp"))
    assert runner.compile_count <= runner.buckets.num_shapes
    if dump:
        logits = np.load(logits_path)
        assert logits.dtype == np.float32 and logits.shape == (len(PROMPTS), SPEC.vocab_size)
        want = np.stack([e[1] for e in expected])
        np.testing.assert_allclose(logits, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_cli_with_orbax_checkpoint(tmp_path, expected):
    save_params(tmp_path / "ckpt", SPEC, init_params(SPEC, 0))
    (tmp_path / "p.json").write_text(json.dumps(PROMPTS[:2]))
    subprocess.run([sys.executable, "-m", "experiments.generate", f"--checkpoint={tmp_path / 'ckpt'}",
                    f"--prompts={tmp_path / 'p.json'}", "--max_new_tokens=6", f"--out={tmp_path / 'o.json'}",
                    "--chunk_size=7"], check=True, capture_output=True, cwd=REPO_ROOT,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert json.loads((tmp_path / "o.json").read_text())["tokens"] == [e[0] for e in expected[:2]]


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not valid JSON"),
    ('{"a": 1}', "expected a non-empty JSON list"),
    ("[]", "expected a non-empty JSON list"),
    ("[[1, 2], []]", "prompt 1 is"),
    ('[[1, "x"]]', "prompt 0 has token 'x'"),
    ("[[1, -3]]", "prompt 0 has token -3"),
])
def test_malformed_prompts_file(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(path)


def test_prompt_token_outside_vocab_and_too_long(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([[1, 2, SPEC.vocab_size]]))
    with pytest.raises(ValueError, match=r"prompt 0 has token id 512 outside \[0, 512\)"):
        run("tiny-llama", str(path), 2, str(tmp_path / "o.json"))
    path.write_text(json.dumps([[1] * 2040]))
    with pytest.raises(ValueError, match=r"2049 exceeds the model's max_position_embeddings=2048"):
        run("tiny-llama", str(path), 9, str(tmp_path / "o.json"))


def test_a_short_prompt_is_no_slow_path(tmp_path, caplog):
    """issue 27: a 3-token prompt warned 'page_size=16 exceeds max_model_len=7 (slow)' on a normal input."""
    from pdjax.runtime import runner as runner_lib
    runner_lib._warned.clear()
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3]]))
    with caplog.at_level("WARNING"):
        _, _, runner = run("tiny-llama", str(prompts), 4, str(tmp_path / "out.json"), page_size=16,
                           attention_impl="reference")
    assert runner.max_model_len == 16 and not [r for r in caplog.records if "exceeds max_model_len" in r.message]
