"""The small models, batches and step runner the Updater's tests share.

Nothing here touches JAX's backend at import time: the 1-device reference run of
`test_updater_devices.py` imports it in a subprocess with one simulated device.
Steps run one at a time, waiting for each (`run_steps`): deep async dispatch of
collective-carrying steps can abort on simulated CPU devices.
"""

import haiku as hk
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from trees import is_typed_key

import haiku_state as hs
from haiku_state import data, losses, models, replication

NUM_DEVICES = 4
NUM_CLASSES = 10
GLOBAL_BATCH = 32
AXIS = "i"
NUM_REAL_EVAL = 20


def host_batch(seed: int, batch_size: int = GLOBAL_BATCH) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {
        "image": rs.normal(size=(batch_size, 8, 8, 1)).astype(np.float32),
        "label": rs.randint(0, NUM_CLASSES, size=batch_size).astype(np.int32),
    }


def bn_mlp(
    cross_replica_axis: str | None = None, dropout_rate: float = 0.0, batch_norm: str = "haiku"
):
    """The project's MLP; by default over `hk.BatchNorm`, whose state holds int32 counters."""
    return models.make_network(
        "mlp",
        NUM_CLASSES,
        cross_replica_axis=cross_replica_axis,
        dropout_rate=dropout_rate,
        hidden_sizes=(16,),
        batch_norm=batch_norm,
    )


def plain_mlp() -> hk.TransformedWithState:
    def forward(batch, is_training):
        del is_training
        return hk.nets.MLP([16, NUM_CLASSES])(hk.Flatten()(batch["image"]))

    return hk.transform_with_state(forward)


def sharding():
    return replication.device_axis_sharding()


def to_host(tree):
    """Host numpy copy of a tree; typed keys become their uint32 key data.

    Global arrays that span processes are gathered: then every process must call it.
    """

    def leaf(x):
        if is_typed_key(x):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(leaf, tree)


def assert_trees_bit_equal(actual, expected) -> None:
    actual_leaves = jax.tree_util.tree_leaves_with_path(actual)
    expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), (_, b) in zip(actual_leaves, expected_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        assert np.array_equal(a, b), f"{name} differs"


def int_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.integer)]


def float_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.floating)]


def run_steps(updater: hs.Updater, train_state: hs.TrainState, batches: list):
    """Runs one update per batch, waiting for each; returns the state and host metrics."""
    all_metrics = []
    for batch in batches:
        train_state, metrics = updater.update(train_state, batch)
        all_metrics.append(jax.device_get(jax.block_until_ready(metrics)))
    return train_state, all_metrics


def train_for_comparison(model_name: str, num_steps: int = 3) -> dict[str, np.ndarray]:
    """3 steps on fixed global batches with however many devices this process has.

    Returns the unreplicated params, BatchNorm state and the per-step losses as a flat
    dict, ready for np.savez. Run in-process (4 devices) and in a 1-device subprocess.
    """
    forward = {
        "bn_mlp": lambda: bn_mlp(AXIS),
        "lean_bn_mlp": lambda: bn_mlp(AXIS, batch_norm="lean"),
        "bn_mlp_per_device": lambda: bn_mlp(None),
        "plain_mlp": plain_mlp,
    }[model_name]()
    updater = hs.Updater(
        forward, optax.sgd(0.1, momentum=0.9), losses.classification_loss(NUM_CLASSES)
    )
    batches = [hs.shard(host_batch(seed)) for seed in range(10, 10 + num_steps)]
    train_state = updater.init(0, batches[0])
    train_state, metrics = run_steps(updater, train_state, batches)
    hs.assert_replicas_identical((train_state.params, train_state.state))
    return flat_result(hs.unreplicate(train_state), metrics)


def flat_result(train_state: hs.TrainState, metrics: list) -> dict[str, np.ndarray]:
    """Params, BatchNorm state, key and per-step losses of an unreplicated or global TrainState."""
    result = {"loss": np.array([m["loss"] for m in metrics])}
    for field in ("params", "state", "rng"):
        tree = to_host(getattr(train_state, field))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            result[f"{field}{jax.tree_util.keystr(path)}"] = leaf
    return result


def train_jit_with_dropout(
    param_sharding: str = "replicated", num_steps: int = 3, keep_train_state: bool = False
) -> dict:
    """3 jit steps with dropout and augmentation on fixed global batches, on every device.

    The randomness is drawn over the global batch from the one key, so the result must
    not depend on the device count or the processes. Run in-process (4 devices), in 1-
    and 8-device subprocesses and on 2 processes x 2 devices; each process feeds its
    slice of the global batch, as the input pipeline does.

    Returns:
      `flat_result` of the run, and its final `train_state` if `keep_train_state`.
    """
    updater = hs.Updater(
        bn_mlp(None, dropout_rate=0.3),
        optax.sgd(0.1, momentum=0.9),
        losses.classification_loss(NUM_CLASSES),
        augment_fn=data.make_augment_fn(max_shift=1),
        backend="jit",
        param_sharding=param_sharding,
    )
    per_process = GLOBAL_BATCH // jax.process_count()
    first = jax.process_index() * per_process
    batches = [
        hs.shard(jax.tree.map(lambda x: x[first : first + per_process], host_batch(seed)))
        for seed in range(10, 10 + num_steps)
    ]
    train_state, metrics = run_steps(updater, updater.init(0, batches[0]), batches)
    result = flat_result(train_state, metrics)
    if keep_train_state:
        result["train_state"] = train_state
    return result


def per_device_step_reference(forward, loss_fn, host_train_state, batch):
    """Each device's loss, new state and gradients, computed with no cross-device averaging."""

    def per_device(params, state, batch):
        def loss(params):
            outputs, new_state = forward.apply(params, state, None, batch, is_training=True)
            loss, metrics = loss_fn(outputs, batch)
            return loss, (new_state, metrics)

        (loss, (new_state, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return loss, new_state, metrics, grads

    return jax.device_get(
        jax.pmap(per_device)(host_train_state.params, host_train_state.state, batch)
    )
