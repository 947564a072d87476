"""Tests of haiku_state.guards.orphans: a spawned worker exits soon after its parent is killed."""

import os
import signal
import subprocess
import sys
import time

from process_helpers import running

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# How long a worker may take to notice, on a loaded machine; it checks every 0.25 s.
GONE_WITHIN_S = 20

# The parent spawns a worker and is killed while the worker is still importing: the
# worker imports this file again (as `python -m haiku_state.train`'s import
# `haiku_state.train`), and so `haiku_state`, then takes forever with the rest.
_PARENT = """
import multiprocessing, os, signal, sys, time

if __name__ == "__mp_main__":
    import haiku_state  # noqa: F401
    open(sys.argv[1] + ".imported", "w").close()
    time.sleep(600)  # As if its other imports took ten minutes.

def work():
    time.sleep(600)

if __name__ == "__main__":
    worker = multiprocessing.get_context("spawn").Process(target=work, daemon=True)
    worker.start()
    with open(sys.argv[1], "w") as f:
        f.write(str(worker.pid))
    while not os.path.exists(sys.argv[1] + ".imported"):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_exits_soon_after_its_parent_is_killed_while_it_still_imports(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    pid_file = tmp_path / "worker.pid"
    env = dict(os.environ, PYTHONPATH=REPO)
    parent = subprocess.run([sys.executable, str(script), str(pid_file)], env=env, timeout=300)
    assert parent.returncode == -signal.SIGKILL
    worker = int(pid_file.read_text())
    killed_at = time.monotonic()
    try:
        while running(worker) and time.monotonic() < killed_at + GONE_WITHIN_S:
            time.sleep(0.1)
        assert not running(worker), f"the worker still runs {GONE_WITHIN_S} s after its parent"
    finally:
        if running(worker):
            os.kill(worker, signal.SIGKILL)
