"""The one exception type for a mistake in what the user asked for (no pdjax imports: every layer may raise it).

`UserError`: a config value, a path, a file's contents, or a combination of settings that cannot run, detected
anywhere (config validation, loading a checkpoint or trace, building an engine or a simulator setup, the start of
a run). The entry points (pdjax.experiment.cli) print it as one line `error: ...` and exit with status 2; any
other exception is a bug and keeps its traceback. It is a ValueError, so code that catches ValueError for bad
input keeps working. `user_errors()` marks a phase whose every ValueError / OSError is the input's (validating a
config, building from it before anything runs).
"""
import contextlib


class UserError(ValueError):
    """A mistake in what the user asked for (a bad key, value, path, file or combination); printed as one line."""


@contextlib.contextmanager
def user_errors():
    """Re-raise a ValueError or OSError raised inside as a UserError (its message; the original as __cause__).
    Only around code whose inputs are the user's and that runs nothing yet, so a bug elsewhere keeps its type."""
    try:
        yield
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)) from e
    except ValueError as e:
        raise UserError(str(e)) from e
