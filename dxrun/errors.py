"""The one exception type for bad user input."""


class ConfigError(ValueError):
    """A config value dxrun cannot run with. Its message names the key, the value and the fix;
    the launcher prints it as one line and exits non-zero, without a traceback."""
