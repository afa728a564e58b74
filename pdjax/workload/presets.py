"""Named workload presets whose length distributions come from real traces.

Each preset carries the trace's prompt and output length distributions as inverse-CDF tables (length at
quantiles 0, .01, .05, .1, .2, ..., .9, .95, .99, 1; numpy's default linear percentile, rounded), so a preset
works without the trace files. The numbers were computed from the files in ../shared/data/traces (see its
SOURCES.md for provenance) and are checked against them by tests/test_traces.py when the files are present.

Prompt and output lengths are drawn independently: in every source file their Spearman rank correlation is
small (chat 0.05, arxiv -0.11, code -0.02, conv 0.07, mooncake 0.07).

`fit_total_tokens` is the prompt+output total the preset is scaled to when a workload asks to fit it into a
small model (`fit_to_model=True`): the source's own filter bound where it has one, otherwise the P99 of the total,
so the rare longer requests get clipped instead of squashing everything.
`rate` / `cv` are the mean arrival rate (req/s) and the inter-arrival CV of the trace, where it has arrivals.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from pdjax.workload.lengths import LengthDist

QUANTILE_POINTS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def _table(lengths: Tuple[int, ...]) -> LengthDist:
    assert len(lengths) == len(QUANTILE_POINTS)
    return LengthDist(kind="quantiles", quantiles=tuple(zip(QUANTILE_POINTS, map(float, lengths))))


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    source_file: str            # file name in ../shared/data/traces the numbers come from
    prompt: LengthDist
    output: LengthDist
    fit_total_tokens: int
    rate: Optional[float] = None
    cv: Optional[float] = None


PRESETS: Dict[str, Preset] = {
    # sarathi_sharegpt_8k_filtered_llama2_tok.csv, 30,731 rows, num_prefill_tokens / num_decode_tokens.
    # Prompt median 1730, P90 5696; output median 415, P90 834: Sarathi-Serve Table 2, openchat_sharegpt4.
    # Filter: total <= 8192 tokens.
    "chat": Preset(
        name="chat",
        description="chat (openchat_sharegpt4, Sarathi-Serve OSDI'24 trace 'chat')",
        source_file="sarathi_sharegpt_8k_filtered_llama2_tok.csv",
        prompt=_table((1, 12, 29, 74, 382, 777, 1203, 1730, 2401, 3235, 4278, 5696, 6563, 7434, 8141)),
        output=_table((2, 6, 44, 84, 181, 271, 346, 415, 493, 581, 683, 834, 920, 998, 1024)),
        fit_total_tokens=8192,
    ),
    # vidur_arxiv_summarization_llama2_tok_filtered_v2.csv, 28,257 rows. Prompt median 2730, P90 3702; output
    # median 167, P90 372. Filter: total <= 4096 (NOT the Sarathi paper's arxiv file, whose prompt median is 7059).
    "arxiv": Preset(
        name="arxiv",
        description="long-prompt summarization (arxiv, Vidur filtered_v2, total <= 4096)",
        source_file="vidur_arxiv_summarization_llama2_tok_filtered_v2.csv",
        prompt=_table((1, 73, 749, 1242, 1802, 2150, 2453, 2730, 2996, 3249, 3490, 3702, 3813, 3933, 4054)),
        output=_table((5, 36, 60, 78, 104, 125, 145, 167, 192, 222, 268, 372, 736, 3271, 4056)),
        fit_total_tokens=4096,
    ),
    # azure_llm_2023_code.csv, 8,819 rows, ContextTokens / GeneratedTokens. Prompt median 1469, P90 5188;
    # output median 13, P90 55. Total P99 7462. Arrivals: 8,818 gaps over 3435.9 s -> 2.566 req/s, gap CV 13.15.
    "code": Preset(
        name="code",
        description="code completion (Azure LLM inference trace 2023, code)",
        source_file="azure_llm_2023_code.csv",
        prompt=_table((3, 17, 75, 147, 386, 770, 1075, 1469, 1909, 2433, 3192, 5188, 7303, 7436, 7437)),
        output=_table((6, 6, 6, 7, 8, 9, 11, 13, 16, 20, 29, 55, 90, 251, 1899)),
        fit_total_tokens=7462,
        rate=2.566,
        cv=13.15,
    ),
    # azure_llm_2023_conv.csv, 19,366 rows. Prompt median 1020, P90 2734; output median 129, P90 424.
    # Total P99 4259 (max 14089). Arrivals: 19,365 gaps over 3501.7 s -> 5.530 req/s, gap CV 1.094.
    "conv": Preset(
        name="conv",
        description="conversation (Azure LLM inference trace 2023, conv)",
        source_file="azure_llm_2023_conv.csv",
        prompt=_table((2, 29, 181, 207, 387, 403, 703, 1020, 1071, 1130, 1315, 2734, 4083, 4142, 14050)),
        output=_table((7, 16, 41, 54, 77, 91, 103, 129, 177, 384, 400, 424, 451, 601, 1000)),
        fit_total_tokens=4259,
        rate=5.530,
        cv=1.094,
    ),
    # mooncake_fast25_conversation.csv, 12,031 rows, input_length / output_length. Prompt median 6909, P90
    # 27367, mean 12035; output median 350, P90 597, mean 343. Total P99 85851. Arrivals: 12,030 gaps over
    # 3537.0 s -> 3.401 req/s, gap CV 3.03 (timestamps quantized to ~3 s).
    "mooncake": Preset(
        name="mooncake",
        description="long-context conversation (Mooncake FAST'25 conversation trace)",
        source_file="mooncake_fast25_conversation.csv",
        prompt=_table((891, 894, 901, 964, 1662, 3263, 4993, 6909, 9570, 13196, 17869, 27367, 39550, 85400,
                       126195)),
        output=_table((1, 3, 10, 24, 100, 213, 291, 350, 399, 447, 504, 597, 698, 1119, 2000)),
        fit_total_tokens=85851,
        rate=3.401,
        cv=3.03,
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r}, expected one of {sorted(PRESETS)}")
    return PRESETS[name]
