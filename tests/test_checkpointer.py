"""Tests of haiku_state.checkpoint.checkpointer: saves and exact resume, async saves under
donation, the step directories, partial and damaged checkpoints set aside, never deleted."""

import asyncio
import errno
import gc
import importlib.metadata
import logging
import os
import re
import shutil
import signal
import sys
import time
import weakref

import jax
import pytest
import tensorstore as ts
import writer_faults
from checkpoint_helpers import (
    Setup,
    assert_bit_identical,
    at_step,
    damage,
    host_copy,
    largest_file,
    listing,
    make_jit_updater,
    make_setup,
    make_updater,
    save_steps,
    set_aside_dirs,
    step_dirs,
)
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

import haiku_state as hs
from benchmarks.compiles import CompileEvents
from haiku_state import checkpoint
from haiku_state.checkpoint import Checkpointer, step_format, writer_process
from haiku_state.guards import quiet_logs

# A failed read of a damaged file leaves Orbax callbacks scheduled on a closed asyncio loop;
# they surface as unraisable exceptions whenever garbage collection runs, in any later test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def setup() -> Setup:
    return make_setup()


def test_no_checkpoint_and_existing_steps_and_bad_metadata(setup, tmp_path):
    train_state = setup.init()
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.restore(train_state) is None
        assert checkpointer.latest_step() is None
        assert checkpointer.metadata() is None
        with pytest.raises(ValueError, match="replicated TrainState"):
            checkpointer.save(hs.unreplicate(train_state))
        with pytest.raises(TypeError, match="JSON-serialisable"):
            checkpointer.save(train_state, metadata={"seed": object()})
        checkpointer.save(train_state)
        checkpointer.wait_until_finished()
        before = listing(tmp_path)
        # A complete step is never rewritten: refused as Orbax refuses it, nothing touched.
        exists = f"Checkpoint step 0 already exists at {tmp_path / '0'}; a complete step is never"
        with pytest.raises(StepAlreadyExistsError, match=re.escape(exists)):
            checkpointer.save(train_state)
        assert listing(tmp_path) == before
        with pytest.raises(FileNotFoundError, match="step 5"):
            checkpointer.restore(train_state, step=5)
    with Checkpointer(tmp_path, read_only=True) as reader:
        with pytest.raises(PermissionError, match="read-only"):
            reader.save(at_step(train_state, 1))
    assert listing(tmp_path) == before


def test_complete_steps_only_looks(setup, tmp_path):
    assert checkpoint.complete_steps(tmp_path / "missing") == []
    assert not (tmp_path / "missing").exists()
    save_steps(tmp_path, [at_step(setup.init(), 3)])
    shutil.copytree(tmp_path / "3", tmp_path / "5.orbax-checkpoint-tmp")  # Killed mid-save.
    shutil.copytree(tmp_path / "3", tmp_path / "7")
    os.remove(tmp_path / "7" / "commit_success.txt")  # Never finished.
    before = listing(tmp_path)
    assert checkpoint.complete_steps(tmp_path) == [3]
    assert checkpoint.complete_steps(str(tmp_path)) == [3]
    assert listing(tmp_path) == before and step_dirs(tmp_path) == {"3", "7"}


# Resumption.


def test_resume_continues_bit_identically(setup, tmp_path):
    uninterrupted = host_copy(setup.train(setup.init(), setup.batches))

    first_half = setup.train(setup.init(), setup.batches[:3])
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(first_half)
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(setup.init(seed=7))
    assert int(restored.step[0]) == 3
    resumed = setup.train(restored, setup.batches[3:])

    assert_bit_identical(resumed, uninterrupted)


def test_a_save_where_device_get_copies_keeps_scalar_leaves(setup, tmp_path, monkeypatch):
    # On a GPU or TPU `device_get` gives host copies, not views: the step count of a
    # per-device state is then a scalar once its device axis is taken off, which
    # np.array(..., copy=False) refused ("Unable to avoid copy"): every save failed on a TPU.
    from haiku_state.checkpoint import step_format

    monkeypatch.setattr(step_format, "device_get_gives_views", lambda: False)
    train_state = setup.train(setup.init(), setup.batches[:2])
    expected = host_copy(train_state)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(train_state)
    with Checkpointer(tmp_path) as checkpointer:
        assert_bit_identical(checkpointer.restore(setup.init(seed=7)), expected)


def test_async_save_is_unaffected_by_donating_the_state_right_after(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:1])
    expected = host_copy(train_state)
    with Checkpointer(tmp_path, async_save=True) as checkpointer:
        checkpointer.save(train_state)
        donated = train_state
        train_state = setup.train(train_state, setup.batches[1:4])
        # The update really donated the buffers the save was given.
        assert jax.tree.leaves(donated.params)[0].is_deleted()
        assert donated.rng.is_deleted()
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(setup.init(seed=1), step=1)
    assert_bit_identical(restored, expected)


@pytest.mark.parametrize("backend", ["pmap", "jit"])
def test_a_save_and_a_restore_compile_no_program(tmp_path, backend):
    # A save's fingerprints are of its host copies: no program to compile in the loop's
    # thread (a large state's took seconds on a TPU, at the run's first save). A restore
    # reads and checks on the host and places the arrays as they are: no program either (a
    # resume compiled five: the fingerprints, the finite check and a broadcast per tree).
    # Widths no other test compiles for: a program compiled before would not count.
    updater = make_updater(24) if backend == "pmap" else make_jit_updater(width=264)
    setup = make_setup(updater)
    train_state = setup.train(setup.init(), setup.batches[:1])
    with CompileEvents() as events, Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(train_state)
    assert events.figures()["programs"] == 0, events.programs
    like = updater.abstract_init(setup.batches[0])  # As a resume reads into it.
    with CompileEvents() as events, Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(like)
    assert events.figures()["programs"] == 0, events.programs
    assert_bit_identical(restored, host_copy(train_state))
    for leaf, like_leaf in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert leaf.sharding == like_leaf.sharding


# Partial and damaged checkpoints.


def test_partial_checkpoints_are_never_loaded_and_unmarked_ones_are_moved_aside(setup, tmp_path):
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, 1)])
    # Killed mid-save: Orbax writes into `<step>.orbax-checkpoint-tmp` and renames it when done.
    shutil.copytree(tmp_path / "1", tmp_path / "5.orbax-checkpoint-tmp")
    # A step directory without Orbax's commit marker (e.g. an interrupted copy).
    shutil.copytree(tmp_path / "1", tmp_path / "7")
    os.remove(tmp_path / "7" / "commit_success.txt")
    unmarked = listing(tmp_path / "7")

    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1]
        assert checkpointer.latest_step() == 1
        assert int(checkpointer.restore(train_state).step[0]) == 1
        # The unmarked directory is moved aside, so its step can be saved; the killed
        # save's step is redone.
        [moved] = set_aside_dirs(tmp_path, 7, "incomplete")
        assert listing(moved) == unmarked
        checkpointer.save(at_step(train_state, 7))
        checkpointer.save(at_step(train_state, 5))
        checkpointer.wait_until_finished()
        assert checkpointer.all_steps() == [1, 5, 7]
        assert int(checkpointer.restore(train_state).step[0]) == 7
    assert not (tmp_path / "5.orbax-checkpoint-tmp").exists()


@pytest.mark.parametrize("how", ["truncate", "delete", "overwrite"])
def test_damaged_latest_checkpoint_is_moved_aside_and_falls_back(setup, tmp_path, caplog, how):
    one_step = setup.train(setup.init(), setup.batches[:1])
    expected = host_copy(one_step)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(one_step)
        checkpointer.save(setup.train(one_step, setup.batches[1:2]))
    damage(largest_file(tmp_path / "2" / "train_state" / "d"), how)
    damaged = listing(tmp_path / "2")

    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        restored = checkpointer.restore(setup.init(seed=3))
    assert_bit_identical(restored, expected)
    [moved] = set_aside_dirs(tmp_path, 2)
    assert listing(moved) == damaged  # Renamed as it was, never deleted.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tmp_path / "2") in w and str(moved) in w for w in warnings), warnings


def test_a_damaged_final_step_is_saved_again(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:1])
    save_steps(tmp_path, [at_step(train_state, 1), at_step(train_state, 2)])
    damage(largest_file(tmp_path / "2" / "train_state" / "d"), "truncate")
    with Checkpointer(tmp_path) as checkpointer:
        assert int(checkpointer.restore(train_state).step[0]) == 1
        checkpointer.save(at_step(train_state, 2))  # Its number is free again.
        checkpointer.wait_until_finished()
        assert int(checkpointer.restore(train_state).step[0]) == 2


async def _fail_with(error: Exception) -> None:
    raise error


def test_the_leftovers_of_a_damaged_read_stay_quiet(setup, tmp_path, monkeypatch, caplog):
    reported = []  # What would be printed as "Exception ignored ..." tracebacks.
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, 1), at_step(train_state, 2)])
    damage(largest_file(tmp_path / "2" / "train_state" / "d"), "truncate")
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.DEBUG):
        assert int(checkpointer.restore(train_state).step[0]) == 1
        # What a failed read leaves in flight when Orbax closes its loop, whose timing
        # decides how much of it a real read leaves: a TensorStore read that completes
        # after the loop closed, and a read task that failed too, never retrieved.
        promise, late_read = ts.Promise.new()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        late_read.__await__()  # As awaiting it does: a callback to the loop once it is done.
        error = ValueError(f'Error reading local file "{tmp_path}/2/train_state/d/0"')
        failed = loop.create_task(_fail_with(error))
        loop.run_until_complete(asyncio.sleep(0))
        asyncio.set_event_loop(None)
        loop.close()
        promise.set_result(None)
        del failed
        gc.collect()
    assert reported == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "2") in warnings[0], warnings


def test_only_damaged_checkpoints_raise(setup, tmp_path):
    train_state = setup.init()
    save_steps(tmp_path, [train_state])
    os.remove(largest_file(tmp_path / "0" / "train_state" / "d"))
    with Checkpointer(tmp_path, read_only=True) as reader:
        with pytest.raises(ValueError, match="step 0 is damaged"):
            reader.restore(train_state, step=0)
        assert step_dirs(tmp_path) == {"0"}  # A reader moves nothing.
    # The refusal moves nothing, so it holds on every rerun until a person acts.
    for _ in range(2):
        with Checkpointer(tmp_path) as checkpointer:
            refused = r"damaged \(steps \[0\]\).*nothing was moved. To start from scratch, move"
            with pytest.raises(RuntimeError, match=f"Every complete .* {refused} them out"):
                checkpointer.restore(train_state)
        assert step_dirs(tmp_path) == {"0"} and not set_aside_dirs(tmp_path, 0)
    # Steps set aside as damaged (by an earlier version, or a fallback) and nothing
    # complete beside them: refused too, naming them.
    os.rename(tmp_path / "0", tmp_path / "0.damaged-20261204T000000Z")
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(RuntimeError, match=r"no complete checkpoint, only damaged steps set "
                           r"aside: 0.damaged-20261204T000000Z; refusing"):  # fmt: skip
            checkpointer.restore(train_state)
    # Moved out of the directory by a person: a fresh start.
    os.rename(tmp_path / "0.damaged-20261204T000000Z", tmp_path.parent / f"{tmp_path.name}-0")
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.restore(train_state) is None


def test_an_unreadable_step_item_is_damage(setup, tmp_path, caplog):
    # Its format version cannot be read, so it cannot be told apart from damage.
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, 1), at_step(train_state, 2)])
    (tmp_path / "2" / "step" / "metadata").write_text('{"format_version": 1, "ste')
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        assert int(checkpointer.restore(train_state).step[0]) == 1
    assert len(set_aside_dirs(tmp_path, 2)) == 1
    assert any("JSONDecodeError" in r.getMessage() for r in caplog.records)


def test_a_damaged_step_that_cannot_be_moved_aside_says_both(tmp_path, monkeypatch):
    from etils import epath

    from haiku_state.guards import damaged_steps

    def read_only(self, step, reason):
        raise OSError(errno.EROFS, "Read-only file system", str(self.step_dir(step)))

    monkeypatch.setattr(damaged_steps.StepDirectories, "set_aside", read_only)
    steps = damaged_steps.StepDirectories(epath.Path(tmp_path))
    with pytest.raises(OSError, match=r"/2 is damaged \(bad checksum\) and cannot be moved aside"):
        steps.set_aside_damaged(2, "bad checksum")


def test_a_full_disk_is_one_error_that_says_what_to_do(setup, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database')

    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        monkeypatch.setattr(checkpointer._manager, "save", full)
        with pytest.raises(OSError, match="No space left to write checkpoint step 0 .* free space"):
            checkpointer.save(setup.init())


@pytest.fixture
def writer():
    """The writer process, to run `writer_faults` in; it writes as made again afterwards."""
    writer = writer_process.shared()
    yield writer
    writer.call(writer_faults.no_faults)


def test_a_failed_background_write_is_raised_once_and_deletes_nothing(setup, tmp_path, writer):
    train_state = setup.init()
    with Checkpointer(tmp_path, max_to_keep=1) as checkpointer:
        checkpointer.save(at_step(train_state, 1))
        checkpointer.wait_until_finished()
        writer.call(writer_faults.full_disk)  # As TensorStore fails in the writer.
        checkpointer.save(at_step(train_state, 2))  # Returns: the write fails later.
        with pytest.raises(OSError, match="No space left to write checkpoint step 2 .* step 1"):
            checkpointer.wait_until_finished()
        checkpointer.wait_until_finished()  # Raised once.
        writer.call(writer_faults.no_faults)
        # Step 2 was never committed, and retention deleted nothing for it.
        assert checkpointer.all_steps() == [1] and not (tmp_path / "2").exists()
        checkpointer.save(at_step(train_state, 3))
    assert step_dirs(tmp_path) == {"3"}


def _writes(log) -> list[str]:
    return log.read_text().split("\n")[:-1] if log.exists() else []


def test_a_save_returns_before_its_write_and_close_waits_for_it(setup, tmp_path, writer):
    train_state = setup.init()
    log = tmp_path / "writes.log"
    writer.call(writer_faults.slow_writes, 2.0, str(log))
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    start = time.perf_counter()
    checkpointer.save(at_step(train_state, 1))
    assert time.perf_counter() - start < 1.5  # Not the write's 2 s.
    assert checkpointer.all_steps() == []  # Still being written, in the writer process.
    checkpointer.close()  # Waits for the write.
    assert checkpoint.complete_steps(tmp_path / "checkpoints") == [1]
    assert _writes(log) == ["start 1", "end 1"]


def test_one_write_at_a_time_and_its_error_is_raised_by_the_next_save(setup, tmp_path, writer):
    train_state = setup.init()
    log = tmp_path / "writes.log"
    writer.call(writer_faults.slow_writes, 0.2, str(log), 2)
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(at_step(train_state, 1))
        checkpointer.save(at_step(train_state, 2))  # Waits for step 1's write; 2's fails.
        with pytest.raises(OSError, match="Input/output error"):
            checkpointer.save(at_step(train_state, 3))  # Raised here; step 3 is not saved.
        checkpointer.save(at_step(train_state, 3))  # Raised once.
        checkpointer.wait_until_finished()
        assert checkpointer.all_steps() == [1, 3]
    # Each write ran alone, in the order saved.
    assert _writes(log) == ["start 1", "end 1", "start 2", "end 2", "start 3", "end 3"]


def test_a_writer_killed_mid_save_loses_only_that_step(setup, tmp_path, writer):
    train_state = setup.init()
    writer.call(writer_faults.slow_writes, 1.0, str(tmp_path / "writes.log"))
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(at_step(train_state, 1))
        checkpointer.wait_until_finished()
        checkpointer.save(at_step(train_state, 2))
        time.sleep(0.5)  # Inside step 2's write.
        os.kill(writer.pid, signal.SIGKILL)
        with pytest.raises(writer_process.WriterProcessLost, match="killed by signal 9"):
            checkpointer.wait_until_finished()
        checkpointer.wait_until_finished()  # Raised once.
        assert checkpointer.all_steps() == [1]
        checkpointer.save(at_step(train_state, 3))  # A new writer, without the slow writes.
    assert checkpoint.complete_steps(tmp_path / "checkpoints") == [1, 3]
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        restored = checkpointer.restore(setup.init(seed=7))
        assert_bit_identical(restored, at_step(train_state, 3))
    assert set_aside_dirs(tmp_path / "checkpoints", 2, "incomplete") == []


def test_a_writing_checkpointer_starts_the_writer_and_a_reader_does_not(tmp_path):
    writer = writer_process.shared()
    writer.close()
    with Checkpointer(tmp_path, read_only=True), Checkpointer(tmp_path, async_save=False):
        assert writer.pid is None
    with Checkpointer(tmp_path):  # Its imports overlap the run's start, before any save.
        assert writer.pid is not None


def test_the_leftovers_of_a_failed_read_stay_quiet_after_the_step_is_read_again(tmp_path, caplog):
    step_dir = str(tmp_path / "2")
    with pytest.raises(ValueError):
        with quiet_logs.failed_read_kept_quiet(step_dir):
            raise ValueError("damaged")
    with quiet_logs.failed_read_kept_quiet(step_dir):  # Saved again, read whole.
        pass
    # The first read's task, never retrieved, freed only now (at a later collection).
    error = ValueError(f'Error reading "params" in OCDBT database at "{step_dir}/train_state/"')
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logging.getLogger("asyncio").error(
            "Task exception was never retrieved", exc_info=(ValueError, error, None)
        )
    assert caplog.records == []


def test_a_save_reads_no_package_metadata(setup, tmp_path, monkeypatch):
    step_format.package_versions.cache_clear()
    with Checkpointer(tmp_path, async_save=False) as checkpointer:  # Reads them, once.

        def no_reading(name):
            raise AssertionError(f"read {name}'s metadata in a save")

        monkeypatch.setattr(importlib.metadata, "version", no_reading)
        checkpointer.save(setup.init())
    assert checkpoint.complete_steps(tmp_path) == [0]


def test_this_process_lets_its_host_copy_go_once_the_writer_has_it(
    setup, tmp_path, writer, monkeypatch
):
    log = tmp_path / "writes.log"
    writer.call(writer_faults.slow_writes, 2.0, str(log))
    copies = []

    def encode(train_state):
        encoded = real_encode(train_state)
        copies.extend(weakref.ref(leaf) for leaf in jax.tree.leaves(encoded.trees))
        return encoded

    real_encode = step_format.encode
    monkeypatch.setattr(step_format, "encode", encode)
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(setup.init())
        deadline = time.monotonic() + 60
        while _writes(log) != ["start 0"] and time.monotonic() < deadline:
            time.sleep(0.05)  # Until the writer has the arrays, inside its slow write.
        gc.collect()
        assert copies and not any(copy() is not None for copy in copies)
        assert _writes(log) == ["start 0"]  # Still writing.
    assert checkpoint.complete_steps(tmp_path / "checkpoints") == [0]
