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
