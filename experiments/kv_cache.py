"""KV-cache-centric scheduling experiments in the simulator (issue 30, Mooncake FAST'25; pdjax.experiment.kv_cache):
cache hit ratio vs host capacity (local tiers vs a shared pool), the routers' TTFT / TBT and highest SLO-meeting
rate (colocated and disaggregated), and the simulator's speed with cache-aware routing. JSON rows to stdout.

    python -m experiments.kv_cache --part=hit_ratio [--traces=conversation,synthetic] [--num_requests=1000]
    python -m experiments.kv_cache --part=routers --rate=1.0 --rates=0.5,1,1.5,2,3
    python -m experiments.kv_cache --part=speed
    python -m experiments.kv_cache --part=replication --traces=conversation --replicate_after=0,1,2,4
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment import kv_cache

FLAGS = flags.FLAGS
flags.DEFINE_enum("part", "hit_ratio", ["hit_ratio", "routers", "speed", "replication"], "Which experiment.")
flags.DEFINE_list("traces", list(kv_cache.TRACES), "Mooncake traces.")
flags.DEFINE_integer("num_requests", 1000, "Trace rows per run (speed: chat10k requests).")
flags.DEFINE_float("rate", 1.0, "Arrival rate (req/s) of the hit-ratio runs and of the latency columns.")
flags.DEFINE_list("rates", ["0.5", "1", "1.5", "2", "3"], "Rates searched for the highest SLO-meeting one.")
flags.DEFINE_list("host_multiples", ["0", "0.5", "1", "2", "4"], "Host KV pages per instance / its device pages.")
flags.DEFINE_list("kinds", list(kv_cache.KINDS), "Deployment kinds of part routers.")
flags.DEFINE_list("routers", list(kv_cache.ROUTERS), "Routers of part routers.")
flags.DEFINE_string("hardware", "a100-80gb-sxm", "GPU of every instance (e.g. h100-sxm).")
flags.DEFINE_list("replicate_after", ["0", "1", "2", "4"], "Part replication: deployment.host_kv_replicate_after "
                  "values (0 = off).")
flags.DEFINE_float("host_multiple", 4.0, "Part replication: shared-pool pages per instance / its device pages.")
flags.DEFINE_integer("num_pages", 0, "Device KV pages per instance (0: what the GPUs hold).")
flags.register_validator("traces", lambda t: bool(t) and all(x in kv_cache.TRACES for x in t),
                         f"expected a comma-separated list of {sorted(kv_cache.TRACES)}")
flags.register_validator("num_requests", lambda n: n >= 1, "expected an integer >= 1")
flags.register_validator("rate", lambda r: r > 0, "expected a rate > 0")


def _floats(values, name):
    try:
        out = [float(v) for v in values]
    except ValueError:
        raise cli.UserError(f"--{name}={','.join(values)}: expected comma-separated numbers") from None
    if any(v < 0 for v in out):
        raise cli.UserError(f"--{name}={','.join(values)}: expected numbers >= 0")
    return out


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if FLAGS.part == "hit_ratio":
        rows = kv_cache.hit_ratio(FLAGS.traces, FLAGS.num_requests, FLAGS.rate,
                                  _floats(FLAGS.host_multiples, "host_multiples"), hardware=FLAGS.hardware,
                                  num_pages=FLAGS.num_pages)
    elif FLAGS.part == "routers":
        rows = kv_cache.routers(FLAGS.traces, FLAGS.num_requests, FLAGS.rate, _floats(FLAGS.rates, "rates"),
                                kinds=FLAGS.kinds, routers_=FLAGS.routers, hardware=FLAGS.hardware)
    elif FLAGS.part == "replication":
        afters = _floats(FLAGS.replicate_after, "replicate_after")
        if any(a != int(a) for a in afters):
            raise cli.UserError(f"--replicate_after={','.join(FLAGS.replicate_after)}: expected whole numbers >= 0")
        rows = kv_cache.replication(FLAGS.traces, FLAGS.num_requests, FLAGS.rate, FLAGS.host_multiple,
                                    [int(a) for a in afters], hardware=FLAGS.hardware, num_pages=FLAGS.num_pages)
    else:
        rows = kv_cache.speed(FLAGS.num_requests)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    cli.run(main)
