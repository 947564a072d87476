"""Tests of haiku_state.experiment: what a config's keys become."""

import os

import jax
import numpy as np
import pytest
from configs import mlp_config
from jax.sharding import PartitionSpec as P

import haiku_state as hs
from haiku_state import config as config_lib
from haiku_state import data, evaluation, experiment, sharding
from haiku_state.guards import config_checks, replicas

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


def _train_three_steps_and_evaluate(config):
    """The experiment of `config`: 3 steps on its pipeline's batches, checked, and evaluated."""
    built = experiment.build_experiment(config)
    updater = built.updater
    train_state = updater.init(
        config.seed, experiment.placeholder_batch(built.dataset, config.batch_size)
    )
    train = built.dataset.train
    losses = []
    for step in range(3):
        rows = slice(step * config.batch_size, (step + 1) * config.batch_size)
        batch = hs.shard({"image": train.images[rows], "label": train.labels[rows]})
        train_state, metrics = updater.update(train_state, batch)
        losses.append(jax.block_until_ready(metrics["loss"]))
    replicas.assert_train_state_invariants(train_state)
    eval_metrics = evaluation.evaluate_test_split(built, train_state, config.eval_batch_size)
    return updater, train_state, np.array(jax.device_get(losses)), eval_metrics


def test_a_jit_fsdp_experiment_trains_and_evaluates_as_the_pmap_one():
    # No dropout, no augmentation: the step draws nothing, so the backends compute alike.
    # 256 hidden units: the first layer's weights (64 x 256 float32) are split under fsdp.
    same = {"model.hidden_sizes": (256,), "model.dropout_rate": 0.0, "data.max_shift": 0}
    pmap_config = mlp_config(**same)
    jit_config = mlp_config(backend="jit", param_sharding="fsdp", **same)
    config_checks.validate_config(jit_config, jax.device_count())
    _, pmap_state, pmap_losses, pmap_eval = _train_three_steps_and_evaluate(pmap_config)
    updater, jit_state, jit_losses, jit_eval = _train_three_steps_and_evaluate(jit_config)

    assert (updater.backend, updater.param_sharding) == ("jit", "fsdp")
    assert sharding.is_global(jit_state)
    assert jit_state.params["mlp/linear"]["w"].sharding.spec == P(None, updater.axis_name)
    per_device, total = sharding.bytes_per_device(jit_state)
    assert per_device < total == sharding.bytes_per_device(pmap_state)[1]
    # BatchNorm of the global batch on both: cross-replica under pmap, global under jit.
    np.testing.assert_allclose(jit_losses, pmap_losses, rtol=1e-5)
    pmap_params = jax.device_get(hs.unreplicate(pmap_state.params))
    jit_params = jax.device_get(jit_state.params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(pmap_params):
        jit_leaf = jit_params
        for key in path:
            jit_leaf = jit_leaf[key.key]
        np.testing.assert_allclose(jit_leaf, leaf, rtol=1e-5, atol=1e-6, err_msg=str(path))
    assert jit_eval == pytest.approx(pmap_eval, rel=1e-5)


def test_the_wide_mlp_exceeds_a_64_mb_budget_replicated_and_fits_it_with_fsdp():
    # Shapes only: tests/test_updater_jit.py trains such a model with fsdp in its budget.
    budget = 64e6  # bytes of params and opt_state per device
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "wide_mlp.py"))
    config_checks.validate_config(config, jax.device_count())
    built = experiment.build_experiment(config)
    assert (built.updater.backend, built.updater.param_sharding) == ("jit", "fsdp")
    image = jax.ShapeDtypeStruct((config.batch_size, *built.dataset.image_shape), np.float32)
    params, _ = jax.eval_shape(
        lambda key, batch: built.network.init(key, batch, is_training=True),
        jax.random.key(0),
        {"image": image, "label": jax.ShapeDtypeStruct((config.batch_size,), np.int32)},
    )
    trees = (params, jax.eval_shape(built.optimizer.init, params))
    specs = sharding.param_specs(
        trees, "fsdp", axis_name=built.updater.axis_name, num_shards=jax.device_count()
    )
    leaves = jax.tree.leaves(trees)
    leaf_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    per_device = sum(
        leaf.size * leaf.dtype.itemsize // (jax.device_count() if spec != P() else 1)
        for leaf, spec in zip(leaves, leaf_specs, strict=True)
    )
    assert total > budget >= per_device
