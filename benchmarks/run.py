r"""Benchmarks the Updater against a hand-written pmap step, Flax, and the whole training loop.

    python -m benchmarks.run [--quick | --full] [--experiments=mlp,resnet,resnet50]
        [--devices=1,2,4] [--batch_size=N] [--steps=N] [--precisions=float32,bfloat16]
        [--output_dir=benchmarks/results] [--record=benchmarks/results/cpu.json --update_readme]

Each device count runs in its own subprocess, because JAX fixes the number of
devices when its backend starts:

* CPU: the subprocess simulates N devices (`XLA_FLAGS=
  --xla_force_host_platform_device_count=N`); they share the host's cores.
* GPU: the subprocess sees the first N GPUs (`CUDA_VISIBLE_DEVICES`, taken from
  the inherited list when there is one).
* TPU: chips cannot be hidden portably, so only N = the host's chip count runs;
  other counts are recorded as skipped.

The parent never starts a JAX backend (it would hold accelerator memory while
the subprocesses run). It prints a table and writes one JSON file per run,
`<output_dir>/<UTC timestamp>_<platform>.json` (`benchmarks.record`); with
`--record=PATH` also at PATH, the platform's curated record, and with
`--update_readme` the README's table from it (`benchmarks.report`).
`python -m benchmarks.plot` draws the charts. What each figure means:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from benchmarks import costs, record, report
from benchmarks.experiment import benchmark_experiment, log_to_stderr
from benchmarks.settings import EXPERIMENTS, SUPPORTED_PRECISIONS, Settings, check_precision
from haiku_state import tpu_host

QUICK_EXPERIMENTS = ("mlp", "resnet")
# One device count, of two devices, so that the collectives run.
QUICK_DEVICES = (2,)
DEFAULT_DEVICES = (1, 2, 4)
# ResNet-50 at 224x224 is slow on a CPU: without --full it runs with a tiny batch, at the
# first device count only, without the training-loop figure.
CPU_RESNET50_BATCH = 8
# --quick is a smoke run sized for a 2-core CPU, where it is compile-bound: it times a
# ResNet with two stages of one block at width 8 (recorded in each result's
# `model_overrides`), and the hand-written step and the shard_map Updater on the MLP only
# (on the ResNet each is one more compile of the same code).
QUICK_MODEL_OVERRIDES = {"resnet": (("width", 8), ("blocks_per_stage", (1, 1)))}
QUICK_MATMUL_SIZE = 512
QUICK_WINDOW_S = 0.15
QUICK_COMPARED_EXPERIMENTS = ("mlp",)
# --quick runs every precision on these experiments (float32 only on the others), so that
# no precision's steps break unseen; --precisions replaces this. In bfloat16 and float16
# it times the Updater, its input pipeline and the hand-written step, and a checkpoint;
# the shard_map Updater and the loop run in float32 only.
QUICK_ALL_PRECISIONS_EXPERIMENTS = ("mlp",)
# Training-loop run lengths (None: the experiment's own `steps`). 200 steps keep the
# ResNet's cadence (log every 50, an asynchronous checkpoint and a replica check at step
# 100) with three steady windows, in half the experiment's 400.
FULL_LOOP_STEPS = {"resnet": 200}
# Training-loop runs per device count, the median reported: the loop cannot be interleaved
# with the bare update, so each run is compared with the update timed around it. The
# MLP's runs are short; one run of each other experiment keeps `make bench` short.
FULL_LOOP_RUNS = {"mlp": 3}
# Timed windows of about this many seconds (5 per variant, interleaved).
WINDOW_S = 0.6


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0]
    )
    flag = parser.add_argument
    flag(
        "--quick",
        action="store_true",
        help="A smoke run (CI's): checks that the benchmarks run, in a few minutes: mlp (every "
        "precision) and a width-8 resnet, 2 devices, tiny step counts. Its figures are not "
        "measurements and no target is judged.",
    )
    flag(
        "--no_input_pipeline",
        action="store_true",
        help="Skip benchmarks.input_pipeline (JPEG decoding workers, and the loop they feed); "
        "skipped by default on a GPU or TPU (--input_pipeline runs it there).",
    )
    flag(
        "--input_pipeline",
        action="store_true",
        help="Run benchmarks.input_pipeline on a GPU or TPU too.",
    )
    flag(
        "--full",
        action="store_true",
        help="ResNet-50 on CPU at its own batch size, every device count, with the loop.",
    )
    flag("--experiments", type=_csv, default=None, help="Comma-separated.")
    flag("--devices", type=lambda s: [int(x) for x in _csv(s)], default=None, help="e.g. 1,2,4")
    flag("--batch_size", type=int, default=None, help="Global batch override.")
    flag(
        "--batch_sizes",
        type=lambda s: [int(x) for x in _csv(s)],
        default=None,
        help="Several global batches, each measured in turn (e.g. 256,512,1024 on a GPU, to "
        "find the best per-device batch); instead of --batch_size.",
    )
    flag(
        "--steps",
        type=int,
        default=None,
        help=f"Steps per timed window (default: windows of about {WINDOW_S} s; --quick "
        f"{QUICK_WINDOW_S} s).",
    )
    flag("--windows", type=int, default=None, help="Timed windows per variant.")
    flag(
        "--loop_steps",
        type=int,
        default=None,
        help="Training-loop run length (default: the experiment's steps; 0 skips).",
    )
    flag(
        "--loop_checkpoint_every",
        type=int,
        default=None,
        help="Steps between the training loop's saves (default: the experiment's).",
    )
    flag(
        "--loop_runs",
        type=int,
        default=None,
        help="Training-loop runs, the median reported (default: 3 for mlp, else 1; --quick 1).",
    )
    flag(
        "--loop_time_limit_s",
        type=float,
        default=None,
        help="Wall-clock limit of each training-loop run: past it the run stops and saves, and "
        "the windows it logged are its figures (default: none).",
    )
    flag("--checkpoint_saves", type=int, default=None, help="Timed saves per mode (0 skips).")
    flag(
        "--steps_per_call",
        type=int,
        default=None,
        help="Also time the Updater at this many steps a call, and run the loop so (default: "
        "what config.steps_per_call=0 chooses on the platform; 1 on a CPU).",
    )
    flag("--no_flax", action="store_true", help="Skip the Flax peer.")
    flag(
        "--no_updater_shard_map",
        action="store_true",
        help="Skip the Updater with backend='shard_map' (timed next to the pmap Updater).",
    )
    flag(
        "--no_updater_jit",
        action="store_true",
        help="Skip the Updater with backend='jit', replicated and fsdp (timed next to the pmap "
        "Updater).",
    )
    flag(
        "--shard_map",
        action="store_true",
        help="Also time the hand-written step as jit(shard_map): what pmap dispatch costs.",
    )
    flag(
        "--precisions",
        type=_csv,
        default=None,
        help=f"Comma-separated, of {','.join(SUPPORTED_PRECISIONS)} (default: float32; "
        "--quick: every precision on the mlp, float32 on the others).",
    )
    flag("--matmul_size", type=int, default=None, help="Peak matmul size.")
    flag("--output_dir", default=str(record.DEFAULT_OUTPUT_DIR))
    flag(
        "--record",
        default=None,
        help="Also write the run record here: the platform's curated record, "
        "e.g. benchmarks/results/cpu.json.",
    )
    flag(
        "--update_readme",
        action="store_true",
        help="Write the table of the --record into benchmarks/README.md.",
    )
    flag("--timeout_s", type=float, default=None, help="Per device-count subprocess limit.")
    # Internal: the subprocess that measures one device count, and the plan it follows.
    flag("--worker_devices", type=int, default=None, help=argparse.SUPPRESS)
    flag("--plan", choices=("named", "accelerator"), default="named", help=argparse.SUPPRESS)
    flag("--worker_output", default=None, help=argparse.SUPPRESS)
    return parser


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.experiments_named = args.experiments is not None
    args.devices_named = args.devices is not None
    args.nothing_named = not any(
        (args.quick, args.full, args.experiments_named, args.precisions, args.batch_size,
         args.batch_sizes)
    )  # fmt: skip
    if args.experiments is None:
        args.experiments = list(QUICK_EXPERIMENTS if args.quick else EXPERIMENTS)
    unknown = sorted(set(args.experiments) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiments {unknown}; expected some of {list(EXPERIMENTS)}")
    if args.devices is None:
        args.devices = list(QUICK_DEVICES if args.quick else DEFAULT_DEVICES)
    if not args.devices or min(args.devices) < 1:
        parser.error(f"--devices must be positive integers, got {args.devices}")
    if args.batch_sizes is not None and args.batch_size is not None:
        parser.error("give --batch_size or --batch_sizes, not both")
    args.batch_sizes = args.batch_sizes or [args.batch_size]
    if any(b is not None and b < 1 for b in args.batch_sizes):
        parser.error(f"batch sizes must be positive integers, got {args.batch_sizes}")
    if args.loop_checkpoint_every is not None and args.loop_checkpoint_every < 1:
        every = args.loop_checkpoint_every
        parser.error(f"--loop_checkpoint_every must be at least 1, got {every}")
    if args.loop_runs is not None and args.loop_runs < 1:
        parser.error(f"--loop_runs must be at least 1, got {args.loop_runs} (--loop_steps=0 skips)")
    args.precisions_named = args.precisions is not None
    if args.precisions is None:
        args.precisions = list(SUPPORTED_PRECISIONS if args.quick else ["float32"])
    for precision in args.precisions:
        try:
            check_precision(precision)
        except ValueError as e:
            parser.error(str(e))
    if args.update_readme and not args.record:
        parser.error("--update_readme writes the table of the curated record: give --record too")
    return args


# `make bench` on a GPU or TPU with nothing named: the headline, ResNet-50 in bfloat16, at the
# chip's best batch per device beside every peer, at a second batch beside Flax and the
# hand-written step; the small ResNet beside Flax, with several steps a call. The best batch
# of a TPU v5e is 128 (2,610 images/s against 2,532 at 256, measured on 2026-12-06).
BEST_BATCH_PER_DEVICE = {"TPU v5 lite": 128}
DEFAULT_BEST_BATCH_PER_DEVICE = 256
# What the second ResNet-50 measurement leaves out: it stands beside Flax and hand-written.
PEERS_ONLY = (("updater_shard_map", False), ("updater_jit", False), ("norms", False),
              ("checkpoint_saves", 0))  # fmt: skip
Measurement = tuple[str, str, int | None, tuple[tuple[str, Any], ...]]


def accelerator_plan(device_kind: str, num_devices: int) -> list[Measurement]:
    """The accelerator plan's `(experiment, precision, global batch, settings overrides)`."""
    best = BEST_BATCH_PER_DEVICE.get(device_kind, DEFAULT_BEST_BATCH_PER_DEVICE)
    second = 256 if best != 256 else 128
    return [  # The headline first: a run cut short keeps what came before.
        ("resnet50", "bfloat16", best * num_devices, ()),
        ("resnet", "float32", 128, ()),
        ("resnet50", "bfloat16", second * num_devices, PEERS_ONLY),
    ]


def measurements(
    args: argparse.Namespace, device_kind: str = "", num_devices: int = 1
) -> list[Measurement]:
    """The `(experiment, precision, batch size, overrides)` a run measures, precision by
    precision: the accelerator plan (`--plan=accelerator`), or every experiment in every
    precision of `--precisions`, at every batch size of `--batch_sizes` (None: the
    experiment's own); `--quick` without `--precisions` runs the half precisions on
    `QUICK_ALL_PRECISIONS_EXPERIMENTS` only.
    """
    if args.plan == "accelerator":
        return accelerator_plan(device_kind, num_devices)
    return [
        (name, precision, batch_size, ())
        for precision in args.precisions
        for name in args.experiments
        for batch_size in args.batch_sizes
        if precision == "float32"
        or args.precisions_named
        or not args.quick
        or name in QUICK_ALL_PRECISIONS_EXPERIMENTS
    ]


def _quick_settings(
    name: str, args: argparse.Namespace, first_count: bool, batch_size: int | None
) -> Settings:
    compared = name in QUICK_COMPARED_EXPERIMENTS
    return Settings(
        batch_size=batch_size,
        steps_per_window=args.steps,
        target_window_s=QUICK_WINDOW_S,
        windows=args.windows or 3,
        warmup_steps=1,
        num_batches=2,
        loop_steps=30 if args.loop_steps is None else args.loop_steps,
        loop_log_every=10,
        loop_checkpoint_every=args.loop_checkpoint_every,
        loop_runs=args.loop_runs or 1,
        loop_synthetic_data=True,
        checkpoint_saves=1 if args.checkpoint_saves is None else args.checkpoint_saves,
        hand_written=compared,
        flax=not args.no_flax and first_count,
        shard_map=args.shard_map and compared,
        updater_shard_map=not args.no_updater_shard_map and compared,
        updater_jit=not args.no_updater_jit and compared,
        norms=compared,
        model_overrides=QUICK_MODEL_OVERRIDES.get(name, ()),
    )


def _full_settings(name: str, args: argparse.Namespace, batch_size: int | None) -> Settings:
    return Settings(
        batch_size=batch_size,
        steps_per_window=args.steps,
        target_window_s=WINDOW_S,
        windows=args.windows or 5,
        loop_steps=FULL_LOOP_STEPS.get(name) if args.loop_steps is None else args.loop_steps,
        loop_checkpoint_every=args.loop_checkpoint_every,
        loop_runs=args.loop_runs or FULL_LOOP_RUNS.get(name, 1),
        checkpoint_saves=2 if args.checkpoint_saves is None else args.checkpoint_saves,
        flax=not args.no_flax,
        shard_map=args.shard_map,
        updater_shard_map=not args.no_updater_shard_map,
        updater_jit=not args.no_updater_jit,
    )


def _cpu_resnet50_settings(args: argparse.Namespace, batch_size: int | None) -> Settings:
    """ResNet-50 on CPU without --full: batch 8 (at most), windows of one step, no loop."""
    return Settings(
        batch_size=min(batch_size or CPU_RESNET50_BATCH, CPU_RESNET50_BATCH),
        steps_per_window=args.steps or 1,
        windows=args.windows or 3,
        warmup_steps=1,
        num_batches=2,
        loop_steps=0,
        checkpoint_saves=1,
        flax=not args.no_flax,
        shard_map=args.shard_map,
        updater_shard_map=not args.no_updater_shard_map,
        updater_jit=not args.no_updater_jit,
    )


def settings_for(
    name: str,
    args: argparse.Namespace,
    platform: str,
    num_devices: int,
    precision: str = "float32",
    batch_size: int | None = None,
) -> tuple[Settings, str | None]:
    """The `Settings` of one measurement, and why its loop figure is skipped (or None).

    `batch_size`: one of `--batch_sizes` (None: `--batch_size`, else the experiment's).
    """
    skip_loop = None
    first_count = num_devices == min(args.devices)
    batch_size = batch_size or args.batch_size
    if args.quick:
        settings = _quick_settings(name, args, first_count, batch_size)
        if name != "mlp" or not first_count:
            skip_loop = "--quick: the loop runs for mlp at the first device count only"
        if precision != "float32":  # What a precision changes: the steps it compiles.
            settings = dataclasses.replace(
                settings, updater_shard_map=False, updater_jit=False, norms=False, loop_steps=0
            )
            skip_loop = "--quick: the loop runs in float32 only"
    else:
        settings = _full_settings(name, args, batch_size)
    if name == "resnet50" and platform == "cpu" and not args.full:
        settings = _cpu_resnet50_settings(args, batch_size)
    if name == "resnet50" and not args.full:
        skip_loop = "resnet50: the loop (synthetic data) runs only with --full"
    settings = dataclasses.replace(
        settings,
        precision=precision,
        loop_time_limit_s=args.loop_time_limit_s,
        steps_per_call=args.steps_per_call,
    )
    return settings, skip_loop


# -- The subprocess: one device count ---------------------------------------------------------


def _cpu_resnet50_skip(
    name: str, args: argparse.Namespace, platform: str, num_devices: int
) -> str | None:
    """Why ResNet-50 is not run here, or None. On CPU it costs minutes per device count."""
    if name != "resnet50" or platform != "cpu" or args.full:
        return None
    if not args.experiments_named:
        return (
            "resnet50 is skipped on CPU unless asked for (minutes per device count); use "
            "--experiments=resnet50 (batch 8, first device count) or --full"
        )
    if num_devices != min(args.devices):
        return "resnet50 on CPU runs at the first device count only, unless --full"
    return None


def _device_run(num_devices: int) -> dict[str, Any]:
    """The record of this device count before anything is measured, or why nothing is."""
    import jax

    info = costs.device_info()
    if info["platform"] == "cpu" and "JAX_THREEFRY_PARTITIONABLE" not in os.environ:
        # As `python -m haiku_state.train` runs on CPU: XLA:CPU compiles JAX's default
        # (partitionable) threefry several times slower, and the parameter initialisers of
        # `Updater.init` and Flax's `model.init` dominate start-up. It changes which random
        # bits are drawn, not the work of a step; each run records the setting.
        jax.config.update("jax_threefry_partitionable", False)
    run: dict[str, Any] = {
        "num_devices": num_devices,
        **info,
        "jax_threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
        "experiments": [],
        "skipped": [],
    }
    if info["local_device_count"] != num_devices:
        run["skipped"].append(
            f"asked for {num_devices} devices, this process has {info['local_device_count']} "
            f"{info['platform']} device(s)"
            + (
                " (TPU chips cannot be hidden: only the full count runs)"
                if info["platform"] == "tpu"
                else ""
            )
        )
    return run


# The training loop's final line (`driver.train_and_evaluate`), which names the loop run's
# temporary workdir, deleted once the worker ends: not a figure, so not shown.
STRAY_LINE_PREFIX = "Final eval at step "


class _WithoutLines(io.TextIOBase):
    """A text stream that passes whole lines on to `stream`, but those starting with `prefix`."""

    def __init__(self, stream: Any, prefix: str):
        self._stream, self._prefix, self._partial = stream, prefix, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if not line.startswith(self._prefix):
                self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def end(self) -> None:
        """Passes on a last line that has no newline (unless it starts with `prefix`)."""
        self.write("\n" if self._partial else "")
        self.flush()


@contextlib.contextmanager
def without_stray_lines():
    """`sys.stderr` without the training loop's final-eval line (`STRAY_LINE_PREFIX`)."""
    stream = _WithoutLines(sys.stderr, STRAY_LINE_PREFIX)
    try:
        with contextlib.redirect_stderr(stream):
            yield
    finally:
        stream.end()


def _worker(args: argparse.Namespace) -> None:
    with without_stray_lines():
        _measure_device_count(args)


def _measure_device_count(args: argparse.Namespace) -> None:
    import jax

    num_devices = args.worker_devices
    run = _device_run(num_devices)
    if run["skipped"]:
        record.write_json(args.worker_output, run)
        return
    run["peak_matmul"] = peak = costs.measure_peak_matmul(
        args.matmul_size or (QUICK_MATMUL_SIZE if args.quick else None),
        precisions=tuple(dict.fromkeys((*costs.PEAK_PRECISIONS, *args.precisions))),
    )
    log_to_stderr(f"[{num_devices} dev] {report.peak_line(run)}")
    with tempfile.TemporaryDirectory(prefix="haiku_state_bench_") as workdir:
        # A compilation cache private to this process: the timed variants compile cold
        # (each is a different program), and the training-loop run, whose Updater is a new
        # object compiling the very same programs, skips compiles it would only drop with
        # its first window anyway.
        jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "xla_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        for name, precision, batch_size, overrides in measurements(
            args, run["device_kind"], num_devices
        ):
            reason = _cpu_resnet50_skip(name, args, run["platform"], num_devices)
            if reason:
                run["skipped"].append(reason)
                continue
            settings, skip_loop = settings_for(
                name, args, run["platform"], num_devices, precision, batch_size
            )
            settings = dataclasses.replace(settings, **dict(overrides))
            result = _measure_within_memory(name, settings, peak, workdir, skip_loop, run)
            if result is not None:
                run["experiments"].append(result)
            record.write_json(args.worker_output, run)  # What is done survives a later crash.
    record.write_json(args.worker_output, run)


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


def _measure_within_memory(
    name: str,
    settings: Settings,
    peak: dict[str, Any],
    workdir: str,
    skip_loop: str | None,
    run: dict[str, Any],
) -> dict[str, Any] | None:
    """`benchmark_experiment`, its batch halved while the device's memory cannot hold it
    (down to one example per device, the reason recorded); None, and why in `run["skipped"]`,
    when it fails otherwise."""
    import jax

    sized_down = []
    while True:
        what = f"{name} ({settings.precision}, batch {settings.batch_size or 'default'})"
        try:
            result = benchmark_experiment(
                name, settings, peak=peak, workdir=workdir, skip_loop=skip_loop
            )
            if sized_down:
                result["sized_down"] = sized_down
            return result
        except Exception as e:  # Recorded, and the other experiments still run.
            traceback.print_exc()
            batch = settings.batch_size
            if _out_of_memory(e) and batch and batch // 2 >= jax.local_device_count():
                sized_down.append(f"batch {batch}: {type(e).__name__}: {str(e)[:300]}")
                log_to_stderr(f"{what} does not fit the device: sized down to {batch // 2}")
                settings = dataclasses.replace(settings, batch_size=batch // 2)
                continue
            run["skipped"].append(f"{what}: failed: {type(e).__name__}: {str(e)[:500]}")
            return None
        finally:
            jax.clear_caches()


# -- The parent ---------------------------------------------------------------------------------


def subprocess_env(num_devices: int) -> dict[str, str]:
    """The environment that gives a subprocess `num_devices` devices (see the module doc)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={num_devices}"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    visible = _csv(env.get("CUDA_VISIBLE_DEVICES", "")) or [str(i) for i in range(num_devices)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:num_devices])
    repo = str(record.REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def probe_platform() -> tuple[str, int, str]:
    """`(platform, local devices, device kind)` of a JAX started in a subprocess (the parent
    never starts one: it would hold the accelerator while the workers run); CPU if it fails."""
    code = (
        "import json, jax; d = jax.local_devices(); "
        "print(json.dumps([jax.default_backend(), len(d), d[0].device_kind]))"
    )
    try:
        completed = subprocess.run(
            [sys.executable, "-c", code],
            env=subprocess_env(1),
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        platform, count, kind = json.loads(completed.stdout.strip().splitlines()[-1])
        return platform, int(count), kind
    except (subprocess.SubprocessError, ValueError, IndexError):
        return "cpu", 1, "cpu"


def apply_platform_defaults(args: argparse.Namespace, platform: str, device_count: int) -> None:
    """On a GPU or TPU: every local device (unless --devices), the accelerator plan (unless
    an experiment, precision or batch is named), no input pipeline (unless --input_pipeline)."""
    if platform == "cpu":
        return
    if not args.devices_named:
        args.devices = [device_count]
    if args.nothing_named:
        args.plan = "accelerator"
    if not args.input_pipeline:
        args.no_input_pipeline = True


def _run_device_count(args: argparse.Namespace, argv: list[str], num_devices: int) -> dict:
    # Beside the run's records: a worker cut short leaves what it measured there.
    os.makedirs(args.output_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        prefix="worker-", suffix=".json.partial", dir=args.output_dir, delete=False
    ) as f:
        output = f.name
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        *argv,
        f"--worker_devices={num_devices}",
        f"--worker_output={output}",
        f"--plan={args.plan}",
    ]
    print(f"== {num_devices} device(s) ==", file=sys.stderr, flush=True)
    try:
        completed = subprocess.run(
            command,
            env=subprocess_env(num_devices),
            cwd=record.REPO_ROOT,
            stdout=sys.stderr,
            timeout=args.timeout_s,
            check=False,
        )
        returncode = completed.returncode
    except subprocess.TimeoutExpired:
        returncode = "timeout"
    try:
        with open(output) as f:
            run = json.load(f) if os.path.getsize(output) else None
    finally:
        os.unlink(output)
    if run is None:
        run = {"num_devices": num_devices, "experiments": [], "skipped": []}
    if returncode != 0:
        run.setdefault("skipped", []).append(f"subprocess exited with {returncode}")
    return run


QUICK_NOTE = (
    "--quick is a smoke run: it checks that the benchmarks run. Its figures are not "
    "measurements (its resnet is a width-8 toy, its windows a fraction of a second, on a "
    "shared CPU), so no target is judged; `make bench` measures."
)


def _notes(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[str]:
    notes = []
    if args.quick:
        notes.append(QUICK_NOTE)
        notes.append(
            "--quick: the hand-written step and the shard_map and jit Updaters are timed on "
            f"{', '.join(QUICK_COMPARED_EXPERIMENTS)} only (each is another compile elsewhere); "
            "in bfloat16 and float16 without the shard_map and jit Updaters and the loop."
        )
    if any(r.get("platform") == "cpu" for r in runs) and max(args.devices) > 1:
        notes.append(
            f"CPU device counts are simulated: all devices share the {os.cpu_count()} host "
            "cores, so examples/s does not scale with the count; the ratios are the figures."
        )
    return notes


# benchmarks.input_pipeline's settings: its defaults for a full run; for --quick, a smoke run
# of the decoders and the workers on a few images, without the loop.
QUICK_INPUT_PIPELINE = ("--images=64", "--distinct=16", "--steps=3", "--decoder_seconds=0.5",
                        "--repeats=1", "--no_loop")  # fmt: skip


def _run_input_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """`benchmarks.input_pipeline` in a subprocess of its own (one device), its JSON record."""
    if args.no_input_pipeline:
        if args.input_pipeline or args.devices_named or not args.nothing_named:
            return {"skipped": "--no_input_pipeline"}
        return {"skipped": "on a GPU or TPU, apart from the accelerator plan (--input_pipeline)"}
    with tempfile.TemporaryDirectory() as scratch:
        output = os.path.join(scratch, "input_pipeline.json")
        command = [sys.executable, "-m", "benchmarks.input_pipeline", f"--out={output}"]
        command += list(QUICK_INPUT_PIPELINE if args.quick else ())
        print("== input pipeline ==", file=sys.stderr, flush=True)
        completed = subprocess.run(
            command, env=subprocess_env(1), cwd=record.REPO_ROOT, stdout=sys.stderr, check=False
        )
        if completed.returncode or not os.path.exists(output):
            return {"skipped": f"benchmarks.input_pipeline exited with {completed.returncode}"}
        with open(output) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    tpu_host.size_premapped_buffer()  # As the commands do, for every process run from here.
    if args.worker_devices is not None:
        _worker(args)
        return 0
    start = time.perf_counter()
    platform, device_count, device_kind = probe_platform()
    apply_platform_defaults(args, platform, device_count)
    print(f"== {platform}: {device_count} x {device_kind}; plan: {args.plan}", file=sys.stderr)
    if args.quick:
        print(f"== {QUICK_NOTE}", file=sys.stderr, flush=True)
    runs = [_run_device_count(args, argv, n) for n in args.devices]
    input_pipeline = _run_input_pipeline(args)
    settings = {
        key: value
        for key, value in vars(args).items()
        if key not in ("worker_devices", "worker_output", "nothing_named")
    }
    run_record = record.make_run_record(
        runs,
        settings=settings,
        command=[sys.executable, "-m", "benchmarks.run", *argv],
        wall_s=time.perf_counter() - start,
        notes=_notes(args, runs),
    )
    run_record["input_pipeline"] = input_pipeline
    path = record.write_run_record(run_record, args.output_dir)
    print(report.format_table(run_record))
    print(f"wrote {path} ({run_record['wall_s']:.0f} s)")
    if args.record:
        print(f"wrote {record.write_json(args.record, run_record)}")
    if args.update_readme:
        report.update_readme(report.README, report.markdown_table(run_record, args.record))
        print(f"wrote its table into {report.README}")
    return 0 if run_record["results"] else 1


if __name__ == "__main__":
    sys.exit(main())
