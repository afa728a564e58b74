"""pdjax.metrics: request/iteration records, DESIGN.md §4 latency metrics, SLOs, capacity search, and the run
outputs (results.json, CSVs, plots) shared by the real engines and the simulator. No JAX."""
from pdjax.metrics.capacity import CapacityResult, capacity_search, holds
from pdjax.metrics.latency import (LATENCY_METRICS, SLOs, STAT_KEYS, e2es, goodput_rps, meets_slos, metric_value,
                                   normalized_latencies, run_duration, sched_delays, slo_attainment, stats,
                                   summarize_iterations, summarize_run, tbts, tpots, ttfts)
from pdjax.metrics.records import NOT_SERVED_REASONS, IterationRecord, RequestRecord, request_record
from pdjax.metrics.report import (RUN_FILES, RunData, atomic_open, atomic_write_bytes, atomic_write_text,
                                  is_finished_run, load_run, prepare_run_dir, recompute_summary, summarize_table,
                                  write_csv, write_json, write_run_outputs)

__all__ = [
    "CapacityResult", "capacity_search", "holds", "LATENCY_METRICS", "SLOs", "STAT_KEYS", "e2es", "goodput_rps",
    "meets_slos", "metric_value", "normalized_latencies", "run_duration", "sched_delays", "slo_attainment",
    "stats", "summarize_iterations", "summarize_run", "tbts", "tpots", "ttfts", "NOT_SERVED_REASONS",
    "IterationRecord", "RequestRecord", "request_record", "RunData", "atomic_open", "atomic_write_bytes",
    "atomic_write_text", "is_finished_run", "prepare_run_dir", "RUN_FILES", "load_run", "recompute_summary",
    "summarize_table", "write_csv",
    "write_json", "write_run_outputs",
]
