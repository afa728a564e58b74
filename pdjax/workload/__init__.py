"""pdjax.workload: request streams for the engines and the simulator (no JAX).

`make_workload(config, seed)` builds a list of `WorkloadRequest`s from a `WorkloadConfig`: synthetic
(arrival process x length distributions or a named preset taken from a real trace) or replayed from a trace CSV.
"""
from pdjax.workload.arrivals import ARRIVAL_KINDS, arrival_times
from pdjax.workload.config import WorkloadConfig
from pdjax.workload.generate import (cap_lengths, describe_length_report, length_report, make_workload,
                                     scale_lengths)
from pdjax.workload.lengths import LengthDist, length_dist, sample_lengths
from pdjax.workload.presets import PRESETS, Preset, get_preset
from pdjax.workload.request import WorkloadRequest
from pdjax.workload.tokens import hashed_token_ids
from pdjax.workload.traces import Trace, TraceRequest, load_trace

__all__ = ["describe_length_report", "length_report",
    "ARRIVAL_KINDS", "arrival_times", "WorkloadConfig", "cap_lengths", "make_workload", "scale_lengths",
    "LengthDist", "length_dist", "sample_lengths", "PRESETS", "Preset", "get_preset", "WorkloadRequest",
    "hashed_token_ids", "Trace", "TraceRequest", "load_trace",
]
