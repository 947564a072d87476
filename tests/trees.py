"""A replicated params-like tree, and copies of it with one replica changed."""

import jax
import jax.numpy as jnp
import numpy as np

import haiku_state as hs


def replicated_tree() -> dict:
    """A params-like tree with float, int and typed-key leaves, replicated on every device."""
    tree = {
        "mlp/linear": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)},
        "mlp/linear_1": {"w": jnp.ones((3, 2)), "b": jnp.full((2,), 0.5)},
        "counter": jnp.array(7, jnp.int32),
        "key": jax.random.key(0),
    }
    return hs.replicate(tree)


def is_typed_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def with_replica_changed(tree, path: tuple, device: int, new_value):
    """A host copy of `tree` in which replica `device` of the leaf at `path` is `new_value`."""
    copy = jax.tree.map(lambda x: x if is_typed_key(x) else np.array(x), tree)
    leaf = copy
    for name in path[:-1]:
        leaf = leaf[name]
    leaf[path[-1]][device] = new_value
    return copy
