"""Small splits held in memory whose images name their examples, for the batch-order tests."""

import numpy as np

from haiku_state import data


def toy_split(num_examples: int = 10) -> data.Split:
    """Image `i` is filled with the value `i`, so a batch's images name its examples."""
    images = np.broadcast_to(
        np.arange(num_examples, dtype=np.float32)[:, None, None, None], (num_examples, 2, 2, 1)
    ).copy()
    return data.Split(images=images, labels=np.arange(num_examples, dtype=np.int32))


def take(iterator, count: int) -> list:
    """The next `count` items of `iterator`."""
    return [next(iterator) for _ in range(count)]
