"""Tests of haiku_state.checkpoint.writer_process: the child that writes checkpoints, its
arrays passed intact, its errors raised in the parent, its signals and its end."""

import errno
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest
import writer_faults

from haiku_state.checkpoint import writer_process
from haiku_state.checkpoint.writer_process import WriterProcess, WriterProcessLost


@pytest.fixture
def writer():
    writer = WriterProcess()
    yield writer
    writer.close()


def _arrays() -> dict:
    return {
        "bfloat16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "strided": np.arange(10, dtype=np.int64)[::3],
        "scalar": np.array(7, dtype=np.uint32),
        "empty": np.zeros((0, 5), np.float16),
        "step": 3,
    }


def test_arrays_cross_as_raw_buffers_and_arrive_intact():
    ours, theirs = multiprocessing.Pipe()
    sent = _arrays()
    writer_process._send(ours, sent)
    header, buffers = writer_process._receive(theirs)
    received = pickle.loads(header, buffers=buffers)
    assert repr(received) == repr(sent)
    for name in ("bfloat16", "fortran", "strided", "scalar", "empty"):
        assert received[name].dtype == sent[name].dtype
        np.testing.assert_array_equal(received[name], sent[name])


def test_a_call_runs_in_the_child_and_its_error_is_raised_here(writer, tmp_path):
    writer.call(writer_faults.arrays_equal, _arrays(), repr(_arrays()))
    assert writer.pid not in (None, os.getpid())
    with pytest.raises(AssertionError, match="received") as raised:
        writer.call(writer_faults.arrays_equal, _arrays(), "something else")
    assert "In the checkpoint writer process:" in "".join(raised.value.__notes__)
    with pytest.raises(FileNotFoundError) as raised:
        writer.call(os.rmdir, str(tmp_path / "missing"))
    assert raised.value.errno == errno.ENOENT  # An OSError keeps its errno.
    with pytest.raises(RuntimeError, match=r"_TwoArgumentError: unpicklable \(extra\)"):
        writer.call(writer_faults.raise_unpicklable, "unpicklable")
    writer.call(time.sleep, 0)  # The same child goes on.


def test_a_child_killed_during_a_call_is_one_error_and_the_next_call_starts_another(writer):
    writer.call(time.sleep, 0)
    first = writer.pid
    threading.Timer(0.5, os.kill, (first, signal.SIGKILL)).start()
    with pytest.raises(
        WriterProcessLost, match=rf"pid {first}\) was killed by signal 9 during sleep"
    ):
        writer.call(time.sleep, 30)
    writer.call(time.sleep, 0)
    assert writer.pid != first


def test_the_child_ignores_the_signals_sent_to_the_run(writer):
    writer.call(time.sleep, 0)
    child = writer.pid
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        os.kill(child, signum)
    writer.call(time.sleep, 0.2)
    assert writer.pid == child


def test_the_child_exits_with_its_parent_even_one_killed_outright(tmp_path):
    parent = textwrap.dedent(
        """
        import os, signal, time
        from haiku_state.checkpoint import writer_process
        writer = writer_process.WriterProcess()
        writer.call(time.sleep, 0)
        print(writer.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    child = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # A zombie has exited.
    except FileNotFoundError:
        return False


def test_close_ends_the_child(writer):
    writer.call(time.sleep, 0)
    child = writer.pid
    writer.close()
    assert not _alive(child) and writer.pid is None
    writer.call(time.sleep, 0)  # Started again when called.
    assert writer.pid != child


def test_a_closed_child_ends_at_once_without_the_interpreter_clean_up(writer, tmp_path):
    # Which the parent's exit would wait for: 0.4 s on a CPU, more on a TPU host.
    log = tmp_path / "log"
    writer.call(writer_faults.note_at_exit, str(log))
    writer.close()
    assert not log.exists()


def test_the_child_imports_from_this_process_path_whatever_its_characters(writer, tmp_path):
    odd = tmp_path / "odd: path, 'quoted' and ü"
    odd.mkdir()
    (odd / "odd_module_for_the_writer.py").write_text(
        "import sys\n\ndef check(expected):\n    assert sys.path[0] == expected, sys.path[:2]\n"
    )
    sys.path.insert(0, str(odd))
    try:
        import odd_module_for_the_writer

        writer.call(odd_module_for_the_writer.check, str(odd))
    finally:
        sys.path.remove(str(odd))
        sys.modules.pop("odd_module_for_the_writer", None)


def test_a_function_the_child_cannot_import_is_an_error_here_and_the_child_goes_on(
    writer, tmp_path
):
    writer.call(time.sleep, 0)  # Started with this path, before the module's folder joins it.
    child = writer.pid
    (tmp_path / "module_only_here.py").write_text("def nothing():\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import module_only_here

        with pytest.raises(ModuleNotFoundError, match="module_only_here"):
            writer.call(module_only_here.nothing)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("module_only_here", None)
    writer.call(time.sleep, 0)
    assert writer.pid == child


def test_a_forked_copy_of_a_process_writes_through_a_child_of_its_own():
    script = textwrap.dedent(
        """
        import os, time
        from haiku_state.checkpoint import writer_process
        parent = writer_process.shared()
        parent.call(time.sleep, 0)
        read, write = os.pipe()
        if os.fork() == 0:
            ours = writer_process.shared()
            ours.call(time.sleep, 0)  # Not over the parent's socket.
            os.write(write, f"{ours is parent} {ours.pid}".encode())
            os._exit(0)
        os.close(write)
        print(os.read(read, 100).decode(), parent.pid, flush=True)
        parent.call(time.sleep, 0)  # The parent's child still answers the parent.
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    same, fork_child, parent_child = result.stdout.split()
    assert same == "False" and fork_child != parent_child
