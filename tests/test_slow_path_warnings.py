"""Slow paths are named at start-up, once per process, in one warning line each: the Pallas kernel on CPU
(interpret mode) and a page size beyond max_model_len."""
import pytest

from pdjax.config.buckets import Buckets
from pdjax.models.checkpoint import load_model
from pdjax.runtime import runner as runner_lib
from pdjax.runtime.runner import ModelRunner, slow_path_warnings


def test_the_default_paths_have_no_note():
    assert slow_path_warnings("auto", "cpu", 16, 1024) == []
    assert slow_path_warnings("pallas", "gpu", 16, 1024) == []
    assert slow_path_warnings("blocked", "cpu", 1024, 1024) == []


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama", seed=0)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(attention_impl="pallas", page_size=16), "attention_impl='pallas' on CPU runs the Pallas kernel in "
                                                  "interpret mode, about 100x slower"),
    (dict(page_size=256), "page_size=256 exceeds max_model_len=128: every sequence gets one page of 256 tokens"),
])
def test_a_slow_path_is_warned_once_in_one_line(model, monkeypatch, caplog, kwargs, expected):
    monkeypatch.setattr(runner_lib, "_warned", set())       # other tests may have built such a runner already
    spec, params = model
    with caplog.at_level("WARNING"):
        for _ in range(2):       # a deployment builds one runner per instance: still one line
            ModelRunner(spec, params, num_pages=4, max_model_len=128, buckets=Buckets((16,), (4,), (8,)), **kwargs)
    notes = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(notes) == 1 and notes[0].startswith(expected) and "\n" not in notes[0]
