"""User-facing errors: one line naming the field and the fix.

The CLI prints them without a traceback and exits 2.
"""


class UserError(Exception):
    """Base class for mistakes in user input (config, data paths, mesh). Exit code 2 in the CLI."""


class ConfigError(UserError):
    """A config file or KEY=VALUE override that does not parse or does not validate."""


class DataError(UserError):
    """A dataset that cannot be read (missing path, no text, too small for the batch)."""
