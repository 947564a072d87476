"""Tests of the Updater's step options on 4 simulated devices: gradient accumulation over
micro-batches (the big batch's step within float tolerance; BatchNorm per micro-batch), and
the moving averages of params and state (the update, replicas, evaluation, donation)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from updater_helpers import (
    AXIS,
    GLOBAL_BATCH,
    NUM_CLASSES,
    bn_mlp,
    host_batch,
    plain_mlp,
    run_steps,
    to_host,
)

import haiku_state as hs
from haiku_state import losses
from haiku_state.guards import replicas
from haiku_state.updater import Ema, micro_batches, train_step

NUM_STEPS = 2


def make_updater(forward, backend="pmap", **options) -> hs.Updater:
    return hs.Updater(
        forward,
        optax.sgd(0.1, momentum=0.9),
        losses.classification_loss(NUM_CLASSES),
        backend=backend,
        **options,
    )


def network(model: str, backend: str):
    return plain_mlp() if model == "plain" else bn_mlp(None if backend == "jit" else AXIS)


def train(model: str, backend: str, **options):
    """NUM_STEPS steps on fixed batches: the final train state (on the host) and metrics."""
    updater = make_updater(network(model, backend), backend, **options)
    batches = [hs.shard(host_batch(seed)) for seed in range(10, 10 + NUM_STEPS)]
    train_state, metrics = run_steps(updater, updater.init(0, batches[0]), batches)
    if backend != "jit":
        replicas.assert_train_state_invariants(train_state)
        train_state = hs.unreplicate(train_state._replace(rng=()))
    return to_host(train_state._replace(rng=())), metrics


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# Gradient accumulation.


def test_micro_batches_take_an_equal_part_of_every_devices_block():
    x = np.arange(16)  # 2 blocks (devices) of 8, in 4 micro-batches.
    parts = [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    np.testing.assert_array_equal(micro_batches(x, steps=4, shards=2), parts)
    np.testing.assert_array_equal(micro_batches(x, 2, 1), x.reshape(2, 8))
    with pytest.raises(ValueError, match="accumulation_steps=3 does not divide each device's 8"):
        micro_batches(x, steps=3, shards=2)


def test_accumulated_micro_batches_give_the_big_batchs_step_within_float_tolerance():
    # No BatchNorm, no dropout: the mean of the micro-batches' gradients is the big batch's.
    # (The jit backend's micro-batches are the same examples: the test below.)
    big, big_metrics = train("plain", "pmap")
    accumulated, metrics = train("plain", "pmap", accumulation_steps=4)
    assert_trees_close(accumulated.params, big.params)
    assert_trees_close(accumulated.opt_state, big.opt_state)
    for got, want in zip(metrics, big_metrics, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
        np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)
    assert int(accumulated.step) == NUM_STEPS  # Steps are optimizer steps.


def test_batchnorm_moves_its_averages_once_per_micro_batch_alike_on_every_backend():
    on_pmap, _ = train("bn", "pmap", accumulation_steps=2)
    on_jit, _ = train("bn", "jit", accumulation_steps=2)
    counters = [x for x in jax.tree.leaves(on_pmap.state) if x.dtype == np.int32]
    assert counters and all(int(c) == 2 * NUM_STEPS for c in counters)
    # The same examples in each micro-batch (each device's i-th part) on both backends.
    assert_trees_close(on_jit.params, on_pmap.params)
    assert_trees_close(on_jit.state, on_pmap.state)


def test_an_accumulation_that_does_not_divide_the_devices_shard_is_refused_in_one_line():
    updater = make_updater(plain_mlp(), accumulation_steps=3)
    batch = hs.shard(host_batch(0))  # 8 examples per device.
    with pytest.raises(ValueError, match="accumulation_steps=3 does not divide each device's 8"):
        updater.update(updater.init(0, batch), batch)
    with pytest.raises(ValueError, match="accumulation_steps=0 must be a positive integer"):
        make_updater(plain_mlp(), accumulation_steps=0)


# Moving averages.

DECAY = 0.75


@pytest.fixture(scope="module")
def ema_run():
    """Two pmap steps of the BatchNorm MLP keeping moving averages: the updater, the state
    before the last step (host copy) and after it (on the devices)."""
    updater = make_updater(bn_mlp(AXIS), ema_decay=DECAY)
    batches = [hs.shard(host_batch(seed)) for seed in range(10, 10 + NUM_STEPS)]
    train_state, _ = run_steps(updater, updater.init(0, batches[0]), batches[:1])
    before = to_host(hs.unreplicate(train_state._replace(rng=())))
    train_state, _ = run_steps(updater, train_state, batches[1:])
    return updater, before, train_state, batches


def test_the_moving_averages_start_at_the_params_and_move_by_the_decay(ema_run):
    updater, before, train_state, batches = ema_run
    fresh = updater.init(0, batches[0])
    initial = to_host(hs.unreplicate(fresh._replace(rng=())))
    assert_trees_close(initial.ema.params, initial.params, rtol=0, atol=0)
    after = to_host(hs.unreplicate(train_state._replace(rng=())))

    def expected(old, new):
        if not np.issubdtype(new.dtype, np.floating):
            return new  # BatchNorm's counter.
        return (np.float32(DECAY) * old + np.float32(1 - DECAY) * new).astype(old.dtype)

    moved = jax.tree.map(expected, before.ema, Ema(after.params, after.state))
    assert_trees_close(after.ema, moved)
    assert not np.allclose(jax.tree.leaves(after.ema.params)[0], jax.tree.leaves(after.params)[0])


def test_the_moving_averages_stay_identical_on_every_replica_and_the_check_covers_them(ema_run):
    _, _, train_state, _ = ema_run
    replicas.assert_train_state_invariants(train_state)
    leaf = train_state.ema.params["mlp/linear"]["w"]
    host = np.array(jax.device_get(leaf))
    host[2, 0, 0] += 1e-3  # Device 2's copy only.
    broken = hs.shard(host)  # The per-device layout of these (now differing) copies.
    linear = {**train_state.ema.params["mlp/linear"], "w": broken}
    ema = train_state.ema._replace(params={**train_state.ema.params, "mlp/linear": linear})
    with pytest.raises(AssertionError, match=r"Replicas differ at leaf .*ema.*w.*devices \[2\]"):
        replicas.assert_train_state_invariants(train_state._replace(ema=ema))


def test_evaluation_uses_the_moving_averages(ema_run):
    updater, _, train_state, batches = ema_run
    plain = make_updater(bn_mlp(AXIS))
    of_averages = train_state._replace(
        params=train_state.ema.params, state=train_state.ema.state, ema=None
    )
    assert jax.device_get(updater.evaluate(train_state, batches[0])) == jax.device_get(
        plain.evaluate(of_averages, batches[0])
    )
    raw = jax.device_get(plain.evaluate(train_state._replace(ema=None), batches[0]))
    assert raw["loss"] != jax.device_get(updater.evaluate(train_state, batches[0]))["loss"]


def test_a_train_state_and_an_updater_that_disagree_on_the_averages_are_refused(ema_run):
    updater, _, train_state, batches = ema_run
    with pytest.raises(ValueError, match="update: train_state.ema holds moving averages, but"):
        make_updater(bn_mlp(AXIS)).update(train_state, batches[0])
    with pytest.raises(ValueError, match=r"keeps moving averages \(ema_decay=0.75\), but train"):
        updater.evaluate(train_state._replace(ema=None), batches[0])
    with pytest.raises(ValueError, match=r"ema_decay=1.0 must be in \[0, 1\)"):
        make_updater(bn_mlp(AXIS), ema_decay=1.0)


@pytest.mark.parametrize("backend, param_sharding", [("shard_map", "replicated"), ("jit", "fsdp")])
def test_the_averages_are_kept_and_donated_on_the_other_backends(backend, param_sharding):
    forward = bn_mlp(None if backend == "jit" else AXIS)
    updater = make_updater(forward, backend, ema_decay=DECAY, param_sharding=param_sharding)
    batch = hs.shard(host_batch(0, GLOBAL_BATCH))
    train_state = updater.init(0, batch)
    if backend == "jit":
        linear = train_state.ema.params["mlp/linear"]["w"]
        assert linear.sharding == train_state.params["mlp/linear"]["w"].sharding
    first = train_state
    train_state, _ = run_steps(updater, train_state, [batch, batch])
    assert first.ema.params["mlp/linear"]["w"].is_deleted()  # Donated with the rest.
    replicas.assert_train_state_invariants(train_state)
    host = to_host(train_state._replace(rng=()))
    assert not np.allclose(jax.tree.leaves(host.ema.params)[0], jax.tree.leaves(host.params)[0])


# What a run's start traces.


@pytest.mark.parametrize("backend", ["pmap", "jit"])
def test_the_loss_is_traced_once_for_every_step_program(backend):
    # The step's gradients are a function of their own: the programs with and without the
    # global norms, of one step or of several a call, share their trace (seconds of a start).
    traced = []
    classification = losses.classification_loss(NUM_CLASSES)

    def loss_fn(outputs, batch):
        traced.append(1)
        return classification(outputs, batch)

    updater = hs.Updater(network("bn", backend), optax.sgd(0.1), loss_fn, backend=backend)
    batch = hs.shard(host_batch(0))
    train_state = updater.abstract_init(batch)
    for method, batches in (("update", batch), ("update_steps", [batch] * 3)):
        for norms in (False, True):
            updater.lower(method, train_state, batches, with_global_norms=norms)
    assert len(traced) == 1


def test_a_loss_that_cannot_be_hashed_trains():
    # The gradients' program is keyed by the loss and the network as objects, not by hash.
    @dataclasses.dataclass
    class Loss:  # eq=True: instances are not hashable.
        num_classes: int

        def __call__(self, outputs, batch):
            return losses.classification_loss(self.num_classes)(outputs, batch)

    updater = hs.Updater(network("bn", "pmap"), optax.sgd(0.1), Loss(NUM_CLASSES))
    batch = hs.shard(host_batch(0))
    train_state, metrics = updater.update(updater.init(0, batch), batch)
    assert np.all(np.isfinite(metrics["loss"]))


def test_train_step_alone_takes_the_updaters_step():
    # The pure step, given no `gradients`, traces the loss's itself (`loss_gradients`).
    forward, optimizer = network("bn", "pmap"), optax.sgd(0.1, momentum=0.9)
    loss_fn = losses.classification_loss(NUM_CLASSES)
    updater = hs.Updater(forward, optimizer, loss_fn, axis_name=AXIS)
    batch = hs.shard(host_batch(0))
    first = updater.init(0, batch)
    step = functools.partial(
        train_step,
        with_global_norms=True,
        forward=forward,
        optimizer=optimizer,
        loss_fn=loss_fn,
        augment_fn=None,
        loss_scale=None,
        axis_name=AXIS,
    )
    alone = jax.pmap(step, axis_name=AXIS)(first, batch)
    expected = updater.update(first, batch, with_global_norms=True)  # Donates `first`.
    assert_trees_close(to_host(alone[1]), to_host(expected[1]))
    assert_trees_close(to_host(alone[0].params), to_host(expected[0].params))
