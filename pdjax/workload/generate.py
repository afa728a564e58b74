"""make_workload: WorkloadConfig + seed -> list[WorkloadRequest], sorted by arrival time.

Determinism: each random quantity has its own numpy stream derived from the seed (prompt lengths, output
lengths, arrivals, sessions), so e.g. changing the rate moves arrival times but keeps every prompt, and token
ids are hashes of (seed, stream, key, position) (tokens.py). The same config and seed give the same workload
on any machine with the same numpy.
Request ids: 'r{i}' in arrival order for single-turn workloads, 's{session}t{turn}' for sessions.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from pdjax.workload.arrivals import arrival_times
from pdjax.workload.config import WorkloadConfig
from pdjax.workload.dataset import dataset_requests
from pdjax.workload.lengths import LengthDist, is_pairable, sample_length_pairs
from pdjax.workload.presets import get_preset
from pdjax.workload.request import WorkloadRequest
from pdjax.workload.tokens import (STREAM_ANSWER, STREAM_BLOCK, STREAM_BODY, STREAM_PREFIX, hashed_token_ids,
                                   load_text_bytes, text_token_ids)
from pdjax.workload.tokenizer import load_tokenizer
from pdjax.workload.traces import Trace, load_trace

_RNG_PROMPT, _RNG_OUTPUT, _RNG_ARRIVAL, _RNG_SESSION = 1, 2, 3, 4


def scale_lengths(lengths: np.ndarray, scale: float) -> np.ndarray:
    """round(lengths * scale), at least 1."""
    return np.maximum(np.rint(np.asarray(lengths, dtype=np.float64) * scale), 1).astype(np.int64)


def cap_lengths(prompt_lens: np.ndarray, output_lens: np.ndarray, cfg: WorkloadConfig
                ) -> Tuple[np.ndarray, np.ndarray]:
    """Apply the caps of `cfg` to (total prompt, output) lengths (see WorkloadConfig)."""
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    output_lens = np.asarray(output_lens, dtype=np.int64)
    if cfg.prompt_cap is not None:
        prompt_lens = np.minimum(prompt_lens, cfg.prompt_cap)
    if cfg.max_output_len:
        output_lens = np.minimum(output_lens, cfg.max_output_len)
    if cfg.max_model_len:
        output_lens = np.minimum(output_lens, cfg.max_model_len - prompt_lens)
    return prompt_lens, output_lens


def _source_dists(cfg: WorkloadConfig) -> Tuple[LengthDist, LengthDist, Optional[int]]:
    """(prompt dist, output dist, fit_total_tokens or None)."""
    preset = get_preset(cfg.preset) if cfg.preset else None
    prompt = cfg.prompt_len if cfg.prompt_len is not None else preset.prompt
    output = cfg.output_len if cfg.output_len is not None else preset.output
    if preset is not None and cfg.prompt_len is None and cfg.output_len is None:
        return prompt, output, preset.fit_total_tokens
    total = prompt.max_length + output.max_length
    return prompt, output, (total if total < 2**62 else None)


def _resolve_scale(cfg: WorkloadConfig, fit_total: Optional[int]) -> float:
    if not cfg.fit_to_model:
        return float(cfg.scale)
    if not fit_total:
        raise ValueError("workload.fit_to_model=True needs bounded length distributions (set 'high' on lognormal)")
    return cfg.scale * cfg.max_model_len / fit_total


def _token_ids(cfg: WorkloadConfig, seed: int, stream: int, key: int, length: int) -> List[int]:
    """[length] prompt token ids for (stream, key): hashed ids ('random') or a byte window of the text ('text')."""
    if cfg.prompt_source == "text":
        return text_token_ids(load_text_bytes(cfg.text_path), seed, stream, key, length)
    return hashed_token_ids(seed, stream, key, length, cfg.vocab_size, cfg.allowed_token_ids)


def _dataset_tokenizer(cfg: WorkloadConfig):
    return _tokenizer_of(cfg.tokenizer)


@functools.lru_cache(maxsize=4)
def _tokenizer_of(checkpoint: str):
    tokenizer = load_tokenizer(checkpoint)
    if tokenizer is None:
        raise ValueError(f"workload.tokenizer={checkpoint!r} has no tokenizer (no tokenizer.json, not a byte "
                         "model); kind='dataset' needs one to tokenize its text")
    return tokenizer


def _token_bound(cfg: WorkloadConfig) -> Tuple[int, int]:
    """(lo, hi) bounding every id _token_ids makes for cfg: bytes for 'text', the tokenizer's ids for
    'dataset', else [0, vocab_size) or the allowed ids."""
    if cfg.kind == "dataset":
        return 0, _dataset_tokenizer(cfg).vocab_size - 1
    if cfg.prompt_source == "text":
        return 0, 255
    if cfg.allowed_token_ids:
        return min(cfg.allowed_token_ids), max(cfg.allowed_token_ids)
    return 0, cfg.vocab_size - 1


def _prompt(cfg: WorkloadConfig, seed: int, key: int, body_len: int) -> List[int]:
    prefix = _token_ids(cfg, seed, STREAM_PREFIX, 0, cfg.shared_prefix_len)
    return prefix + _token_ids(cfg, seed, STREAM_BODY, key, body_len)


def _single_turn(cfg: WorkloadConfig, seed: int, prompt_body: np.ndarray, outputs: np.ndarray,
                 arrivals: np.ndarray, trace_rows=None, block_len: int = 0) -> List[WorkloadRequest]:
    uncapped_prompts, uncapped_outputs = prompt_body + cfg.shared_prefix_len, outputs
    prompt_lens, outputs = cap_lengths(uncapped_prompts, uncapped_outputs, cfg)
    order = np.argsort(arrivals, kind="stable")
    requests = []
    for rank, i in enumerate(order):
        body_len = int(prompt_lens[i]) - cfg.shared_prefix_len
        if trace_rows is not None and trace_rows[i].hash_ids and block_len:
            body = []
            for h in trace_rows[i].hash_ids:
                if len(body) >= body_len:
                    break
                body += _token_ids(cfg, seed, STREAM_BLOCK, h, block_len)
            body = body[:body_len]
            body += _token_ids(cfg, seed, STREAM_BODY, int(i), body_len - len(body))
            prompt = _token_ids(cfg, seed, STREAM_PREFIX, 0, cfg.shared_prefix_len) + body
        else:
            prompt = _prompt(cfg, seed, int(i), body_len)
        requests.append(WorkloadRequest(
            request_id=f"r{rank}", arrival_time=float(arrivals[i]), prompt_token_ids=prompt,
            max_tokens=int(outputs[i]), prefix_group="system" if cfg.shared_prefix_len else None,
            shared_prefix_len=cfg.shared_prefix_len, uncapped_prompt_len=int(uncapped_prompts[i]),
            uncapped_output_len=int(uncapped_outputs[i])))
    return requests


def _joint(cfg: WorkloadConfig, prompt: LengthDist, output: LengthDist) -> bool:
    """Draw (prompt, output) pairs: length_sampling='joint' and the two distributions are one trace's columns."""
    return cfg.length_sampling == "joint" and is_pairable(prompt, output)


def _sessions(cfg: WorkloadConfig, seed: int, prompt: LengthDist, output: LengthDist, scale: float
              ) -> List[WorkloadRequest]:
    starts = arrival_times(cfg.arrival, cfg.num_requests, cfg.rate / cfg.num_turns, cfg.cv,
                           np.random.default_rng([seed, _RNG_ARRIVAL]))
    cap = cfg.prompt_cap
    requests: List[WorkloadRequest] = []
    session = 0
    while len(requests) < cfg.num_requests:
        rng = np.random.default_rng([seed, _RNG_SESSION, session])
        bodies, answers = sample_length_pairs(prompt, output, cfg.num_turns, rng, rng, _joint(cfg, prompt, output))
        bodies, answers = scale_lengths(bodies, scale), scale_lengths(answers, scale)
        tokens: List[int] = _token_ids(cfg, seed, STREAM_PREFIX, 0, cfg.shared_prefix_len)
        for turn in range(cfg.num_turns):
            key = session * cfg.num_turns + turn
            body_len = uncapped_body = int(bodies[turn])
            if turn == 0 and cap is not None:
                body_len = min(body_len, cap - len(tokens))
            next_prompt = tokens + _token_ids(cfg, seed, STREAM_BODY, key, body_len)
            if turn > 0 and ((cap is not None and len(next_prompt) > cap)):
                break
            (_,), (max_tokens,) = cap_lengths([len(next_prompt)], [int(answers[turn])], cfg)
            requests.append(WorkloadRequest(
                request_id=f"s{session}t{turn}", arrival_time=float(starts[session] + turn * cfg.turn_gap_s),
                prompt_token_ids=next_prompt, max_tokens=int(max_tokens), session_id=f"s{session}", turn=turn,
                prefix_group="system" if cfg.shared_prefix_len else None, shared_prefix_len=cfg.shared_prefix_len,
                uncapped_prompt_len=len(next_prompt) + uncapped_body - body_len,
                uncapped_output_len=int(answers[turn])))
            if len(requests) == cfg.num_requests:
                break
            # The model's real answer is unknown here; a stand-in of its length keeps the prompt growth right.
            tokens = next_prompt + _token_ids(cfg, seed, STREAM_ANSWER, key, int(max_tokens))
        session += 1
    requests.sort(key=lambda r: r.arrival_time)
    return requests


def _from_trace(cfg: WorkloadConfig, seed: int, trace: Trace) -> List[WorkloadRequest]:
    if cfg.trace_start >= len(trace.rows):
        raise ValueError(f"workload.trace_start={cfg.trace_start} is beyond the end of {trace.path}, which has "
                         f"{len(trace.rows)} rows; expected trace_start <= {len(trace.rows) - 1} (rows count from 0)")
    rows = trace.rows[cfg.trace_start:cfg.trace_start + cfg.num_requests]
    if len(rows) < cfg.num_requests:
        raise ValueError(f"workload.num_requests={cfg.num_requests} with trace_start={cfg.trace_start}, but "
                         f"{trace.path} has only {len(trace.rows)} rows; expected num_requests <= "
                         f"{len(trace.rows) - cfg.trace_start}")
    prompts = np.array([r.prompt_len for r in rows], dtype=np.int64)
    outputs = np.array([r.output_len for r in rows], dtype=np.int64)
    scale = float(cfg.scale)   # a trace replays its own lengths; fit_to_model is for synthetic sources
    if cfg.arrival == "trace":
        if not trace.has_arrivals:
            raise ValueError(f"workload.arrival='trace', but {trace.path} ({trace.format} format) has no arrival "
                             "times; expected a synthetic arrival such as 'poisson'")
        times = np.array([r.arrival_time for r in rows])
        arrivals = (times - times.min()) * cfg.trace_time_scale
    else:
        arrivals = arrival_times(cfg.arrival, len(rows), cfg.rate, cfg.cv,
                                 np.random.default_rng([seed, _RNG_ARRIVAL]))
    block_len = max(1, int(round(trace.block_size * scale))) if trace.block_size else 0
    return _single_turn(cfg, seed, scale_lengths(prompts, scale), scale_lengths(outputs, scale), arrivals,
                        trace_rows=rows, block_len=block_len)


def length_report(cfg: Any, requests: Sequence[WorkloadRequest]) -> Dict[str, Any]:
    """What make_workload did to the source's lengths, for results.json and the console: the scale applied
    (fit_to_model or `scale`), and how many prompts / outputs the caps cut.

    {"source", "scale", "fit_to_model", "prompt_cap", "max_output_len", "num_requests", "num_prompts_cut",
     "num_outputs_cut"}"""
    cfg = WorkloadConfig.from_dict(cfg)
    if cfg.kind == "trace":
        source, scale = f"trace {cfg.trace_path}", float(cfg.scale)
    elif cfg.kind == "dataset":
        source, scale = f"dataset {cfg.dataset_path}", float(cfg.scale)
    else:
        source = f"preset {cfg.preset}" if cfg.preset and cfg.prompt_len is None else "length distributions"
        scale = _resolve_scale(cfg, _source_dists(cfg)[2])
    return {
        "source": source, "scale": scale, "fit_to_model": bool(cfg.fit_to_model and cfg.kind == "synthetic"),
        "prompt_cap": cfg.prompt_cap, "max_output_len": cfg.max_output_len or None, "num_requests": len(requests),
        "num_prompts_cut": sum(r.num_prompt_tokens < r.uncapped_prompt_len for r in requests),
        "num_outputs_cut": sum(r.max_tokens < r.uncapped_output_len for r in requests)}


def describe_length_report(report: Mapping[str, Any]) -> Optional[str]:
    """One console line when the workload's lengths differ from its source's; None when replayed as they are."""
    parts = []
    if report["scale"] != 1.0:
        why = " (fit_to_model: the source's long requests fill max_model_len)" if report["fit_to_model"] else ""
        parts.append(f"lengths scaled x{report['scale']:.4g}{why}")
    n = report["num_requests"]
    if report["num_prompts_cut"]:
        parts.append(f"{report['num_prompts_cut']} of {n} prompts cut to {report['prompt_cap']} tokens")
    if report["num_outputs_cut"]:
        parts.append(f"{report['num_outputs_cut']} of {n} outputs cut (max_output_len="
                     f"{report['max_output_len'] or 0}, max_model_len)")
    return f"workload {report['source']}: " + "; ".join(parts) if parts else None


def make_workload(cfg: Any, seed: Optional[int] = None) -> List[WorkloadRequest]:
    """Requests of the workload `cfg` (a WorkloadConfig, dict or ConfigDict); `seed` overrides cfg.seed. Each
    carries the bound of its prompt ids (WorkloadRequest.token_bound)."""
    cfg = WorkloadConfig.from_dict(cfg)
    seed = cfg.seed if seed is None else seed
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}, expected an int >= 0")
    requests = _make_workload(cfg, seed)
    bound = _token_bound(cfg)
    for r in requests:
        r.token_bound = bound
    return requests


def _make_workload(cfg: WorkloadConfig, seed: int) -> List[WorkloadRequest]:
    if cfg.kind == "trace":
        return _from_trace(cfg, seed, load_trace(cfg.trace_path))
    if cfg.kind == "dataset":
        return dataset_requests(cfg, _dataset_tokenizer(cfg), rng_outputs=np.random.default_rng([seed, _RNG_OUTPUT]),
                                rng_arrivals=np.random.default_rng([seed, _RNG_ARRIVAL]))
    prompt, output, fit_total = _source_dists(cfg)
    scale = _resolve_scale(cfg, fit_total)
    if cfg.num_turns > 1:
        return _sessions(cfg, seed, prompt, output, scale)
    n = cfg.num_requests
    bodies, outputs = sample_length_pairs(prompt, output, n, np.random.default_rng([seed, _RNG_PROMPT]),
                                          np.random.default_rng([seed, _RNG_OUTPUT]), _joint(cfg, prompt, output))
    bodies, outputs = scale_lengths(bodies, scale), scale_lengths(outputs, scale)
    arrivals = arrival_times(cfg.arrival, n, cfg.rate, cfg.cv, np.random.default_rng([seed, _RNG_ARRIVAL]))
    return _single_turn(cfg, seed, bodies, outputs, arrivals)
