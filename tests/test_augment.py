"""Tests of haiku_state.data.augment: on-device random shifts and flips inside the step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from haiku_state import data

NUM_DEVICES = 4


def _gradient_images(batch: int, height: int = 6, width: int = 6) -> np.ndarray:
    """Images whose pixels are all distinct, so any shift or flip shows."""
    values = np.arange(batch * height * width * 2, dtype=np.float32)
    return values.reshape(batch, height, width, 2)


def test_random_shift_keeps_the_shape_and_zero_shift_is_identity():
    images = _gradient_images(8)
    shifted = data.random_shift(jax.random.key(0), images, max_shift=2)
    assert shifted.shape == images.shape and shifted.dtype == images.dtype
    np.testing.assert_array_equal(data.random_shift(jax.random.key(0), images, 0), images)


def test_random_shift_draws_per_key_and_per_example():
    images = np.repeat(_gradient_images(1), 16, axis=0)
    first = np.asarray(data.random_shift(jax.random.key(0), images, max_shift=2))
    second = np.asarray(data.random_shift(jax.random.key(1), images, max_shift=2))
    assert not np.array_equal(first, second)
    distinct_examples = {example.tobytes() for example in first}
    assert len(distinct_examples) > 1


def test_random_shift_moves_content_and_edge_pads():
    image = _gradient_images(1, height=5, width=5)[0]
    padded = np.pad(image, ((2, 2), (2, 2), (0, 0)), mode="edge")
    shifted = np.asarray(data.random_shift(jax.random.key(3), image[None].repeat(32, 0), 2))
    for example in shifted:
        assert any(
            np.array_equal(example, padded[dy : dy + 5, dx : dx + 5])
            for dy in range(5)
            for dx in range(5)
        )


@pytest.mark.parametrize(
    "dtype, height, width, max_shift",
    [(np.uint8, 8, 8, 1), (np.float32, 5, 7, 3), (jnp.bfloat16, 4, 3, 2)],
)
def test_random_shift_crops_the_edge_padded_image_at_the_offsets_its_key_draws(
    dtype, height, width, max_shift
):
    """The offsets are `randint(key, (b, 2), 0, 2 * max_shift + 1)`, rows then columns: the
    draw every release has made, so a run resumed across releases augments as before."""
    images = _gradient_images(16, height, width).astype(dtype)
    key = jax.random.key(7)
    shifted = np.asarray(data.random_shift(key, images, max_shift))
    offsets = np.asarray(jax.random.randint(key, (16, 2), 0, 2 * max_shift + 1))
    pad = ((max_shift, max_shift), (max_shift, max_shift), (0, 0))
    for image, (dy, dx), got in zip(images, offsets, shifted, strict=True):
        expected = np.pad(image, pad, mode="edge")[dy : dy + height, dx : dx + width]
        np.testing.assert_array_equal(got, expected)
    assert shifted.dtype == images.dtype


def test_random_shift_is_one_vectorised_program_without_a_per_image_loop():
    """A slice per image at an offset computed on the device lowers to a gather, which a TPU
    runs as a loop over the images: 0.26 ms of the small ResNet's 0.38 ms step on a v5e."""
    shift = jax.jit(functools.partial(data.random_shift, max_shift=2))
    program = shift.lower(jax.random.key(0), _gradient_images(8)).as_text()
    for op in ("gather", "dynamic_slice", "dynamic_update_slice"):
        assert f"stablehlo.{op}" not in program, op


def test_random_flip_mirrors_along_the_width():
    images = np.repeat(_gradient_images(1), 32, axis=0)
    flipped = np.asarray(data.random_flip(jax.random.key(0), images))
    mirror = images[0, :, ::-1, :]
    is_flipped = [np.array_equal(example, mirror) for example in flipped]
    is_kept = [np.array_equal(example, images[0]) for example in flipped]
    assert all(f or k for f, k in zip(is_flipped, is_kept, strict=True))
    assert any(is_flipped) and any(is_kept)


def test_make_augment_fn_is_none_when_there_is_nothing_to_do():
    assert data.make_augment_fn() is None
    assert data.make_augment_fn(max_shift=0, flip=False) is None


def test_make_augment_fn_changes_only_the_image():
    augment = data.make_augment_fn(max_shift=1, flip=True)
    batch = {"image": _gradient_images(8), "label": np.arange(8, dtype=np.int32)}
    augmented = jax.jit(augment)(jax.random.key(0), batch)
    assert set(augmented) == {"image", "label"}
    assert augmented["image"].shape == batch["image"].shape
    np.testing.assert_array_equal(augmented["label"], batch["label"])
    assert not np.array_equal(augmented["image"], batch["image"])


def test_each_device_augments_an_identical_shard_differently_inside_pmap():
    augment = data.make_augment_fn(max_shift=2, flip=True)
    shard = _gradient_images(4)
    batch = {
        "image": np.broadcast_to(shard, (NUM_DEVICES, *shard.shape)).copy(),
        "label": np.zeros((NUM_DEVICES, 4), np.int32),
    }
    keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
    augmented = np.asarray(jax.pmap(augment, axis_name="i")(keys, batch)["image"])
    assert augmented.shape == (NUM_DEVICES, *shard.shape)
    per_device = {augmented[d].tobytes() for d in range(NUM_DEVICES)}
    assert len(per_device) == NUM_DEVICES, "two devices augmented their shard identically"
