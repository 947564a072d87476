"""One process of the jit backend's multi-process run: 2 processes x 2 devices.

    python tests/multiprocess_jit.py PORT NUM_PROCESSES PROCESS_ID OUT.npz FROM_DIR TO_DIR

Run by `test_multiprocess.py` once per process. Every process trains the same fsdp
run on its slice of the global batches, checks the invariants of the global train
state (collectives over both processes), and process 0 saves the result for
comparison with one process of 4 devices. Each process then prints the verdict of
the replica check on a copy perturbed on the last device of the last process.

Checkpoints: the processes restore the fsdp checkpoint that one process of 4
devices wrote in FROM_DIR onto their 2 x 2 devices and save it again to TO_DIR,
each process writing its own shards; each prints the bytes it wrote.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from multiprocess_checks import report


def main(
    port: int, num_processes: int, process_id: int, out_path: str, from_dir: str, to_dir: str
) -> None:
    # No absl flags parsed: Orbax's asynchronous saves need none across processes.
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    import updater_helpers

    from haiku_state.guards import replicas

    result = updater_helpers.train_jit_with_dropout("fsdp", keep_train_state=True)
    train_state = result.pop("train_state")
    replicas.assert_train_state_invariants(train_state)
    if process_id == 0:
        np.savez(out_path, **result)

    # The last device of the last process holds a BatchNorm average one ulp off.
    leaf = train_state.state["mlp/batch_norm/~/mean_ema"]["average"]
    copies = []
    for shard in leaf.addressable_shards:
        copy = np.array(shard.data)
        if shard.device == jax.devices()[-1]:
            copy = np.nextafter(copy, np.float32(np.inf))
        copies.append(jax.device_put(copy, shard.device))
    perturbed = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, copies)
    state = {**train_state.state}
    state["mlp/batch_norm/~/mean_ema"] = {
        **state["mlp/batch_norm/~/mean_ema"],
        "average": perturbed,
    }
    try:
        replicas.assert_train_state_invariants(train_state._replace(state=state))
        report("perturbed", "passed")
    except AssertionError as e:
        report("perturbed", "raised: " + str(e).replace("\n", " "))
    resave_checkpoint(from_dir, to_dir)
    jax.distributed.shutdown()


def resave_checkpoint(from_dir: str, to_dir: str) -> None:
    """Restores the 4-device checkpoint in `from_dir` onto these processes, saves it to `to_dir`."""
    from checkpoint_helpers import make_batch, make_jit_updater

    from haiku_state.checkpoint import Checkpointer

    like = make_jit_updater(2048).init(5, make_batch(0))
    with Checkpointer(from_dir, read_only=True) as checkpointer:
        restored = checkpointer.restore(like)
    with Checkpointer(to_dir) as checkpointer:
        checkpointer.save(restored)
    [step] = [name for name in os.listdir(to_dir) if name.isdigit()]
    mine = os.path.join(to_dir, step, "train_state", f"ocdbt.process_{jax.process_index()}")
    written = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(mine)
        for name in names
    )
    report("wrote", f"{written} bytes")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
