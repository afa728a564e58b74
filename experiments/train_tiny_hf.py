"""Train `tiny-hf` (pdjax.models.tiny_hf): a byte-level BPE tokenizer and a tiny Llama on the pydoc topics text,
saved as an HF model directory with a ChatML chat template.

    python -m experiments.train_tiny_hf --out=checkpoints/tiny-hf [--steps=N --vocab_size=V --seed=S]

Prints one JSON object on stdout (losses in nats/token, sizes, greedy chat samples through pdjax's own serving
path); progress goes to stderr. Deterministic from --seed (up to XLA float reduction order). The committed
checkpoints/tiny-hf is this command with its defaults (numbers in experiments/README.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
from absl import flags

from pdjax.experiment import cli
from pdjax.models import tiny_hf
from pdjax.models import train as tr

_OUT = flags.DEFINE_string("out", "checkpoints/tiny-hf", "output HF model directory")
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "BPE vocabulary size (special tokens included)", lower_bound=300)
_STEPS = flags.DEFINE_integer("steps", 500, "optimizer steps", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 16, "windows per step", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "tokens per window", lower_bound=2)
_LR = flags.DEFINE_float("lr", 3e-3, "peak learning rate")
_SEED = flags.DEFINE_integer("seed", 0, "init and batch-order seed")
_LOG_EVERY = flags.DEFINE_integer("log_every", 25, "steps between progress lines", lower_bound=1)
_QUESTIONS = ("What is assert?", "What is a class?")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    train_cfg = tr.TrainConfig(steps=_STEPS.value, batch=_BATCH.value, seq_len=_SEQ_LEN.value, lr=_LR.value,
                               warmup_steps=min(30, _STEPS.value - 1), seed=_SEED.value, log_every=_LOG_EVERY.value)
    cfg = tiny_hf.TinyHFConfig(vocab_size=_VOCAB.value, train=train_cfg)
    start = time.perf_counter()

    def log(step, loss):
        print(f"step {step}/{train_cfg.steps}  train loss {loss:.4f} nats/token  {time.perf_counter() - start:.0f}s",
              file=sys.stderr, flush=True)

    built = tiny_hf.build(cfg, on_log=log)
    jax.block_until_ready(built["params"])
    train_s = time.perf_counter() - start
    spec = built["spec"]
    val = tr.evaluate(built["params"], built["val_ids"], spec, seq_len=min(train_cfg.seq_len, 128))
    tiny_hf.save(_OUT.value, spec, built["params"], built["tokenizer"])
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(_OUT.value) for f in fs)
    samples = tiny_hf.greedy_chat_samples(_OUT.value, _QUESTIONS, max_new_tokens=48)
    print(json.dumps({
        "spec": spec.name, "num_params": spec.num_params(), "vocab_size": spec.vocab_size,
        "train_config": dataclasses.asdict(train_cfg), "train_tokens": int(len(built["train_ids"])),
        "val_tokens": int(len(built["val_ids"])), "train_loss_last_log": built["history"][-1][1],
        "val_loss_nats_per_token": val["loss"], "val_accuracy": val["accuracy"], "train_wall_s": round(train_s, 1),
        "checkpoint": _OUT.value, "checkpoint_bytes": size, "greedy_chat_samples": samples,
        "history": built["history"],
    }, indent=1, default=lambda o: np.asarray(o).tolist()))


if __name__ == "__main__":
    cli.run(main)
