"""Tests of haiku_state.data.order, through the host batches of `data.batches`.

The batch order is a pure function of `(seed, step)`: resumable at any step,
each process its slice of every global batch, evaluation padded and masked.
"""

import jax
import numpy as np
import pytest
from toy_splits import take, toy_split

from haiku_state import data
from haiku_state.data import batches as batches_lib

# Training batches.


def test_steps_per_epoch_drops_the_remainder():
    assert data.steps_per_epoch(10, 3) == 3
    assert data.steps_per_epoch(9, 3) == 3
    with pytest.raises(ValueError):
        data.steps_per_epoch(10, 0)


def test_train_batches_same_seed_same_order_other_seed_other_order():
    split = toy_split()
    first = take(batches_lib.host_train_batches(split, 3, seed=7), 6)
    again = take(batches_lib.host_train_batches(split, 3, seed=7), 6)
    other = take(batches_lib.host_train_batches(split, 3, seed=8), 6)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["image"], b["image"])
    assert any(
        not np.array_equal(a["label"], b["label"]) for a, b in zip(first, other, strict=True)
    )


def test_train_batches_shapes_dtypes_and_pairing():
    split = toy_split()
    batch = next(batches_lib.host_train_batches(split, 4, seed=0))
    assert batch["image"].shape == (4, 2, 2, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (4,) and batch["label"].dtype == np.int32
    np.testing.assert_array_equal(batch["image"][:, 0, 0, 0], batch["label"])


def test_train_batches_visit_every_example_once_per_epoch_in_a_new_order():
    split = toy_split(12)
    batches = take(batches_lib.host_train_batches(split, 4, seed=0), 9)
    epochs = [np.concatenate([b["label"] for b in batches[i : i + 3]]) for i in (0, 3, 6)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(12))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])


def test_train_batches_drop_the_remainder_of_each_epoch():
    split = toy_split(10)
    batches = take(batches_lib.host_train_batches(split, 3, seed=0), 3)
    seen = np.concatenate([b["label"] for b in batches])
    assert len(np.unique(seen)) == 9


@pytest.mark.parametrize("start_step", [0, 1, 2, 3, 5, 7])
def test_train_batches_resume_at_a_step_as_if_never_interrupted(start_step):
    split = toy_split(10)  # 3 steps per epoch: start steps 3 and 5, 7 cross epoch boundaries.
    uninterrupted = take(batches_lib.host_train_batches(split, 3, seed=4), start_step + 6)[
        start_step:
    ]
    resumed = take(batches_lib.host_train_batches(split, 3, seed=4, start_step=start_step), 6)
    for a, b in zip(uninterrupted, resumed, strict=True):
        np.testing.assert_array_equal(a["label"], b["label"])
        np.testing.assert_array_equal(a["image"], b["image"])


def test_train_batches_refuse_a_batch_larger_than_the_split():
    with pytest.raises(ValueError, match=r"batch_size=11.*10 examples"):
        batches_lib.host_train_batches(toy_split(10), 11, seed=0)


def test_train_batches_refuse_a_negative_start_step():
    with pytest.raises(ValueError, match="start_step"):
        batches_lib.host_train_batches(toy_split(10), 2, seed=0, start_step=-1)


@pytest.mark.parametrize("process_count", [2, 4])
def test_train_batches_of_the_processes_concatenate_to_the_global_batch(process_count):
    split = toy_split(20)
    global_batches = take(batches_lib.host_train_batches(split, 8, seed=3, start_step=5), 4)
    per_process = [
        take(
            batches_lib.host_train_batches(
                split, 8, seed=3, start_step=5, process=data.ProcessSlice(p, process_count)
            ),
            4,
        )
        for p in range(process_count)
    ]
    for step, expected in enumerate(global_batches):
        for name in ("image", "label"):
            slices = [batches[step][name] for batches in per_process]
            assert all(len(s) == 8 // process_count for s in slices)
            np.testing.assert_array_equal(np.concatenate(slices), expected[name])


def test_batches_refuse_a_batch_the_processes_do_not_divide():
    process = data.ProcessSlice(0, 3)
    with pytest.raises(ValueError, match="train_batches: .*not divisible by the 3 processes"):
        batches_lib.host_train_batches(toy_split(10), 4, seed=0, process=process)
    with pytest.raises(ValueError, match="eval_batches: .*not divisible by the 3 processes"):
        batches_lib.host_eval_batches(toy_split(10), 4, process=process)


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 2), (0, 0)])
def test_a_process_slice_outside_the_processes_is_refused(index, count):
    with pytest.raises(
        ValueError, match=rf"process_index={index} must be in \[0, process_count={count}\)"
    ):
        data.ProcessSlice(index, count)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_the_process_slices_tile_the_global_batch(count):
    slices = [data.ProcessSlice(index, count) for index in range(count)]
    assert [(s.offset(8), s.size(8)) for s in slices] == [
        (i * 8 // count, 8 // count) for i in range(count)
    ]


def test_the_current_process_slice_is_jaxs_process(monkeypatch):
    assert data.ProcessSlice.current() == data.SINGLE_PROCESS == data.ProcessSlice(0, 1)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert data.ProcessSlice.current() == data.ProcessSlice(1, 2)


# Evaluation batches.


def test_eval_batches_cover_every_example_once_and_mask_the_padding():
    split = toy_split(10)
    batches = list(batches_lib.host_eval_batches(split, 4))
    assert len(batches) == 3
    for batch in batches:
        assert batch["image"].shape == (4, 2, 2, 1)
        assert batch["label"].shape == (4,)
        assert batch["mask"].shape == (4,) and batch["mask"].dtype == np.float32
    np.testing.assert_array_equal(batches[0]["mask"], [1, 1, 1, 1])
    np.testing.assert_array_equal(batches[2]["mask"], [1, 1, 0, 0])
    labels = np.concatenate([b["label"] for b in batches])
    mask = np.concatenate([b["mask"] for b in batches])
    np.testing.assert_array_equal(labels[mask == 1], np.arange(10))
    np.testing.assert_array_equal(batches[2]["image"][:, 0, 0, 0], batches[2]["label"])


def test_eval_batches_without_remainder_have_no_padding():
    batches = list(batches_lib.host_eval_batches(toy_split(8), 4))
    assert len(batches) == 2
    assert all(np.all(b["mask"] == 1) for b in batches)


def test_eval_batches_of_the_processes_concatenate_to_the_global_batch():
    split = toy_split(10)
    global_batches = list(batches_lib.host_eval_batches(split, 4))
    per_process = [
        list(batches_lib.host_eval_batches(split, 4, process=data.ProcessSlice(p, 2)))
        for p in range(2)
    ]
    assert [len(batches) for batches in per_process] == [3, 3]
    for step, expected in enumerate(global_batches):
        for name in ("image", "label", "mask"):
            got = np.concatenate([batches[step][name] for batches in per_process])
            np.testing.assert_array_equal(got, expected[name])
