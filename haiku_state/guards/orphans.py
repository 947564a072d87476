"""Processes a run starts exit when the process that started them is killed.

A process killed outright (`kill -9`, the OOM killer) cannot stop its decoding workers, which
would wait on a queue nobody reads, holding their memory. A worker watches its parent from
`haiku_state/__init__.py` (`guard_spawned_child`), before slow imports, and once grain
initialises it, through the pipe `multiprocessing` gives each child.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time

CHECK_S = 0.25  # How often a watching thread checks that the parent is still there.
_SPAWNED_FLAG = "--multiprocessing-fork"  # The last argument of every spawned process.


def exit_with_parent(parent_pid: int | None = None) -> None:
    """Exits this process (status 1) within `CHECK_S` of its parent's end: the parent is
    `multiprocessing.parent_process()` once set up, before that `parent_pid` (default:
    `os.getppid()` at this call, which is already init's if the parent died first)."""
    parent = multiprocessing.parent_process()
    parent_pid = os.getppid() if parent_pid is None else parent_pid

    def alive() -> bool:
        return parent.is_alive() if parent is not None else os.getppid() == parent_pid

    def watch() -> None:
        while alive():
            time.sleep(CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit_with_parent", daemon=True).start()


def guard_spawned_child() -> None:
    """`exit_with_parent` if `multiprocessing` spawned this process; nothing otherwise."""
    if sys.orig_argv[-1:] == [_SPAWNED_FLAG]:
        exit_with_parent()
