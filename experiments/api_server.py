"""OpenAI-compatible HTTP server over the real engine, from the same config file as experiments.serve.

    python -m experiments.api_server --config=configs/serve.py [--host=127.0.0.1 --port=8000] --workdir=/tmp/api
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "tiny-byte", "prompt": "def main(", "max_tokens": 32, "temperature": 0}'

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics
(pdjax/serving/api); text through the checkpoint's tokenizer and chat template (an HF directory's tokenizer.json,
e.g. --config.model.checkpoint=checkpoints/tiny-hf; README "Serve your own HF model directory"). The
deployment block, scheduler and engine keys are experiments.serve's; `server.max_queued_requests` bounds the
requests held (429 beyond), `server.drain_timeout_s` is the SIGTERM grace period. SIGTERM / Ctrl-C stops the
server and writes the run's result files (as experiments.serve's) to --workdir. The workload block is unused.
"""
from absl import flags

from pdjax.experiment import cli
from pdjax.metrics import summarize_table

_CONFIG = cli.define_config_file("config", "configs/serve.py", "Serve config file.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=1, upper_bound=65535)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pdjax_api", "Output directory of the run (new, empty, or an "
                               "earlier run's, whose outputs are replaced), written at shutdown.")
_LOG_LEVEL = flags.DEFINE_enum("log_level", "warning", ["critical", "error", "warning", "info", "debug"],
                               "uvicorn's log level (info logs every request).")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}; settings go in --config.KEY=VALUE flags")
    from pdjax.serving.api.server import EngineFailed, serve  # noqa: PLC0415 (fastapi: optional serve extra)
    try:     # a bad key, value or path is a UserError (one line) before anything compiles; so is a layout that
        summary = serve(_CONFIG.value, _WORKDIR.value, host=_HOST.value, port=_PORT.value,   # cannot be built
                        log_level=_LOG_LEVEL.value)
    except EngineFailed as e:
        if isinstance(e.__cause__, cli.UserError):
            raise e.__cause__ from None
        raise
    if summary:
        print(summarize_table(summary))
    print(f"outputs written to {_WORKDIR.value}")


if __name__ == "__main__":
    cli.run(main)
