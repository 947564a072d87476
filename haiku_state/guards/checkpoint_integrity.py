"""Whether a checkpoint can be trusted (fingerprints, version 1's CRC-32s, finite params),
and the first leaf where it does not fit a model, by a stable leaf name."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _mix(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: each input bit flips each output bit with odds 1/2."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (a trailing axis of 2 for 64-bit types)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 digest of an array's bits and their positions, the same for any sharding.

    The uint32 sum of `mix(bits + golden * flat index)`: exact in any order, so it is
    computed where the shards are. The mixing makes any change show but with odds
    about 2**-32 (a plain weighted sum misses two flipped sign bits).
    """
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):  # The flat (row-major) index, in uint32.
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return jnp.sum(_mix(words + index * jnp.uint32(0x9E3779B9)), dtype=jnp.uint32)


fingerprint = jax.jit(_fingerprint)


@jax.jit
def device_fingerprints(trees: PyTree) -> PyTree:
    """The `fingerprint` of every array of `trees`, on the devices (nothing waits for them):
    one program for a whole tree, not one per leaf shape."""
    return jax.tree.map(_fingerprint, trees)


@jax.jit
def _tree_all_finite(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), tree)


def fingerprint_trees(trees: dict[str, PyTree]) -> dict[str, int]:
    """The `fingerprint` of every array of `trees`, by leaf name; every process calls it."""
    return named_values(device_fingerprints(trees), int)


def host_fingerprints(trees: PyTree) -> dict[str, int]:
    """The `fingerprint` of every numpy array of `trees`, by leaf name, computed on the host
    (the same uint32 arithmetic, so it matches the devices' to the bit): a save's writer
    thread fingerprints its host copies without compiling or dispatching a program."""
    return {
        leaf_name(path): _host_fingerprint(np.asarray(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(trees)
    }


def _host_fingerprint(x: np.ndarray, chunk: int = 1 << 22) -> int:
    """`_fingerprint` in numpy, `chunk` words at a time (bounded memory)."""
    if x.dtype == np.bool_:
        words = x.astype(np.uint32).reshape(-1)
    else:
        unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
        words = np.ascontiguousarray(x).view(unsigned).reshape(-1)  # 64-bit: two words each.
    total = 0
    for start in range(0, words.size, chunk):
        part = words[start : start + chunk].astype(np.uint32)
        part += np.arange(start, start + part.size, dtype=np.uint32) * np.uint32(0x9E3779B9)
        part ^= part >> np.uint32(16)  # `_mix`, in place.
        part *= np.uint32(0x85EBCA6B)
        part ^= part >> np.uint32(13)
        part *= np.uint32(0xC2B2AE35)
        part ^= part >> np.uint32(16)
        total += int(part.sum(dtype=np.uint32))
    return total % 2**32


def named_values(tree: PyTree, kind: type) -> dict[str, Any]:
    """A tree of replicated scalars as host values by leaf name, in one transfer."""
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(tree)
    values = jax.device_get([leaf.addressable_data(0) for _, leaf in paths_and_leaves])
    return {leaf_name(path): kind(v) for (path, _), v in zip(paths_and_leaves, values, strict=True)}


def verify_fingerprints(trees: dict[str, PyTree], expected: dict[str, int]) -> str | None:
    """Why restored `trees` cannot be trusted (an array unlike its fingerprint, or params
    not finite), or None."""
    finite = _tree_all_finite(trees["params"])
    for name, value in fingerprint_trees(trees).items():
        if expected.get(name) != value:
            return f"{name}: its values do not match the fingerprint saved with it"
    for name, is_finite in named_values(finite, bool).items():
        if not is_finite:
            return f"params/{name}: holds non-finite values"
    return None


def verify_host_fingerprints(trees: dict[str, PyTree], expected: dict[str, int]) -> str | None:
    """As `verify_fingerprints` for host `trees` (numpy): no program."""
    for name, value in host_fingerprints(trees).items():
        if expected.get(name) != value:
            return f"{name}: its values do not match the fingerprint saved with it"
    for path, leaf in jax.tree_util.tree_leaves_with_path(trees["params"]):
        if not _all_finite_on_host(leaf):
            return f"params/{leaf_name(path)}: holds non-finite values"
    return None


def verify_checksums(trees: dict[str, PyTree], expected: dict[str, int]) -> str | None:
    """As `verify_fingerprints` for the host `trees` of a version 1 step: CRC-32s of the bytes."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(trees):
        checksum = zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        if expected.get(leaf_name(path)) != checksum:
            return f"{leaf_name(path)}: its bytes do not match the checksum saved with it"
    for path, leaf in jax.tree_util.tree_leaves_with_path(trees["params"]):
        if not _all_finite_on_host(leaf):
            return f"params{jax.tree_util.keystr(path)}: holds non-finite values"
    return None


def _all_finite_on_host(leaf: np.ndarray) -> bool:
    return not np.issubdtype(leaf.dtype, np.inexact) or bool(np.all(np.isfinite(leaf)))


def leaf_name(path: tuple) -> str:
    """A key path as one stable name, `params/mlp/linear/w`, whatever the containers (so a
    NamedTuple field matches a saved dict key)."""
    names = []
    for key in path:
        attribute = next((a for a in ("key", "name", "idx") if hasattr(key, a)), None)
        names.append(str(key if attribute is None else getattr(key, attribute)))
    return "/".join(names)


def first_mismatch(model: Mapping[str, PyTree], saved: Mapping[str, PyTree]) -> str | None:
    """`"<tree><path>: <what differs>"` at the first leaf where `saved` does not fit `model`
    (trees by name, of leaves with shape and dtype), or None."""
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


def _leaf_signatures(tree: PyTree) -> dict[str, tuple[str, tuple[int, ...], np.dtype]]:
    """Each leaf by its `leaf_name`: (printable path, shape, dtype)."""
    return {
        leaf_name(path): (
            jax.tree_util.keystr(path),
            tuple(getattr(leaf, "shape", ())),
            np.dtype(leaf.dtype),
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
