"""Faults for the checkpoint writer process: each function here runs in it (through
`writer_process.shared().call`), where the `Checkpointer`'s writes happen."""

from __future__ import annotations

import atexit
import errno
import time

import orbax.checkpoint as ocp

from haiku_state.checkpoint import checkpointer

_REAL = {"write": checkpointer.Checkpointer._write, "async_save": None}


def slow_writes(delay_s: float, log: str, fail_step: int | None = None) -> None:
    """Each write waits `delay_s` and notes `start <step>` and `end <step>` in the file `log`;
    step `fail_step`'s fails with an input/output error."""

    def write(self, encoded, metadata_item):
        _note(log, f"start {encoded.step}")
        try:
            time.sleep(delay_s)
            if encoded.step == fail_step:
                raise OSError(errno.EIO, "Input/output error", f"step {encoded.step}")
            _REAL["write"](self, encoded, metadata_item)
        finally:
            _note(log, f"end {encoded.step}")

    checkpointer.Checkpointer._write = write


def full_disk() -> None:
    """Orbax's array writes fail as TensorStore's do when the disk is full."""

    def disk_full(*args, **kwargs):
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database')

    _REAL["async_save"] = _REAL["async_save"] or ocp.StandardCheckpointHandler.async_save
    ocp.StandardCheckpointHandler.async_save = disk_full


def no_faults() -> None:
    """Writes as the library makes them again."""
    checkpointer.Checkpointer._write = _REAL["write"]
    if _REAL["async_save"] is not None:
        ocp.StandardCheckpointHandler.async_save = _REAL["async_save"]


def raise_unpicklable(message: str) -> None:
    """Raises an error that cannot be rebuilt from its pickle (its `__init__` takes two)."""
    raise _TwoArgumentError(message, "extra")


def arrays_equal(arrays: dict, expected_repr: str) -> None:
    """Raises if `arrays` (received by the writer) do not print as `expected_repr`."""
    if repr(arrays) != expected_repr:
        raise AssertionError(f"received {arrays!r}")


def note_at_exit(log: str) -> None:
    """The child notes `exit` in the file `log` if its interpreter's clean-up runs."""
    atexit.register(_note, log, "exit")


class _TwoArgumentError(Exception):
    def __init__(self, message: str, extra: str):
        super().__init__(f"{message} ({extra})")


def _note(log: str, line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")
