"""The errors this package raises on purpose: refusals whose message says what is wrong.

Each is a `Refused` and the builtin it stands for (`except ValueError` still catches an
`InvalidValue`). The command line prints a `Refused` as one line; any other error is
unexpected and keeps its traceback (`train.py`).
"""

from __future__ import annotations


class Refused(Exception):
    """An error raised on purpose: its message is all a user needs, no traceback."""


class InvalidValue(Refused, ValueError):
    """A value refused: a config key, an argument, data or a checkpoint that does not fit."""


class MissingFile(Refused, FileNotFoundError):
    """A file, folder or checkpoint that is not there."""


class CannotWrite(Refused, OSError):
    """A file or folder that cannot be written: a full disk, no permission."""


class CannotContinue(Refused, RuntimeError):
    """A run that cannot go on as it is (every checkpoint damaged, a run that ended worse)."""


class NonFinite(Refused, FloatingPointError):
    """A loss or params no longer finite: the run diverged."""
