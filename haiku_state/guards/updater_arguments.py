"""The Updater's argument checks: a clear one-line error before anything runs or is donated."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from haiku_state import errors, replication, sharding


def check_backend(backend: str, param_sharding: str = "replicated") -> None:
    """Raises ValueError unless an Updater takes this backend and param_sharding."""
    if backend not in replication.BACKENDS:
        raise errors.InvalidValue(
            f"Unknown backend {backend!r}; expected one of {replication.BACKENDS}."
        )
    sharding.check_param_sharding(param_sharding)
    if param_sharding != "replicated" and backend != "jit":
        raise errors.InvalidValue(
            f"param_sharding={param_sharding!r} needs backend='jit'; backend={backend!r} "
            "holds a whole replica on every device (param_sharding='replicated')."
        )


def check_method(method: str, methods: tuple[str, ...]) -> None:
    """Raises ValueError unless `method` names one of the Updater's programs."""
    if method not in methods:
        raise errors.InvalidValue(f"Unknown Updater method {method!r}; expected one of {methods}.")


def check_step_options(accumulation_steps: int, ema_decay: float | None) -> None:
    """Raises ValueError unless `accumulation_steps` is a positive integer and `ema_decay` is
    None, 0 (off) or in (0, 1)."""
    integer = isinstance(accumulation_steps, int) and not isinstance(accumulation_steps, bool)
    if not integer or accumulation_steps < 1:
        raise errors.InvalidValue(
            f"accumulation_steps={accumulation_steps!r} must be a positive integer."
        )
    if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
        raise errors.InvalidValue(f"ema_decay={ema_decay!r} must be in [0, 1) (0 or None: no EMA).")


def check_ema(train_state: Any, ema_decay: float | None, where: str) -> None:
    """Refuses a train state with moving averages for an Updater without `ema_decay`, or the
    other way round: the step would drop them, or have none to update."""
    if (train_state.ema is None) == (ema_decay is None):
        return
    if ema_decay is None:
        raise errors.InvalidValue(
            f"{where}: train_state.ema holds moving averages, but this Updater has no "
            "ema_decay to update them with; build it with the run's ema_decay."
        )
    raise errors.InvalidValue(
        f"{where}: this Updater keeps moving averages (ema_decay={ema_decay}), but "
        "train_state.ema is None; make the train state with this Updater's init or "
        "abstract_init."
    )


def check_arguments(train_state: Any, batch: Any, where: str, kind: type, layout: Any) -> None:
    """Refuses what is not a `kind` (TrainState) in `layout`, a batch not per device, or a train
    state donated before (its buffers are gone: jax 0.10 aborts on it). Run at every call: the
    train state is looked at in one leaf per field, the batch in its shapes alone."""
    if not isinstance(train_state, kind):
        raise TypeError(f"{where}: expected a {kind.__name__}, got {type(train_state).__name__}.")
    replication.check_batch(batch, where)
    # Donation deletes every leaf at once: a leaf of each field tells, the scan names it.
    if any(is_deleted(_a_leaf(field)) for field in train_state):
        for path, leaf in jax.tree_util.tree_leaves_with_path(train_state):
            if is_deleted(leaf):
                raise errors.InvalidValue(
                    f"{where}: train_state{jax.tree_util.keystr(path)} is deleted: this "
                    "TrainState was donated to an earlier update; use the TrainState that "
                    "update returned."
                )
    layout.check(train_state, where)


def _a_leaf(tree: Any) -> Any:
    """One leaf of `tree`, None if it has none: the first found through its dicts, lists and
    tuples without flattening the rest (a train state's params hold hundreds of leaves).
    Containers are asked about first: most of the nodes it meets are."""
    if isinstance(tree, (dict, list, tuple)):
        for child in tree.values() if isinstance(tree, dict) else tree:
            leaf = _a_leaf(child)
            if leaf is not None:
                return leaf
        return None
    if tree is None or isinstance(tree, jax.Array):
        return tree
    leaves = jax.tree.leaves(tree)  # Another kind of node, or a leaf that is not an array.
    return leaves[0] if leaves else None


def is_deleted(leaf: Any) -> bool:
    """Whether `leaf` is a concrete array whose buffers were donated (a tracer never is)."""
    return (
        isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted()
    )


def check_loss(loss: jax.Array, metrics: Mapping[str, jax.Array]) -> None:
    """Refuses, at trace time, a `loss_fn` whose loss or metrics are not scalars."""
    if jnp.shape(loss) != ():
        raise errors.InvalidValue(
            f"loss_fn must return a scalar loss; got shape {jnp.shape(loss)}. Reduce it "
            "over the batch (e.g. with jnp.mean)."
        )
    for name, value in metrics.items():
        if jnp.shape(value) != ():
            raise errors.InvalidValue(
                f"loss_fn metric {name!r} must be a scalar; got shape {jnp.shape(value)}."
            )


@contextlib.contextmanager
def unbound_axis_refused(where: str, axis_name: str) -> Iterator[None]:
    """Under jit, a collective naming an axis nothing binds: BatchNorm's cross_replica_axis."""
    try:
        yield
    except NameError as e:
        _refuse_unbound_axis(e, where, axis_name)
        raise


def _refuse_unbound_axis(error: NameError, where: str, axis_name: str) -> None:
    """Raises the one-line error of a NameError that names an unbound axis; returns otherwise."""
    if "unbound axis name" in str(error):
        raise errors.InvalidValue(
            f"{where}: the network uses a device axis ({error}); backend='jit' binds none: "
            f"build its BatchNorm with cross_replica_axis=None (not {axis_name!r}), "
            "whose statistics under jit are those of the global batch."
        ) from error


def explain_rejection(error: Exception, train_state: Any, where: str, layout: Any) -> None:
    """What to raise for an `error` a step program raised (before running or donating): the one-line
    error of an unbound axis or of the leaf at fault; returns when it names none (the caller
    re-raises `error`). A function, so that a call costs no context manager when all is well."""
    if isinstance(error, NameError):
        _refuse_unbound_axis(error, where, layout.axis_name)
        return
    if not isinstance(error, (ValueError, TypeError)):
        return
    shardings = layout.shardings(train_state)
    if shardings is None:
        replication.check_device_axis(train_state, where)
        return
    leaves = jax.tree_util.tree_leaves_with_path(train_state)
    for (path, leaf), want in zip(leaves, jax.tree.leaves(shardings), strict=True):
        have = getattr(leaf, "sharding", None)
        if have is None or not have.is_equivalent_to(want, np.ndim(leaf)):
            raise errors.InvalidValue(
                f"{where}: train_state{jax.tree_util.keystr(path)} has sharding {have}; "
                f"param_sharding={layout.param_sharding!r} lays it out as {want.spec} "
                f"on the mesh of all {jax.device_count()} devices."
            ) from error
