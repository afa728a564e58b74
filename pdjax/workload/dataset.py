"""Workloads of real text: a file of prompts or of ShareGPT-style conversations, tokenized at load.

    workload.kind='dataset', workload.dataset_path=FILE.json, workload.tokenizer=DIR ('' in a serve config: the
    model's checkpoint), workload.output_len (needed for plain prompts; overrides the replies' lengths)

File formats (recognised per entry):
- a JSON list of strings: each a completion prompt, encoded with the tokenizer (add_special_tokens=True);
- a JSON list of {"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant", "value": text}, ...]}
  (ShareGPT): the turns before the first reply ("gpt"/"assistant") are the chat prompt, rendered by the model's
  chat template (pdjax.workload.chat_template); the output length is the token count of that reply, as vLLM's
  benchmark does. A conversation with no user turn before a reply, or no reply and no workload.output_len, is
  skipped (the error says how many were usable when too few remain). Plain prompts need workload.output_len.
Entries from `trace_start` on are used in file order, `num_requests` of them; arrivals come from `arrival` (a
file has no times). Lengths are recorded and capped as a trace's are (uncapped_prompt_len / _output_len, then
`cap_lengths`: a prompt beyond the cap keeps its first tokens, and `length_report` counts it). A file that is not
JSON, an entry of another shape, or a role outside the list raises ValueError naming the file and the entry.
"""
from __future__ import annotations

import json
import pathlib
from typing import List, Optional, Tuple

import numpy as np

from pdjax.workload.arrivals import arrival_times
from pdjax.workload.chat_template import chat_prompt_ids
from pdjax.workload.lengths import sample_lengths
from pdjax.workload.request import WorkloadRequest

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _entry(path: str, i: int, entry) -> Tuple[Optional[str], Optional[list], Optional[str]]:
    """(prompt text, chat messages, reply text) of one entry; exactly one of the first two is set."""
    if isinstance(entry, str):
        return entry, None, None
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        raise ValueError(f"dataset {path!r}: entry {i} is {json.dumps(entry)[:60]}, expected a prompt string or "
                         "{'conversations': [{'from': ..., 'value': ...}, ...]}")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or turn.get("from") not in ROLES:
            raise ValueError(f"dataset {path!r}: entry {i} has turn {json.dumps(turn)[:60]}, expected "
                             f"{{'from': one of {sorted(ROLES)}, 'value': text}}")
        role = ROLES[turn["from"]]
        if role == "assistant":
            return None, messages, turn["value"]
        messages.append({"role": role, "content": turn["value"]})
    return None, messages, None


def load_dataset(path: str) -> Tuple[Tuple[Optional[str], Optional[tuple], Optional[str]], ...]:
    """The entries of a dataset file (module docstring) as (prompt, messages, reply) tuples."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"workload.dataset_path={path!r} is not a file; expected a JSON list of prompts or "
                         "ShareGPT conversations")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"dataset {path!r} is not UTF-8 JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"dataset {path!r}: expected a non-empty JSON list, got {type(data).__name__}")
    out = []
    for i, entry in enumerate(data):
        prompt, messages, reply = _entry(path, i, entry)
        out.append((prompt, None if messages is None else tuple(tuple(m.items()) for m in messages), reply))
    return tuple(out)


def _tokenized(cfg, tokenizer) -> List[Tuple[List[int], Optional[int]]]:
    """(prompt ids, output length from the reply or None) of the usable entries from trace_start on."""
    out = []
    for prompt, messages, reply in load_dataset(cfg.dataset_path)[cfg.trace_start:]:
        if len(out) == cfg.num_requests:
            break
        if messages is not None:
            msgs = [dict(m) for m in messages]
            if not any(m["role"] == "user" for m in msgs) or (reply is None and cfg.output_len is None):
                continue
            ids = chat_prompt_ids(tokenizer, msgs)
        elif cfg.output_len is None:
            raise ValueError(f"dataset {cfg.dataset_path!r} holds plain prompts, which have no reply to measure: "
                             "set workload.output_len (e.g. 'fixed:value=128')")
        else:
            ids = tokenizer.encode(prompt)
        reply_len = None if reply is None else max(1, len(tokenizer.encode(reply, add_special_tokens=False)))
        if ids:
            out.append((ids, reply_len))
    return out


def dataset_requests(cfg, tokenizer, *, rng_outputs, rng_arrivals) -> List[WorkloadRequest]:
    """The requests of a kind='dataset' workload (module docstring)."""
    from pdjax.workload.generate import cap_lengths, scale_lengths  # noqa: PLC0415 (generate imports this module)
    entries = _tokenized(cfg, tokenizer)
    if len(entries) < cfg.num_requests:
        raise ValueError(f"workload.num_requests={cfg.num_requests}, but dataset {cfg.dataset_path!r} has only "
                         f"{len(entries)} usable entries from trace_start={cfg.trace_start}")
    n = len(entries)
    outputs = np.array([r or 0 for _, r in entries], dtype=np.int64)
    if cfg.output_len is not None:
        outputs = sample_lengths(cfg.output_len, n, rng_outputs)
    prompts_uncapped = scale_lengths(np.array([len(ids) for ids, _ in entries], dtype=np.int64), 1.0)
    outputs_uncapped = scale_lengths(outputs, float(cfg.scale))
    prompt_lens, output_lens = cap_lengths(prompts_uncapped, outputs_uncapped, cfg)
    arrivals = arrival_times(cfg.arrival, n, cfg.rate, cfg.cv, rng_arrivals)
    return [WorkloadRequest(request_id=f"r{i}", arrival_time=float(arrivals[i]),
                            prompt_token_ids=list(entries[i][0][:int(prompt_lens[i])]),
                            max_tokens=int(output_lens[i]), uncapped_prompt_len=int(prompts_uncapped[i]),
                            uncapped_output_len=int(outputs_uncapped[i])) for i in range(n)]
