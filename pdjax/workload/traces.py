"""Loaders for request trace CSVs: arrival times (when the file has them) and prompt/output token counts.

The format is recognised from the header (the columns in ../shared/data/traces/SOURCES.md):
- azure:     TIMESTAMP,ContextTokens,GeneratedTokens (Azure LLM inference trace 2023; absolute wall clock,
             `YYYY-MM-DD HH:MM:SS.fffffff`)
- vidur:     arrived_at,num_prefill_tokens,num_decode_tokens (seconds from the first request)
- lengths:   num_prefill_tokens,num_decode_tokens[,num_total_tokens,pd_ratio] (no arrival times)
- mooncake:  timestamp_ms,input_length,output_length[,num_hash_blocks,hash_ids] (ms; hash_ids are 512-token
             prefix blocks, space separated; equal leading ids mean a shared prefix)
- simple:    prompt_tokens,output_tokens[,arrival_time] (seconds) for hand-written files.
Arrival times are returned in seconds from the earliest row. Extra columns are ignored; blank lines are
skipped. Any other malformed row (wrong column count, a cell that is not a number, a length < 1, a negative
time, totals or block counts that disagree) raises ValueError naming the file and its 1-based line number; a
file that is not UTF-8 text (a binary file) raises ValueError naming the file.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import os
from typing import Callable, Dict, List, Optional, Tuple

from pdjax.workload.lengths import LengthDist

MOONCAKE_BLOCK_SIZE = 512


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_time: Optional[float]          # seconds from the earliest row; None when the file has no times
    prompt_len: int
    output_len: int
    hash_ids: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass(frozen=True)
class Trace:
    path: str
    format: str
    rows: Tuple[TraceRequest, ...]
    has_arrivals: bool
    block_size: Optional[int] = None       # tokens per hash id (mooncake)

    def __len__(self) -> int:
        return len(self.rows)

    def empirical_lengths(self) -> Tuple[LengthDist, LengthDist]:
        """(prompt, output) distributions resampling this trace's lengths."""
        return (LengthDist(kind="empirical", samples=tuple(r.prompt_len for r in self.rows)),
                LengthDist(kind="empirical", samples=tuple(r.output_len for r in self.rows)))


class _RowError(ValueError):
    pass


def _int(cell: str, column: str) -> int:
    try:
        return int(cell)
    except ValueError:
        raise _RowError(f"column {column}={cell!r} is not an integer") from None


def _float(cell: str, column: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise _RowError(f"column {column}={cell!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise _RowError(f"column {column}={cell!r} is not finite")
    return value


def _azure_time(cell: str, column: str) -> int:
    """`YYYY-MM-DD HH:MM:SS[.fffffff]` (UTC) as an exact integer count of 100 ns ticks since the epoch."""
    whole, _, frac = cell.partition(".")
    try:
        if frac and (not frac.isdigit() or len(frac) > 7):
            raise ValueError
        stamp = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        raise _RowError(f"column {column}={cell!r} is not a timestamp YYYY-MM-DD HH:MM:SS.fffffff") from None
    return int(stamp.timestamp()) * 10_000_000 + int(frac.ljust(7, "0") or 0)


@dataclasses.dataclass(frozen=True)
class _Format:
    name: str
    prompt: str
    output: str
    time: Optional[str] = None
    time_parser: Optional[Callable[[str, str], float]] = None
    time_scale: float = 1.0
    total: Optional[str] = None
    num_blocks: Optional[str] = None
    hash_ids: Optional[str] = None
    block_size: Optional[int] = None


_FORMATS = (
    _Format("azure", "ContextTokens", "GeneratedTokens", time="TIMESTAMP", time_parser=_azure_time,
            time_scale=1e-7),
    _Format("vidur", "num_prefill_tokens", "num_decode_tokens", time="arrived_at", time_parser=_float),
    _Format("mooncake", "input_length", "output_length", time="timestamp_ms", time_parser=_float,
            time_scale=1e-3, num_blocks="num_hash_blocks", hash_ids="hash_ids", block_size=MOONCAKE_BLOCK_SIZE),
    _Format("simple", "prompt_tokens", "output_tokens", time="arrival_time", time_parser=_float),
    _Format("lengths", "num_prefill_tokens", "num_decode_tokens", total="num_total_tokens"),
)


def _detect(header: List[str], path: str) -> Tuple[_Format, Dict[str, int]]:
    index = {name.strip(): i for i, name in enumerate(header)}
    for fmt in _FORMATS:
        if fmt.prompt not in index or fmt.output not in index:
            continue
        if fmt.time is not None and fmt.time not in index:
            if fmt.name != "simple":   # the time column is optional only in the simple format
                continue
            fmt = dataclasses.replace(fmt, time=None, time_parser=None)
        return fmt, index
    raise ValueError(
        f"{path}:1: header {header!r} is not a known trace format; expected the columns of one of: "
        + "; ".join(f"{f.name} ({', '.join(c for c in (f.time, f.prompt, f.output) if c)})" for f in _FORMATS))


def load_trace(path: str) -> Trace:
    """Read a trace CSV (format from its header). Arrival times are made relative to the earliest row."""
    path = os.fspath(path)
    try:
        return _load_trace(path)
    except UnicodeDecodeError as e:   # a binary file (or another encoding): name the file, not the codec
        raise ValueError(f"{path}: not a text CSV file (byte 0x{e.object[e.start]:02x} is not UTF-8); expected a "
                         "trace CSV with a header line") from None


def _load_trace(path: str) -> Trace:
    rows: List[TraceRequest] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise ValueError(f"{path}:1: empty file, expected a CSV header line")
        fmt, index = _detect(header, path)
        for cells in reader:
            if not cells or all(not c.strip() for c in cells):
                continue
            line = reader.line_num
            try:
                if len(cells) != len(header):
                    raise _RowError(f"{len(cells)} columns, expected {len(header)} as in the header")
                prompt_len = _int(cells[index[fmt.prompt]], fmt.prompt)
                output_len = _int(cells[index[fmt.output]], fmt.output)
                if prompt_len < 1:
                    raise _RowError(f"column {fmt.prompt}={prompt_len}, expected >= 1")
                if output_len < 1:
                    raise _RowError(f"column {fmt.output}={output_len}, expected >= 1")
                if fmt.total and fmt.total in index:
                    total = _int(cells[index[fmt.total]], fmt.total)
                    if total != prompt_len + output_len:
                        raise _RowError(f"column {fmt.total}={total}, expected {fmt.prompt} + {fmt.output} = "
                                        f"{prompt_len + output_len}")
                stamp = None
                if fmt.time:
                    stamp = fmt.time_parser(cells[index[fmt.time]].strip(), fmt.time)
                    if fmt.name != "azure" and stamp < 0:
                        raise _RowError(f"column {fmt.time}={cells[index[fmt.time]]!r}, expected >= 0")
                hash_ids = None
                if fmt.hash_ids and fmt.hash_ids in index:
                    hash_ids = tuple(_int(h, fmt.hash_ids) for h in cells[index[fmt.hash_ids]].split())
                    if fmt.num_blocks in index:
                        num_blocks = _int(cells[index[fmt.num_blocks]], fmt.num_blocks)
                        if num_blocks != len(hash_ids):
                            raise _RowError(f"column {fmt.num_blocks}={num_blocks}, but {fmt.hash_ids} has "
                                            f"{len(hash_ids)} ids")
            except _RowError as e:
                raise ValueError(f"{path}:{line}: {e}") from None
            rows.append(TraceRequest(stamp, prompt_len, output_len, hash_ids))
    if not rows:
        raise ValueError(f"{path}: no data rows after the header, expected at least one request")
    if fmt.time:
        start = min(r.arrival_time for r in rows)
        # Subtract in the file's own units first: azure ticks are exact integers, so no precision is lost.
        rows = [dataclasses.replace(r, arrival_time=(r.arrival_time - start) * fmt.time_scale) for r in rows]
    return Trace(path=path, format=fmt.name, rows=tuple(rows), has_arrivals=fmt.time is not None,
                 block_size=fmt.block_size)
