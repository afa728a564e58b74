"""run_real meets every process after warm-up and before its first clock reading (issue 27): on CPU, JAX's
persistent compilation cache serves process 0 only, so process 1 may compile its warm-up for minutes longer;
process 0 served meanwhile and the first decode step of an instance on process 1's devices absorbed the lag
(72-293 s). A recording coordinator on one process checks the order; the waits themselves are in
test_peer_watchdog, the real two-process run in test_multiprocess."""
from __future__ import annotations

from pdjax.config.serving import serve_config_from_dict
from pdjax.serving.distributed import Coordinator


class RecordingCoordinator(Coordinator):
    def __init__(self):
        super().__init__()
        self.events = []

    def wait_for_peers(self, name, waiting_for, limit_s=None):
        self.events.append(("wait_for_peers", name))
        return 0.0

    def now(self, local_elapsed):
        self.events.append(("now",))
        return super().now(local_elapsed)


def test_serving_starts_after_every_process_is_warmed_up(tmp_path):
    from pdjax.serving.run import run_real
    config = {
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"},
        "engine": {"mode": "offline", "warmup": False, "progress": False, "token_buckets": [32],
                   "seq_buckets": [8], "page_buckets": [8]},
        "scheduler": {"token_budget": 32, "max_num_seqs": 8, "max_model_len": 64, "page_size": 8, "num_pages": 48},
        "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 20},
                     "output_len": {"kind": "fixed", "value": 2}, "num_requests": 2, "vocab_size": 256},
        "deployment": {"kind": "disaggregated", "prefill": {"devices": [6]}, "decode": {"devices": [7]}}}
    coordinator = RecordingCoordinator()
    summary = run_real(serve_config_from_dict(config), config, str(tmp_path), coordinator=coordinator)
    assert summary["num_completed"] == 2
    assert coordinator.events.count(("wait_for_peers", "warmed-up")) == 1
    assert coordinator.events[0] == ("wait_for_peers", "warmed-up"), coordinator.events[:3]   # before any clock
    assert ("now",) in coordinator.events
