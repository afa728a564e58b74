"""pdjax.workload.tokenizer / chat_template / detokenize: the Tokenizer interface (byte and HF), chat templates
rendered in jinja2's sandbox, incremental detokenization (no U+FFFD mid-stream, pieces joined == the whole
decode, stop strings spanning tokens, skip_special_tokens), and one-line errors for bad tokenizer files."""
import json
import pathlib
import subprocess
import sys

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pdjax.models.tiny_hf import CHAT_TEMPLATE, SPECIAL_TOKENS, tokenizer_files, train_tokenizer  # noqa: E402
from pdjax.workload import byte_tokenizer  # noqa: E402
from pdjax.workload.chat_template import ChatTemplateError, chat_prompt_ids, compile_template, render  # noqa: E402
from pdjax.workload.detokenize import IncrementalDetokenizer, TextStream  # noqa: E402
from pdjax.workload.tokenizer import (ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer)  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXTS = ["def main(argv):\n    return 0", "中文字符和日本語のテキスト", "emoji 😀🎉 mixed with ascii and ü",
         "tabs\tand  double  spaces", "🇫🇷 flags and 👩‍👩‍👧 families"]
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 20, "def f(x):\n    return x + 1\n" * 20,
          "Python classes and functions; the assert statement. " * 20]


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    """A tiny-hf style directory (ByteLevel BPE, ChatML template, generation_config eos list), no weights."""
    d = tmp_path_factory.mktemp("bytelevel")
    for name, text in tokenizer_files(train_tokenizer(CORPUS, 400)).items():
        (d / name).write_text(text)
    (d / "config.json").write_text(json.dumps({"vocab_size": 512}))
    return d


@pytest.fixture(scope="module")
def byte_fallback_dir(tmp_path_factory):
    """A Llama-2 style directory: BPE with byte_fallback (<0xNN> tokens), Metaspace, BOS added by the
    post-processor, a template that writes bos_token itself."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    d = tmp_path_factory.mktemp("bytefallback")
    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    pre = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    base = Tokenizer(models.BPE())
    base.normalizer, base.pre_tokenizer = normalizer, pre
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, show_progress=False))
    learned = json.loads(base.to_str())["model"]
    # Llama-2's layout: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF>, then the merges' tokens
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{{ bos_token }}{% for m in messages %}\n  [{{ m['role'] }}] {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    return d


def _stream(tok, ids, prompt=()):
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(t) for t in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("kind", ["byte", "byte_level", "byte_fallback"])
def test_streamed_pieces_are_whole_characters_and_join_to_the_decode(kind, byte_level_dir, byte_fallback_dir):
    tok = {"byte": ByteTokenizer(), "byte_level": HFTokenizer(byte_level_dir),
           "byte_fallback": HFTokenizer(byte_fallback_dir)}[kind]
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces, rest = _stream(tok, ids)
        assert all("\ufffd" not in p for p in pieces), (text, pieces)
        assert "".join(pieces) + rest == tok.decode(ids) == text
        assert rest == ""
        split_chars += sum(1 for p in pieces if p == "")      # a token inside a character: nothing sent
    assert split_chars > 0       # the texts do split characters across tokens in every vocabulary


def test_byte_tokens_of_a_character_release_it_at_its_last_byte():
    tok = ByteTokenizer()
    pieces, rest = _stream(tok, list("a😀b".encode()))
    assert pieces == ["a", "", "", "", "😀", "b"] and rest == ""


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement():
    tok = ByteTokenizer()
    pieces, rest = _stream(tok, list("ok".encode()) + list("😀".encode())[:2])
    assert "".join(pieces) == "ok" and rest == "\ufffd"


def test_prompt_context_keeps_metaspace_spaces(byte_fallback_dir):
    tok = HFTokenizer(byte_fallback_dir)
    prompt = tok.encode("The quick")
    out = tok.encode("The quick brown fox", add_special_tokens=True)[len(prompt):]
    pieces, rest = _stream(tok, out, prompt)
    assert "".join(pieces) + rest == " brown fox"       # the leading space of '▁brown' is kept, as vLLM's


def test_stop_string_spanning_tokens_is_cut_and_never_sent(byte_level_dir):
    tok = HFTokenizer(byte_level_dir)
    text = "return x + 1\ndef f(x):\n 中文"
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ["x + 1\nde", "中", "(x)"]:
        stream = TextStream(tok, [stop, "never there"])
        sent, hit_at = "", None
        for i, t in enumerate(ids):
            piece, hit = stream.add(t)
            sent += piece
            if hit:
                hit_at = i
                break
        assert hit_at is not None and sent == text[:text.index(stop)], stop
        assert tok.decode(ids[:hit_at + 1]).find(stop) >= 0 > tok.decode(ids[:hit_at]).find(stop)
    stream = TextStream(tok, ["nope"])
    sent = "".join(stream.add(t)[0] for t in ids) + stream.flush()[0]
    assert sent == text


def test_skip_special_tokens(byte_level_dir):
    tok = HFTokenizer(byte_level_dir)
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in tok.special_token_ids
    ids = tok.encode("hello", add_special_tokens=False) + im_end
    assert "".join(_stream(tok, ids)[0]) == "hello"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.add(t) for t in ids) == "hello<|im_end|>"
    assert ByteTokenizer().decode([104, byte_tokenizer.EOS_ID], skip_special_tokens=False) == "h<eos>"


def test_hf_tokenizer_fields(byte_level_dir, byte_fallback_dir):
    tok = HFTokenizer(byte_level_dir)
    ids = {t: tok.encode(t, add_special_tokens=False)[0] for t in SPECIAL_TOKENS}
    assert tok.stop_token_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])     # generation_config's list
    assert tok.special_tokens["eos_token"] == "<|im_end|>" and tok.bos_token_id is None
    assert 300 < tok.vocab_size <= 400 and tok.chat_template == CHAT_TEMPLATE
    assert b"".join(tok.token_bytes(t) for t in tok.encode("ü 中", add_special_tokens=False)) == "ü 中".encode()
    fb = HFTokenizer(byte_fallback_dir)
    assert fb.encode("hi")[0] == fb.bos_token_id == 1 and fb.stop_token_ids == (2,)   # eos_token, no gen. config
    assert fb.encode("hi", add_special_tokens=False)[0] != 1
    assert b"".join(fb.token_bytes(t) for t in fb.encode("a 中", add_special_tokens=False)) == " a 中".encode()


def test_chat_templates(byte_level_dir, byte_fallback_dir):
    tok = HFTokenizer(byte_level_dir)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 中"}]
    text = render(tok, msgs)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi 中<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, msgs, add_generation_prompt=False) == text[:-len("<|im_start|>assistant\n")]
    assert chat_prompt_ids(tok, msgs) == tok.encode(text, add_special_tokens=False)
    with pytest.raises(ChatTemplateError, match="roles must be system, user or assistant, got tool"):
        render(tok, [{"role": "tool", "content": "x"}])
    fb = HFTokenizer(byte_fallback_dir)
    # trim_blocks / lstrip_blocks and the template's own bos_token
    assert render(fb, [{"role": "user", "content": "yo"}]) == "<s>  [user] yo\n[assistant]"
    assert chat_prompt_ids(fb, [{"role": "user", "content": "yo"}])[0] == 1       # once: no post-processor BOS
    assert chat_prompt_ids(fb, [{"role": "user", "content": "yo"}]).count(1) == 1
    assert chat_prompt_ids(ByteTokenizer(), msgs) == byte_tokenizer.encode("system: S\nuser: Hi 中\nassistant:")


def test_template_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*line 1"):
        compile_template("{% for m in messages %}")
    tok = ByteTokenizer()
    tok.chat_template = "{{ system_prompt }}{{ messages[0]['content'] }}"
    with pytest.raises(ChatTemplateError, match="'system_prompt' is undefined"):
        render(tok, [{"role": "user", "content": "x"}])
    tok.chat_template = "{% if system_prompt is defined %}{{ system_prompt }}{% endif %}{{ messages[0].content }}"
    assert render(tok, [{"role": "user", "content": "x"}]) == "x"      # testing a missing variable is fine
    tok.chat_template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}"
                         "{{ m.content | tojson }}{% endgeneration %}{% endfor %}")
    assert render(tok, [{"role": "user", "content": "中"}, {"role": "user", "content": "y"}]) == '"中"'
    tok.chat_template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):                              # the sandbox
        render(tok, [{"role": "user", "content": "x"}])


def test_load_tokenizer_choice_and_bad_files(tmp_path, byte_level_dir):
    assert isinstance(load_tokenizer(str(REPO / "checkpoints/tiny-byte")), ByteTokenizer)
    assert isinstance(load_tokenizer("tiny-byte"), ByteTokenizer)          # registry spec name
    assert load_tokenizer("tiny-llama") is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert load_tokenizer(str(tmp_path)) is None                              # no tokenizer files: ids only
    assert isinstance(load_tokenizer(str(byte_level_dir)), HFTokenizer)
    with pytest.raises(TokenizerError, match=r"tokenizer has 3\d\d tokens but the model.s vocab_size is 300"):
        load_tokenizer(str(byte_level_dir), 300)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(TokenizerError, match=r"bad/tokenizer.json: cannot be parsed by the tokenizers package"):
        load_tokenizer(str(bad))
    (bad / "tokenizer.json").write_text((byte_level_dir / "tokenizer.json").read_text())
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 99999]}))
    with pytest.raises(TokenizerError, match=r"generation_config.json: eos_token_id 99999 is outside"):
        load_tokenizer(str(bad))
    (bad / "generation_config.json").write_text("{}")
    (bad / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token='<\|nope\|>' is not a token"):
        load_tokenizer(str(bad))
    (bad / "tokenizer_config.json").write_text("not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: the tokenizer config is not valid JSON"):
        load_tokenizer(str(bad))


def test_tokenizer_modules_import_no_jax():
    code = ("import sys, pdjax.workload.tokenizer, pdjax.workload.chat_template, pdjax.workload.detokenize; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the pydoc topics text differs between Python versions")
def test_shipped_tiny_hf_tokenizer_files_are_reproduced_by_its_trainer():
    from pdjax.models import tiny_hf
    pairs = tiny_hf.topics()
    cut = int(round(len(pairs) * (1.0 - tiny_hf.TinyHFConfig().val_fraction)))
    tok = train_tokenizer(tiny_hf.documents(pairs[:cut], tiny_hf.TinyHFConfig().answer_chars), 2048)
    for name, text in tokenizer_files(tok).items():
        assert (REPO / "checkpoints/tiny-hf" / name).read_text() == text, name
