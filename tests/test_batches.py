"""Tests of haiku_state.data.batches: the entry point picks a pipeline, the batches stay the same.

The encoded splits' path is tested with the workers (test_pipeline.py).
"""

import numpy as np
import pytest
from toy_splits import toy_split

from haiku_state import data, replication
from haiku_state.data import batches as batches_lib


@pytest.mark.parametrize("fits", [True, False])
def test_train_batches_are_the_host_batches_by_either_pipeline(monkeypatch, fits):
    monkeypatch.setattr(data.device, "fits_on_device", lambda split: fits)
    split = toy_split(20)
    host = batches_lib.host_train_batches(split, 8, seed=3, start_step=1)
    sharded = data.train_batches(split, 8, seed=3, start_step=1)
    for _ in range(5):
        expected, batch = next(host), next(sharded)
        for name, leaf in batch.items():
            assert leaf.sharding == replication.device_axis_sharding()
            np.testing.assert_array_equal(np.asarray(leaf), expected[name].reshape(leaf.shape))
    sharded.close()
