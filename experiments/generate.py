"""Offline greedy generation: python -m experiments.generate --checkpoint=DIR|SPEC --prompts=FILE.json
--max_new_tokens=N --out=OUT.json [--chunk_size=C] [--dump_logits=PATH.npy]

    python -m experiments.generate --checkpoint=checkpoints/tiny-hf --prompt="What is assert?" --chat \
        --max_new_tokens=32 --out=/tmp/gen.json

Prompts: a JSON list of token-id lists, or --prompt texts (repeatable) tokenized with the checkpoint's tokenizer
(--chat: each one user message under its chat template). OUT.json: {"tokens": [[...], ...]} in prompt order,
written atomically; with --prompt also "prompt_tokens" and "texts" (each output's text up to its first EOS id).
--dump_logits: float32 [num_prompts, vocab] logits at each prompt's last position.
"""
from __future__ import annotations

import json
import pathlib

from absl import flags

from pdjax.experiment import cli
from pdjax.runtime.generate import run_generate

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "tiny-llama", "HF or orbax checkpoint directory, or a registry spec name.")
flags.DEFINE_string("prompts", None, "JSON file: a list of token-id lists.")
flags.DEFINE_multi_string("prompt", [], "A text prompt (repeatable), tokenized with the checkpoint's tokenizer.")
flags.DEFINE_bool("chat", False, "With --prompt: each prompt is a user message under the model's chat template.")
flags.DEFINE_integer("max_new_tokens", 16, "Greedy tokens to generate per prompt.", lower_bound=0)
flags.DEFINE_string("out", None, "Output JSON path ({'tokens': [[...], ...]}).")
flags.DEFINE_integer("chunk_size", 64, "Prefill chunk size in tokens.", lower_bound=1)
flags.DEFINE_integer("token_budget", 0, "Most tokens per step (0: chunk_size x prompts, capped at 512; else at "
                     "least chunk_size).", lower_bound=0)
flags.DEFINE_integer("page_size", 16, "KV cache page size in tokens.", lower_bound=1)
flags.DEFINE_string("dump_logits", None, "Optional .npy path for last-prompt-position logits.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Override params dtype.")
flags.DEFINE_enum("attention_impl", "auto", ["auto", "reference", "pallas"], "Attention implementation.")
# Every numeric flag is checked at parsing (lower_bound above, and this), so a bad value fails with one line
# naming the flag before any model is loaded.
flags.register_multi_flags_validator(
    ["token_budget", "chunk_size"], lambda f: f["token_budget"] == 0 or f["token_budget"] >= f["chunk_size"],
    message="--token_budget must be 0 (automatic) or >= --chunk_size")


def check_output_path(flag: str, path: str) -> None:
    """UserError unless `path` can be written as a file: not a directory, and no file where its parent
    directories would go (those are created)."""
    target = pathlib.Path(path)
    if target.is_dir():
        raise cli.UserError(f"--{flag}={path!r} is a directory; expected the path of a file to write")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise cli.UserError(f"--{flag}={path!r}: {str(parent)!r} is a file, not a directory")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if bool(FLAGS.prompts) == bool(FLAGS.prompt) or not FLAGS.out:
        raise cli.UserError("--out and one of --prompts (a file of token ids) or --prompt (text) are required")
    check_output_path("out", FLAGS.out)             # before anything is loaded or generated
    if FLAGS.dump_logits:
        check_output_path("dump_logits", FLAGS.dump_logits)

    try:    # bad inputs found while loading: the prompts file, the checkpoint (missing, truncated), lengths
        tokens, _, runner = run_generate(
            FLAGS.checkpoint, FLAGS.prompts, FLAGS.max_new_tokens, FLAGS.out, chunk_size=FLAGS.chunk_size,
            token_budget=FLAGS.token_budget, page_size=FLAGS.page_size, dump_logits=FLAGS.dump_logits,
            dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl, texts=FLAGS.prompt, chat=FLAGS.chat)
    except (ValueError, OSError) as e:   # a bad prompts file or checkpoint: one line naming it
        raise cli.UserError(cli.one_line(e)) from None
    summary = {"out": FLAGS.out, "num_prompts": len(tokens), "compile_count": runner.compile_count}
    if FLAGS.prompt:
        summary["texts"] = json.loads(pathlib.Path(FLAGS.out).read_text())["texts"]
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    cli.run(main)
