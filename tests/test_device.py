"""Tests of haiku_state.data.device: prefetching onto the devices, device-resident batches."""

import itertools
import threading
import time

import jax
import numpy as np
import pytest
from toy_splits import toy_split

from benchmarks.compiles import CompileEvents
from haiku_state import data, replication
from haiku_state.data import batches as batches_lib
from haiku_state.data import device as device_lib
from haiku_state.data import order

NUM_DEVICES = 4


# Prefetching onto devices.


def test_prefetch_to_device_yields_sharded_copies_of_the_host_batches():
    assert jax.local_device_count() == NUM_DEVICES
    split = toy_split(16)
    host_batches = list(batches_lib.host_eval_batches(split, 8))
    device_batches = list(device_lib.prefetch_to_device(iter(host_batches), size=2))
    assert len(device_batches) == len(host_batches)
    for host, device in zip(host_batches, device_batches, strict=True):
        assert set(device) == set(host)
        for name, leaf in device.items():
            assert isinstance(leaf, jax.Array)
            assert leaf.shape == (NUM_DEVICES, 2) + host[name].shape[1:]
            assert len(leaf.sharding.device_set) == NUM_DEVICES
            np.testing.assert_array_equal(np.asarray(leaf), host[name].reshape(leaf.shape))


def test_prefetch_to_device_reraises_an_error_of_the_source():
    def failing_source():
        yield next(batches_lib.host_eval_batches(toy_split(8), 8))
        raise RuntimeError("source failed")

    batches = device_lib.prefetch_to_device(failing_source())
    next(batches)
    with pytest.raises(RuntimeError, match="source failed"):
        next(batches)


def test_prefetch_to_device_reraises_an_error_of_shard():
    batches = device_lib.prefetch_to_device(batches_lib.host_eval_batches(toy_split(6), 6))
    with pytest.raises(ValueError, match="not divisible"):
        next(batches)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "prefetch_to_device"]


def test_prefetch_to_device_shards_ahead_before_the_first_next():
    pulled = threading.Event()

    def source():
        pulled.set()
        yield from batches_lib.host_eval_batches(toy_split(8), 8)

    batches = device_lib.prefetch_to_device(source())
    try:
        assert pulled.wait(10), "the source was not read until a batch was asked for"
        assert len(list(batches)) == 1
    finally:
        batches.close()


def test_prefetch_to_device_thread_stops_when_the_consumer_closes_early():
    before = len(_prefetch_threads())
    batches = device_lib.prefetch_to_device(
        batches_lib.host_train_batches(toy_split(16), 8, seed=0), size=1
    )
    next(batches)
    assert len(_prefetch_threads()) == before + 1
    batches.close()
    deadline = time.monotonic() + 5
    while len(_prefetch_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_prefetch_threads()) == before


# Device-resident batches.


@pytest.mark.parametrize(
    "start_step, steps_per_gather, process_index, process_count",
    [(0, 1, 0, 1), (3, 1, 0, 1), (0, 4, 0, 1), (3, 4, 0, 1), (3, 4, 1, 2), (3, None, 1, 2)],
)
def test_device_train_batches_are_the_train_batches_sharded_across_epochs(
    start_step, steps_per_gather, process_index, process_count
):
    # 2 steps per epoch of 8 per process: the steps below cross four epochs.
    batch_size = 8 * process_count
    split = toy_split(20 * process_count)
    process = data.ProcessSlice(process_index, process_count)
    host = batches_lib.host_train_batches(
        split, batch_size, seed=3, start_step=start_step, process=process
    )
    on_device = device_lib.device_train_batches(
        split,
        batch_size,
        seed=3,
        start_step=start_step,
        steps_per_gather=steps_per_gather,
        process=process,
    )
    for _ in range(7):
        expected, batch = next(host), next(on_device)
        assert set(batch) == set(expected)
        for name, leaf in batch.items():
            assert leaf.sharding == replication.device_axis_sharding()
            assert leaf.shape == (NUM_DEVICES, 2) + expected[name].shape[1:]
            np.testing.assert_array_equal(np.asarray(leaf), expected[name].reshape(leaf.shape))
    on_device.close()


def _stacked_host_calls(host, calls):
    """The host batches of each call, stacked per device: `[devices, steps, per_device, ...]`."""
    for steps in calls:
        batches = [next(host) for _ in range(steps)]
        per_device = [
            {k: v.reshape(NUM_DEVICES, -1, *v.shape[1:]) for k, v in b.items()} for b in batches
        ]
        yield {name: np.stack([b[name] for b in per_device], axis=1) for name in batches[0]}


@pytest.mark.parametrize(
    "start_step, num_steps, steps_per_call, steps_per_gather",
    [(0, 23, 5, None), (3, 20, 5, 16), (3, 9, 4, 1), (6, None, 3, 7), (1, 12, 2, 3)],
)
def test_device_train_batches_of_several_steps_a_call_stack_each_calls_batches(
    start_step, num_steps, steps_per_call, steps_per_gather
):
    # A call ends at the multiples of steps_per_call and after num_steps: a resume's first
    # call and a run's last are shorter, gathered in launches of their own.
    split = toy_split(20)
    calls = list(itertools.islice(order.call_lengths(start_step, num_steps, steps_per_call), 8))
    host = batches_lib.host_train_batches(split, 8, seed=3, start_step=start_step)
    on_device = device_lib.device_train_batches(
        split,
        8,
        seed=3,
        start_step=start_step,
        num_steps=num_steps,
        steps_per_gather=steps_per_gather,
        steps_per_call=steps_per_call,
    )
    got = list(itertools.islice(on_device, 8))
    assert len(got) == len(calls)
    for steps, expected, batch in zip(calls, _stacked_host_calls(host, calls), got, strict=True):
        for name, leaf in batch.items():
            assert leaf.sharding == replication.device_axis_sharding()
            assert leaf.shape[:3] == (NUM_DEVICES, steps, 2)
            np.testing.assert_array_equal(np.asarray(leaf), expected[name])
    if num_steps is not None and len(calls) < 8:
        assert next(on_device, None) is None  # Ended after num_steps.


def test_call_lengths_end_calls_at_multiples_and_after_the_steps():
    assert list(order.call_lengths(3, 11, 4)) == [1, 4, 4, 2]
    assert list(order.call_lengths(0, 8, 4)) == [4, 4]
    assert list(order.call_lengths(5, 0, 4)) == []
    assert list(itertools.islice(order.call_lengths(2, None, 1), 3)) == [1, 1, 1]
    with pytest.raises(ValueError, match="steps_per_call must be positive"):
        order.call_lengths(0, 8, 0)  # At the call, not at the first length.


def test_shard_steps_stacks_what_stack_steps_stacks_of_the_sharded_batches():
    host = list(itertools.islice(batches_lib.host_train_batches(toy_split(16), 8, seed=0), 3))
    stacked = replication.shard_steps(host)
    expected = replication.stack_steps([replication.shard(b) for b in host])
    for name in host[0]:
        assert stacked[name].sharding == expected[name].sharding
        np.testing.assert_array_equal(np.asarray(stacked[name]), np.asarray(expected[name]))
    on_devices = replication.shard_steps([jax.device_put(b) for b in host])  # Decoded there.
    for name in host[0]:
        assert on_devices[name].sharding == expected[name].sharding
        np.testing.assert_array_equal(np.asarray(on_devices[name]), np.asarray(expected[name]))
    with pytest.raises(ValueError, match="shard_steps: batch size B=6"):
        replication.shard_steps([{"image": np.zeros((6, 2))}])


def test_train_batches_prefetched_from_the_host_stack_each_calls_batches(monkeypatch):
    monkeypatch.setattr(device_lib, "DEVICE_RESIDENT_MAX_BYTES", 0)  # Gathered on the host.
    split = toy_split(20)
    prefetched = batches_lib.train_batches(
        split, 8, seed=3, start_step=3, num_steps=9, steps_per_call=4
    )
    host = batches_lib.host_train_batches(split, 8, seed=3, start_step=3)
    calls = [1, 4, 4]
    got = list(prefetched)
    assert [batch["label"].shape[1] for batch in got] == calls
    for expected, batch in zip(_stacked_host_calls(host, calls), got, strict=True):
        for name, leaf in batch.items():
            np.testing.assert_array_equal(np.asarray(leaf), expected[name])


def test_device_train_batches_refuse_what_train_batches_refuse_and_an_uneven_split():
    with pytest.raises(ValueError, match="between 1 and the 10 examples"):
        device_lib.device_train_batches(toy_split(10), 12, seed=0)
    with pytest.raises(ValueError, match="start_step"):
        device_lib.device_train_batches(toy_split(10), 4, seed=0, start_step=-1)
    with pytest.raises(ValueError, match="not divisible by the 4 local devices"):
        device_lib.device_train_batches(toy_split(10), 6, seed=0)
    with pytest.raises(ValueError, match="steps_per_gather"):
        device_lib.device_train_batches(toy_split(10), 4, seed=0, steps_per_gather=0)


def test_fits_on_device_counts_images_and_labels():
    split = toy_split(10)  # 10 * 4 float32 pixels + 10 int32 labels = 200 bytes.
    assert device_lib.fits_on_device(split, max_bytes=200)
    assert not device_lib.fits_on_device(split, max_bytes=199)


@pytest.mark.parametrize("num_examples, steps_per_call", [(37, 1), (39, 3)])
def test_the_gather_compiled_ahead_is_the_one_the_batches_run(num_examples, steps_per_call):
    """`compile_gather_ahead` from the shapes alone: no batch compiles, the last launch of a
    run (fewer calls than a launch holds: padded) included."""
    split = toy_split(num_examples)  # A size of its own: no other test compiled its gather.
    device_lib.compile_gather_ahead(split, 8, steps_per_call=steps_per_call)
    num_steps = 22 * steps_per_call  # 16 steps a launch: 5 calls of 3, 22 calls of 1.
    with CompileEvents() as events:
        batches = list(
            device_lib.device_train_batches(
                split, 8, seed=0, num_steps=num_steps, steps_per_call=steps_per_call
            )
        )
    assert not events.programs, events.programs
    assert len(batches) == 22
    steps = (steps_per_call,) if steps_per_call > 1 else ()
    assert batches[0]["image"].shape == (NUM_DEVICES, *steps, 2, 2, 2, 1)
