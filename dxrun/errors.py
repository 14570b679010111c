"""The one exception type for bad user input."""


class ConfigError(ValueError):
    """A config value dxrun cannot run with. Its message names the key, the value and the fix;
    the launcher prints it as one line and exits non-zero, without a traceback."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient under ``train.nan_policy=halt``. Its message names the step
    and the last good checkpoint; the launcher prints it as one line and exits 1."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message cut to its first line: what a crash shows in one line."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


class NothingToTrain(Exception):  # noqa: N818 - an outcome, not a failure
    """A relaunch whose ``train.steps`` the checkpoint has already reached: the launcher says so
    in one line and exits 0, leaving the run's files as they are (or, for a run that reached
    its end but was stopped before recording it, records it). ``checkpoint``: the step dir,
    ``meta`` its meta."""

    def __init__(self, message: str, checkpoint: object = None, meta: dict | None = None):
        super().__init__(message)
        self.checkpoint, self.meta = checkpoint, meta or {}


class CheckpointReadError(RuntimeError):
    """A checkpoint that could not be read for a reason other than damage (an I/O error, out
    of memory): the run stops with one line and the checkpoint is left as it is."""
