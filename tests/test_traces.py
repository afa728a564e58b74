"""Trace loaders: real files in ../shared/data/traces, malformed rows, exact times; presets vs the real files."""
import csv

import numpy as np
import pytest

from pdjax.workload import PRESETS, load_trace, make_workload
from pdjax.workload.presets import QUANTILE_POINTS

# file -> (rows per SOURCES.md, format, has arrival times)
REAL_FILES = {
    "azure_llm_2023_code.csv": (8819, "azure", True),
    "azure_llm_2023_conv.csv": (19366, "azure", True),
    "vidur_splitwise_code.csv": (8819, "vidur", True),
    "vidur_splitwise_conv.csv": (19366, "vidur", True),
    "vidur_arxiv_summarization_llama2_tok_filtered_v2.csv": (28257, "lengths", False),
    "sarathi_sharegpt_8k_filtered_llama2_tok.csv": (30731, "lengths", False),
    "mooncake_fast25_conversation.csv": (12031, "mooncake", True),
    "mooncake_fast25_synthetic.csv": (3993, "mooncake", True),
}


def _raw_columns(path):
    """Independent read with csv.DictReader: the header's columns as lists of strings."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: [r[k] for r in rows] for k in rows[0]}


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_real_trace_loads(shared_data, name):
    path = shared_data / "traces" / name
    if not path.exists():
        pytest.skip(f"{path} absent")
    expected_rows, fmt, has_arrivals = REAL_FILES[name]
    trace = load_trace(str(path))
    assert (len(trace), trace.format, trace.has_arrivals) == (expected_rows, fmt, has_arrivals)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace.rows)
    raw = _raw_columns(path)
    prompt_col = {"azure": "ContextTokens", "vidur": "num_prefill_tokens", "lengths": "num_prefill_tokens",
                  "mooncake": "input_length"}[fmt]
    assert [r.prompt_len for r in trace.rows] == [int(v) for v in raw[prompt_col]]
    if has_arrivals:
        times = np.array([r.arrival_time for r in trace.rows])
        assert times.min() == 0.0 and np.all(np.diff(times) >= 0)   # the real files are sorted by time
    else:
        assert all(r.arrival_time is None for r in trace.rows)
    if fmt == "mooncake":
        assert all(len(r.hash_ids) == int(n) for r, n in zip(trace.rows, raw["num_hash_blocks"]))


def test_azure_and_vidur_copies_agree(shared_data):
    """SOURCES.md: the vidur files are the Azure rows with the timestamp turned into seconds from the first."""
    azure = load_trace(str(shared_data / "traces" / "azure_llm_2023_conv.csv"))
    vidur = load_trace(str(shared_data / "traces" / "vidur_splitwise_conv.csv"))
    assert [(r.prompt_len, r.output_len) for r in azure.rows] == [(r.prompt_len, r.output_len) for r in vidur.rows]
    np.testing.assert_allclose([r.arrival_time for r in azure.rows], [r.arrival_time for r in vidur.rows],
                               atol=1e-6)


@pytest.mark.parametrize("preset_name", sorted(PRESETS))
def test_preset_tables_match_real_file(shared_data, preset_name):
    preset = PRESETS[preset_name]
    path = shared_data / "traces" / preset.source_file
    trace = load_trace(str(path))
    prompts = np.array([r.prompt_len for r in trace.rows])
    outputs = np.array([r.output_len for r in trace.rows])
    qs = 100 * np.array(QUANTILE_POINTS)
    for dist, values in ((preset.prompt, prompts), (preset.output, outputs)):
        table = np.array([v for _, v in dist.quantiles])
        np.testing.assert_allclose(table, np.rint(np.percentile(values, qs)), atol=0)
    totals = prompts + outputs
    assert preset.fit_total_tokens >= np.percentile(totals, 99) - 1
    if preset.rate is not None:
        times = np.array([r.arrival_time for r in trace.rows])
        gaps = np.diff(times)
        assert preset.rate == pytest.approx((len(times) - 1) / times[-1], rel=1e-3)
        assert preset.cv == pytest.approx(gaps.std() / gaps.mean(), rel=1e-2)


def test_real_trace_workload_keeps_trace_times(shared_data):
    path = str(shared_data / "traces" / "vidur_splitwise_code.csv")
    reqs = make_workload(dict(kind="trace", trace_path=path, arrival="trace", num_requests=50, trace_start=10,
                              max_model_len=1024, fit_to_model=True, vocab_size=256), seed=0)
    raw = _raw_columns(path)
    expected = np.array([float(v) for v in raw["arrived_at"][10:60]])
    np.testing.assert_allclose([r.arrival_time for r in reqs], expected - expected[0], atol=1e-9)
    assert all(r.num_prompt_tokens + r.max_tokens <= 1024 for r in reqs)


def _write(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


MALFORMED = [
    # (file text, bad line, words the message must contain)
    ("num_prefill_tokens,num_decode_tokens\n10,5\n12,x\n", 3, "num_decode_tokens='x'"),
    ("num_prefill_tokens,num_decode_tokens\n10,5\n\n7,2,9\n", 4, "3 columns"),
    ("num_prefill_tokens,num_decode_tokens\n0,5\n", 2, "num_prefill_tokens=0"),
    ("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n10,5,15,2\n10,5,16,2\n", 3,
     "num_total_tokens=16"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,48,10\n2023-13-16 18:17:04,3,8\n",
     3, "TIMESTAMP"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,5,5\n-1.0,5,5\n", 3, "arrived_at"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,5,5\nnan,5,5\n", 3, "not finite"),
    ("timestamp_ms,input_length,output_length,num_hash_blocks,hash_ids\n0,600,5,2,0 1\n3,600,5,3,0 2\n", 3,
     "num_hash_blocks=3"),
    ("timestamp_ms,input_length,output_length,num_hash_blocks,hash_ids\n0,600,5,2,0 a\n", 2, "hash_ids"),
    ("when,a,b\n1,2,3\n", 1, "not a known trace format"),
    ("", 1, "empty file"),
]


@pytest.mark.parametrize("text,line,words", MALFORMED)
def test_malformed_rows_name_file_and_line(tmp_path, text, line, words):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_trace(path)
    assert f"{path}:{line}:" in str(info.value)
    assert words in str(info.value)


def test_header_only_file_is_an_error(tmp_path):
    path = _write(tmp_path, "prompt_tokens,output_tokens\n")
    with pytest.raises(ValueError, match="no data rows"):
        load_trace(path)


def test_azure_times_are_exact_differences(tmp_path):
    stamps = ["2023-11-16 18:59:59.9999999", "2023-11-16 19:00:00.0000001", "2023-11-17 00:00:01.5"]
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},7,3\n" for s in stamps)
    trace = load_trace(_write(tmp_path, text.rstrip("\n")))    # the Azure files end without a newline
    # 18:59:59.9999999 -> 19:00:00.0000001 is 2e-7 s; -> next day 00:00:01.5 is 5 h + 1.5 s + 1e-7 s.
    expected = [0.0, 2e-7, 5 * 3600 + 1.5 + 1e-7]
    np.testing.assert_allclose([r.arrival_time for r in trace.rows], expected, rtol=0, atol=1e-9)


def test_unsorted_times_are_relative_to_the_earliest(tmp_path):
    trace = load_trace(_write(tmp_path, "prompt_tokens,output_tokens,arrival_time\n5,1,3.5\n6,2,1.0\n7,3,2.0\n"))
    assert [r.arrival_time for r in trace.rows] == [2.5, 0.0, 1.0]
    reqs = make_workload(dict(kind="trace", trace_path=trace.path, arrival="trace", num_requests=3), seed=0)
    assert [(r.arrival_time, r.num_prompt_tokens) for r in reqs] == [(0.0, 6), (1.0, 7), (2.5, 5)]


def test_simple_format_without_times_and_blank_lines(tmp_path):
    trace = load_trace(_write(tmp_path, "prompt_tokens,output_tokens\n5,1\n\n6,2\n"))
    assert [(r.prompt_len, r.output_len, r.arrival_time) for r in trace.rows] == [(5, 1, None), (6, 2, None)]
    assert not trace.has_arrivals
    with pytest.raises(ValueError, match="has no arrival times"):
        make_workload(dict(kind="trace", trace_path=trace.path, arrival="trace", num_requests=2))
