r"""Start-up: how long a run takes to reach its first step, cold and with the compilation cache.

    python -m benchmarks.startup [--experiment=resnet50] [--batch_size=8] [--out=PATH]

Every run is `python -m haiku_state.train` in a process of its own (the time to
the first step counts the imports and the backend's start), on synthetic data of
the experiment's shape, with the compilation cache in a directory of this
benchmark's (`config.compilation_cache_dir`):

1. `cold`: a fresh workdir, an empty cache;
2. `cached`: another fresh workdir, the cache the cold run filled (a rerun);
3. `resumed_cold`: a copy of the cold run's workdir (its checkpoint), an empty cache;
4. `resumed_cached`: the cold run's workdir and cache (a resumed run).

A run's time to the first step runs from its process's start to the moment its
first new step's metrics are in `metrics.jsonl` (logged every step); it is then
stopped with SIGTERM, which saves the step reached (the checkpoint the resumed
runs start from). `speedup.resumed` is `resumed_cold / resumed_cached`
(**target: >= 3**).

`phases` splits the same start-up in one process (`--phase_worker`), cold and
then with the cache: the imports, building the experiment
(`experiment.build_experiment`: the data and the pieces of the step), `Updater.init`
(its compile, or cache load, and its run) and the first step, each with the
programs compiled or loaded (`benchmarks.compiles`).

Prints one JSON record (also written to `--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_S = 0.05
RUNS = ("cold", "cached", "resumed_cold", "resumed_cached")


def _config(experiment: str) -> Any:
    from haiku_state import config as config_lib  # Imports JAX: not at the phases' start.

    return config_lib.load_config_file(os.path.join(REPO, "experiments", f"{experiment}.py"))


def data_overrides(experiment: str, batch_size: int) -> dict[str, int]:
    """Synthetic data (resnet50's) of two batches: its start-up makes no data worth timing."""
    if _config(experiment).data.name != "synthetic":
        return {}
    return {"data.num_train": 2 * batch_size, "data.num_test": batch_size}


def _env() -> dict[str, str]:
    """This environment, with the repository importable."""
    path = os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}


def train_command(
    experiment: str,
    workdir: str,
    cache_dir: str,
    batch_size: int,
    steps: int = 10_000,
    overrides: dict[str, Any] | None = None,
) -> list[str]:
    """`python -m haiku_state.train` of `experiment` on synthetic data, logging every step.

    An experiment's variant (`resnet50:imagenet`, a recipe) keeps its own length and
    cadences, and reads the data `overrides` name (`data.dir`, `log_every`, ...).
    """
    name, _, variant = experiment.partition(":")
    if variant:
        settings = {"batch_size": batch_size, "eval_batch_size": batch_size}
    else:
        settings = {
            "steps": steps,
            "log_every": 1,
            "check_every": steps,
            "eval_every": steps,
            "checkpoint_every": steps,
            "batch_size": batch_size,
            "eval_batch_size": batch_size,
            **data_overrides(name, batch_size),
        }
    settings.update(checkpoint_every_secs=0, compilation_cache_dir=cache_dir, **(overrides or {}))
    config = os.path.join(REPO, "experiments", f"{name}.py") + (f":{variant}" if variant else "")
    return [
        sys.executable,
        "-m",
        "haiku_state.train",
        f"--config={config}",
        f"--workdir={workdir}",
        "--cpu_devices=1",
        *(f"--config.{key}={value}" for key, value in settings.items()),
    ]


def _train_steps(workdir: str) -> list[int]:
    """The steps of the train records in the workdir's `metrics.jsonl` so far."""
    steps = []
    with contextlib.suppress(FileNotFoundError), open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            with contextlib.suppress(ValueError):  # A line being written.
                record = json.loads(line)
                if record.get("split") == "train":
                    steps.append(record["step"])
    return steps


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process, all its threads (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_to_first_step(command: list[str], workdir: str, timeout_s: float) -> dict[str, Any]:
    """Runs `command` until a step beyond the workdir's last logged one; then SIGTERMs it.

    Returns the seconds from the process's start to that step's metrics (None if
    it never came, with `error` saying why), the CPU seconds the process had
    taken by then (what a machine shared with other work measures best), the
    step, and the run's `Start-up` line (where its start went; None if it logged none).
    """
    done = max(_train_steps(workdir), default=0)
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        seconds, cpu_seconds, step, error = None, None, None, None
        while seconds is None and error is None:
            new = [s for s in _train_steps(workdir) if s > done]
            if new:
                seconds, step = time.perf_counter() - start, min(new)
                cpu_seconds = _cpu_seconds(process.pid)
            elif process.poll() is not None:
                error = f"exited with {process.returncode} before a step"
            elif time.perf_counter() - start > timeout_s:
                error = f"no step within {timeout_s:.0f} s"
            else:
                time.sleep(POLL_S)
        process.send_signal(signal.SIGTERM)  # Saves the step reached and exits.
        try:
            process.wait(timeout=max(60.0, timeout_s / 4))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")
    if error:
        error += ": " + output[-2000:]
    lines = [line for line in output.splitlines() if "Start-up " in line]
    startup_line = lines[-1][lines[-1].index("Start-up ") :] if lines else None
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "step": step,
        "error": error,
        "startup_line": startup_line,
    }


def measure_runs(
    experiment: str,
    batch_size: int,
    scratch: str,
    timeout_s: float,
    runs: tuple[str, ...] = RUNS,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `runs` (of `RUNS`, in that order; `cold` first), each's time to its first logged
    step (`train_command`'s, with `overrides`)."""
    cache, empty_cache = os.path.join(scratch, "cache"), os.path.join(scratch, "cache_resumed")
    workdirs = {name: os.path.join(scratch, name) for name in ("cold", "cached", "resumed_cold")}
    results: dict[str, Any] = {}
    for name in runs:
        if name == "resumed_cold":  # The cold run's checkpoint, and no cache.
            shutil.copytree(workdirs["cold"], workdirs[name])
        workdir = workdirs["cold"] if name == "resumed_cached" else workdirs[name]
        cache_dir = empty_cache if name == "resumed_cold" else cache
        command = train_command(experiment, workdir, cache_dir, batch_size, overrides=overrides)
        results[name] = time_to_first_step(command, workdir, timeout_s)
        if name == "cold":
            results["cache_entries_after_cold"] = (
                len(os.listdir(cache)) if os.path.isdir(cache) else 0
            )
    return results


def speedups(runs: dict[str, Any], key: str = "seconds") -> dict[str, float | None]:
    """cold / cached and resumed_cold / resumed_cached (or cold / resumed_cached without
    the first): how many times sooner the cache brings the first step, in `key`
    (`seconds`, or `cpu_seconds`)."""

    def ratio(slow: str, fast: str) -> float | None:
        a, b = (runs.get(name, {}).get(key) for name in (slow, fast))
        return a / b if a and b else None

    return {
        "rerun": ratio("cold", "cached"),
        "resumed": ratio("resumed_cold", "resumed_cached") or ratio("cold", "resumed_cached"),
    }


# -- The phases, in one process -------------------------------------------------------------------


def phase_worker(experiment: str, batch_size: int, cache_dir: str) -> dict[str, Any]:
    """The start-up of a run in this process, phase by phase (imports timed from here)."""
    start = time.perf_counter()
    import jax

    from benchmarks.compiles import CompileEvents
    from haiku_state import compilation_cache
    from haiku_state.experiment import build_experiment, placeholder_batch

    phases: dict[str, Any] = {"import_s": time.perf_counter() - start}
    if jax.default_backend() == "cpu":  # As `python -m haiku_state.train` runs there.
        jax.config.update("jax_threefry_partitionable", False)
    config = _config(experiment)
    config.update(
        batch_size=batch_size, eval_batch_size=batch_size, compilation_cache_dir=cache_dir
    )
    for key, value in data_overrides(experiment, batch_size).items():
        config.data[key.split(".")[1]] = value
    compilation_cache.enable(cache_dir)

    def timed(name: str, fn):
        began = time.perf_counter()
        with CompileEvents() as compiles:
            out = jax.block_until_ready(fn())
        phases[name] = {"s": time.perf_counter() - began, **compiles.figures()}
        return out

    built = timed("build_experiment", lambda: build_experiment(config))
    batch = placeholder_batch(built.dataset, batch_size)
    state = timed("init", lambda: built.updater.init(config.seed, batch))
    state, _ = timed("first_step", lambda: built.updater.update(state, batch))
    timed("second_step", lambda: built.updater.update(state, batch))
    phases["to_first_step_s"] = time.perf_counter() - start - phases["second_step"]["s"]
    return phases


def measure_phases(experiment: str, batch_size: int, scratch: str, timeout_s: float) -> dict:
    """`phase_worker` in a fresh process with an empty cache, then again with its cache."""
    cache = os.path.join(scratch, "phase_cache")
    command = [
        sys.executable, "-m", "benchmarks.startup", "--phase_worker",
        f"--experiment={experiment}", f"--batch_size={batch_size}", f"--cache_dir={cache}",
    ]  # fmt: skip
    phases = {}
    for name in ("cold", "cached"):
        out = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=timeout_s)
        if out.returncode:
            phases[name] = {"error": out.stderr[-2000:]}
            break
        phases[name] = json.loads(out.stdout.splitlines()[-1])
    return phases


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup")
    parser.add_argument("--experiment", default="resnet50", help="mlp, resnet or resnet50")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--timeout_s", type=float, default=600.0, help="per run")
    parser.add_argument("--no_phases", action="store_true", help="skip the in-process phases")
    parser.add_argument("--out", default="")
    parser.add_argument("--phase_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache_dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase_worker:
        print(json.dumps(phase_worker(args.experiment, args.batch_size, args.cache_dir)))
        return {}
    record: dict[str, Any] = {"experiment": args.experiment, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as scratch:
        record["runs"] = measure_runs(args.experiment, args.batch_size, scratch, args.timeout_s)
        record["speedup"] = speedups(record["runs"])
        record["speedup_cpu_seconds"] = speedups(record["runs"], "cpu_seconds")
        if not args.no_phases:
            record["phases"] = measure_phases(
                args.experiment, args.batch_size, scratch, args.timeout_s
            )
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return record


if __name__ == "__main__":
    main()
