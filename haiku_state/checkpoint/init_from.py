"""`warm_start` (config key `init_from`): a fresh run's params and state from another run.

Only params and state move (not opt_state, step or keys: the new run's own
optimizer starts afresh). Leaves whose name matches `skip` keep their fresh
initialisation, e.g. `skip="logits"` for a classifier head of another class
count; every other difference between the checkpoint and the model is refused
by name. Names are `<tree>/<haiku path>`, e.g. `params/logits/w` or
`state/stem_bn/~/mean_ema/average`, matched with `re.search`. The checkpoint is
read through a read-only `Checkpointer`, so its format version and integrity are
checked as a resume checks them.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np
from absl import logging

from haiku_state import replication, sharding
from haiku_state.checkpoint.checkpointer import Checkpointer
from haiku_state.guards.checkpoint_integrity import leaf_name
from haiku_state.updater import TrainState

WARM_STARTED_TREES = ("params", "state")


def locate(path: str) -> tuple[str, int | None]:
    """The checkpoint directory and step that `path` names.

    `path` is a step directory (`.../checkpoints/600`), a checkpoint directory
    (`.../checkpoints`: its newest complete step) or a workdir holding one.
    """
    path = os.path.abspath(path)
    if os.path.basename(path).isdigit():
        return os.path.dirname(path), int(os.path.basename(path))
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), None
    return path, None


def _merge(
    fresh: Any, saved: Any, tree: str, skip: re.Pattern | None, problems: list, skipped: list
) -> Any:
    """`fresh` with every leaf taken from `saved`, except skipped ones; notes mismatches and
    the names of the leaves skipped."""
    saved_leaves = {
        leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(saved)
    }
    fresh_names = set()

    def take(path, leaf):
        name = f"{tree}/{leaf_name(path)}"
        fresh_names.add(name)
        if skip is not None and skip.search(name):
            skipped.append(name)
            return leaf
        if leaf_name(path) not in saved_leaves:
            problems.append(f"{name}: not in the checkpoint")
            return leaf
        value = saved_leaves[leaf_name(path)]
        if (value.shape, value.dtype) != (leaf.shape, leaf.dtype):
            problems.append(
                f"{name}: checkpoint {value.shape} {value.dtype} vs model {leaf.shape} {leaf.dtype}"
            )
            return leaf
        return value

    merged = jax.tree_util.tree_map_with_path(take, fresh)
    for name in saved_leaves:
        full = f"{tree}/{name}"
        if full not in fresh_names and not (skip is not None and skip.search(full)):
            problems.append(f"{full}: in the checkpoint but not in the model")
    return merged


def _check_skip_matches(pattern: re.Pattern, train_state: TrainState, saved: Any, path: str):
    """Refuses a `skip` matching no leaf of the model or the checkpoint: it would skip nothing."""
    names = []
    for tree in WARM_STARTED_TREES:
        for source in (getattr(train_state, tree), saved[tree]):
            names += [
                f"{tree}/{leaf_name(p)}" for p, _ in jax.tree_util.tree_leaves_with_path(source)
            ]
    if not any(pattern.search(name) for name in names):
        shown = sorted(set(names))
        raise ValueError(
            f"config.init_skip={pattern.pattern!r} matches none of the leaves of the model or of "
            f"config.init_from={path}, so it would skip nothing; the leaves are "
            + ", ".join(shown[:6])
            + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")
            + ". Correct the regex, or leave init_skip empty."
        )


def warm_start(train_state: TrainState, path: str, skip: str, axis_name: str) -> TrainState:
    """`train_state` with params and state from the checkpoint at `path` (see the module doc).

    Of either layout, from a checkpoint of either: a jit train state gets each
    saved leaf in the sharding of the leaf it replaces.

    Raises:
      FileNotFoundError: if `path` holds no complete checkpoint.
      ValueError: if `skip` matches no leaf (it would skip nothing).
      checkpoint.UnsupportedFormatError: if the step is of a format version this
        code does not read (a directory's newest step: no fallback past it).
      ValueError: naming every leaf that differs and is not skipped; nothing is loaded.
    """
    directory, step = locate(path)
    with Checkpointer(directory, read_only=True) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None or step not in checkpointer.all_steps():
            raise FileNotFoundError(f"config.init_from={path}: no complete checkpoint there.")
        saved = checkpointer.read_trees(step)
    pattern = re.compile(skip) if skip else None
    problems: list[str] = []
    skipped: list[str] = []
    global_layout = sharding.is_global(train_state)
    trees = {}
    for tree in WARM_STARTED_TREES:
        current = getattr(train_state, tree)
        # Only the shapes and dtypes of a jit train state's global arrays are compared.
        fresh = current if global_layout else jax.device_get(replication.unreplicate(current))
        trees[tree] = _merge(fresh, saved[tree], tree, pattern, problems, skipped)
    if pattern is not None:
        _check_skip_matches(pattern, train_state, saved, path)
    if problems:
        raise ValueError(
            f"config.init_from={path} (step {step}) does not fit the model: "
            + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". Set config.init_skip to a regex of the leaves to initialise afresh."
        )
    _log_loaded(directory, step, skip, len(jax.tree.leaves(trees)), skipped)
    if global_layout:
        placed = {
            tree: jax.tree.map(_place_like, trees[tree], getattr(train_state, tree))
            for tree in trees
        }
        return train_state._replace(**placed)
    replicated = {tree: replication.replicate(trees[tree], axis_name) for tree in trees}
    return train_state._replace(**replicated)


def _log_loaded(directory: str, step: int, skip: str, leaves: int, skipped: list[str]) -> None:
    """Says how many leaves of params and state were loaded and skipped; warns if none loaded."""
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
        f"; {len(skipped)} freshly initialised (config.init_skip={skip!r}): "
        + ", ".join(skipped[:6])
        + (f" and {len(skipped) - 6} more" if len(skipped) > 6 else "")
        if skipped
        else "",
    )


def _place_like(value: Any, fresh: jax.Array) -> jax.Array:
    """A saved host value in the sharding of the fresh global array it replaces (or `fresh`)."""
    if not isinstance(value, np.ndarray):
        return fresh  # Skipped: the fresh initialisation.
    return jax.make_array_from_callback(fresh.shape, fresh.sharding, lambda index: value[index])
