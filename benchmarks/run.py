r"""Benchmarks the Updater against a hand-written pmap step, Flax, and the whole training loop.

    python -m benchmarks.run [--quick | --full] [--experiments=mlp,resnet,resnet50]
        [--devices=1,2,4] [--batch_size=N] [--steps=N] [--precisions=float32,bfloat16]
        [--output_dir=benchmarks/results]

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
`<output_dir>/<UTC timestamp>_<platform>.json`; `python -m benchmarks.plot`
draws the charts. What each figure means: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from benchmarks import core

QUICK_EXPERIMENTS = ("mlp", "resnet")
# One device count (two devices: the collectives run) keeps --quick within 60 s on 2 cores.
QUICK_DEVICES = (2,)
DEFAULT_DEVICES = (1, 2, 4)
# ResNet-50 at 224x224 takes seconds per step on a CPU: without --full it runs with a
# tiny batch, at the first device count only, without the training-loop figure.
CPU_RESNET50_BATCH = 8
# --quick is a smoke run that must fit in 60 s on 2 CPU cores, where XLA takes 10-15 s to
# compile each step of the full small-image ResNet (and its init): it times a ResNet with
# two stages of one block at width 8 instead (recorded in each result's `model_overrides`).
QUICK_MODEL_OVERRIDES = {"resnet": (("width", 8), ("blocks_per_stage", (1, 1)))}
QUICK_MATMUL_SIZE = 512
# --quick times the hand-written step and the shard_map Updater on the MLP only: on the
# ResNet each is one more compile of 5-11 s on 2 cores, and the code they exercise is the same.
QUICK_COMPARED_EXPERIMENTS = ("mlp",)
# Training-loop run lengths (None: the experiment's own `steps`). The ResNet's 400 steps
# take minutes per device count on a CPU; 200 keep its cadence (log every 50, an
# asynchronous checkpoint and a replica check at step 100) with three steady windows.
FULL_LOOP_STEPS = {"resnet": 200}
# Training-loop runs per device count, the median reported: the loop cannot be interleaved
# with the bare update, so each run is compared with the update timed around it. The MLP's
# run takes about 6 s, the ResNet's 20-25 s (one run keeps `make bench` within 10 minutes).
FULL_LOOP_RUNS = {"mlp": 3}
# Timed windows of about 0.6 s (5 per variant, interleaved): with five variants per
# experiment and three device counts, `make bench` took 355-501 s on 2 cores.
WINDOW_S = 0.6


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke run: mlp and resnet, 2 devices, tiny step counts (< 60 s on 2 cores).",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="ResNet-50 on CPU at its own batch size, every device count, with the loop.",
    )
    parser.add_argument("--experiments", type=_csv, default=None, help="Comma-separated.")
    parser.add_argument(
        "--devices", type=lambda s: [int(x) for x in _csv(s)], default=None, help="e.g. 1,2,4"
    )
    parser.add_argument("--batch_size", type=int, default=None, help="Global batch override.")
    parser.add_argument(
        "--steps", type=int, default=None, help="Steps per timed window (default: ~1 s windows)."
    )
    parser.add_argument("--windows", type=int, default=None, help="Timed windows per variant.")
    parser.add_argument(
        "--loop_steps",
        type=int,
        default=None,
        help="Training-loop run length (default: the experiment's steps; 0 skips).",
    )
    parser.add_argument(
        "--loop_runs",
        type=int,
        default=None,
        help="Training-loop runs, the median reported (default: 3 for mlp, else 1; --quick 1).",
    )
    parser.add_argument(
        "--checkpoint_saves", type=int, default=None, help="Timed saves per mode (0 skips)."
    )
    parser.add_argument("--no_flax", action="store_true", help="Skip the Flax peer.")
    parser.add_argument(
        "--no_updater_shard_map",
        action="store_true",
        help="Skip the Updater with backend='shard_map' (timed next to the pmap Updater).",
    )
    parser.add_argument(
        "--shard_map",
        action="store_true",
        help="Also time the hand-written step as jit(shard_map): what pmap dispatch costs.",
    )
    parser.add_argument(
        "--precisions",
        type=_csv,
        default=["float32"],
        help=f"Comma-separated; supported now: {','.join(core.SUPPORTED_PRECISIONS)}.",
    )
    parser.add_argument("--matmul_size", type=int, default=None, help="Peak matmul size.")
    parser.add_argument("--output_dir", default=str(core.DEFAULT_OUTPUT_DIR))
    parser.add_argument(
        "--timeout_s", type=float, default=None, help="Per device-count subprocess limit."
    )
    # Internal: the subprocess that measures one device count.
    parser.add_argument("--worker_devices", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker_output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    args.experiments_named = args.experiments is not None
    if args.experiments is None:
        args.experiments = list(QUICK_EXPERIMENTS if args.quick else core.EXPERIMENTS)
    unknown = sorted(set(args.experiments) - set(core.EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiments {unknown}; expected some of {list(core.EXPERIMENTS)}")
    if args.devices is None:
        args.devices = list(QUICK_DEVICES if args.quick else DEFAULT_DEVICES)
    if not args.devices or min(args.devices) < 1:
        parser.error(f"--devices must be positive integers, got {args.devices}")
    if args.loop_runs is not None and args.loop_runs < 1:
        parser.error(f"--loop_runs must be at least 1, got {args.loop_runs} (--loop_steps=0 skips)")
    for precision in args.precisions:
        try:
            core.check_precision(precision)
        except ValueError as e:
            parser.error(str(e))
    return args


def settings_for(name: str, args: argparse.Namespace, platform: str, num_devices: int):
    """The `core.Settings` of one experiment, and why its loop figure is skipped (or None)."""
    skip_loop = None
    first_count = num_devices == min(args.devices)
    if args.quick:
        settings = core.Settings(
            batch_size=args.batch_size,
            steps_per_window=args.steps,
            target_window_s=0.15,
            windows=args.windows or 3,
            warmup_steps=1,
            num_batches=2,
            loop_steps=30 if args.loop_steps is None else args.loop_steps,
            loop_log_every=10,
            loop_runs=args.loop_runs or 1,
            loop_synthetic_data=True,
            checkpoint_saves=1 if args.checkpoint_saves is None else args.checkpoint_saves,
            hand_written=name in QUICK_COMPARED_EXPERIMENTS,
            flax=not args.no_flax and first_count,
            shard_map=args.shard_map and name in QUICK_COMPARED_EXPERIMENTS,
            updater_shard_map=not args.no_updater_shard_map and name in QUICK_COMPARED_EXPERIMENTS,
            model_overrides=QUICK_MODEL_OVERRIDES.get(name, ()),
        )
        if name != "mlp" or not first_count:
            skip_loop = "--quick: the loop runs for mlp at the first device count only"
    else:
        settings = core.Settings(
            batch_size=args.batch_size,
            steps_per_window=args.steps,
            target_window_s=WINDOW_S,
            windows=args.windows or 5,
            loop_steps=FULL_LOOP_STEPS.get(name) if args.loop_steps is None else args.loop_steps,
            loop_runs=args.loop_runs or FULL_LOOP_RUNS.get(name, 1),
            checkpoint_saves=2 if args.checkpoint_saves is None else args.checkpoint_saves,
            flax=not args.no_flax,
            shard_map=args.shard_map,
            updater_shard_map=not args.no_updater_shard_map,
        )
    if name == "resnet50" and platform == "cpu" and not args.full:
        settings = core.Settings(
            batch_size=min(args.batch_size or CPU_RESNET50_BATCH, CPU_RESNET50_BATCH),
            steps_per_window=args.steps or 1,
            windows=args.windows or 3,
            warmup_steps=1,
            num_batches=2,
            loop_steps=0,
            checkpoint_saves=1,
            flax=not args.no_flax,
            shard_map=args.shard_map,
            updater_shard_map=not args.no_updater_shard_map,
        )
    if name == "resnet50" and not args.full:
        skip_loop = "resnet50: the loop (synthetic data) runs only with --full"
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
            "resnet50 is skipped on CPU unless asked for: at batch 8 it took 8 min for one "
            "device count on 2 cores (about 40 s to compile each of 3 steps, 77 s of init, "
            "12 s per step); use --experiments=resnet50 (batch 8, first device count) or --full"
        )
    if num_devices != min(args.devices):
        return "resnet50 on CPU runs at the first device count only, unless --full"
    return None


def _worker(args: argparse.Namespace) -> None:
    import jax

    num_devices = args.worker_devices
    info = core.device_info()
    if info["platform"] == "cpu" and "JAX_THREEFRY_PARTITIONABLE" not in os.environ:
        # As `python -m haiku_state.train` runs on CPU: XLA:CPU compiles JAX's default
        # (partitionable) threefry about 3x slower, and the parameter initialisers of
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
        run["experiments"] = []
        _write_json(args.worker_output, run)
        return
    run["peak_matmul"] = core.measure_peak_matmul(
        args.matmul_size or (QUICK_MATMUL_SIZE if args.quick else None)
    )
    peak = run["peak_matmul"]
    core._log_to_stderr(
        f"[{num_devices} dev] peak matmul {peak['size']}^2: f32 "
        f"{peak['float32']['all_devices_tflop_per_s']:.3f} TFLOP/s, bf16 "
        f"{peak['bfloat16']['all_devices_tflop_per_s']:.3f} TFLOP/s (all devices)"
    )
    with tempfile.TemporaryDirectory(prefix="haiku_state_bench_") as workdir:
        # A compilation cache private to this process: the timed variants compile cold
        # (each is a different program), and the training-loop run, whose Updater is a new
        # object compiling the very same programs, skips compiles it would only drop with
        # its first window anyway.
        jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "xla_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        for precision in args.precisions:
            for name in args.experiments:
                reason = _cpu_resnet50_skip(name, args, info["platform"], num_devices)
                if reason:
                    run["skipped"].append(reason)
                    continue
                settings, skip_loop = settings_for(name, args, info["platform"], num_devices)
                settings = _replace(settings, precision=precision)
                try:
                    result = core.benchmark_experiment(
                        name, settings, peak=peak, workdir=workdir, skip_loop=skip_loop
                    )
                except Exception as e:  # Recorded, and the other experiments still run.
                    traceback.print_exc()
                    run["skipped"].append(f"{name} ({precision}): failed: {type(e).__name__}: {e}")
                    continue
                run["experiments"].append(result)
                _write_json(args.worker_output, run)  # What is done survives a later crash.
                jax.clear_caches()
    _write_json(args.worker_output, run)


def _replace(settings: core.Settings, **changes: Any) -> core.Settings:
    import dataclasses

    return dataclasses.replace(settings, **changes)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(core._json_ready(value), f)


# -- The parent ---------------------------------------------------------------------------------


def subprocess_env(num_devices: int) -> dict[str, str]:
    """The environment that gives a subprocess `num_devices` devices (see the module doc)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={num_devices}"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    visible = _csv(env.get("CUDA_VISIBLE_DEVICES", "")) or [str(i) for i in range(num_devices)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:num_devices])
    repo = str(core.REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def _run_device_count(args: argparse.Namespace, argv: list[str], num_devices: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        output = f.name
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        *argv,
        f"--worker_devices={num_devices}",
        f"--worker_output={output}",
    ]
    print(f"== {num_devices} device(s) ==", file=sys.stderr, flush=True)
    try:
        completed = subprocess.run(
            command,
            env=subprocess_env(num_devices),
            cwd=core.REPO_ROOT,
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


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(value * scale, spec)


def format_table(record: dict[str, Any]) -> str:
    """The run's figures as a fixed-width text table."""
    columns = [
        ("experiment", 10),
        ("dev", 3),
        ("batch", 5),
        ("updater ex/s", 12),
        ("steps/s", 8),
        ("hand ex/s", 10),
        ("upd/hand", 8),
        ("input/pre", 9),
        ("flax ex/s", 10),
        ("upd/flax", 8),
        ("shmap ex/s", 10),
        ("shmap/pmap", 10),
        ("TFLOP/s", 8),
        ("MFU", 6),
        ("compile s", 9),
        ("loop ex/s", 10),
        ("loop/upd", 8),
        ("ckpt async/sync s", 17),
        ("ckpt MB/s", 9),
    ]
    lines = ["  ".join(f"{title:>{width}}" for title, width in columns)]
    for r in record["results"]:
        throughput, ratios = r["throughput"], r["ratios"]
        flax = throughput.get("flax")
        shard_map = throughput.get("updater_shard_map")
        loop, checkpoint = r.get("loop", {}), r.get("checkpoint", {})
        ckpt_blocked = ckpt_rate = "-"
        if "async" in checkpoint:
            ckpt_blocked = (
                f"{checkpoint['async']['blocked_s']:.3f}/{checkpoint['sync']['blocked_s']:.3f}"
            )
            ckpt_rate = f"{checkpoint['async']['write_mb_per_s']:.0f}"
        cells = [
            r["experiment"] + ("" if r["precision"] == "float32" else f" {r['precision']}"),
            str(r["num_devices"]),
            str(r["batch_size"]),
            _fmt(throughput["updater"]["examples_per_s"], ",.0f"),
            _fmt(throughput["updater"]["steps_per_s"], ".2f"),
            _fmt((throughput.get("hand_written") or {}).get("examples_per_s"), ",.0f"),
            _fmt(ratios.get("updater_vs_hand_written"), ".3f"),
            _fmt(ratios.get("input_pipeline_vs_presharded"), ".3f"),
            _fmt(flax["examples_per_s"] if flax else None, ",.0f"),
            _fmt(ratios["updater_vs_flax"], ".3f"),
            _fmt(shard_map["examples_per_s"] if shard_map else None, ",.0f"),
            _fmt(ratios.get("updater_shard_map_vs_pmap"), ".3f"),
            _fmt(r["utilisation"]["achieved_tflop_per_s"], ".3f"),
            _fmt(r["utilisation"]["mfu"], ".1%"),
            _fmt(throughput["updater"]["compile_s"], ".1f"),
            _fmt(loop.get("examples_per_s"), ",.0f"),
            _fmt(loop.get("ratio_vs_update"), ".3f"),
            ckpt_blocked,
            ckpt_rate,
        ]
        lines.append(
            "  ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns, strict=True))
        )
    for run in record["runs"]:
        peak = run.get("peak_matmul")
        if peak:
            lines.append(
                f"peak matmul on {run['num_devices']} {run['device_kind']} device(s), "
                f"{peak['size']}^2: f32 {peak['float32']['single_device_tflop_per_s']:.3f} "
                f"TFLOP/s one device, {peak['float32']['all_devices_tflop_per_s']:.3f} all; "
                f"bf16 {peak['bfloat16']['single_device_tflop_per_s']:.3f} / "
                f"{peak['bfloat16']['all_devices_tflop_per_s']:.3f}"
            )
        for note in run.get("skipped", []):
            lines.append(f"skipped ({run['num_devices']} dev): {note}")
    for note in record.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    if args.worker_devices is not None:
        _worker(args)
        return 0
    start = time.perf_counter()
    runs = [_run_device_count(args, argv, n) for n in args.devices]
    notes = []
    if args.quick:
        notes.append(
            "--quick: the hand-written step and the shard_map Updater are timed on "
            f"{', '.join(QUICK_COMPARED_EXPERIMENTS)} only (each is another compile elsewhere)."
        )
    if any(r.get("platform") == "cpu" for r in runs) and max(args.devices) > 1:
        notes.append(
            f"CPU device counts are simulated: all devices share the {os.cpu_count()} host "
            "cores, so examples/s does not scale with the count; the ratios are the figures."
        )
    settings = {
        key: value
        for key, value in vars(args).items()
        if key not in ("worker_devices", "worker_output")
    }
    record = core.make_run_record(
        runs,
        settings=settings,
        command=[sys.executable, "-m", "benchmarks.run", *argv],
        wall_s=time.perf_counter() - start,
        notes=notes,
    )
    path = core.write_run_record(record, args.output_dir)
    print(format_table(record))
    print(f"wrote {path} ({record['wall_s']:.0f} s)")
    return 0 if record["results"] else 1


if __name__ == "__main__":
    sys.exit(main())
