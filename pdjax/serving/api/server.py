"""Serve one config's deployment over HTTP until SIGTERM / SIGINT, then write the run's result files.

    serve(config, workdir, host="127.0.0.1", port=8000)

Start-up: the config is validated and the workdir readied as for experiments.serve (pdjax.experiment.run.
prepare_experiment: a bad key, value or path raises pdjax.errors.UserError before anything compiles), then the HTTP
server starts at once (/health answers 503 "starting") while the engine thread builds, warms up and serves
(pdjax.serving.run.run_real with the bridge as its `online` front end: the same build path, warm-up and result
files as experiments.serve). /health turns 200 once warm-up is done.

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting connections and gives the in-flight requests
server.drain_timeout_s to finish (streams keep streaming); those still running then are ended by the bridge
(EngineBridge.end_all): a stream gets a last chunk with finish_reason "abort" and `data: [DONE]`, a whole answer its
text so far with finish_reason "abort", and the engine aborts them. A signal during warm-up stops the warm-up after
the shape being compiled (nothing served, no result files). The engine run ends and writes config.json,
results.json, requests.csv, token_times.csv, iterations.csv, outputs.json and the plots for every request the server
handed to the engine (the aborted ones as 'aborted'), under results.json's "server" block the address and model
name. Returns the run's summary.
A failure of the engine thread ends the server and is raised here (the requests in flight get an error).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Dict

import uvicorn

from pdjax.errors import UserError
from pdjax.experiment.run import prepare_experiment
from pdjax.serving.api.app import create_app
from pdjax.serving.api.bridge import EngineBridge
from pdjax.serving.online import WarmupCancelled
from pdjax.workload.chat_template import ChatTemplateError, compile_template
from pdjax.workload.tokenizer import TokenizerError, load_tokenizer

SWITCH_INTERVAL_S = 0.0005
END_GRACE_S = 5.0   # after the drain deadline: time for the ended requests to send their last chunk and [DONE]


class EngineFailed(RuntimeError):
    """The engine thread raised; the original exception is the __cause__."""


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, calling `on_stop()` at the first SIGTERM / SIGINT (before uvicorn starts draining)."""

    def __init__(self, config: uvicorn.Config, on_stop):
        super().__init__(config)
        self._on_stop = on_stop

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._on_stop()
        super().handle_exit(sig, frame)


def _stopper(bridge: EngineBridge, drain_timeout_s: float):
    """What the first signal does: before warm-up ended, close the source (warm-up stops); after, end every live
    request `drain_timeout_s` later (EngineBridge.end_all) unless it finished by then."""
    def on_stop() -> None:
        if not bridge.ready.is_set():
            bridge.shutdown()
            return
        timer = threading.Timer(drain_timeout_s, bridge.end_all)
        timer.daemon = True
        timer.start()
    return on_stop


def checked_tokenizer(checkpoint: str):
    """The checkpoint's tokenizer (None: token ids only) with its chat template compiled; a bad tokenizer file or
    one that disagrees with the model is a one-line UserError, before anything compiles."""
    try:
        tokenizer = load_tokenizer(checkpoint)
        if tokenizer is not None and tokenizer.chat_template:
            compile_template(tokenizer.chat_template)
    except (TokenizerError, ChatTemplateError) as e:
        raise UserError(f"model.checkpoint={checkpoint!r}: {e}") from None
    return tokenizer


def model_name_of(cfg) -> str:
    return cfg.server.model_name or os.path.basename(os.path.normpath(cfg.model.checkpoint))


def serve(config: Any, workdir: str, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          announce=print) -> Dict[str, Any]:
    prep = prepare_experiment(config, workdir)
    cfg = prep.cfg
    if cfg.backend != "real":
        raise UserError(f"backend={cfg.backend!r}: the API server serves the real engine (backend='real')")
    name = model_name_of(cfg)
    tokenizer = checked_tokenizer(cfg.model.checkpoint)
    bridge = EngineBridge(max_queued=cfg.server.max_queued_requests)
    app = create_app(bridge, model_name=name, eos_token_id=cfg.model.eos_token_id, tokenizer=tokenizer)
    drain_s = cfg.server.drain_timeout_s
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                            timeout_graceful_shutdown=drain_s + END_GRACE_S),
                             _stopper(bridge, drain_s))
    extra = {"server": {"host": host, "port": port, "model_name": name,
                        "max_queued_requests": cfg.server.max_queued_requests}}
    outcome: Dict[str, Any] = {}

    class Online:    # run_real's front end: the bridge, announcing readiness
        source, on_token = bridge.source, bridge.on_token

        @staticmethod
        def attach(engine):
            bridge.attach(engine)
            announce(f"serving {name!r} at http://{host}:{port}/v1 (max_model_len {bridge.max_model_len}; "
                     f"SIGTERM or Ctrl-C stops and writes the results to {workdir})")
            sys.stdout.flush()

    def engine_thread():
        from pdjax.serving.run import run_real  # noqa: PLC0415 (loads JAX; this module is JAX-free)
        try:
            outcome["summary"] = run_real(cfg, prep.config, workdir, workload=[], extra=extra, online=Online)
        except WarmupCancelled as e:
            outcome["cancelled"] = str(e)
            server.should_exit = True
        except BaseException as e:  # noqa: BLE001  (reported by serve() in the main thread)
            outcome["error"] = e
            bridge.fail(f"{type(e).__name__}: {e}")
            server.should_exit = True

    # The engine thread and the event loop share the GIL: a thread that wants it back (the engine after a step)
    # waits at most this long for the other to yield (CPython's default is 5 ms, a whole step of the tiny model).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    thread = threading.Thread(target=engine_thread, name="pdjax-engine", daemon=True)
    # uvicorn re-raises the signal it caught once it has stopped; a no-op handler keeps the process alive for
    # the results (the engine thread still has to end and write them).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        thread.start()
        server.run()
        bridge.shutdown()          # nothing new; whatever is still live is aborted
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "cancelled" in outcome:
        announce(outcome["cancelled"])
    if "error" in outcome:
        raise EngineFailed(f"the engine failed: {outcome['error']}") from outcome["error"]
    return outcome.get("summary", {})
