"""The Updater's dispatch: its call against the traced program it runs and that program
compiled ahead (AOT), interleaved in one process, per backend.

    python -m benchmarks.dispatch [--cpu_devices=2] [--calls=200] [--rounds=9]
        [--hidden_layers=2] [--steps_per_call=1]

An MLP of batch 32 (the step is short, so the call's own cost shows), at most two calls in
flight as in the loop. `--hidden_layers=60` gives a train state of ~370 leaves, as many as a
ResNet's, so what the call costs per leaf shows; `--steps_per_call=5` times `update_steps` on
a list of 5 batches, as the loop calls it. Prints one JSON object: the median and minimum ms a
call of each.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch")
    parser.add_argument("--cpu_devices", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hidden_layers", type=int, default=2)
    parser.add_argument("--steps_per_call", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.cpu_devices))
    shape = (args.hidden_layers, args.steps_per_call)
    print(
        json.dumps(
            {b: _measure(b, args.calls, args.rounds, *shape) for b in ("pmap", "shard_map", "jit")}
        )
    )


def _measure(
    backend: str, calls: int, rounds: int, hidden_layers: int = 2, steps_per_call: int = 1
) -> dict[str, dict[str, float]]:
    import haiku as hk
    import numpy as np
    import optax

    import haiku_state as hs

    def net(batch, is_training):
        del is_training
        return hk.nets.MLP([64] * hidden_layers + [10])(
            batch["image"].reshape(batch["image"].shape[0], -1)
        )

    def loss_fn(logits, batch):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return loss.mean(), {}

    updater = hs.Updater(hk.transform_with_state(net), optax.sgd(0.1), loss_fn, backend=backend)
    batch = hs.shard({"image": np.ones((32, 8, 8), np.float32), "label": np.zeros(32, np.int32)})
    method = "update" if steps_per_call == 1 else "update_steps"
    batches = batch if steps_per_call == 1 else [batch] * steps_per_call
    update = getattr(updater, method)
    train_state, _ = update(updater.init(0, batch), batches, with_global_norms=False)
    (traced,) = updater._programs.values()  # The one program the call above built.
    view = updater.layout.view(batches)
    aot = traced.lower(train_state, view).compile()
    variants = {
        "updater": lambda ts: update(ts, batches, with_global_norms=False),
        "traced": lambda ts: traced(ts, view),
        "aot": lambda ts: aot(ts, view),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            train_state, ms = _ms_per_call(call, train_state, calls)
            times[name].append(ms)
    return {
        "median_ms": {k: round(float(np.median(v)), 3) for k, v in times.items()},
        "min_ms": {k: round(min(v), 3) for k, v in times.items()},
    }


def _ms_per_call(call, train_state, calls: int):
    """`calls` calls of `call` in a row, at most two in flight: the train state after them and
    the ms a call took."""
    previous, start = None, time.perf_counter()
    for _ in range(calls):
        train_state, metrics = call(train_state)
        if previous is not None:
            previous.block_until_ready()
        previous = metrics["loss"]
    previous.block_until_ready()
    return train_state, (time.perf_counter() - start) / calls * 1e3


if __name__ == "__main__":
    main()
