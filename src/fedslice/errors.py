"""User-facing errors.

Everything a user can get wrong (a config field, a data file, a model path) raises a subclass of
:class:`FedsliceError`. The CLI prints such errors as one clear message and exits with code 2,
without a traceback; an :class:`EnvironmentFault` (or an ``OSError``: a full disk, a read-only
folder) is one message and exit code 1; any other exception is a bug and keeps its traceback.
``fedslice --debug`` shows the traceback of every error.
"""

from __future__ import annotations

import errno

#: OSError numbers that are the machine's fault, not the input's: no permission, a read-only
#: file system, a full disk or quota
ENVIRONMENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})


class FedsliceError(Exception):
    """Base class for errors caused by user input (config, data, model, CLI usage)."""


class ConfigError(FedsliceError):
    """An experiment config is invalid: the message names the field and the value."""


class DataError(FedsliceError):
    """A data source is missing or malformed: the message names the file, column or row."""


class ModelError(FedsliceError):
    """A model cannot be loaded or is not supported (unknown path, unsupported architecture)."""


class EnvironmentFault(FedsliceError):
    """The machine, not the input, stopped the command: a full disk, a folder without write
    permission, a file that cannot be read. The CLI prints one line and exits with code 1."""
