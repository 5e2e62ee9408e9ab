"""User-facing errors.

Everything a user can get wrong (a config field, a data file, a model path) raises a subclass of
:class:`FedsliceError`. The CLI prints such errors as one clear message and exits with code 2,
without a traceback; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class FedsliceError(Exception):
    """Base class for errors caused by user input (config, data, model, CLI usage)."""


class ConfigError(FedsliceError):
    """An experiment config is invalid: the message names the field and the value."""


class DataError(FedsliceError):
    """A data source is missing or malformed: the message names the file, column or row."""


class ModelError(FedsliceError):
    """A model cannot be loaded or is not supported (unknown path, unsupported architecture)."""
