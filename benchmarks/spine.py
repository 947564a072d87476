r"""What a reader must open to follow a run: the modules a real run calls, traced.

    python -m benchmarks.spine [--config=experiments/resnet.py] [--out=PATH]

Runs `python -m haiku_state.train` in this process for 20 steps (a save at step
10) under a profiler that records, on every thread, which of the library's
modules a call lands in. Two spans are reported, each with the modules and
their lines (`wc -l`), the guards (`haiku_state/guards/`) apart:

- `step_to_save`: from the first `Updater.update` to the end of the first
  `Checkpointer.save`, the path a step takes to a checkpoint;
- `command_line_to_save`: from the command line to the end of the first save.

Prints one JSON record (also written to `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from typing import Any

LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "haiku_state")
GUARDS = os.path.join(LIBRARY, "guards")


class _Tracer:
    """Records the library modules called, from the start and from the first update on."""

    def __init__(self):
        self.command_line: set[str] = set()
        self.step: set[str] | None = None  # From the first update on.
        self.done = False

    def __call__(self, frame, event, arg) -> None:
        del arg  # Unused.
        if self.done or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if not path.startswith(LIBRARY):
            return
        name = frame.f_code.co_name
        if event == "call":
            if self.step is None and name == "update" and path.endswith("updater.py"):
                self.step = set()
            self.command_line.add(path)
            if self.step is not None:
                self.step.add(path)
        elif name == "save" and path.endswith(os.path.join("checkpoint", "checkpointer.py")):
            self.done = self.step is not None


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def _span(paths: set[str]) -> dict[str, Any]:
    """The modules of `paths` and their lines, the guards apart."""
    modules = {os.path.relpath(p, os.path.dirname(LIBRARY)): _lines(p) for p in sorted(paths)}
    guards = {m: n for m, n in modules.items() if m.startswith("haiku_state/guards/")}
    read = {m: n for m, n in modules.items() if m not in guards}
    return {
        "modules": len(read),
        "lines": sum(read.values()),
        "guard_modules": len(guards),
        "guard_lines": sum(guards.values()),
        "read": read,
        "guards": guards,
    }


def trace(config: str, workdir: str) -> dict[str, Any]:
    """Runs 20 steps of `config` in `workdir` under the tracer; returns both spans."""
    from haiku_state import train  # After the profiler is set: the imports are not calls.

    tracer = _Tracer()
    argv = [
        "train",
        f"--config={config}",
        f"--workdir={workdir}",
        "--config.steps=20",
        "--config.optimizer.warmup_steps=2",
        "--config.log_every=5",
        "--config.checkpoint_every=10",
        "--config.eval_every=20",
    ]
    sys.argv = argv  # ml_collections reads the overrides from sys.argv.
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        train.main(argv)
    except SystemExit as e:
        if e.code:
            raise
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {
        "config": config,
        "step_to_save": _span(tracer.step or set()),
        "command_line_to_save": _span(tracer.command_line),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/resnet.py")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        record = trace(args.config, os.path.join(workdir, "run"))
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
