"""Library noise kept off the terminal when the error it echoes is reported once, elsewhere.

Orbax closes its event loop as soon as one array read (or write) fails, while TensorStore has
others in flight: each then reports late, hundreds of lines of tracebacks. And the libraries'
INFO chatter.
"""

from __future__ import annotations

import contextlib
import functools
import logging as std_logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

_reading_or_failed: set[str] = set()  # Step directories, "<directory>/<step>/".
_failed: set[str] = set()  # Those a read failed in: its leftovers come whenever they are freed.
_next_unraisablehook: Any = None


def _drop_late_loop_callback(unraisable: Any) -> None:
    """`sys.unraisablehook`: drops a callback or coroutine that outlived its event loop."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        logging.debug("A late callback of a failed checkpoint read or write: %s", error)
        return
    _next_unraisablehook(unraisable)


def _is_not_a_failed_read_task(record: std_logging.LogRecord) -> bool:
    """A filter of asyncio's logger: drops the failed tasks of a failed checkpoint read."""
    error = record.exc_info[1] if record.exc_info else None
    text = str(error) if error is not None else ""
    return not any(step_dir in text for step_dir in _reading_or_failed)


def drop_late_loop_callbacks() -> None:
    """Drops the callbacks that outlive the event loop of a failed read or write; idempotent
    and process-wide (they come from other threads, later)."""
    global _next_unraisablehook
    if sys.unraisablehook is not _drop_late_loop_callback:
        _next_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _drop_late_loop_callback


@contextlib.contextmanager
def failed_read_kept_quiet(step_dir: str) -> Iterator[None]:
    """Around an Orbax read under `step_dir`: should it fail, its leftovers stay quiet."""
    drop_late_loop_callbacks()
    asyncio_logger = std_logging.getLogger("asyncio")
    if _is_not_a_failed_read_task not in asyncio_logger.filters:
        asyncio_logger.addFilter(_is_not_a_failed_read_task)
    step_dir = f"{step_dir}/"
    _reading_or_failed.add(step_dir)
    try:
        yield
    except BaseException:
        _failed.add(step_dir)
        raise
    finally:
        if step_dir not in _failed:  # A later read of a step saved again leaves it quiet.
            _reading_or_failed.discard(step_dir)


def _is_not_a_read_only_note(record: std_logging.LogRecord) -> bool:
    """Orbax's warning that a directory is read only: evaluation opens it so on purpose."""
    return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def read_only_note_kept_quiet() -> Iterator[None]:
    """Around opening a read-only Checkpointer: Orbax's note that it is stays off the log."""
    absl_logger = std_logging.getLogger("absl")
    absl_logger.addFilter(_is_not_a_read_only_note)
    try:
        yield
    finally:
        absl_logger.removeFilter(_is_not_a_read_only_note)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def keep_the_log_to_this_package() -> None:
    """Keeps the log to this package's lines and the libraries' warnings and errors, but
    Orbax's "read only" note and its tracebacks of a failed write (the Checkpointer reports it
    in one line); with a short prefix: the level, the time and the module."""

    def keep(record) -> bool:
        if os.path.abspath(record.pathname).startswith(_PACKAGE_DIR):
            return True
        if "/orbax/" in record.pathname and (
            record.exc_info or not _is_not_a_read_only_note(record)
        ):
            return False
        return record.levelno >= std_logging.WARNING

    logging.get_absl_handler().addFilter(keep)
    short = std_logging.Formatter("%(levelname).1s %(asctime)s %(module)s] %(message)s", "%H:%M:%S")
    logging.get_absl_handler().setFormatter(short)
    threading.excepthook = functools.partial(_thread_error, threading.excepthook)


def _thread_error(previous: Callable[[Any], None], args: Any) -> None:
    """tensorboardX's writer thread failing on a full disk: one line, not its traceback (the
    run's own error is the one to read); any other thread's as before."""
    if type(args.thread).__name__ == "_EventLoggerThread" and issubclass(args.exc_type, OSError):
        logging.warning("TensorBoard events cannot be written: %s", args.exc_value)
        return
    previous(args)
