"""The Updater's dispatch: its call against the traced program it runs and that program
compiled ahead (AOT), interleaved in one process, per backend.

    python -m benchmarks.dispatch [--cpu_devices=2] [--calls=200] [--rounds=9]

An MLP of batch 32 (the step is short, so the call's own cost shows), at most two calls in
flight as in the loop. Prints one JSON object: the median and minimum ms a call of each.
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
    args = parser.parse_args()
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.cpu_devices))
    print(
        json.dumps({b: _measure(b, args.calls, args.rounds) for b in ("pmap", "shard_map", "jit")})
    )


def _measure(backend: str, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    import haiku as hk
    import numpy as np
    import optax

    import haiku_state as hs

    def net(batch, is_training):
        del is_training
        return hk.nets.MLP([64, 64, 10])(batch["image"].reshape(batch["image"].shape[0], -1))

    def loss_fn(logits, batch):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return loss.mean(), {}

    updater = hs.Updater(hk.transform_with_state(net), optax.sgd(0.1), loss_fn, backend=backend)
    batch = hs.shard({"image": np.ones((32, 8, 8), np.float32), "label": np.zeros(32, np.int32)})
    train_state, _ = updater.update(updater.init(0, batch), batch, with_global_norms=False)
    (traced,) = updater._programs.values()  # The one program the call above built.
    view = updater.layout.view(batch)
    aot = traced.lower(train_state, view).compile()
    variants = {
        "updater": lambda ts: updater.update(ts, batch, with_global_norms=False),
        "traced": lambda ts: traced(ts, view),
        "aot": lambda ts: aot(ts, view),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            previous, start = None, time.perf_counter()
            for _ in range(calls):
                train_state, metrics = call(train_state)
                if previous is not None:
                    previous.block_until_ready()
                previous = metrics["loss"]
            previous.block_until_ready()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {
        "median_ms": {k: round(float(np.median(v)), 3) for k, v in times.items()},
        "min_ms": {k: round(min(v), 3) for k, v in times.items()},
    }


if __name__ == "__main__":
    main()
