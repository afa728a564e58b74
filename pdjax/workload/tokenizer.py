"""The text side of a model: one `Tokenizer` interface, chosen from the checkpoint by `load_tokenizer`.

    tok = load_tokenizer("checkpoints/tiny-hf")        # HFTokenizer (tokenizer.json), ByteTokenizer, or None
    ids = tok.encode("Hello")                          # add_special_tokens=True: the tokenizer's post-processor
    tok.decode(ids)                                    # skip_special_tokens=True by default
    chat_prompt_ids(tok, messages)                     # pdjax.workload.chat_template

Implementations:
- `ByteTokenizer`: the 259-id byte vocabulary of `tiny-byte` (pdjax.workload.byte_tokenizer); no stop ids (the
  model was never trained to emit EOS), no chat template.
- `HFTokenizer`: Hugging Face's `tokenizers` (Rust) reading tokenizer.json; bos/eos/pad/unk tokens and the chat
  template from tokenizer_config.json (special_tokens_map.json fills what it lacks; a chat_template.jinja file
  wins, as in transformers 5), stop ids from generation_config.json's `eos_token_id` (an int or a list, as
  Llama-3 has), else the tokenizer's eos token.

Choice (`load_tokenizer`): a directory with tokenizer.json -> HFTokenizer; else a model whose vocabulary is the
byte vocabulary (259) -> ByteTokenizer; else None (the API then takes token ids only). Bad files raise
TokenizerError (a ValueError), one line naming the file and field; a tokenizer whose vocabulary is larger than
the model's raises it too (ids the model cannot embed). No JAX: workloads and the API server use it.
"""
from __future__ import annotations

import functools
import json
import pathlib
import re
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

from pdjax.workload import byte_tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(ValueError):
    """A tokenizer file or field is unusable (one line naming it)."""


class Tokenizer(Protocol):
    """What pdjax needs of a tokenizer. Ids are ints in [0, vocab_size)."""
    vocab_size: int
    bos_token_id: Optional[int]
    stop_token_ids: Tuple[int, ...]           # ids that end a generation (EOS; generation_config's list)
    special_token_ids: frozenset
    special_tokens: Dict[str, Optional[str]]  # bos_token / eos_token / pad_token / unk_token -> text or None
    chat_template: Optional[str]

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class ByteTokenizer:
    """The byte vocabulary of `tiny-byte`: token id = byte value; BOS 256, EOS 257, PAD 258."""
    vocab_size = byte_tokenizer.VOCAB_SIZE
    bos_token_id = byte_tokenizer.BOS_ID
    stop_token_ids: Tuple[int, ...] = ()
    special_token_ids = frozenset(byte_tokenizer.SPECIAL_IDS)
    special_tokens = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": None}
    chat_template: Optional[str] = None
    _NAMES = {byte_tokenizer.BOS_ID: "<bos>", byte_tokenizer.EOS_ID: "<eos>", byte_tokenizer.PAD_ID: "<pad>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:   # the byte vocabulary adds no BOS
        return byte_tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = byte_tokenizer.decode(ids)
        if skip_special_tokens:
            return text
        out, run = [], []
        for t in ids:   # the special ids as their names, between the decoded byte runs
            if t in self._NAMES:
                out += [byte_tokenizer.decode(run), self._NAMES[t]]
                run = []
            else:
                run.append(t)
        return "".join(out) + byte_tokenizer.decode(run)

    def id_to_token(self, token_id: int) -> str:
        return self._NAMES.get(token_id) or self.token_bytes(token_id).decode("latin-1")

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in self._NAMES else byte_tokenizer.decode_bytes([token_id])


@functools.lru_cache(maxsize=1)
def _byte_level_decoding() -> Dict[str, int]:
    """GPT-2's byte -> printable character map, inverted: the characters of a ByteLevel token -> its bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _read_json(path: pathlib.Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: {what} is not valid JSON ({e})") from None


def _token_text(value: Any, path: pathlib.Path, key: str) -> Optional[str]:
    """A special token's text from tokenizer_config.json: a string, an AddedToken dict ({'content': ...}) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {key}={value!r:.80}, expected a string, {{'content': str}} or null")


def _chat_template_of(directory: pathlib.Path, config: dict) -> Optional[str]:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of {name, template}
    of which 'default' is taken)."""
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template is {type(template).__name__}, "
                             "expected a Jinja string or a list of {name, template} with a 'default'")
    return template


class HFTokenizer:
    """A Hugging Face tokenizer directory (module docstring) over the `tokenizers` package."""

    def __init__(self, directory):
        from tokenizers import Tokenizer as RustTokenizer  # noqa: PLC0415 (a dependency only HF models need)
        self.directory = pathlib.Path(directory)
        path = self.directory / TOKENIZER_FILE
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception on a bad file)
            raise TokenizerError(f"{path}: cannot be parsed by the tokenizers package "
                                 f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config = self._read_config()
        self.special_tokens = self._special_tokens(config)
        self.special_token_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.bos_token_id = self._id_of("bos_token")
        self.stop_token_ids = self._stop_ids()
        self.chat_template = _chat_template_of(self.directory, config)
        self._byte_level = "ByteLevel" in repr(self._tok.decoder)    # GPT-2 style bytes-as-characters tokens

    def _read_config(self) -> dict:
        path = self.directory / TOKENIZER_CONFIG_FILE
        config = _read_json(path, "the tokenizer config") if path.is_file() else {}
        if not isinstance(config, dict):
            raise TokenizerError(f"{path}: expected a JSON object, got {type(config).__name__}")
        return config

    def _special_tokens(self, config: dict) -> Dict[str, Optional[str]]:
        tokens = {k: _token_text(config.get(k), self.directory / TOKENIZER_CONFIG_FILE, k) for k in SPECIAL_TOKEN_KEYS}
        map_path = self.directory / SPECIAL_TOKENS_MAP_FILE
        if map_path.is_file():
            mapping = _read_json(map_path, "the special tokens map")
            for k in SPECIAL_TOKEN_KEYS:
                if tokens[k] is None and isinstance(mapping, dict):
                    tokens[k] = _token_text(mapping.get(k), map_path, k)
        for key, text in tokens.items():
            if text is not None and self._tok.token_to_id(text) is None:
                raise TokenizerError(f"{self.directory / TOKENIZER_CONFIG_FILE}: {key}={text!r} is not a token of "
                                     f"{TOKENIZER_FILE}")
        return tokens

    def _id_of(self, key: str) -> Optional[int]:
        text = self.special_tokens.get(key)
        return None if text is None else self._tok.token_to_id(text)

    def _stop_ids(self) -> Tuple[int, ...]:
        path = self.directory / GENERATION_CONFIG_FILE
        ids = _read_json(path, "the generation config").get("eos_token_id") if path.is_file() else None
        if ids is None:
            eos = self._id_of("eos_token")
            return () if eos is None else (eos,)
        ids = [ids] if isinstance(ids, int) else ids
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise TokenizerError(f"{path}: eos_token_id={ids!r:.80}, expected an int or a list of ints")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenizerError(f"{path}: eos_token_id {bad[0]} is outside the tokenizer's vocabulary "
                                 f"[0, {self.vocab_size})")
        return tuple(dict.fromkeys(ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids past the tokenizer's vocabulary (a model's padded embedding rows) have none."""
        return self._tok.decode([int(t) for t in ids if 0 <= t < self.vocab_size],
                                skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(int(token_id))
        return "" if token is None else token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a ByteLevel token's mapped bytes, a byte-fallback <0xNN> byte, a
        Metaspace token with its '▁' as a space); a special token's text."""
        token = self.id_to_token(token_id)
        if token_id in self.special_token_ids:
            return token.encode("utf-8")
        fallback = _BYTE_FALLBACK.match(token)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level:
            table = _byte_level_decoding()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
        return token.replace("\u2581", " ").encode("utf-8")


def has_tokenizer_files(directory) -> bool:
    return (pathlib.Path(directory) / TOKENIZER_FILE).is_file()


def checkpoint_vocab_size(checkpoint: str) -> Optional[int]:
    """The model's vocab_size from the checkpoint's own files (pdjax_spec.json or config.json) or the registry
    spec of that name, without loading weights; None when it cannot be told."""
    path = pathlib.Path(checkpoint)
    for name in ("pdjax_spec.json", "config.json"):
        if (path / name).is_file():
            data = _read_json(path / name, "the model config")
            size = data.get("vocab_size") if isinstance(data, dict) else None
            return size if isinstance(size, int) and not isinstance(size, bool) else None
    if path.exists():
        return None
    from pdjax.config.model_specs import MODEL_SPECS  # noqa: PLC0415 (only for registry names)
    spec = MODEL_SPECS.get(checkpoint)
    return None if spec is None else spec.vocab_size


def load_tokenizer(checkpoint: str, model_vocab_size: Optional[int] = None) -> Optional[Tokenizer]:
    """The tokenizer of a checkpoint (module docstring), or None. model_vocab_size: the model's vocabulary (read
    from the checkpoint when None); a tokenizer with more ids than the model raises TokenizerError."""
    if model_vocab_size is None:
        model_vocab_size = checkpoint_vocab_size(checkpoint)
    if has_tokenizer_files(checkpoint):
        tok = HFTokenizer(checkpoint)
        if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
            raise TokenizerError(f"{pathlib.Path(checkpoint) / TOKENIZER_FILE}: the tokenizer has {tok.vocab_size} "
                                 f"tokens but the model's vocab_size is {model_vocab_size} (config.json); they must "
                                 "come from the same model")
        return tok
    if model_vocab_size == byte_tokenizer.VOCAB_SIZE:
        return ByteTokenizer()
    return None
