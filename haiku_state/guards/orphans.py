"""Processes a run starts exit when the process that started them is killed.

A process killed outright (`kill -9`, the kernel's OOM killer) runs no code of
its own: it cannot stop the decoding workers it started, which would wait on a
queue nobody reads, holding their memory (about 240 MB each), until something
noticed. `exit_with_parent` starts a daemon thread that checks every `CHECK_S`
whether the parent is still there and exits this process once it is not.

A worker calls it twice. First when `multiprocessing` spawns it: the worker
imports the parent's main module (`haiku_state.train`), and so this package,
before anything else, and `haiku_state/__init__.py` calls
`guard_spawned_child` before its own imports, which with grain's take seconds
(tens of seconds on a loaded machine): a parent killed then is noticed at
once. Then when grain initialises the worker (`pipeline.exit_with_parent`),
through the pipe `multiprocessing` gives each child, which also tells of a
parent that died before the first check began.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time

# How often a watching thread checks that the parent is still there.
CHECK_S = 0.25
# The last argument of every process `multiprocessing` spawns (`spawn.get_command_line`).
_SPAWNED_FLAG = "--multiprocessing-fork"


def exit_with_parent() -> None:
    """Exits this process (status 1) within `CHECK_S` of its parent's end.

    The parent is `multiprocessing.parent_process()` once `multiprocessing` has
    set it up (its pipe closes when the parent dies, even before this call);
    before that, the process `os.getppid()` names at this call.
    """
    parent = multiprocessing.parent_process()
    parent_pid = os.getppid()

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
