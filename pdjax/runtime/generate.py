"""Offline batched greedy generation over the ModelRunner (the engine of `experiments.generate`).

Self-contained on purpose (the real scheduler lives in pdjax/scheduler): a free-list page allocator gives each
prompt the pages for prompt + max_new_tokens up front, and every iteration packs, within a token budget,
first one decode token per running sequence and then the next prefill chunk (<= chunk_size tokens) of each
prompt still prefilling. Prompts of different lengths therefore share mixed batches: some sequences decode
while others are still prefilling. Each iteration is a `SchedulerOutput`, so the runner contract is exercised
end to end. Decoding is greedy. A prompt whose logits are not finite (NaN or inf) stops the generation with
NonFiniteLogitsError naming the prompt and the step (no token is made up for it). `run_generate` is the whole
`experiments.generate` command (files in, files out, written atomically by pdjax.metrics.atomic_open).
"""
from __future__ import annotations

import json
import pathlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

from pdjax.metrics.report import atomic_open, atomic_write_text
from pdjax.models.checkpoint import load_model
from pdjax.runtime.batch import Buckets
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler.output import NONFINITE_LOGITS, SchedulerOutput
from pdjax.workload.chat_template import chat_prompt_ids
from pdjax.workload.tokenizer import load_tokenizer


class NonFiniteLogitsError(ValueError):
    """A prompt's logits held NaN or inf, so no token could be drawn (generation stops: it never emits id 0)."""


class PageAllocator:
    """Free list of page ids [0, num_pages)."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, -1, -1))

    def allocate(self, n: int) -> List[int]:
        if n > len(self.free):
            raise ValueError(f"out of KV pages: need {n}, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: Sequence[int]) -> None:
        self.free.extend(reversed(list(pages)))


def load_prompts(path) -> List[List[int]]:
    """A JSON list of non-empty lists of int token ids; ValueError naming what is wrong otherwise."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"prompts file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"prompts file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"prompts file {str(path)!r}: expected a non-empty JSON list of token-id lists, "
                         f"got {type(data).__name__}{'' if data else ' (empty)'}")
    for i, prompt in enumerate(data):
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"prompts file {str(path)!r}: prompt {i} is {prompt!r:.60}, expected a non-empty "
                             f"list of int token ids")
        for tok in prompt:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"prompts file {str(path)!r}: prompt {i} has token {tok!r}, expected ints >= 0")
    return data


def generation_buckets(prompts: Sequence[Sequence[int]], max_new_tokens: int, page_size: int,
                       token_budget: int) -> Buckets:
    max_pages = max(-(-(len(p) + max_new_tokens) // page_size) for p in prompts)
    return Buckets.powers_of_two(token_budget, len(prompts), max_pages, min_tokens=16, min_seqs=4, min_pages=4)


def _check_generate(runner, prompts: Sequence[Sequence[int]], max_new_tokens: int, chunk_size: int,
                    token_budget: Optional[int]) -> int:
    """generate's argument checks (ValueError); returns the token budget."""
    spec = runner.spec
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}, expected >= 1")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}, expected >= 0")
    budget = token_budget or max(chunk_size, min(len(prompts) * chunk_size, 512))
    if budget < chunk_size:
        raise ValueError(f"token_budget={budget} is smaller than chunk_size={chunk_size}")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside [0, {spec.vocab_size})")
        if len(prompt) + max_new_tokens > runner.max_model_len:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"max_model_len={runner.max_model_len}")
    return budget


def _plan_step(step: int, prompts, computed: List[int], outputs: List[List[int]], tables, finished, budget: int,
               chunk_size: int) -> SchedulerOutput:
    """generate's batch of `step`: every running decode (one token), then prefill chunks of at most chunk_size,
    until `budget` tokens."""
    n = len(prompts)
    out = SchedulerOutput(step=step)
    left = budget
    decodes = [i for i in range(n) if not finished(i) and computed[i] >= len(prompts[i])]
    prefills = [i for i in range(n) if computed[i] < len(prompts[i])]
    for i in decodes + prefills:
        if left == 0:
            break
        is_prefill = computed[i] < len(prompts[i])
        if is_prefill:
            take = min(chunk_size, len(prompts[i]) - computed[i], left)
            tokens = list(prompts[i][computed[i]:computed[i] + take])
            sample = computed[i] + take == len(prompts[i])
        else:
            tokens, sample = [outputs[i][-1]], True
        out.req_ids.append(str(i))
        out.token_ids.append(tokens)
        out.num_computed_tokens.append(computed[i])
        out.num_new_tokens.append(len(tokens))
        out.page_tables.append(tables[i])
        out.do_sample.append(sample)
        out.is_prefill.append(is_prefill)
        if is_prefill:
            out.num_prefill_tokens += len(tokens)
        else:
            out.num_decode_tokens += len(tokens)
        left -= len(tokens)
    return out


def generate(runner, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, chunk_size: int = 64,
             token_budget: Optional[int] = None, return_logits: bool = False
             ) -> Tuple[List[List[int]], Optional[np.ndarray]]:
    """Greedy continuations ([max_new_tokens] ids per prompt) and, if return_logits, float32
    [num_prompts, vocab] logits at each prompt's last position.

    token_budget: most tokens per iteration (default: every prompt's chunk fits, capped at 512 but at least
    chunk_size). The runner's buckets must cover it.
    """
    spec = runner.spec
    n = len(prompts)
    budget = _check_generate(runner, prompts, max_new_tokens, chunk_size, token_budget)
    allocator = PageAllocator(runner.num_pages)
    tables = [allocator.allocate(-(-(len(p) + max_new_tokens) // runner.page_size)) for p in prompts]
    computed = [0] * n
    outputs: List[List[int]] = [[] for _ in range(n)]
    last_logits = np.zeros((n, spec.vocab_size), np.float32) if return_logits else None

    def finished(i):
        return computed[i] >= len(prompts[i]) and len(outputs[i]) >= max_new_tokens

    step = 0
    while not all(finished(i) for i in range(n)):
        out = _plan_step(step, prompts, computed, outputs, tables, finished, budget, chunk_size)
        if return_logits:
            logits = runner.execute_logits(out)
            sampled = np.where(np.isfinite(logits).all(axis=-1), np.argmax(logits, axis=-1), NONFINITE_LOGITS)
        else:
            sampled = runner.execute(out)
        for j in np.flatnonzero(np.asarray(sampled) == NONFINITE_LOGITS):
            if out.do_sample[j]:
                raise NonFiniteLogitsError(f"prompt {out.req_ids[j]}: non-finite logits (NaN or inf) at step {step}: "
                                           "no token could be sampled (the weights or activations hold NaN or inf)")
        for j, rid in enumerate(out.req_ids):
            i = int(rid)
            was_prefill = out.is_prefill[j]
            computed[i] += out.num_new_tokens[j]
            if out.do_sample[j]:
                if was_prefill and return_logits:
                    last_logits[i] = logits[j]
                if len(outputs[i]) < max_new_tokens:
                    outputs[i].append(int(sampled[j]))
        step += 1
    for table in tables:
        allocator.release(table)
    return outputs, last_logits


def text_prompt_ids(checkpoint: str, texts: Sequence[str], vocab_size: int, *, chat: bool = False):
    """(the checkpoint's tokenizer, token ids of each text): encoded, or with chat=True each text one user message
    under the model's chat template. ValueError naming the checkpoint when it has no tokenizer."""
    tokenizer = load_tokenizer(checkpoint, vocab_size)
    if tokenizer is None:
        raise ValueError(f"checkpoint {checkpoint!r} has no tokenizer (no tokenizer.json, not a byte model); pass "
                         "--prompts with token ids")
    if chat:
        return tokenizer, [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return tokenizer, [tokenizer.encode(t) for t in texts]


def output_texts(tokenizer, outputs: Sequence[Sequence[int]]) -> List[str]:
    """Text of each output, up to its first stop token (the model's EOS ids)."""
    stops = set(tokenizer.stop_token_ids)
    return [tokenizer.decode(ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]) for ids in outputs]


def run_generate(checkpoint: str, prompts_path, max_new_tokens: int, out_path, *, chunk_size: int = 64,
                 token_budget: int = 0, page_size: int = 16, dump_logits=None, dtype=None,
                 attention_impl: str = "auto", texts: Sequence[str] = (), chat: bool = False):
    """The body of `experiments.generate`: load, generate, write OUT.json (and logits) atomically. Prompts are
    the token-id lists of `prompts_path`, or `texts` tokenized with the checkpoint's tokenizer (and chat
    template with chat=True); OUT.json then also holds the outputs' "texts".

    Returns (tokens, logits or None, runner).
    """
    prompts = None if texts else load_prompts(prompts_path)     # a bad prompts file fails before the model loads
    spec, params = load_model(checkpoint, dtype=dtype)
    tokenizer = None
    if texts:
        tokenizer, prompts = text_prompt_ids(checkpoint, texts, spec.vocab_size, chat=chat)
    budget = token_budget or max(chunk_size, min(len(prompts) * chunk_size, 512))
    buckets = generation_buckets(prompts, max_new_tokens, page_size, budget)
    num_pages = sum(-(-(len(p) + max_new_tokens) // page_size) for p in prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    if max_len > spec.max_position_embeddings:
        raise ValueError(f"longest prompt + max_new_tokens = {max_len} exceeds the model's "
                         f"max_position_embeddings={spec.max_position_embeddings}")
    # The runner's limit in whole pages: a short input is no reason for the page-size-beyond-max_model_len warning.
    runner_len = min(spec.max_position_embeddings, -(-max_len // page_size) * page_size)
    runner = ModelRunner(spec, params, num_pages=num_pages, page_size=page_size, buckets=buckets,
                         attention_impl=attention_impl, max_model_len=runner_len)
    tokens, logits = generate(runner, prompts, max_new_tokens, chunk_size=chunk_size, token_budget=budget,
                              return_logits=dump_logits is not None)
    pathlib.Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    result = {"tokens": tokens}
    if tokenizer is not None:
        result.update(prompt_tokens=prompts, texts=output_texts(tokenizer, tokens))
    atomic_write_text(out_path, json.dumps(result, ensure_ascii=False))
    if dump_logits is not None:
        pathlib.Path(dump_logits).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(dump_logits, "wb") as f:
            np.save(f, logits.astype(np.float32))
    return tokens, logits, runner
