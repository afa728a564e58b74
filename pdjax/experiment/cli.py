"""What every absl entry point in experiments/ shares: quiet logs and one-line user errors.

    from pdjax.experiment import cli
    ...
    if __name__ == "__main__":
        cli.run(main)

- Quiet: absl logs at WARNING unless --verbosity / -v is given, so the INFO chatter of orbax, absl and JAX
  (checkpoint steps, "Unable to initialize backend 'tpu'") stays out of the output; our tables, progress bars
  and warnings remain.
- One line per user error: a bad flag or --config override (a typo'd key, a value of the wrong type or out of
  range: `parse_flags`) or a `UserError` (pdjax.errors; any layer raises it where it finds the mistake, and an
  entry point turns the ValueError of its config and build phase into one) raised by main prints `error: ...` on
  stderr and exits with status 2 at once (`fail`), never a traceback (nor absl's usage text, nor the "Event loop
  is closed" noise of a failed orbax read: `ignore_closed_loop_callbacks`); so is a --config file that cannot be
  read. Ctrl-C (SIGINT) ends the run with one line and status 130 (EXIT_INTERRUPTED). Anything else is a bug and
  keeps its traceback.
"""
from __future__ import annotations

import ast
import logging as py_logging
import sys
from typing import Callable, NoReturn, Optional

from absl import app, flags, logging
from ml_collections import config_flags

from pdjax import errors
from pdjax.procs import exit_now

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130   # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


# pdjax.errors.UserError: raised by any layer for a mistake in what the user asked for; printed as one line.
UserError = errors.UserError


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
    marker = "Traceback (most recent call last):"
    if marker in text:   # ml_collections puts the traceback of a config file's failed get_config in its message
        head, _, trace = text.partition(marker)
        text = f"{head.strip()} {trace.strip().splitlines()[-1]}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def fail(error: BaseException | str) -> NoReturn:
    """Print the one-line error and end the process with EXIT_USER_ERROR at once: without interpreter shutdown,
    where the threads of a failed orbax/TensorStore read print "Event loop is closed" tracebacks after our line
    (and a multi-process run would wait in jax's shutdown barrier)."""
    print(f"error: {error if isinstance(error, str) else one_line(error)}", file=sys.stderr)
    exit_now(EXIT_USER_ERROR)     # flushes; a multi-process run's processes leave in order (pdjax.procs)


def ignore_closed_loop_callbacks() -> None:
    """After a failed orbax read, TensorStore's pending reads still call back into the checkpointer's event loop,
    which the failure closed: each prints "RuntimeError: Event loop is closed" (an unraisable exception) around
    the one-line error the user should see. Drop exactly those; everything else goes to the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)
    sys.unraisablehook = hook


def quiet_logging() -> None:
    """absl and Python logging at WARNING unless the user asked for a verbosity."""
    if not flags.FLAGS["verbosity"].present:    # -v is the same flag
        logging.set_verbosity(logging.WARNING)
    py_logging.getLogger().setLevel(max(py_logging.WARNING, logging.get_absl_logger().getEffectiveLevel()))
    for noisy in ("jax._src.xla_bridge", "absl", "orbax", "orbax.checkpoint"):
        py_logging.getLogger(noisy).setLevel(py_logging.WARNING)
    # pdjax runs no asyncio of its own; orbax's reads that a failed restore abandons are logged by asyncio as
    # "Task exception was never retrieved" after the one-line error.
    py_logging.getLogger("asyncio").setLevel(py_logging.CRITICAL)


def define_config_file(name: str, default: Optional[str], help_string: str):
    """config_flags.DEFINE_config_file, with a bad `--NAME.key=value` override reported as one line. (With a
    default file, ml_collections applies the overrides in sys.argv right here, at import, before `run`.)"""
    try:
        return config_flags.DEFINE_config_file(name, default, help_string)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        fail(f"bad command-line flag: {one_line(e)}")


def flag_error_line(error: BaseException) -> str:
    """absl's text for a bad flag value, with Python's conversion jargon said plainly."""
    text = one_line(error)
    for jargon, plain in (("invalid literal for int() with base 10: ", "expected an integer, got "),
                          ("could not convert string to float: ", "expected a number, got ")):
        text = text.replace(jargon, plain)
    return text if text.startswith("flag --") else f"bad command-line flag: {text}"


def parse_flags(argv):
    """absl's flag parsing, with a bad value (wrong type, out of range, a failed validator) or a config file absl
    cannot load (its get_config raised, or it is not Python) reported as one `error:` line with status 2 instead
    of absl's "FATAL Flags parsing error" with status 1 (or a traceback)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(flag_error_line(e))
    except SyntaxError as e:    # a --config file that is not Python (ml_collections executes it)
        fail(f"bad command-line flag: config file {e.filename}:{e.lineno}: {e.msg}; expected a Python config file")


def run(main: Callable) -> None:
    """app.run(main) with quiet logs and one-line user errors (see the module docstring)."""
    started = []

    def wrapped(argv):
        started.append(True)
        quiet_logging()
        ignore_closed_loop_callbacks()
        try:
            return main(argv)
        except UserError as e:
            fail(e)
        except OSError as e:
            if "Failed loading config file" not in str(e):   # ml_collections reads --config when first used
                raise
            fail(f"bad command-line flag: --config: {str(e).strip().splitlines()[-1].strip()}")
        except KeyboardInterrupt:
            print("error: interrupted (SIGINT); this run's results are not written", file=sys.stderr)
            exit_now(EXIT_INTERRUPTED)

    try:
        app.run(wrapped, flags_parser=parse_flags)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        if started:
            raise
        fail(f"bad command-line flag: {one_line(e)}")   # raised while absl parsed a --config override
