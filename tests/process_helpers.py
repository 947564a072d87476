"""What tests of processes share: whether a process still runs; code stuck in native code,
and a SIGTERM sent to a process stuck there."""

import signal
import subprocess
import textwrap
import time
from collections.abc import Callable


def running(pid: int) -> bool:
    """Whether process `pid` runs (exists, and is not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def stuck_in_native_code(said: str, indent: str = "") -> str:
    """Python lines that print `said`, then block in native code no signal interrupts (a
    mutex locked twice), as a wait for a device that never answers does; `indent`ed."""
    lines = (
        "import ctypes\n"
        "mutex, libc = ctypes.create_string_buffer(64), ctypes.CDLL(None)\n"
        "libc.pthread_mutex_lock(mutex)\n"
        f"print({said!r}, flush=True)\n"
        "libc.pthread_mutex_lock(mutex)\n"
    )
    return textwrap.indent(lines, indent)


def sigterm_once_stuck(
    process: subprocess.Popen, wait_until_stuck: Callable[[], None]
) -> tuple[tuple[str, str], float]:
    """SIGTERMs `process` once `wait_until_stuck` has returned (it has printed what
    `stuck_in_native_code` says) and it is in the second lock; its output and error once ended
    (killed past 30 s, or if the wait fails), and the seconds from the signal to its end."""
    try:
        wait_until_stuck()
        time.sleep(0.5)  # Into the second lock (a signal before it is taken, and recorded).
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        outputs = process.communicate(timeout=30)
    finally:
        process.kill()
    return outputs, time.monotonic() - sent
