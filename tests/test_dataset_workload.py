"""workload.kind='dataset' (pdjax.workload.dataset): prompts and ShareGPT conversations tokenized at load with a
model's tokenizer and chat template, lengths recorded and capped as a trace's, bad files named in one line; a serve
config fills workload.tokenizer from model.checkpoint."""
import json
import pathlib

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pdjax.models.tiny_hf import tokenizer_files, train_tokenizer
from pdjax.workload import WorkloadConfig, length_report, make_workload
from pdjax.workload.chat_template import chat_prompt_ids
from pdjax.workload.tokenizer import HFTokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "What is a class?"},
                       {"from": "gpt", "value": "A class bundles data and functions. 中文"}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "def?"},
                       {"from": "gpt", "value": "A function definition."}, {"from": "human", "value": "more"}]},
    {"conversations": [{"from": "gpt", "value": "no question first"}]},           # skipped: no user turn
    {"conversations": [{"from": "human", "value": "the last one " * 30},
                       {"from": "gpt", "value": "ok " * 40}]},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    corpus = ["What is a class? A class bundles data and functions. " * 30, "def f(x): return x\n" * 30]
    for name, text in tokenizer_files(train_tokenizer(corpus, 400)).items():
        (d / name).write_text(text)
    return d


def _cfg(tmp_path, data, **kw):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    base = dict(kind="dataset", dataset_path=str(path), arrival="poisson", rate=2.0, num_requests=3)
    return WorkloadConfig.from_dict({**base, **kw})


def test_sharegpt_conversations(tmp_path, tok_dir):
    tok = HFTokenizer(tok_dir)
    reqs = make_workload(_cfg(tmp_path, SHAREGPT, tokenizer=str(tok_dir)), seed=0)
    msgs = [[{"role": "user", "content": "What is a class?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def?"}],
            [{"role": "user", "content": "the last one " * 30}]]
    replies = ["A class bundles data and functions. 中文", "A function definition.", "ok " * 40]
    assert [r.prompt_token_ids for r in reqs] == [chat_prompt_ids(tok, m) for m in msgs]
    assert [r.max_tokens for r in reqs] == [len(tok.encode(t, add_special_tokens=False)) for t in replies]
    assert [r.uncapped_prompt_len for r in reqs] == [len(r.prompt_token_ids) for r in reqs]
    assert all(r.token_bound == (0, tok.vocab_size - 1) for r in reqs)
    times = [r.arrival_time for r in reqs]
    assert times == sorted(times) and times[0] == 0.0


def test_prompts_file_with_output_len_and_caps(tmp_path, tok_dir):
    tok = HFTokenizer(tok_dir)
    prompts = ["short", "What is a class? " * 20, "def f(x): return x"]
    cfg = _cfg(tmp_path, prompts, tokenizer=str(tok_dir), output_len="fixed:value=50", max_model_len=40)
    reqs = make_workload(cfg, seed=0)
    assert [r.uncapped_prompt_len for r in reqs] == [len(tok.encode(p)) for p in prompts]
    assert reqs[1].prompt_token_ids == tok.encode(prompts[1])[:39]         # cut as a trace's prompt is
    assert all(r.num_prompt_tokens + r.max_tokens <= 40 for r in reqs)
    report = length_report(cfg, reqs)
    assert report["source"].startswith("dataset ") and report["num_prompts_cut"] == 1
    assert report["num_outputs_cut"] == 3


def test_bad_dataset_files_and_fields(tmp_path, tok_dir):
    tok = str(tok_dir)
    cases = [
        ("not json", {}, "is not UTF-8 JSON"),
        ([{"turns": []}], {}, "entry 0 is"),
        ([{"conversations": [{"from": "robot", "value": "x"}]}], {}, "entry 0 has turn"),
        (["a prompt"], {}, "plain prompts, which have no reply to measure: set workload.output_len"),
        (SHAREGPT, {"num_requests": 4}, "has only 3 usable entries"),
    ]
    for data, kw, needle in cases:
        with pytest.raises(ValueError, match=needle):
            make_workload(_cfg(tmp_path, data, tokenizer=tok, **kw), seed=0)
    with pytest.raises(ValueError, match="workload.tokenizer"):
        WorkloadConfig.from_dict({"kind": "dataset", "dataset_path": "x.json"})
    with pytest.raises(ValueError, match="has no tokenizer"):
        make_workload(_cfg(tmp_path, SHAREGPT, tokenizer="tiny-llama"), seed=0)
    with pytest.raises(ValueError, match="dataset_path"):
        WorkloadConfig.from_dict({"preset": "chat", "dataset_path": "x.json"})


def test_serve_config_tokenizer_is_the_model_checkpoint(tmp_path):
    from pdjax.config.files import config_file
    from pdjax.experiment.run import to_plain_dict
    from pdjax.config.serving import serve_config_from_dict
    d = to_plain_dict(config_file(str(REPO / "README.md"), "configs/serve.py"))
    d["workload"] = {**d["workload"], "kind": "dataset", "dataset_path": str(tmp_path / "x.json"), "preset": ""}
    cfg = serve_config_from_dict(d)
    assert cfg.workload.tokenizer == cfg.model.checkpoint == "checkpoints/tiny-byte"
