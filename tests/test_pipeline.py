"""Tests of haiku_state.data.pipeline: grain's workers decoding ImageFolder batches.

The batches are a pure function of `(seed, step)` and each example's place in the
global batch: the same for 0, 1 or 2 workers, for 1 process or 2, resumed or not.
Most tests decode in-process (`workers=0`, which runs the same code); the worker
tests start real worker processes.
"""

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import pytest
from grain.multiprocessing import SharedMemoryArray
from image_trees import CORRUPTIONS, add_corrupt_file, write_imagefolder
from process_helpers import running

from haiku_state import data, replication
from haiku_state.data import order, pipeline
from haiku_state.guards import corrupt_images

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMAGE_SIZE = 16
NUM_DEVICES = 4


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("tree") / "with spaces", per_class=(7, 3))


@pytest.fixture(scope="module")
def dataset(tree):
    return data.load_dataset("imagefolder", data_dir=tree, image_size=IMAGE_SIZE)


def _plain(batch):
    """Host copies, so no batch keeps grain's shared memory alive."""
    return {name: np.array(leaf) for name, leaf in batch.items()}


def _train(split, batch_size=6, *, steps=4, **kwargs):
    kwargs.setdefault("workers", 0)
    batches = pipeline.encoded_train_batches(split, batch_size, seed=3, num_steps=steps, **kwargs)
    return [_plain(batch) for batch in batches]


def _assert_same_batches(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_train_batches_are_uint8_crops_with_the_labels_of_the_order(dataset):
    batches = _train(dataset.train, steps=5)
    split_order = order.batch_order(21, 6, 3)
    for step, batch in enumerate(batches):
        assert batch["image"].shape == (6, IMAGE_SIZE, IMAGE_SIZE, 3)
        assert batch["image"].dtype == np.uint8 and batch["label"].dtype == np.int32
        indices = order.step_indices(split_order, step)
        expected = [dataset.train.records[i][1] for i in indices]
        np.testing.assert_array_equal(batch["label"], expected)
    # Random crops: the same example gets another crop at another step.
    assert len({b["image"].tobytes() for b in batches}) == 5


def test_workers_0_1_and_2_decode_identical_batches_with_a_corrupt_file(tmp_path):
    root = write_imagefolder(tmp_path / "tree", per_class=(4, 2))
    add_corrupt_file(root, "truncated")
    split = data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).train
    runs = {
        workers: _train(split, steps=6, start_step=1, workers=workers, skip_corrupt=True)
        for workers in (0, 1, 2)
    }
    assert sum(float(b["replaced"].sum()) for b in runs[0]) > 0  # The corrupt file was met.
    _assert_same_batches(runs[1], runs[0])
    _assert_same_batches(runs[2], runs[0])


@pytest.mark.parametrize("process_count", [2, 3])
def test_each_process_decodes_its_slice_of_the_global_batch(dataset, process_count):
    global_batches = _train(dataset.train, steps=3, start_step=2)
    per_process = [
        _train(dataset.train, steps=3, start_step=2, process=data.ProcessSlice(p, process_count))
        for p in range(process_count)
    ]
    for step, expected in enumerate(global_batches):
        for name in expected:
            got = np.concatenate([batches[step][name] for batches in per_process])
            np.testing.assert_array_equal(got, expected[name], err_msg=name)


@pytest.mark.parametrize("start_step", [1, 3, 4])
def test_resuming_at_a_step_sees_the_batches_of_an_uninterrupted_run(dataset, start_step):
    # 21 examples in batches of 6: 3 steps per epoch, so steps 3 and 4 are in epoch 1.
    uninterrupted = _train(dataset.train, steps=start_step + 3)[start_step:]
    _assert_same_batches(_train(dataset.train, steps=3, start_step=start_step), uninterrupted)


def test_train_batches_of_an_encoded_split_are_the_host_batches_on_the_devices(dataset):
    expected = _train(dataset.train, batch_size=8, steps=2)
    options = data.PipelineOptions(workers=0)
    batches = data.train_batches(dataset.train, 8, seed=3, num_steps=2, options=options)
    for want, batch in zip(expected, batches, strict=True):
        for name, leaf in batch.items():
            assert leaf.sharding == replication.device_axis_sharding()
            assert leaf.shape == (NUM_DEVICES, 2, *want[name].shape[1:])
            np.testing.assert_array_equal(np.asarray(leaf), want[name].reshape(leaf.shape))


def test_train_batches_of_an_encoded_split_stack_each_calls_host_batches(dataset):
    # A resume at step 1 with 2 steps a call: calls of 1, 2 and (num_steps=4) 1 step.
    expected = _train(dataset.train, batch_size=8, steps=4, start_step=1)
    options = data.PipelineOptions(workers=1)
    batches = data.train_batches(
        dataset.train, 8, seed=3, start_step=1, num_steps=4, options=options, steps_per_call=2
    )
    calls = [expected[:1], expected[1:3], expected[3:]]
    for want, batch in zip(calls, batches, strict=True):
        for name, leaf in batch.items():
            per_device = [w[name].reshape(NUM_DEVICES, 2, *w[name].shape[1:]) for w in want]
            np.testing.assert_array_equal(np.asarray(leaf), np.stack(per_device, axis=1))
    batches.close()


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_evaluation_covers_every_example_once_on_any_process_count(dataset, process_count):
    # 9 examples in global batches of 4: the third is padded with 3 masked copies.
    per_process = [
        [
            _plain(b)
            for b in pipeline.encoded_eval_batches(
                dataset.test, 4, process=data.ProcessSlice(p, process_count), workers=0
            )
        ]
        for p in range(process_count)
    ]
    assert all(len(batches) == 3 for batches in per_process)
    labels, masks, images = (
        np.concatenate([b[name] for step in zip(*per_process, strict=True) for b in step])
        for name in ("label", "mask", "image")
    )
    records = dataset.test.records
    np.testing.assert_array_equal(labels[masks == 1], [records[i][1] for i in range(9)])
    assert masks.sum() == 9 and images.shape[1:] == (IMAGE_SIZE, IMAGE_SIZE, 3)
    # Evaluation crops are the centre: the same every pass.
    again = [_plain(b) for b in pipeline.encoded_eval_batches(dataset.test, 4, workers=0)]
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in again]), images)


def _first_step_holding(split, index, batch_size=6):
    split_order = order.batch_order(len(split.records), batch_size, 3)
    return next(s for s in range(100) if index in order.step_indices(split_order, s))


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_an_unreadable_image_stops_naming_the_file_and_the_step(tmp_path, kind):
    root = write_imagefolder(tmp_path / "tree", per_class=(5, 2))
    path = add_corrupt_file(root, kind)
    split = data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).train
    index = next(i for i in range(len(split.records)) if split.records.describe(i) == path)
    step = _first_step_holding(split, index)
    with pytest.raises(data.CorruptImageError) as error:
        _train(split, steps=step + 1)
    message = str(error.value)
    assert path in message and f"for step {step + 1}:" in message
    assert "skip_corrupt=True" in message


def test_skip_corrupt_replaces_an_unreadable_image_by_the_next_example(tmp_path):
    root = write_imagefolder(tmp_path / "tree", per_class=(5, 2))
    path = add_corrupt_file(root, "random-bytes")
    split = data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).train
    index = next(i for i in range(len(split.records)) if split.records.describe(i) == path)
    step = _first_step_holding(split, index)
    batch = _train(split, steps=step + 1, skip_corrupt=True)[step]
    indices = list(order.step_indices(order.batch_order(16, 6, 3), step))
    position = indices.index(index)
    np.testing.assert_array_equal(batch["replaced"], np.eye(6)[position])
    assert batch["label"][position] == split.records[index + 1][1]
    again = _train(split, steps=step + 1, skip_corrupt=True)[step]
    np.testing.assert_array_equal(again["image"], batch["image"])


def test_evaluation_with_skip_corrupt_masks_the_unreadable_image_out(tmp_path):
    root = write_imagefolder(tmp_path / "tree", per_class=(2, 2))
    path = add_corrupt_file(root, "zero-bytes", split="val")
    split = data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).test
    with pytest.raises(data.CorruptImageError, match=f"{path}.*in evaluation"):
        list(pipeline.encoded_eval_batches(split, 4, workers=0))
    batches = [
        _plain(b) for b in pipeline.encoded_eval_batches(split, 4, workers=0, skip_corrupt=True)
    ]
    masks = np.concatenate([b["mask"] for b in batches])
    assert masks.sum() == len(split.records) - 1


def _with_unreadable(root, count, split="train"):
    for i in range(count):
        with open(os.path.join(root, split, "dog", f"unreadable_{i}.jpg"), "wb") as f:
            f.write(b"")
    return data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE)


def test_skip_corrupt_stops_once_more_than_max_corrupt_fraction_of_an_epoch_is_unreadable(
    tmp_path, caplog
):
    root = write_imagefolder(tmp_path / "tree", per_class=(5, 2))
    split = _with_unreadable(root, 8).train  # 8 of 23.
    with pytest.raises(data.CorruptImageError) as error:
        _train(split, steps=3, skip_corrupt=True)
    message = str(error.value)
    assert "training images read in epoch 1 (up to step" in message
    assert "config.data.max_corrupt_fraction=0.001 of the epoch's 18 allows (1)" in message
    assert os.path.join(root, "train", "dog", "unreadable_") in message
    # A ceiling the data is within: it trains on, logging the first few unreadable images
    # and not a line for each.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        batches = _train(split, steps=6, skip_corrupt=True, max_corrupt_fraction=0.5)
    replaced = sum(int(b["replaced"].sum()) for b in batches)
    logged = [r for r in caplog.records if "replacing unreadable" in r.getMessage()]
    assert replaced > len(logged) == corrupt_images.LOGGED_IN_FULL


def test_an_unreadable_evaluation_image_is_named_as_one_and_counted_when_skipped(tmp_path, caplog):
    root = write_imagefolder(tmp_path / "tree", per_class=(2, 2))
    split = _with_unreadable(root, 2, split="val").test
    with pytest.raises(data.CorruptImageError) as error:
        list(pipeline.encoded_eval_batches(split, 4, workers=0))
    assert "to leave unreadable evaluation images out" in str(error.value)
    assert "training" not in str(error.value)
    with caplog.at_level(logging.WARNING):
        list(pipeline.encoded_eval_batches(split, 4, workers=0, skip_corrupt=True))
    assert "Evaluation left out 2 unreadable of this process's 8 images" in caplog.text


def test_default_workers_leave_a_core_to_the_training_loop(dataset, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert data.default_workers() == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert data.default_workers() == 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert data.default_workers() == 0
    with pytest.raises(ValueError, match="workers must be >= 0"):
        pipeline.encoded_train_batches(dataset.train, 4, seed=0, workers=-1)


def test_a_decoding_worker_leaves_ctrl_c_hangups_and_sigterm_to_the_training_process():
    # Ctrl-C, a closed terminal's hangup and the SIGTERM of `timeout`, Slurm or systemd reach
    # the whole process group; a worker that raised KeyboardInterrupt would print its
    # traceback beside the training process's orderly stop, one that a hangup killed would
    # fail the run, and one that SIGTERM killed left its batches' shared memory behind (the
    # resource tracker said "There appear to be 4 leaked shared_memory objects").
    # The worker starts with the default handlers whatever this process inherited (a job a
    # shell started in the background ignores SIGINT from its start).
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "from haiku_state.data import pipeline\n"
        "pipeline.exit_with_parent(0, 1)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.1)\n"
        "print('still here')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "still here" in result.stdout, result.stderr


_WORKERS_TO_THE_END = """
import gc, os, sys
from grain.multiprocessing import SharedMemoryArray
from haiku_state import data
from haiku_state.data import pipeline

def run(root):
    split = data.load_dataset("imagefolder", data_dir=root, image_size=16).train
    batches = pipeline.encoded_train_batches(split, 6, seed=3, num_steps=3, workers=2)
    kept = [next(batches)]  # Still held at the exit, as a prefetch queue holds batches.
    batches.close()  # Early, with batches in flight.
    held = {id(leaf) for batch in kept for leaf in batch.values()}
    alive = [o for o in gc.get_objects() if isinstance(o, SharedMemoryArray) and id(o) not in held]
    print(f"arrays of the closed pipeline still to release: {len(alive)}", flush=True)
    batches = pipeline.encoded_train_batches(split, 6, seed=3, num_steps=40, workers=1)
    try:
        kept += list(batches)
    except data.CorruptImageError as e:  # The run's error; the exit holds its traceback.
        names = [batch["image"].shm.name for batch in kept]
        there = [name for name in names if os.path.exists(os.path.join("/dev/shm", name))]
        sys.exit(f"stopped: {type(e).__name__}; of the batches held, in /dev/shm: {there}")

if __name__ == "__main__":
    run(sys.argv[1])
"""


def test_no_run_leaves_shared_memory_behind_on_success_or_error(tmp_path):
    # grain unlinked each batch's shared memory when its array was deleted, in a thread the
    # exit did not wait for, and the arrays a closed pipeline held only once a collection
    # found them: the resource tracker said "There appear to be 4 leaked shared_memory objects".
    root = write_imagefolder(tmp_path / "tree", per_class=(5, 2))
    add_corrupt_file(root, "truncated")
    result = _run_script(tmp_path / "to_the_end.py", _WORKERS_TO_THE_END, root)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "stopped: CorruptImageError; of the batches held, in /dev/shm: []" in result.stderr
    _assert_no_shared_memory_left(result)


def _run_script(script, source: str, root: str) -> subprocess.CompletedProcess:
    """Runs `source` as the file `script`, on the image tree `root`, in a process of its own."""
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(
        [sys.executable, str(script), root], env=env, capture_output=True, text=True, timeout=120
    )


def _assert_no_shared_memory_left(result: subprocess.CompletedProcess) -> None:
    """The script released every array's shared memory, and its exit reported none leaked."""
    assert "arrays of the closed pipeline still to release: 0" in result.stdout
    assert "leaked" not in result.stderr and "resource_tracker" not in result.stderr, result.stderr[
        -3000:
    ]
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]


class _SlowToFinalize:
    """Garbage whose finalizer holds the collection that frees it open for `seconds`."""

    def __init__(self, seconds):
        self.seconds, self.cycle = seconds, self

    def __del__(self):
        time.sleep(self.seconds)


class _Freed:
    """Garbage in a reference cycle that says when a collection frees it."""

    def __init__(self, event):
        self.event, self.cycle = event, self

    def __del__(self):
        self.event.set()


@contextlib.contextmanager
def _only_explicit_collections():
    """No automatic collection frees the garbage a test makes before the one it means to."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _collecting_in_another_thread(seconds):
    _SlowToFinalize(seconds)
    collecting = threading.Thread(target=gc.collect)
    collecting.start()
    time.sleep(0.2)  # In the finalizer: until it returns, `gc.collect()` here does nothing.
    return collecting


def test_the_collection_after_closing_runs_while_another_thread_collects():
    # `gc.collect()` returns at once while another thread collects (a prefetching thread
    # closes the pipeline while the training loop collects): the closed pipeline's arrays,
    # in grain's reference cycles, waited for a later collection.
    freed = threading.Event()
    with _only_explicit_collections():
        collecting = _collecting_in_another_thread(seconds=1.0)
        _Freed(freed)
        pipeline._collect_garbage()
        assert freed.is_set()
        collecting.join()


def test_only_grains_thread_closes_the_shared_memory_of_the_arrays_a_close_frees(monkeypatch):
    # Freed by the collection, an array's shared memory object was closed by its finalizer in
    # this thread while grain's thread closed it: the close that lost ("Bad file descriptor")
    # skipped the unlink, and the tracker said "There appear to be 1 leaked shared_memory objects".
    SharedMemoryArray.enable_async_del()
    SharedMemoryArray._del_thread_pool.apply_async(time.sleep, (0.3,))  # Busy as it closes.
    found_open = []
    finalize = shared_memory.SharedMemory.__del__

    def noting_finalize(shm):
        if shm._fd >= 0:
            found_open.append(shm.name)
        finalize(shm)

    monkeypatch.setattr(shared_memory.SharedMemory, "__del__", noting_finalize)
    with _only_explicit_collections():
        array = SharedMemoryArray((4,), np.uint8)
        array.unlink_on_del()  # As grain marks the arrays it receives.
        name, cycle = array.shm.name, [array]
        cycle.append(cycle)
        del array, cycle
        pipeline._wait_for_shared_memory_release()
    assert name not in found_open
    assert not os.path.exists(os.path.join("/dev/shm", name))


_CLOSED_WHILE_COLLECTING = """
import gc, sys, threading, time
from grain.multiprocessing import SharedMemoryArray
from haiku_state import data
from haiku_state.data import pipeline

class SlowToFinalize:
    def __init__(self):
        self.cycle = self

    def __del__(self):
        time.sleep(2.5)

def run(root):
    split = data.load_dataset("imagefolder", data_dir=root, image_size=16).train
    batches = pipeline.encoded_train_batches(split, 6, seed=3, num_steps=3, workers=2)
    kept = [next(batches)]
    time.sleep(2.0)  # The workers' last batches and their ends reach this process.
    SlowToFinalize()
    collecting = threading.Thread(target=gc.collect)
    collecting.start()
    time.sleep(0.2)  # In the finalizer.
    batches.close()
    held = {id(leaf) for batch in kept for leaf in batch.values()}
    alive = [o for o in gc.get_objects() if isinstance(o, SharedMemoryArray) and id(o) not in held]
    print(f"arrays of the closed pipeline still to release: {len(alive)}", flush=True)
    del alive
    collecting.join()

if __name__ == "__main__":
    run(sys.argv[1])
"""


def test_a_pipeline_closed_while_another_thread_collects_leaves_no_shared_memory(tmp_path):
    # The arrays left in grain's reference cycles outlived the close: the exit's collection
    # freed them after `multiprocessing` had stopped grain's releasing thread, and the
    # resource tracker said "There appear to be 4 leaked shared_memory objects".
    root = write_imagefolder(tmp_path / "tree", per_class=(5, 2))
    result = _run_script(tmp_path / "closed_while_collecting.py", _CLOSED_WHILE_COLLECTING, root)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_no_shared_memory_left(result)


_ORPHAN = """
import multiprocessing, os, sys, time

def worker(parent_pid):
    while os.getppid() == parent_pid:  # Still starting when its parent is killed.
        time.sleep(0.05)
    from haiku_state.data import pipeline
    pipeline.exit_with_parent(0, 1)
    time.sleep(600)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=worker, args=(os.getpid(),))
    child.start()
    with open(sys.argv[1], "w") as f:
        f.write(str(child.pid))
    os._exit(0)  # As if killed: nothing stops the child.
"""


def test_a_worker_whose_parent_died_while_it_started_exits(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    env = dict(os.environ, PYTHONPATH=REPO)
    pid_file = tmp_path / "child.pid"
    subprocess.run([sys.executable, str(script), str(pid_file)], env=env, check=True)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    try:
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(child), "the orphaned worker is still running"
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_a_small_evaluation_is_decoded_in_process_whatever_the_workers(dataset):
    # Workers start anew for every pass, in seconds; 9 images decode in milliseconds.
    expected = [_plain(b) for b in pipeline.encoded_eval_batches(dataset.test, 4, workers=0)]
    with contextlib.closing(pipeline.encoded_eval_batches(dataset.test, 4, workers=2)) as batches:
        got = [_plain(next(batches))]
        assert multiprocessing.active_children() == []
        got += [_plain(b) for b in batches]
    _assert_same_batches(got, expected)
    assert pipeline.eval_workers(pipeline.IN_PROCESS_EVAL_EXAMPLES, 2) == 0
    assert pipeline.eval_workers(pipeline.IN_PROCESS_EVAL_EXAMPLES + 1, 2) == 2
