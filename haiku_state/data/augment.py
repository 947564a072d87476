"""On-device augmentation: random shifts and flips inside the pmapped step, per device's shard.

The Updater calls the function `make_augment_fn` builds at the start of every
training step with a per-device key, so each device augments its shard
differently, and every step afresh. It works on the images as they arrive
(uint8 pixels or standardised floats), before the network standardises them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from haiku_state.data.splits import Batch


def random_shift(key: jax.Array, images: jax.Array, max_shift: int) -> jax.Array:
    """Shifts each image by its own random offset of up to `max_shift` pixels per axis.

    Each image is edge-padded by `max_shift` on both sides of H and W and cropped
    back to `[H, W]` at an offset drawn uniformly from `[0, 2 * max_shift]` per axis.
    Edge padding repeats the border pixels, so no value appears that the image
    did not contain (a zero would be the mean pixel after normalisation, not a border).

    Args:
      key: a PRNG key; one per device when called inside a pmapped step.
      images: `[b, H, W, C]`.
      max_shift: the largest shift in pixels; 0 returns `images` unchanged.

    Returns:
      The shifted images, `[b, H, W, C]`.
    """
    if max_shift < 0:
        raise ValueError(f"random_shift: max_shift must be >= 0, got {max_shift}.")
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
    """Mirrors each image left-right (along W) with probability 0.5, independently.

    Args:
      key: a PRNG key; one per device when called inside a pmapped step.
      images: `[b, H, W, C]`.

    Returns:
      The images, some flipped, `[b, H, W, C]`.
    """
    flip = jax.random.bernoulli(key, 0.5, (images.shape[0],))
    return jnp.where(flip[:, None, None, None], images[:, :, ::-1, :], images)


def make_augment_fn(
    *, max_shift: int = 0, flip: bool = False
) -> Callable[[jax.Array, Batch], Batch] | None:
    """Builds the per-device augmentation a training step applies to its shard.

    Which augmentations suit a dataset is the experiment config's choice: digits,
    for example, must not be flipped.

    Args:
      max_shift: passed to `random_shift`; 0 skips shifting.
      flip: whether to apply `random_flip`.

    Returns:
      None when there is nothing to do, else `augment(key, batch) -> batch`, which
      replaces `batch["image"]` by its augmented copy and leaves other leaves as
      they are.
    """
    if max_shift < 0:
        raise ValueError(f"make_augment_fn: max_shift must be >= 0, got {max_shift}.")
    if not max_shift and not flip:
        return None

    def augment(key: jax.Array, batch: Batch) -> Batch:
        shift_key, flip_key = jax.random.split(key)
        images = random_shift(shift_key, batch["image"], max_shift)
        if flip:
            images = random_flip(flip_key, images)
        return {**batch, "image": images}

    return augment
