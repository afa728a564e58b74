"""The server's Prometheus metrics (GET /metrics), per instance ('replica0', 'prefill0', 'decode0', ...).

Read from the schedulers at scrape time (a custom collector; plain attribute reads of the engine thread's
objects): `pdjax_num_requests_running`, `pdjax_num_requests_waiting`, `pdjax_kv_pages_used`,
`pdjax_kv_pages_total`, `pdjax_num_preemptions_total`. Observed as tokens are emitted (engine thread; the
Prometheus client is thread-safe): `pdjax_time_to_first_token_seconds`, `pdjax_time_between_tokens_seconds`
(every gap between consecutive tokens of a request), `pdjax_e2e_request_latency_seconds`,
`pdjax_prompt_tokens_total`, `pdjax_generation_tokens_total`, `pdjax_requests_finished_total{finish_reason}`
(length, stop, aborted, rejected). Latencies follow DESIGN.md's definitions on the engine clock (arrival = when
the server submitted the request to the engine). `pdjax_http_requests_rejected_total{code}` counts requests
answered 400 / 404 / 429 / 503 before reaching the engine. Instance label: the instance holding the request when
the token was emitted (a disaggregated request's first token is its prefill instance's, later ones its decode
instance's).
"""
from __future__ import annotations

from typing import Dict

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TBT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _SchedulerCollector:
    """Gauges and the preemption counter of every instance's scheduler, read at scrape time."""

    def __init__(self):
        self.schedulers: Dict[str, object] = {}

    def collect(self):
        running = GaugeMetricFamily("pdjax_num_requests_running", "Requests running (in the batch)",
                                    labels=["instance"])
        waiting = GaugeMetricFamily("pdjax_num_requests_waiting", "Requests waiting (queued, swapped, or "
                                    "awaiting their KV)", labels=["instance"])
        used = GaugeMetricFamily("pdjax_kv_pages_used", "KV cache pages in use", labels=["instance"])
        total = GaugeMetricFamily("pdjax_kv_pages_total", "KV cache pages of the instance", labels=["instance"])
        preempt = CounterMetricFamily("pdjax_num_preemptions", "Preemptions", labels=["instance"])
        for name, s in list(self.schedulers.items()):
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            used.add_metric([name], s.block_manager.num_used_pages)
            total.add_metric([name], s.block_manager.num_pages)
            preempt.add_metric([name], s.num_preemptions)
        return [running, waiting, used, total, preempt]


class ServerMetrics:
    """One registry per server (not the process-global one)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self._schedulers = _SchedulerCollector()
        self.registry.register(self._schedulers)
        r = self.registry
        self.ttft = Histogram("pdjax_time_to_first_token_seconds", "TTFT: first token - arrival", ["instance"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("pdjax_time_between_tokens_seconds", "TBT: gap between consecutive tokens",
                             ["instance"], buckets=TBT_BUCKETS, registry=r)
        self.e2e = Histogram("pdjax_e2e_request_latency_seconds", "E2E: last token - arrival", ["instance"],
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdjax_prompt_tokens", "Prompt tokens of admitted requests", ["instance"],
                                     registry=r)
        self.generation_tokens = Counter("pdjax_generation_tokens", "Generated tokens", ["instance"], registry=r)
        self.finished = Counter("pdjax_requests_finished", "Requests finished, by reason",
                                ["instance", "finish_reason"], registry=r)
        self.http_rejected = Counter("pdjax_http_requests_rejected", "Requests refused before the engine",
                                     ["code"], registry=r)

    def attach(self, schedulers: Dict[str, object]) -> None:
        self._schedulers.schedulers = dict(schedulers)

    def render(self) -> bytes:
        return generate_latest(self.registry)
