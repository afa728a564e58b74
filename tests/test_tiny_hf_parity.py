"""checkpoints/tiny-hf against transformers (the `.[hf]` extra; skipped without it): the same chat prompt ids
(AutoTokenizer.apply_chat_template with add_generation_prompt=True), the same text ids and decodes, and the same
greedy tokens from pdjax's runner as from transformers' LlamaForCausalLM on the same directory."""
import pathlib

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from pdjax.workload.chat_template import chat_prompt_ids  # noqa: E402
from pdjax.workload.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints/tiny-hf"
CHATS = [
    [{"role": "user", "content": "What is assert?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "中文 and 😀?"},
     {"role": "assistant", "content": "A class."}, {"role": "user", "content": "  spaces\tand\nnewlines  "}],
]
TEXTS = ["def main(argv):\n    return 0", "naïve 中文 😀 <|im_end|> tail", "  leading and trailing  "]


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(str(CKPT))


def _ids(x):
    """apply_chat_template returns a list or (transformers 5) a BatchEncoding."""
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


def test_chat_prompt_ids_equal_transformers(hf_tok):
    ours = HFTokenizer(CKPT)
    for messages in CHATS:
        for gen in (True, False):
            want = _ids(hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True))
            assert chat_prompt_ids(ours, messages, add_generation_prompt=gen) == want, (messages, gen)


def test_text_ids_decodes_and_stop_ids_equal_transformers(hf_tok):
    ours = HFTokenizer(CKPT)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tok(text)["input_ids"]
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    gen = transformers.GenerationConfig.from_pretrained(str(CKPT))
    assert list(ours.stop_token_ids) == list(gen.eos_token_id)
    assert ours.vocab_size == len(hf_tok)


def test_greedy_tokens_equal_transformers():
    from pdjax.models.checkpoint import load_model
    from pdjax.runtime.generate import generate, generation_buckets
    from pdjax.runtime.runner import ModelRunner
    spec, params = load_model(str(CKPT), dtype="float32")
    tok = load_tokenizer(str(CKPT), spec.vocab_size)
    prompts = [chat_prompt_ids(tok, m) for m in CHATS] + [tok.encode(t) for t in TEXTS[:1]]
    new = 24
    runner = ModelRunner(spec, params, num_pages=64, page_size=16, attention_impl="reference",
                         buckets=generation_buckets(prompts, new, 16, 128))
    ours, _ = generate(runner, prompts, new, token_budget=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(CKPT), dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        want = out[0, len(prompt):].tolist()
        stop = next((i for i, t in enumerate(want) if t in tok.stop_token_ids), len(want) - 1)
        want = want[:stop + 1]              # transformers stops at an EOS id; pdjax's generate runs on
        assert len(want) >= 4 and got[:len(want)] == want, (tok.decode(prompt), tok.decode(got), tok.decode(want))
    with torch.no_grad():       # and the first-step logits agree to float32 round-off
        logits = model(torch.tensor([prompts[0]])).logits[0, -1].numpy()
    _, ours_logits = generate(runner, prompts[:1], 1, token_budget=128, return_logits=True)
    np.testing.assert_allclose(ours_logits[0], logits, rtol=1e-4, atol=1e-4)


# A Llama-3 / Mistral style template: whitespace control, bos_token, namespace, tojson, loop controls, a
# raise_exception branch, strftime_now; rendered by transformers and by pdjax from the same directory.
TEMPLATE = """{{ bos_token }}
{% set ns = namespace(sys='') %}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}
    {% if (m['role'] == 'user') != (loop.index0 % 2 == (1 if ns.sys else 0)) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    <|im_start|>{{ m['role'] }}
{{ (ns.sys + '\\n\\n' if ns.sys and loop.index0 == 1 else '') + m['content'] | trim }}<|im_end|>
    {% if m['role'] == 'assistant' %}{{ {'len': m['content'] | length, 'text': m['content']} | tojson }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_richer_template_renders_as_transformers_renders_it(tmp_path):
    import json
    import shutil

    from pdjax.workload.chat_template import ChatTemplateError, render
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        shutil.copy(CKPT / name, tmp_path / name)
    config = json.loads((CKPT / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE,
                                                                "bos_token": "<|endoftext|>"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer(tmp_path)
    for messages in CHATS:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert render(ours, messages, add_generation_prompt=gen) == want
            assert chat_prompt_ids(ours, messages, add_generation_prompt=gen) == _ids(
                hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True))
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render(ours, bad)
