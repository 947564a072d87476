r"""One check of an accelerator host (a GPU or a TPU) that fits a short lease: one record.

    make accelerator-check VENV= RECORD=benchmarks/results/gpu.json              # a GPU host
    make accelerator-check VENV= ARGS=--plan=tpu RECORD=benchmarks/results/tpu.json  # a TPU
    python -m benchmarks.accelerator_check [--plan=gpu|tpu] [--out=PATH] [--budget_s=480]

(`make gpu-check` and `make tpu-check` are the same target with their plan.) In
this order, each phase timed against what is left of `--budget_s` and skipped
(with the reason recorded) when its estimate does not fit:

1. `data`: ImageNet-like JPEGs in a temporary ImageFolder (`input_pipeline.write_tree`).
2. `startup`: `python -m haiku_state.train` of the ImageNet recipe
   (`resnet50:imagenet`) on those JPEGs, from the command to its first logged
   step, cold, as a rerun with the compilation cache and resumed with it
   (`benchmarks.startup`). Before this process opens the accelerator: a TPU is
   held by one process at a time.
3. `peak_matmul`: float32 (TF32 on a GPU) and bfloat16 matmuls, the MFU denominators.
4. `steps`: the Updater's bfloat16 step at the plan's global batch sizes on
   synthetic data (`benchmarks.experiment`, the Updater alone): examples/s,
   FLOPs counted from the jaxpr beside XLA's and the analytic figure, MFU
   against the bfloat16 peak, memory.
5. `decoders`: decode + crop + resize to 224 on one core, per decoder
   (`benchmarks.input_pipeline.decoder_rates`), on ImageNet-like JPEGs.
6. `pipeline`: the input pipeline alone with 1 worker and with `cores - 1`, per
   decoder (`input_pipeline.measure_pipeline`).
7. `loop`: the training loop of `resnet50:imagenet` fed by `cores - 1` workers
   against the bare update at the plan's batch, per decoder
   (`input_pipeline.measure_loop`), each bounded in time.

A decoder this checkout does not have (`config.data.decoder`, or a `decoder`
argument of the pipeline's functions) is recorded as skipped, with the reason;
the TPU plan records the GPU decoder as not applicable.
The record is rewritten after every phase, so a run cut short leaves what it
measured. `--quick` is a smoke run for a CPU: the mlp at tiny batches, a few
images, the `resnet`'s start-up; every phase runs, no figure means anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

from benchmarks import record as record_lib
from benchmarks import startup
from haiku_state import tpu_host

DECODERS = ("cpu", "gpu")
NOT_APPLICABLE = "not applicable: the plan's host has no such decoder (a TPU host: no nvJPEG)"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the check measures, and its estimates of the seconds each part needs."""

    step_experiment: str = "resnet50"
    step_batch_sizes: tuple[int, ...] = (256, 512, 1024)
    step_overrides: tuple[tuple[str, Any], ...] = ()
    step_window_s: float = 1.0
    startup_experiment: str = "resnet50:imagenet"
    startup_batch_size: int = 256
    startup_log_every: int = 20
    startup_runs: tuple[str, ...] = ("cold", "cached", "resumed_cached")
    decoders: tuple[str, ...] = ("cpu", "gpu")
    images: int = 2048
    distinct: int = 256
    image_size: int = 224
    decoder_seconds: float = 3.0
    pipeline_batch_size: int = 64
    pipeline_steps: int = 24
    loop_experiment: str = "resnet50:imagenet"
    loop_image_size: int = 224
    loop_batch_size: int = 1024
    loop_steps: int = 40
    loop_log_every: int = 10
    loop_time_limit_s: float = 90.0
    matmul_size: int | None = None
    # Estimates of each part on one H200, from GPU-NOTES.md (a cold ResNet-50 start, build
    # and compile, took about a minute; a step's compile 14 s): a part is skipped when less
    # than its estimate is left. Together they fit the 480 s of the check.
    startup_s: float = 100.0
    step_s: float = 45.0
    decoders_s: float = 10.0
    pipeline_s: float = 30.0
    loop_s: float = 90.0


# One TPU v5e chip (TPU-NOTES.md): its best batch is 128 (256 ran 6% slower a step), a
# ResNet-50 step compiles in about 50 s, and there is no GPU decoder. Estimates as measured
# in one whole check (benchmarks/results/tpu.json, issue40_stop45): the start-up 194 s, a
# batch size's steps 66 s, the loop at the recipe's batch 155 s (its compiles trace for 42 s).
# With both batch sizes the check took 536 s, so the steps run at 128 only: the loop and
# the start-up run the recipe at 256.
TPU = Plan(
    step_batch_sizes=(128,),
    loop_batch_size=256,
    decoders=("cpu",),
    startup_runs=("cold", "resumed_cached"),
    startup_s=195.0,
    step_s=70.0,
    loop_s=160.0,
)
QUICK = Plan(
    step_experiment="mlp",
    step_batch_sizes=(32, 64, 128),
    step_window_s=0.05,
    startup_experiment="mlp",
    startup_batch_size=32,
    startup_log_every=1,
    startup_runs=("cold", "resumed_cached"),
    images=64,
    distinct=8,
    image_size=64,
    decoder_seconds=0.25,
    pipeline_batch_size=16,
    pipeline_steps=2,
    loop_experiment="mlp",
    loop_image_size=16,
    loop_batch_size=16,
    loop_steps=30,
    loop_log_every=10,
    loop_time_limit_s=60.0,
    matmul_size=256,
    startup_s=60.0,
    step_s=10.0,
    decoders_s=2.0,
    pipeline_s=15.0,
    loop_s=30.0,
)


class Check:
    """The record, written after every phase, and the time left to the budget."""

    def __init__(self, path: str, budget_s: float, plan: Plan, argv: list[str]):
        self.path, self.plan = path, plan
        self._start = time.perf_counter()
        self._deadline = self._start + budget_s
        self.record: dict[str, Any] = {
            "kind": "accelerator_check",
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": [sys.executable, "-m", "benchmarks.accelerator_check", *argv],
            "budget_s": budget_s,
            "plan": dataclasses.asdict(plan),
            "machine": record_lib.machine_info(),
            "versions": record_lib.package_versions(),
            "status": "running",
            "skipped": [],
        }
        self.write()

    def left_s(self) -> float:
        return self._deadline - time.perf_counter()

    def write(self) -> None:
        self.record["wall_s"] = time.perf_counter() - self._start
        record_lib.write_json(self.path, self.record)

    def skip(self, what: str, reason: str) -> None:
        self.record["skipped"].append(f"{what}: {reason}")
        say(f"skipped {what}: {reason}")
        self.write()

    def phase(self, name: str, estimate_s: float, measure: Callable[[], Any]) -> Any:
        """`record[name] = measure()` if `estimate_s` fits in what is left; an error is recorded."""
        if self.left_s() < estimate_s:
            self.skip(name, f"{self.left_s():.0f} s left, it needs about {estimate_s:.0f} s")
            return None
        say(f"{name} ({self.left_s():.0f} s left)")
        began = time.perf_counter()
        try:
            self.record[name] = measure()
        except Exception as e:  # Recorded; the other phases still run.
            traceback.print_exc()
            self.record[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        self.record.setdefault("phase_s", {})[name] = time.perf_counter() - began
        self.write()
        return self.record[name]


def say(line: str) -> None:
    print(f"[accelerator_check] {line}", file=sys.stderr, flush=True)


def measure_startup(check: Check, root: str, workers: int) -> dict[str, Any]:
    plan = check.plan
    overrides: dict[str, Any] = {"log_every": plan.startup_log_every}
    if ":" in plan.startup_experiment:  # The recipe: on the JPEGs, with the loop's workers,
        # and a warmup the few JPEGs' epochs hold (the recipe's is 5 of ImageNet's).
        overrides.update({"data.dir": root, "data.workers": workers, "optimizer.warmup_steps": 10})
    with tempfile.TemporaryDirectory(prefix="accelerator_check_startup_") as scratch:
        runs = startup.measure_runs(
            plan.startup_experiment,
            plan.startup_batch_size,
            scratch,
            timeout_s=max(check.left_s() / 3, 30.0),
            runs=plan.startup_runs,
            overrides=overrides,
        )
    return {
        "experiment": plan.startup_experiment,
        "overrides": {key: str(value) for key, value in overrides.items()},
        "batch_size": plan.startup_batch_size,
        "runs": runs,
        "speedup": startup.speedups(runs),
        "speedup_cpu_seconds": startup.speedups(runs, "cpu_seconds"),
        "target_speedup": 3.0,
    }


def measure_steps(check: Check, peak: dict[str, Any] | None, workdir: str) -> list[dict]:
    """The Updater alone at each batch size of the plan, in bfloat16; the record grows with each."""
    import jax

    from benchmarks.experiment import benchmark_experiment
    from benchmarks.settings import Settings

    plan, results = check.plan, []
    check.record["steps"] = results
    for batch_size in plan.step_batch_sizes:
        if check.left_s() < plan.step_s:
            check.skip(f"steps at batch {batch_size}", f"{check.left_s():.0f} s left")
            break
        settings = Settings(
            batch_size=batch_size,
            target_window_s=plan.step_window_s,
            windows=3,
            warmup_steps=2,
            num_batches=2,
            loop_steps=0,
            checkpoint_saves=0,
            hand_written=False,
            flax=False,
            updater_shard_map=False,
            updater_jit=False,
            norms=False,
            precision="bfloat16",
            model_overrides=plan.step_overrides,
        )
        try:
            result = benchmark_experiment(
                plan.step_experiment, settings, peak=peak, workdir=workdir
            )
        except Exception as e:  # An out-of-memory batch, say: the smaller ones stand.
            traceback.print_exc()
            result = {"batch_size": batch_size, "error": f"{type(e).__name__}: {e}"[:1000]}
        results.append(_step_summary(result))
        check.write()
        jax.clear_caches()
    return results


def _step_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The step's figures the check keeps (the whole result stays under `result`)."""
    if "error" in result:
        return result
    updater = result["throughput"]["updater"]
    return {
        "batch_size": result["batch_size"],
        "per_device_batch": result["per_device_batch"],
        "examples_per_s": updater["examples_per_s"],
        "step_ms": updater["step_ms"],
        "compile_s": updater["compile_s"],
        "mfu": result["utilisation"]["mfu"],
        "flops_per_example": result["flops"]["per_example"],
        "xla_flops_per_example": result["flops"]["xla_per_example"],
        "analytic_flops_per_example": result["flops"]["analytic_per_example"],
        "input_pipeline_vs_presharded": result["ratios"]["input_pipeline_vs_presharded"],
        "result": result,
    }


def _jpeg_tree(check: Check, root: str) -> dict[str, Any]:
    from benchmarks import input_pipeline

    plan = check.plan
    return input_pipeline.write_tree(root, plan.images, plan.distinct)


def measure_pipeline(check: Check, root: str, workers: int) -> dict[str, Any]:
    """The pipeline alone at 1 and `workers` workers, for each decoder this checkout has."""
    from benchmarks import input_pipeline
    from haiku_state import data

    plan = check.plan
    split = data.load_dataset("imagefolder", data_dir=root, image_size=plan.image_size).train
    by_decoder = {}
    for decoder in DECODERS:
        if decoder not in plan.decoders:
            by_decoder[decoder] = {"skipped": NOT_APPLICABLE}
            continue
        try:
            counts = sorted({1, workers})
            runs = {
                str(w): input_pipeline.pipeline_rate(
                    split, plan.pipeline_batch_size, w, plan.pipeline_steps, decoder
                )
                for w in counts
            }
            by_decoder[decoder] = {"batch_size": plan.pipeline_batch_size, "workers": runs}
        except Exception as e:  # No such decoder here, or none that runs: recorded.
            by_decoder[decoder] = {"skipped": f"{type(e).__name__}: {e}"[:1000]}
            check.record["skipped"].append(f"pipeline with the {decoder} decoder: {e}")
    return by_decoder


def measure_loops(check: Check, root: str, workers: int) -> dict[str, Any]:
    """The loop against the bare update for each decoder, each bounded in time."""
    from benchmarks import input_pipeline

    plan = check.plan
    args = argparse.Namespace(
        decoder=None,
        loop_experiment=plan.loop_experiment,
        loop_image_size=plan.loop_image_size,
        loop_batch_size=plan.loop_batch_size,
        loop_steps=plan.loop_steps,
        loop_log_every=plan.loop_log_every,
        loop_time_limit_s=plan.loop_time_limit_s,
        pin_update_core="auto",
    )
    loops: dict[str, Any] = {}
    check.record["loop"] = loops
    for decoder in DECODERS:
        if decoder not in plan.decoders:
            loops[decoder] = {"skipped": NOT_APPLICABLE}
            continue
        if check.left_s() < plan.loop_s:
            check.skip(f"loop with the {decoder} decoder", f"{check.left_s():.0f} s left")
            continue
        try:
            args.decoder = decoder
            loops[decoder] = input_pipeline.measure_loop(args, root, workers)
        except Exception as e:  # No such decoder here, or none that runs: recorded.
            traceback.print_exc()
            loops[decoder] = {"skipped": f"{type(e).__name__}: {e}"[:1000]}
            check.record["skipped"].append(f"loop with the {decoder} decoder: {e}")
        check.write()
    return loops


def run_check(check: Check) -> None:
    """Every phase, in order; the record is complete unless a phase was skipped."""
    plan = check.plan
    from haiku_state.data import host_cache

    workers = max(len(os.sched_getaffinity(0)) - 1, 1)
    with (
        tempfile.TemporaryDirectory(prefix="accelerator_check_") as scratch,
        mock.patch.dict(os.environ, {host_cache.CACHE_ENV: scratch}),  # Not the user's cache.
    ):
        root = os.path.join(scratch, "jpegs")
        if check.phase("data", 10.0, lambda: _jpeg_tree(check, root)) is None:
            return
        # Before this process opens the accelerator: the runs it starts need it (a TPU is
        # held by one process at a time, a GPU's memory by the first that takes it).
        check.phase("startup", plan.startup_s, lambda: measure_startup(check, root, workers))

        import jax

        from benchmarks import costs, input_pipeline
        from haiku_state import compilation_cache

        check.record["device"] = costs.device_info()
        peak = check.phase("peak_matmul", 5.0, lambda: costs.measure_peak_matmul(plan.matmul_size))
        # One private cache: a program compiled twice (the step and its cost analysis, the
        # bare update and the loop) compiles once.
        compilation_cache.enable(os.path.join(scratch, "jax_compilation_cache"))
        if jax.default_backend() == "cpu":  # As `python -m haiku_state.train` runs there.
            jax.config.update("jax_threefry_partitionable", False)
        measure_steps(
            check, peak if isinstance(peak, dict) and "error" not in peak else None, scratch
        )
        check.phase(
            "decoders",
            plan.decoders_s,
            lambda: input_pipeline.decoder_rates(root, plan.image_size, plan.decoder_seconds),
        )
        check.phase("pipeline", plan.pipeline_s, lambda: measure_pipeline(check, root, workers))
        check.record["loop_workers"] = workers
        measure_loops(check, root, workers)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accelerator_check", description=__doc__
    )
    parser.add_argument("--out", default="", help="the record (default: a timestamped file "
                        "in benchmarks/results)")  # fmt: skip
    parser.add_argument("--budget_s", type=float, default=480.0, help="the whole check's")
    parser.add_argument("--quick", action="store_true", help="a CPU smoke run at toy sizes")
    parser.add_argument("--plan", choices=("gpu", "tpu"), default="gpu",
                        help="the host's plan: batch sizes, decoders, estimates")  # fmt: skip
    args = parser.parse_args(argv)
    tpu_host.size_premapped_buffer()  # As the commands do, for every process run from here.
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out or str(record_lib.DEFAULT_OUTPUT_DIR / f"{stamp}_accelerator_check.json")
    plan = QUICK if args.quick else TPU if args.plan == "tpu" else Plan()
    check = Check(path, args.budget_s, plan, argv)
    try:
        run_check(check)
    finally:
        check.record["status"] = "partial" if check.record["skipped"] else "complete"
        check.write()
    say(f"wrote {path} ({check.record['wall_s']:.0f} s, {check.record['status']})")
    return check.record


if __name__ == "__main__":
    main()
