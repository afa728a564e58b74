"""`tiny-hf`: a tiny Llama with its own byte-level BPE tokenizer and ChatML template, saved as an HF directory.

The example of "your own HF model directory": config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (special tokens, ChatML `chat_template`), generation_config.json (eos ids
[<|im_end|>, <|endoftext|>]). transformers loads the same directory (tests/test_tiny_hf_parity.py).

Data: the pinned stdlib pydoc topics (pdjax.workload.tokens.pinned_topics, the text of tiny-byte), one document
per topic in sorted key order; the last `val_fraction` of the topics is held out. Each training topic appears
twice: as plain text ending in <|endoftext|>, and as a ChatML exchange ("What is <topic>?" -> the topic's first
paragraphs, ending in <|im_end|>), so the model learns to close an assistant turn.
Tokenizer: `tokenizers`' BPE trainer over GPT-2 style ByteLevel pre-tokenization (every byte has a token, so
any text encodes; a character outside the merges is several byte tokens), special tokens first (ids 0-2).
Model: tiny-byte's dimensions with the BPE vocabulary, tied embeddings, no sliding window (transformers'
Llama has none), trained with `pdjax.models.train` on windows of the token stream, saved in bfloat16.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Dict, List, Sequence, Tuple

import numpy as np

from pdjax.config.model_specs import ModelSpec, get_model_spec
from pdjax.metrics.report import atomic_write_text
from pdjax.models import train as tr
from pdjax.models.checkpoint import save_hf_checkpoint, write_checksums
from pdjax.workload.tokens import pinned_topics

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
SYSTEM_PROMPT = "You are a helpful assistant."
# ChatML, as Qwen2's instruct models write it; raise_exception names a role the model was not trained on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclasses.dataclass(frozen=True)
class TinyHFConfig:
    vocab_size: int = 2048
    val_fraction: float = 0.05
    answer_chars: int = 600          # characters of a topic used as the chat answer
    train: tr.TrainConfig = tr.TrainConfig(steps=500, batch=16, seq_len=256, lr=3e-3, warmup_steps=30)


def topics() -> List[Tuple[str, str]]:
    """(key, text) of each pinned pydoc topic in sorted key order (pdjax.workload.tokens.pinned_topics: the
    documents of `default_text_bytes()`)."""
    return list(pinned_topics())


def chat_text(question: str, answer: str) -> str:
    return (f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n{IM_START}user\n{question}{IM_END}\n"
            f"{IM_START}assistant\n{answer}{IM_END}\n")


def documents(pairs: Sequence[Tuple[str, str]], answer_chars: int) -> List[str]:
    """The training documents of some topics: each topic's text + <|endoftext|>, and its chat exchange."""
    docs = []
    for key, body in pairs:
        docs.append(body + ENDOFTEXT)
        answer = body[:answer_chars].rsplit("\n", 1)[0] if len(body) > answer_chars else body
        docs.append(chat_text(f"What is {key}?", answer.strip()))
    return docs


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`, SPECIAL_TOKENS at ids 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 (hf deps)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    plain = [d.replace(ENDOFTEXT, "").replace(IM_START, "").replace(IM_END, "") for d in texts]
    tok.train_from_iterator(plain, trainer)
    return tok


def tokenizer_files(tok) -> Dict[str, str]:
    """The tokenizer's files of an HF directory: name -> text."""
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in ids.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
              "pad_token": ENDOFTEXT, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
              "model_max_length": 1024, "clean_up_tokenization_spaces": False, "added_tokens_decoder": added,
              "chat_template": CHAT_TEMPLATE}
    generation = {"bos_token_id": None, "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id":
                  ids[ENDOFTEXT], "do_sample": False}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=1),
            "generation_config.json": json.dumps(generation, indent=1)}


def model_spec(vocab_size: int) -> ModelSpec:
    return get_model_spec("tiny-byte").replace(name="tiny-hf", vocab_size=vocab_size, tie_word_embeddings=True,
                                               sliding_window=None)


def token_stream(tok, docs: Sequence[str]) -> np.ndarray:
    """int32 ids of the documents, concatenated."""
    return np.asarray([i for enc in tok.encode_batch(list(docs), add_special_tokens=False) for i in enc.ids],
                      dtype=np.int32)


def build(cfg: TinyHFConfig, on_log=None) -> dict:
    """Train the tokenizer and the model; returns {spec, params, tokenizer, train_ids, val_ids, history}."""
    pairs = topics()
    cut = int(round(len(pairs) * (1.0 - cfg.val_fraction)))
    train_docs, val_docs = documents(pairs[:cut], cfg.answer_chars), documents(pairs[cut:], cfg.answer_chars)
    tok = train_tokenizer(train_docs, cfg.vocab_size)
    spec = model_spec(tok.get_vocab_size(with_added_tokens=True))
    train_ids, val_ids = token_stream(tok, train_docs), token_stream(tok, val_docs)
    params, history = tr.train(spec, train_ids, cfg.train, on_log=on_log)
    return {"spec": spec, "params": params, "tokenizer": tok, "train_ids": train_ids, "val_ids": val_ids,
            "history": history}


def save(directory, spec: ModelSpec, params, tok, dtype: str = "bfloat16") -> None:
    """The HF directory: weights (save_hf_checkpoint), tokenizer files, checksums of all of them."""
    import jax  # noqa: PLC0415 (only to cast the params)
    directory = pathlib.Path(directory)
    saved_spec = spec.replace(dtype=dtype)
    save_hf_checkpoint(directory, saved_spec, jax.tree_util.tree_map(lambda x: x.astype(dtype), params))
    for name, text in tokenizer_files(tok).items():
        atomic_write_text(directory / name, text)
    write_checksums(directory)


def greedy_chat_samples(directory, questions: Sequence[str], max_new_tokens: int = 48) -> Dict[str, str]:
    """question -> the saved model's greedy answer (pdjax's ModelRunner; cut at the first stop id)."""
    from pdjax.models.checkpoint import load_model  # noqa: PLC0415 (JAX-heavy imports only here)
    from pdjax.runtime.generate import generate, generation_buckets  # noqa: PLC0415 (as above)
    from pdjax.runtime.runner import ModelRunner  # noqa: PLC0415 (as above)
    from pdjax.workload.chat_template import chat_prompt_ids  # noqa: PLC0415 (as above)
    from pdjax.workload.tokenizer import load_tokenizer  # noqa: PLC0415 (as above)
    spec, params = load_model(str(directory), dtype="float32")
    tok = load_tokenizer(str(directory), spec.vocab_size)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in questions]
    runner = ModelRunner(spec, params, num_pages=64, page_size=16, attention_impl="reference",
                         buckets=generation_buckets(prompts, max_new_tokens, 16, 64))
    outputs, _ = generate(runner, prompts, max_new_tokens)
    out = {}
    for q, ids in zip(questions, outputs):
        stop = next((i for i, t in enumerate(ids) if t in tok.stop_token_ids), len(ids))
        out[q] = tok.decode(ids[:stop])
    return out
