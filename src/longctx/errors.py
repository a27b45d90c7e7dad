"""Errors the user can act on. Stages print them without a traceback and exit non-zero."""


class LongctxError(Exception):
    """Base class: the message names the file or key at fault and what to do."""


class ConfigError(LongctxError):
    """A params key is unknown, has the wrong type or an impossible value."""


class DataError(LongctxError):
    """An input file is missing, corrupt, or cannot yield what the stage needs."""


class WorkspaceBusy(LongctxError):
    """A pipeline run holds the workspace (io.PIPELINE_LOCK)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `kill`'s stop), raised where the process is: it unwinds like
    Ctrl-C, so every cleanup a stage has for an interrupt runs, and runs end KILLED."""
