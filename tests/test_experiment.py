"""Tests of haiku_state.experiment: what a config's keys become."""

import os

import pytest

from haiku_state import config as config_lib
from haiku_state import data, experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mlp_config():
    return config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))


def test_the_pipeline_options_are_the_config_s_data_keys_of_their_names():
    config = _mlp_config()
    _, options = experiment.load_data(config.data, seed=0)
    assert options == data.DEFAULT_OPTIONS  # The schema's defaults are the library's.
    config.data.workers, config.data.prefetch, config.data.skip_corrupt = 3, 5, True
    _, options = experiment.load_data(config.data, seed=0)
    assert options == data.PipelineOptions(workers=3, prefetch=5, skip_corrupt=True)


def test_the_data_keys_choose_and_shape_the_dataset():
    config = _mlp_config()
    config.data.name = "synthetic"
    config.data.image_shape, config.data.num_classes = (4, 3, 1), 3
    config.data.num_train, config.data.num_test = 8, 4
    dataset, _ = experiment.load_data(config.data, seed=0)
    assert (dataset.name, dataset.image_shape, dataset.num_classes) == ("synthetic", (4, 3, 1), 3)
    assert (len(dataset.train.labels), len(dataset.test.labels)) == (8, 4)


def test_the_placeholder_batch_is_this_process_s_slice(monkeypatch):
    dataset = data.load_dataset("digits")
    monkeypatch.setattr(data.ProcessSlice, "current", classmethod(lambda cls: cls(1, 2)))
    batch = experiment.placeholder_batch(dataset, 16)
    assert batch["image"].shape == (4, 2, 8, 8, 1) and batch["label"].shape == (4, 2)
    monkeypatch.setattr(data.ProcessSlice, "current", classmethod(lambda cls: cls(0, 4)))
    with pytest.raises(
        ValueError, match="placeholder_batch: batch_size=6 is not divisible by the 4"
    ):
        experiment.placeholder_batch(dataset, 6)
