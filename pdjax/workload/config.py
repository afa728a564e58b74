"""WorkloadConfig: the frozen, validated description of a workload (what `make_workload` builds).

Built from a dict or an ml_collections ConfigDict with `WorkloadConfig.from_dict` (the one parser,
pdjax.config.parse.dataclass_from_dict); unknown keys and bad values raise ValueError naming the field, the value
and what was expected.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

from pdjax.config.parse import (FieldError, check_fields, dataclass_from_dict, flag, is_int, is_number, nonneg_int,
                                number, one_of, positive_int, text)
from pdjax.workload.arrivals import ARRIVAL_KINDS
from pdjax.workload.lengths import LengthDist, length_dist
from pdjax.workload.presets import PRESETS

WORKLOAD_KINDS = ("synthetic", "trace", "dataset")
WORKLOAD_ARRIVALS = ARRIVAL_KINDS + ("trace",)
PROMPT_SOURCES = ("random", "text")
NO_CAP = "(0 = no cap)"
LENGTH_SAMPLING = ("joint", "independent")


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """A workload.

    kind: 'synthetic' (lengths from `preset` or `prompt_len`/`output_len`), 'trace' (lengths, and with
      arrival='trace' also arrival times, from the CSV at `trace_path`, rows trace_start .. +num_requests), or
      'dataset' (real text: the prompts or ShareGPT conversations of the JSON file at `dataset_path`, entries
      trace_start on, tokenized with `tokenizer`'s tokenizer and chat template; pdjax.workload.dataset).
    dataset_path / tokenizer: kind='dataset' only: the file, and the checkpoint directory whose tokenizer is used
      ('' in a serve config: model.checkpoint). output_len, when set, gives the output lengths (a plain prompt
      has no reply to measure).
    arrival: 'poisson' | 'gamma' (burstiness `cv`) | 'fixed' | 'offline' (all at t=0) | 'trace'.
    rate: mean arrival rate in requests/s (sessions start at rate/num_turns, see below).
    trace_time_scale: trace arrival times are multiplied by it (0.5 replays twice as fast).
    preset: a name in presets.PRESETS; an explicit prompt_len/output_len overrides the preset's.
    prompt_len / output_len: a LengthDist, a dict like {'kind': 'uniform', 'low': 8, 'high': 64}, or its
      command-line string 'uniform:low=8,high=64' ('' or None: from the preset).
    length_sampling: 'joint' (default): when prompt_len and output_len are both 'empirical' with equal sample
      counts (one trace's columns, e.g. experiments.placement --trace), each request draws one row for both,
      keeping the trace's (prompt, output) pairs, as DistServe and Splitwise sample; 'independent' draws the two
      columns separately. Every other pair of distributions is drawn independently either way.
    scale: every sampled length is multiplied by it and rounded (min 1).
    fit_to_model: synthetic sources only: multiply `scale` by max_model_len / the source's fit_total_tokens
      (preset.fit_total_tokens, or the sum of the explicit distributions' maxima), so scale=1 maps the source's
      long requests onto max_model_len. A trace always replays its own lengths (times `scale`, then the caps);
      `length_report` says what was scaled or cut. A plain bool, so `--config.workload.fit_to_model=True`
      works with ml_collections' typed overrides.
    max_model_len / max_prompt_len / max_output_len: caps (0 = none) applied after scaling: the prompt is cut to
      min(max_prompt_len, max_model_len - 1), then the output to min(max_output_len, max_model_len - prompt).
    vocab_size / allowed_token_ids: synthetic token ids lie in [0, vocab_size), or in the allowed list.
    prompt_source: 'random' (hashed ids as above) or 'text': every prompt piece (system prompt, body, trace
      hash block, multi-turn answer stand-in) is a deterministic window of the bytes of the text at
      `text_path` ('' = the stdlib pydoc topics text), ids = byte values, for byte-level models (vocab_size
      >= 256, no allowed_token_ids). Lengths are sampled exactly as with 'random'.
    shared_prefix_len: a system prompt of this many tokens, the same for all requests, starts every prompt
      (the prompt length drawn is the part after it).
    num_turns: > 1 makes multi-turn sessions: turn k's prompt is turn k-1's prompt, a stand-in for its answer
      (output-length tokens), then a new user message. Turn k arrives turn_gap_s after turn k-1 (open loop).
      A session ends early when its next prompt would break the caps.
    """
    kind: str = one_of("synthetic", WORKLOAD_KINDS)
    num_requests: int = positive_int(64)
    seed: int = nonneg_int(0)
    arrival: str = one_of("poisson", WORKLOAD_ARRIVALS)
    rate: float = 1.0
    cv: float = 1.0
    preset: str = one_of("", ("",) + tuple(sorted(PRESETS)), expected=f"'' or one of {sorted(PRESETS)}")
    prompt_len: Optional[Union[LengthDist, Mapping[str, Any], str]] = None
    output_len: Optional[Union[LengthDist, Mapping[str, Any], str]] = None
    length_sampling: str = one_of("joint", LENGTH_SAMPLING)
    trace_path: str = ""
    trace_start: int = nonneg_int(0)
    trace_time_scale: float = number(1.0, low=0, low_open=True)
    scale: float = number(1.0, low=0, low_open=True)
    fit_to_model: bool = flag(False)
    max_model_len: int = nonneg_int(0, expected="0 (no cap) or an int >= 2")
    max_prompt_len: int = nonneg_int(0, note=NO_CAP)
    max_output_len: int = nonneg_int(0, note=NO_CAP)
    vocab_size: int = positive_int(32000)
    allowed_token_ids: Tuple[int, ...] = ()
    shared_prefix_len: int = nonneg_int(0)
    num_turns: int = positive_int(1)
    turn_gap_s: float = number(0.0, low=0, note="(seconds)")
    prompt_source: str = one_of("random", PROMPT_SOURCES)
    text_path: str = text("", expected="a path string ('' = the stdlib pydoc topics text)")
    dataset_path: str = text("", expected="a path string (kind='dataset')")
    tokenizer: str = text("", expected="a checkpoint directory with a tokenizer (kind='dataset')")

    def __post_init__(self):
        def bad(field, expected):
            raise FieldError(f"workload.{field}", getattr(self, field), expected)

        check_fields(self, "workload")
        if self.arrival == "trace" and self.kind != "trace":
            bad("arrival", "not 'trace' unless kind='trace'")
        if self.arrival not in ("offline", "trace") and not (is_number(self.rate) and self.rate > 0):
            bad("rate", f"a number > 0 (req/s) for arrival={self.arrival!r}")
        if self.arrival == "gamma" and not (is_number(self.cv) and self.cv > 0):
            bad("cv", "a number > 0 for arrival='gamma'")
        for field in ("prompt_len", "output_len"):
            value = getattr(self, field)
            if value == "":
                object.__setattr__(self, field, None)
            elif value is not None:
                try:
                    object.__setattr__(self, field, length_dist(value))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"workload.{field}={value!r}: {e}") from None
        if self.kind == "synthetic" and not self.preset and (self.prompt_len is None or self.output_len is None):
            bad("preset", "a preset name, or both prompt_len and output_len, for kind='synthetic'")
        if self.kind == "trace":
            if not self.trace_path:
                bad("trace_path", "the path of a trace CSV for kind='trace'")
            if self.preset or self.prompt_len is not None or self.output_len is not None:
                bad("kind", "'synthetic' when preset/prompt_len/output_len are set (a trace brings its own lengths)")
            if self.num_turns != 1:
                bad("num_turns", "1 for kind='trace'")
        if self.kind == "dataset":
            self._check_dataset(bad)
        elif self.dataset_path or self.tokenizer:
            bad("dataset_path" if self.dataset_path else "tokenizer", "'' unless kind='dataset'")
        if self.fit_to_model and not self.max_model_len and self.kind == "synthetic":
            bad("max_model_len", "> 0 when fit_to_model=True")
        if self.max_model_len == 1:
            bad("max_model_len", "0 (no cap) or an int >= 2")
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if any(not is_int(t) or not 0 <= t < self.vocab_size for t in self.allowed_token_ids):
            bad("allowed_token_ids", f"ints in [0, vocab_size={self.vocab_size})")
        if self.prompt_source == "text":
            if self.vocab_size < 256:
                bad("vocab_size", "an int >= 256 for prompt_source='text' (token ids are byte values)")
            if self.allowed_token_ids:
                bad("allowed_token_ids", "empty for prompt_source='text' (token ids are the text's bytes)")
        elif self.text_path:
            bad("text_path", "'' unless prompt_source='text'")
        prompt_cap = self.prompt_cap
        if prompt_cap is not None and self.shared_prefix_len >= prompt_cap:
            bad("shared_prefix_len", f"< the prompt cap {prompt_cap} (min of max_prompt_len, max_model_len - 1), "
                "leaving room for at least one token of the request's own")

    def _check_dataset(self, bad) -> None:
        if not self.dataset_path:
            bad("dataset_path", "the path of a JSON file of prompts or ShareGPT conversations for kind='dataset'")
        if not self.tokenizer:
            bad("tokenizer", "a checkpoint directory with a tokenizer for kind='dataset'")
        if self.preset or self.prompt_len is not None:
            bad("kind", "'synthetic' when preset/prompt_len are set (a dataset brings its own prompts)")
        if self.num_turns != 1:
            bad("num_turns", "1 for kind='dataset'")

    @property
    def prompt_cap(self) -> Optional[int]:
        """Longest prompt allowed, or None for no cap."""
        caps = [c for c in (self.max_prompt_len, self.max_model_len - 1 if self.max_model_len else 0) if c]
        return min(caps) if caps else None

    @classmethod
    def from_dict(cls, d: Any) -> "WorkloadConfig":
        """From a WorkloadConfig, a mapping, or anything with `to_dict()` (an ml_collections ConfigDict)."""
        if isinstance(d, cls):
            return d
        if hasattr(d, "to_dict"):
            d = d.to_dict()
        if not isinstance(d, Mapping):
            raise TypeError(f"workload config {d!r}: expected a WorkloadConfig, a mapping or a ConfigDict")
        return dataclass_from_dict(cls, d, "workload")

    def to_dict(self) -> dict:
        """Plain JSON-friendly dict (length distributions as dicts)."""
        out = dataclasses.asdict(self)
        out["allowed_token_ids"] = list(self.allowed_token_ids)
        return out
