"""Real-text prompts of the workload generator (prompt_source='text'): byte windows of a text, deterministic,
same lengths and arrivals as the default hashed prompts, every prompt piece (system prompt, multi-turn history)
consistent."""
import dataclasses
import hashlib
import platform

import pytest

from pdjax.workload import WorkloadConfig, make_workload
from pdjax.workload.tokens import default_text_bytes, load_text_bytes, text_token_ids

BASE = dict(preset="chat", num_requests=12, fit_to_model=True, max_model_len=512, vocab_size=259)


def test_text_prompts_are_windows_of_the_text_with_the_sampled_lengths():
    text = default_text_bytes()
    random_reqs = make_workload(BASE, seed=3)
    text_reqs = make_workload({**BASE, "prompt_source": "text"}, seed=3)
    assert [(r.request_id, r.arrival_time, r.num_prompt_tokens, r.max_tokens) for r in random_reqs] == \
        [(r.request_id, r.arrival_time, r.num_prompt_tokens, r.max_tokens) for r in text_reqs]
    for r in text_reqs:
        assert bytes(r.prompt_token_ids) in text
    assert len({tuple(r.prompt_token_ids[:16]) for r in text_reqs}) == len(text_reqs)   # different windows
    assert make_workload({**BASE, "prompt_source": "text"}, seed=3) == text_reqs        # deterministic
    other = make_workload({**BASE, "prompt_source": "text"}, seed=4)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in text_reqs]


def test_text_from_a_file_shared_prefix_and_sessions(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. " * 20)
    cfg = dict(prompt_len=dict(kind="uniform", low=5, high=30), output_len=dict(kind="fixed", value=4),
               num_requests=6, shared_prefix_len=10, max_model_len=128, vocab_size=256, prompt_source="text",
               text_path=str(path), num_turns=3)
    reqs = make_workload(cfg, seed=0)
    text = path.read_bytes()
    prefix = reqs[0].prompt_token_ids[:10]
    assert all(r.prompt_token_ids[:10] == prefix for r in reqs) and bytes(prefix) in text * 2
    by_id = {r.request_id: r for r in reqs}
    for r in reqs:
        if r.turn:
            previous = by_id[f"{r.session_id}t{r.turn - 1}"]
            assert r.prompt_token_ids[:previous.num_prompt_tokens] == previous.prompt_token_ids
    assert all(0 <= t < 256 for r in reqs for t in r.prompt_token_ids)


def test_windows_wrap_around_the_end_of_a_short_text():
    text = b"0123456789"
    for key in range(20):
        ids = text_token_ids(text, 0, 1, key, 25)
        assert len(ids) == 25 and bytes(ids) in text * 4
    assert text_token_ids(text, 0, 1, 0, 0) == []


def test_default_random_prompts_are_unchanged_by_the_new_fields():
    cfg = WorkloadConfig(**BASE)
    assert cfg.prompt_source == "random" and cfg.text_path == ""
    assert make_workload(cfg, 1) == make_workload(dataclasses.replace(cfg, prompt_source="random"), 1)
    assert any(t >= 256 for r in make_workload(cfg, 1) for t in r.prompt_token_ids)   # hashed over vocab 259


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_source="bytes"), r"workload.prompt_source='bytes', expected one of \('random', 'text'\)"),
    (dict(prompt_source="text", vocab_size=128), "workload.vocab_size=128, expected an int >= 256"),
    (dict(prompt_source="text", allowed_token_ids=(65, 66)), "workload.allowed_token_ids"),
    (dict(text_path="x.txt"), "workload.text_path='x.txt', expected '' unless prompt_source='text'"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkloadConfig(**{**BASE, **kwargs})


def test_missing_or_empty_text_file(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        make_workload({**BASE, "prompt_source": "text", "text_path": str(tmp_path / "nope.txt")})
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_text_bytes(str(tmp_path / "empty.txt"))


PINNED_SHA256 = "d9dc35bce5ab1a24ed7f4c3c9b7c22450410e9d68279e3426db458c6be371621"   # CPython 3.11.7's topics


def test_the_default_text_is_pinned_whatever_the_interpreter(monkeypatch):
    """The default text is the pinned snapshot of CPython 3.11.7's pydoc topics, not the running stdlib's (which
    changes between Python versions: a seeded text workload would not repeat across interpreters); on 3.11.7 the
    snapshot is the stdlib's text itself."""
    from pydoc_data.topics import topics as stdlib_topics

    from pdjax.models.tiny_hf import topics
    from pdjax.workload.tokens import pinned_topics
    pinned_topics.cache_clear()
    monkeypatch.setitem(stdlib_topics, "a-topic-of-another-python", "text this interpreter's stdlib would add")
    text = default_text_bytes()
    assert hashlib.sha256(text).hexdigest() == PINNED_SHA256
    pinned = pinned_topics()
    assert [key for key, _ in pinned] == sorted(key for key, _ in pinned) and len(pinned) > 50
    assert text == "\n\n".join(body for _, body in pinned).encode("utf-8")
    assert topics() == list(pinned)     # tiny-hf's documents: the same topics
    monkeypatch.undo()
    if platform.python_version() == "3.11.7":
        assert pinned == tuple((key, stdlib_topics[key].strip("\n")) for key in sorted(stdlib_topics))
