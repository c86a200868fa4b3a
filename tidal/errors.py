"""User-facing errors.

A TidalError carries one line that names what is wrong (the file, tensor, field or flag) and what to
do about it. The CLI prints it without a traceback and exits non-zero; the HTTP server turns it into a
4xx response. Anything else that escapes is a bug in Tidal.
"""


class TidalError(Exception):
    """An error caused by the user's input or machine, with a message meant to be read by them."""


class CheckpointError(TidalError):
    """A model directory, config or weight file that Tidal cannot use."""


class ConfigError(TidalError):
    """A bad option value, flag or configuration field."""


class RequestError(TidalError):
    """A request that cannot be served as asked (bad parameter, prompt too long, ...)."""
