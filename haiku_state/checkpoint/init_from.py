"""`warm_start` (config key `init_from`): a fresh run's params and state from another run
(and its moving averages, if it keeps them, start from them).

Leaves whose name (`params/logits/w`) matches the regex `skip` keep their fresh
initialisation (a classifier head of another class count); any other difference
is refused by name. The read is a read-only `Checkpointer`'s, checked as on resume.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np
from absl import logging

from haiku_state import errors, replication, sharding
from haiku_state.checkpoint.checkpointer import Checkpointer
from haiku_state.guards.checkpoint_integrity import leaf_name
from haiku_state.updater import TrainState

WARM_STARTED_TREES = ("params", "state")


def locate(path: str) -> tuple[str, int | None]:
    """The checkpoint directory and step (None: the newest) of a step directory
    (`.../checkpoints/600`), a checkpoint directory, or a workdir holding one."""
    path = os.path.abspath(path)
    if os.path.basename(path).isdigit():
        return os.path.dirname(path), int(os.path.basename(path))
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), None
    return path, None


def _named_leaves(tree: str, source: Any) -> dict[str, Any]:
    """The leaves of `source` by their names in a train state (`params/logits/w`)."""
    leaves = jax.tree_util.tree_leaves_with_path(source)
    return {f"{tree}/{leaf_name(path)}": leaf for path, leaf in leaves}


def _merge(
    fresh: Any, saved: Any, tree: str, skip: re.Pattern | None, problems: list, skipped: list
) -> Any:
    """`fresh` with every leaf not skipped from `saved`; notes mismatches and skipped names."""
    saved_leaves = _named_leaves(tree, saved)

    def take(path, leaf):
        name = f"{tree}/{leaf_name(path)}"
        value = saved_leaves.pop(name, None)
        if skip is not None and skip.search(name):
            skipped.append(name)
        elif value is None:
            problems.append(f"{name}: not in the checkpoint")
        elif (value.shape, value.dtype) != (leaf.shape, leaf.dtype):
            problems.append(
                f"{name}: checkpoint {value.shape} {value.dtype} vs model {leaf.shape} {leaf.dtype}"
            )
        else:
            return value
        return leaf

    merged = jax.tree_util.tree_map_with_path(take, fresh)
    for name in saved_leaves:  # Those the model has not taken.
        if not (skip is not None and skip.search(name)):
            problems.append(f"{name}: in the checkpoint but not in the model")
    return merged


def warm_start(train_state: TrainState, path: str, skip: str, axis_name: str) -> TrainState:
    """`train_state` (either layout) with params and state from the checkpoint at `path`
    (either layout); a directory's newest step, with no fallback past it."""
    directory, step = locate(path)
    with Checkpointer(directory, read_only=True) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None or step not in checkpointer.all_steps():
            raise errors.MissingFile(f"config.init_from={path}: no complete checkpoint there.")
        saved = checkpointer.read_trees(step)
    pattern = re.compile(skip) if skip else None
    problems: list[str] = []
    skipped: list[str] = []
    names: set[str] = set()  # Of the leaves of the model and the checkpoint.
    global_layout = sharding.is_global(train_state)
    trees = {}
    for tree in WARM_STARTED_TREES:
        current = getattr(train_state, tree)
        # Only the shapes and dtypes of a jit train state's global arrays are compared.
        fresh = current if global_layout else jax.device_get(replication.unreplicate(current))
        names |= _named_leaves(tree, fresh).keys() | _named_leaves(tree, saved[tree]).keys()
        trees[tree] = _merge(fresh, saved[tree], tree, pattern, problems, skipped)
    if pattern is not None and not any(pattern.search(name) for name in names):
        raise errors.InvalidValue(
            f"config.init_skip={skip!r} matches none of the leaves of the model or of "
            f"config.init_from={path}, so it would skip nothing; the leaves are "
            f"{_listed(sorted(names), 6)}. Correct the regex, or leave init_skip empty."
        )
    if problems:
        raise errors.InvalidValue(
            f"config.init_from={path} (step {step}) does not fit the model: "
            f"{_listed(problems, 8, '; ', '; and')}. Set config.init_skip to a regex of the "
            "leaves to initialise afresh."
        )
    _log_loaded(directory, step, skip, len(jax.tree.leaves(trees)), skipped)

    def placed(source: Any) -> list[Any]:  # Params and state in the layout of `source`'s.
        if global_layout:
            return [jax.tree.map(_place_like, trees[t], getattr(source, t)) for t in trees]
        return [replication.replicate(trees[tree], axis_name) for tree in trees]

    params, state = placed(train_state)
    ema = train_state.ema  # The moving averages start from the params and state loaded.
    ema = None if ema is None else type(ema)(*placed(ema))
    return train_state._replace(params=params, state=state, ema=ema)


def _log_loaded(directory: str, step: int, skip: str, leaves: int, skipped: list[str]) -> None:
    """Logs how many leaves were loaded, and which were skipped; warns if none were loaded."""
    if len(skipped) == leaves:
        logging.warning(
            "Warm start from %s step %d loaded nothing: config.init_skip=%r matches all %d "
            "leaves of params and state, which keep their fresh initialisation.",
            directory,
            step,
            skip,
            leaves,
        )
        return
    logging.info(
        "Warm start: %d of %d leaves of params and state from %s step %d%s.",
        leaves - len(skipped),
        leaves,
        directory,
        step,
        f"; {len(skipped)} freshly initialised (config.init_skip={skip!r}): {_listed(skipped, 6)}"
        if skipped
        else "",
    )


def _listed(names: list[str], shown: int, sep: str = ", ", more: str = " and") -> str:
    """The first `shown` of `names`, and how many more."""
    rest = len(names) - shown
    return sep.join(names[:shown]) + (f"{more} {rest} more" if rest > 0 else "")


def _place_like(value: Any, fresh: jax.Array) -> jax.Array:
    """A saved host value in the sharding of the fresh global array it replaces; a skipped
    leaf (the fresh array itself) as it is."""
    return sharding.put_global(value, fresh.sharding) if isinstance(value, np.ndarray) else fresh
