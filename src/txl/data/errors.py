"""The one exception type of the data pipeline: a message that names the file, the line and what to do."""

from __future__ import annotations


class DataError(ValueError):
    """Bad or missing input data (the CLI prints the message alone, without a traceback)."""
