"""The pmap and shard_map backends of the Updater compute the same training run."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import haiku_state as hs
from benchmarks.compiles import CompileEvents
from haiku_state import data, losses, models, replication, updater

NUM_STEPS = 4


def _run(backend, train_state=None, steps=NUM_STEPS):
    network = models.make_network(
        "mlp", 10, cross_replica_axis="i", hidden_sizes=(16,), dropout_rate=0.2
    )
    step_updater = hs.Updater(
        network,
        # Not Adam: the bias before BatchNorm has a zero gradient up to rounding, which
        # Adam would scale up to full-size steps and so amplify the last-bit differences.
        optax.sgd(0.05, momentum=0.9),
        losses.classification_loss(10),
        augment_fn=data.make_augment_fn(max_shift=1),
        backend=backend,
    )
    rng = np.random.default_rng(0)
    batch = hs.shard(
        {
            "image": rng.normal(size=(32, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, 32).astype(np.int32),
        }
    )
    if train_state is None:
        train_state = step_updater.init(0, batch)
    for _ in range(steps):
        train_state, metrics = step_updater.update(train_state, batch)
    return train_state, metrics, step_updater.evaluate(train_state, batch)


def _as_arrays(train_state):
    return train_state._replace(rng=jax.random.key_data(train_state.rng))


@pytest.fixture(scope="module")
def runs():
    return {backend: _run(backend) for backend in replication.PER_DEVICE_BACKENDS}


def test_backends_give_the_same_params_state_keys_and_metrics(runs):
    (pmap_state, pmap_metrics, pmap_eval) = runs["pmap"]
    (shard_map_state, shard_map_metrics, shard_map_eval) = runs["shard_map"]
    # Keys and steps are integer arithmetic: exactly equal. Floats are compiled as
    # two different programs, so they may differ in the last bits.
    np.testing.assert_array_equal(
        jax.random.key_data(pmap_state.rng), jax.random.key_data(shard_map_state.rng)
    )
    np.testing.assert_array_equal(pmap_state.step, shard_map_state.step)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        _as_arrays(pmap_state),
        _as_arrays(shard_map_state),
    )
    for name in pmap_metrics:
        np.testing.assert_allclose(pmap_metrics[name], shard_map_metrics[name], rtol=1e-5)
    for name in pmap_eval:
        np.testing.assert_allclose(pmap_eval[name], shard_map_eval[name], rtol=1e-5)


@pytest.mark.parametrize("backend", replication.PER_DEVICE_BACKENDS)
def test_backend_keeps_replicas_identical_and_keys_distinct(runs, backend):
    train_state = runs[backend][0]
    hs.assert_replicas_identical(train_state._replace(rng=()))
    hs.assert_keys_distinct(train_state.rng)
    assert train_state.step.sharding == hs.replication.device_axis_sharding()


def test_state_of_one_backend_continues_on_the_other(runs):
    """Same TrainState layout: a run started with pmap continues with shard_map."""
    pmap_state, _, _ = runs["pmap"]
    two_and_two, _, _ = _run("shard_map", _run("pmap", steps=2)[0], steps=2)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        _as_arrays(two_and_two),
        _as_arrays(pmap_state),
    )


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"Unknown backend 'vmap'.*'pmap', 'shard_map'"):
        hs.Updater(lambda: None, optax.sgd(0.1), losses.classification_loss(10), backend="vmap")


@pytest.mark.parametrize("backend", replication.PER_DEVICE_BACKENDS)
def test_keys_of_another_device_count_are_refused_by_name_and_nothing_is_donated(runs, backend):
    # Eight keys on four devices: shard_map would quietly hand each device two of them (and
    # use the first) if the Updater did not check; no shape check downstream would notice.
    train_state = runs[backend][0]
    broken = train_state._replace(rng=jax.random.split(jax.random.key(0), 8))
    step_updater = hs.Updater(
        models.make_network("mlp", 10, cross_replica_axis="i", hidden_sizes=(16,)),
        optax.sgd(0.05, momentum=0.9),
        losses.classification_loss(10),
        backend=backend,
    )
    batch = hs.shard(
        {"image": np.zeros((32, 8, 8, 1), np.float32), "label": np.zeros(32, np.int32)}
    )
    pattern = r"update: train_state.rng has shape \(8,\); every leaf needs a leading axis"
    with pytest.raises(ValueError, match=pattern):
        step_updater.update(broken, batch)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(train_state))


@pytest.mark.parametrize("backend", replication.PER_DEVICE_BACKENDS)
def test_lower_gives_the_per_device_cost_without_consuming_the_state(runs, backend):
    train_state = runs[backend][0]
    step_updater = hs.Updater(
        models.make_network("mlp", 10, cross_replica_axis="i", hidden_sizes=(16,)),
        optax.sgd(0.05),
        losses.classification_loss(10),
        backend=backend,
    )
    batch = hs.shard(
        {"image": np.zeros((32, 8, 8, 1), np.float32), "label": np.zeros(32, np.int32)}
    )
    compiled = step_updater.lower("update", train_state, batch).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    # At least the forward and backward matmuls of one device's 8 examples.
    assert costs["flops"] > 2 * 2 * 8 * (64 * 16 + 16 * 10)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(train_state))


def test_the_norms_are_a_second_program_compiled_once_and_reported_only_when_asked():
    step_updater = hs.Updater(
        models.make_network("mlp", 10, cross_replica_axis="i", hidden_sizes=(16,)),
        optax.sgd(0.05),
        losses.classification_loss(10),
    )
    batch = hs.shard(
        {"image": np.zeros((32, 8, 8, 1), np.float32), "label": np.zeros(32, np.int32)}
    )
    train_state = step_updater.init(0, batch)
    with CompileEvents() as events:
        train_state, without = step_updater.update(train_state, batch, with_global_norms=False)
        train_state, with_norms = step_updater.update(train_state, batch, with_global_norms=True)
        train_state, _ = step_updater.update(train_state, batch, with_global_norms=False)
    # Two programs: a lax.cond over the norms in one would keep `updates` whole in every step.
    assert events.figures()["programs"] == 2
    assert set(without) == {"loss", "accuracy"}
    assert set(with_norms) == {"loss", "accuracy", "l2_grads", "l2_params", "l2_updates"}
    assert all(float(with_norms[name]) > 0 for name in updater.NORMS)
