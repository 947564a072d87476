"""One process of the jit backend's multi-process run: 2 processes x 2 devices.

    python tests/multiprocess_jit.py PORT NUM_PROCESSES PROCESS_ID OUT.npz

Run by `test_multiprocess.py` once per process. Every process trains the same fsdp
run on its slice of the global batches, checks the invariants of the global train
state (collectives over both processes), and process 0 saves the result for
comparison with one process of 4 devices. Each process then prints the verdict of
the replica check on a copy perturbed on the last device of the last process.
"""

from __future__ import annotations

import sys

import jax
import numpy as np


def main(port: int, num_processes: int, process_id: int, out_path: str) -> None:
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    import updater_helpers

    from haiku_state import asserts

    result = updater_helpers.train_jit_with_dropout("fsdp", keep_train_state=True)
    train_state = result.pop("train_state")
    asserts.assert_train_state_invariants(train_state)
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
        asserts.assert_train_state_invariants(train_state._replace(state=state))
        print("RESULT perturbed passed", flush=True)
    except AssertionError as e:
        print("RESULT perturbed raised:", str(e).replace("\n", " "), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
