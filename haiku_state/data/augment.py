"""On-device augmentation: random shifts and flips of each device's shard inside the step."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from haiku_state import errors
from haiku_state.data.splits import Batch


def random_shift(key: jax.Array, images: jax.Array, max_shift: int) -> jax.Array:
    """Shifts each image of `[b, H, W, C]` by its own random offset of up to `max_shift` pixels
    per axis, edge-padded: no value appears that the image did not hold (as a zero would)."""
    if max_shift < 0:
        raise errors.InvalidValue(f"random_shift: max_shift must be >= 0, got {max_shift}.")
    if max_shift == 0:
        return images
    batch, height, width, channels = images.shape
    padding = ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0))
    padded = jnp.pad(images, padding, mode="edge")
    offsets = jax.random.randint(key, (batch, 2), 0, 2 * max_shift + 1)

    def crop(image: jax.Array, offset: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, channels))

    return jax.vmap(crop)(padded, offsets)


def random_flip(key: jax.Array, images: jax.Array) -> jax.Array:
    """Mirrors each image of `[b, H, W, C]` left-right with probability 0.5, independently."""
    flip = jax.random.bernoulli(key, 0.5, (images.shape[0],))
    return jnp.where(flip[:, None, None, None], images[:, :, ::-1, :], images)


def make_augment_fn(
    *, max_shift: int = 0, flip: bool = False
) -> Callable[[jax.Array, Batch], Batch] | None:
    """`augment(key, batch)`, which shifts and (with `flip`) flips `batch["image"]`, or None.
    A negative `max_shift` is refused when it runs (`random_shift`)."""
    if not max_shift and not flip:
        return None

    def augment(key: jax.Array, batch: Batch) -> Batch:
        shift_key, flip_key = jax.random.split(key)
        images = random_shift(shift_key, batch["image"], max_shift)
        return {**batch, "image": random_flip(flip_key, images) if flip else images}

    return augment
