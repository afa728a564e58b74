"""Load generator for experiments.api_server: replay a config's workload against a running server with the openai
client (pdjax.serving.api.replay; the role of `vllm bench serve --backend openai`) and print the client-side
summary as JSON (TTFT / TBT / TPOT / E2E as in every pdjax result).

    python -m experiments.api_server --config=configs/serve.py --workdir=/tmp/api &      # wait for "serving"
    python -m experiments.bench_api_server --config=configs/serve.py --base_url=http://127.0.0.1:8000/v1

The workload (prompts, output lengths, arrival times) is the config's, exactly experiments.serve's for the same
config and seed; compare the output with `python -m experiments.serve --config=configs/serve.py` and with the
server's own results.json (written at SIGTERM). Ceiling: the same engine run in process, experiments.serve.
"""
import json

from absl import flags

from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment import cli
from pdjax.experiment.run import to_plain_dict
from pdjax.serving.api.replay import replay_summary
from pdjax.workload import make_workload

_CONFIG = cli.define_config_file("config", "configs/serve.py", "Serve config file (its workload is replayed).")
_BASE_URL = flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "The server's OpenAI base URL.")
_MODEL = flags.DEFINE_string("model", "", "Model name to send ('' = the server's first /v1/models entry).")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    import openai  # noqa: PLC0415 (optional serve extra)
    try:
        cfg = serve_config_from_dict(to_plain_dict(_CONFIG.value))
        workload = make_workload(cfg.workload, seed=cfg.seed)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from e
    try:
        model = _MODEL.value or openai.OpenAI(base_url=_BASE_URL.value, api_key="none").models.list().data[0].id
    except openai.APIConnectionError as e:
        raise cli.UserError(f"no server at --base_url={_BASE_URL.value}: {e}") from e
    summary = replay_summary(_BASE_URL.value, model, workload, cfg.slo.as_dict())
    print(json.dumps({"base_url": _BASE_URL.value, "model": model, "client": summary}, indent=1, default=str))


if __name__ == "__main__":
    cli.run(main)
