"""One process of a multi-process check of the replica and key assertions.

    python tests/multiprocess_checks.py PORT NUM_PROCESSES PROCESS_ID

Run by `test_multiprocess.py` once per process, each with 2 simulated CPU
devices. Every process prints one `RESULT <name> <outcome>` line per check, so
the test can verify that all processes reach the same verdict (a check that
raised on one process only would leave the others waiting in the next
collective).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np


def report(name: str, verdict: str) -> None:
    """Prints `RESULT <name> <verdict>` in one write: the C++ collectives (Gloo) log
    to this process's stdout from their own threads, between the parts of a print."""
    os.write(1, f"RESULT {name} {verdict}\n".encode())


def outcome(check) -> str:
    try:
        check()
    except (AssertionError, ValueError) as e:
        return "raised: " + str(e).replace("\n", " ")
    return "passed"


def main(port: int, num_processes: int, process_id: int) -> None:
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    import haiku_state as hs

    tree = hs.replicate({"w": jnp.arange(6.0).reshape(2, 3), "count": jnp.int32(7)})
    report("identical", outcome(lambda: hs.assert_replicas_identical(tree)))

    # The last device of the last process holds a copy that differs in one element.
    local = np.array(jax.device_get(tree["w"]))
    if process_id == num_processes - 1:
        local[-1, 0, 0] += 1e-6
    perturbed = {"w": hs.shard(local.reshape(-1, 3)), "count": tree["count"]}
    report("perturbed", outcome(lambda: hs.assert_replicas_identical(perturbed)))

    # Keys distinct on each process but equal across processes (every process folds
    # in local indices 0 and 1): only the cross-process comparison can catch it.
    local_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.key(0), jnp.arange(jax.local_device_count())
    )
    report("keys_local", outcome(lambda: hs.assert_keys_distinct(local_keys)))
    global_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.key(0),
        jnp.arange(jax.local_device_count()) + process_id * jax.local_device_count(),
    )
    report("keys_global", outcome(lambda: hs.assert_keys_distinct(global_keys)))

    # The config of the last process differs in one nested key.
    from ml_collections import ConfigDict

    from haiku_state.guards import workdir as workdir_lib

    config = ConfigDict({"seed": 0, "optimizer": {"name": "sgd", "learning_rate": 0.1}})
    config.data = {"dir": f"/mnt/host{process_id}/data"}  # Where each host mounts it may differ.
    same = outcome(lambda: workdir_lib.check_same_config_on_every_process(config))
    report("same_config", same)
    if process_id == num_processes - 1:
        config.optimizer.learning_rate = 0.2
    other = outcome(lambda: workdir_lib.check_same_config_on_every_process(config))
    report("other_config", other)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:4]))
