"""Text at the entry points: experiments.generate --prompt (the model's tokenizer and chat template), the
api_server's start-up checks of a model directory's tokenizer files (one line naming the file), and a smoke run
of experiments.train_tiny_hf at its smallest size."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pdjax.workload.chat_template import chat_prompt_ids
from pdjax.workload.tokenizer import HFTokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
CKPT = REPO / "checkpoints/tiny-hf"


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_generate_text_prompts_with_the_chat_template(tmp_path):
    out = tmp_path / "gen.json"
    r = _run("experiments.generate", f"--checkpoint={CKPT}", "--prompt=What is assert?", "--prompt=中文 😀",
             "--chat", "--max_new_tokens=8", f"--out={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    tok = HFTokenizer(CKPT)
    assert result["prompt_tokens"] == [chat_prompt_ids(tok, [{"role": "user", "content": t}])
                                       for t in ("What is assert?", "中文 😀")]
    for ids, text in zip(result["tokens"], result["texts"]):
        stop = next((i for i, t in enumerate(ids) if t in tok.stop_token_ids), len(ids))
        assert len(ids) == 8 and text == tok.decode(ids[:stop])
    assert json.loads(r.stdout.strip().splitlines()[-1])["texts"] == result["texts"]


def test_generate_text_prompt_needs_a_tokenizer(tmp_path):
    r = _run("experiments.generate", "--checkpoint=tiny-llama", "--prompt=hi", f"--out={tmp_path / 'o.json'}")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: checkpoint 'tiny-llama' has no tokenizer (no tokenizer.json, not a byte model); pass --prompts with "
        "token ids")


def _broken_copy(tmp_path, name, edit):
    d = tmp_path / name
    shutil.copytree(CKPT, d)
    edit(d)
    return d


@pytest.mark.parametrize("name,edit,expected", [
    ("badjson", lambda d: (d / "tokenizer.json").write_text('{"model": '),
     "tokenizer.json: cannot be parsed by the tokenizers package"),
    ("vocab", lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "vocab_size": 1000})),
     "tokenizer.json: the tokenizer has 2048 tokens but the model's vocab_size is 1000"),
    ("template", lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((d / "tokenizer_config.json").read_text()), "chat_template": "{% if %}"})),
     "chat_template does not compile"),
])
def test_api_server_refuses_bad_tokenizer_files_at_start_up(tmp_path, name, edit, expected):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    d = _broken_copy(tmp_path, name, edit)
    r = _run("experiments.api_server", "--config=configs/serve.py", f"--config.model.checkpoint={d}",
             f"--workdir={tmp_path / 'w'}", "--port=1", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"error: model.checkpoint={str(d)!r}: ") and expected in lines[0], lines[0]


@pytest.mark.slow
def test_train_tiny_hf_smoke(tmp_path):
    out = tmp_path / "ckpt"
    r = _run("experiments.train_tiny_hf", f"--out={out}", "--steps=2", "--vocab_size=320", "--batch=2",
             "--seq_len=16", "--log_every=1", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["vocab_size"] == 320 and set(result["greedy_chat_samples"]) == {"What is assert?",
                                                                                  "What is a class?"}
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert HFTokenizer(out).vocab_size == json.loads((out / "config.json").read_text())["vocab_size"] == 320
