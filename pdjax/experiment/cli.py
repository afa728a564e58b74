"""What every absl entry point in experiments/ shares: quiet logs and one-line user errors.

    from pdjax.experiment import cli
    ...
    if __name__ == "__main__":
        cli.run(main)

- Quiet: absl logs at WARNING unless --verbosity / -v is given, so the INFO chatter of orbax, absl and JAX
  (checkpoint steps, "Unable to initialize backend 'tpu'") stays out of the output; our tables, progress bars
  and warnings remain.
- One line per user error: a bad --config override (a typo'd key, a value of the wrong type) or a `UserError`
  raised by main prints `error: ...` on stderr and exits with status 2, never a traceback. Anything else is a
  bug and keeps its traceback.
"""
from __future__ import annotations

import ast
import logging as py_logging
import sys
from typing import Callable, NoReturn, Optional

from absl import app, flags, logging

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in what the user asked for (a bad key, value or path); printed as one line."""


def one_line(error: BaseException) -> str:
    """The message of `error` on one line (ml_collections wraps its key errors in quotes and newlines)."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    text = (str(error.args[0]) if len(error.args) == 1 else str(error)).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":   # ml_collections: repr of a KeyError's text
        try:
            text = str(ast.literal_eval(text))
        except (SyntaxError, ValueError):
            text = text[1:-1]
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def fail(error: BaseException | str) -> NoReturn:
    print(f"error: {error if isinstance(error, str) else one_line(error)}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def quiet_logging() -> None:
    """absl and Python logging at WARNING unless the user asked for a verbosity."""
    if not flags.FLAGS["verbosity"].present:    # -v is the same flag
        logging.set_verbosity(logging.WARNING)
    py_logging.getLogger().setLevel(max(py_logging.WARNING, logging.get_absl_logger().getEffectiveLevel()))
    for noisy in ("jax._src.xla_bridge", "absl", "orbax", "orbax.checkpoint"):
        py_logging.getLogger(noisy).setLevel(py_logging.WARNING)


def define_config_file(name: str, default: Optional[str], help_string: str):
    """config_flags.DEFINE_config_file, with a bad `--NAME.key=value` override reported as one line. (With a
    default file, ml_collections applies the overrides in sys.argv right here, at import, before `run`.)"""
    from ml_collections import config_flags  # noqa: PLC0415
    try:
        return config_flags.DEFINE_config_file(name, default, help_string)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        fail(f"bad command-line flag: {one_line(e)}")


def run(main: Callable) -> None:
    """app.run(main) with quiet logs and one-line user errors (see the module docstring)."""
    started = []

    def wrapped(argv):
        started.append(True)
        quiet_logging()
        try:
            return main(argv)
        except UserError as e:
            fail(e)

    try:
        app.run(wrapped)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        if started:
            raise
        fail(f"bad command-line flag: {one_line(e)}")   # raised while absl parsed a --config override
