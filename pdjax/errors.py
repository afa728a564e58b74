"""The one exception type for a mistake in what the user asked for (no imports: every layer may raise it).

`UserError`: a config value, a path, a file's contents, or a combination of settings that cannot run, detected
anywhere (config validation, loading a checkpoint or trace, building an engine or a simulator setup, the start of
a run). The entry points (pdjax.experiment.cli) print it as one line `error: ...` and exit with status 2; any
other exception is a bug and keeps its traceback. It is a ValueError, so code that catches ValueError for bad
input keeps working.
"""


class UserError(ValueError):
    """A mistake in what the user asked for (a bad key, value, path, file or combination); printed as one line."""
