"""Where a checkpoint does not fit a model: the first leaf whose path, shape or dtype differs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

PyTree = Any
LeafSignature = tuple[str, tuple[int, ...], np.dtype]  # (printable path, shape, dtype)


def _path_names(path: tuple) -> tuple[str, ...]:
    """A key path as plain names, so a NamedTuple field matches a saved dict key."""
    names = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
        else:
            names.append(str(key))
    return tuple(names)


def leaf_name(path: tuple) -> str:
    """A key path as one stable name, `params/mlp/linear/w`, whatever the containers."""
    return "/".join(_path_names(path))


def _leaf_signatures(tree: PyTree) -> dict[tuple[str, ...], LeafSignature]:
    return {
        _path_names(path): (
            jax.tree_util.keystr(path),
            tuple(getattr(leaf, "shape", ())),
            np.dtype(leaf.dtype),
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def first_mismatch(model: Mapping[str, PyTree], saved: Mapping[str, PyTree]) -> str | None:
    """Describes the first leaf where `saved` (checkpoint metadata) does not fit `model`.

    Args:
      model: the trees the model expects, by name (leaves with shape and dtype).
      saved: the trees of the checkpoint under the same names.

    Returns:
      `"<tree><path>: <what differs>"`, or None when every leaf fits.
    """
    for name, model_tree in model.items():
        model_leaves = _leaf_signatures(model_tree)
        saved_leaves = _leaf_signatures(saved[name]) if saved.get(name) is not None else {}
        for names, (where, shape, dtype) in model_leaves.items():
            if names not in saved_leaves:
                return f"{name}{where}: missing from the checkpoint (model {shape} {dtype})"
            _, saved_shape, saved_dtype = saved_leaves[names]
            if saved_shape != shape:
                return f"{name}{where}: checkpoint {saved_shape} vs model {shape}"
            if saved_dtype != dtype:
                return f"{name}{where}: checkpoint dtype {saved_dtype} vs model dtype {dtype}"
        for names, (where, shape, dtype) in saved_leaves.items():
            if names not in model_leaves:
                return f"{name}{where}: in the checkpoint ({shape} {dtype}) but not in the model"
    return None
