"""What tests of processes share: whether a process still runs; code stuck in native code."""

import textwrap


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
