"""One experiment measured on the devices of this process: the parts of the benchmark, composed.

`benchmark_experiment` builds the experiment with `experiment.build_experiment` (the
synthetic-data config of `benchmarks.settings`) and measures, at
`jax.local_device_count()`:

1. the throughput of every variant of the step (`benchmarks.variants`) in
   interleaved windows, and their paired ratios (`benchmarks.timing`);
2. FLOPs per step, MFU and memory of the compiled steps (`benchmarks.costs`);
3. `Checkpointer.save` blocking time, asynchronous against synchronous
   (`benchmarks.checkpoints`);
4. the whole training loop against the bare update around it (`benchmarks.loop`).

`benchmarks.run` calls it once per experiment and precision, in one subprocess
per device count; the tests call it directly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from benchmarks import checkpoints, costs, flops, loop, timing, variants
from benchmarks.settings import Settings, check_precision, synthetic_config, targets_for
from haiku_state import sharding
from haiku_state.experiment import build_experiment
from haiku_state.updater import Updater

Log = Callable[[str], None]
_PROCESS_START = time.monotonic()


def log_to_stderr(line: str) -> None:
    """Prints a progress line to stderr, with the seconds since the process started."""
    print(f"{time.monotonic() - _PROCESS_START:6.1f}s {line}", file=sys.stderr, flush=True)


def benchmark_experiment(
    name: str,
    settings: Settings,
    *,
    peak: dict[str, Any] | None = None,
    workdir: str | os.PathLike | None = None,
    skip_loop: str | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """Measures one experiment on this process's devices; returns a JSON-ready dict.

    Args:
      name: one of `settings.EXPERIMENTS`.
      settings: sizes and lengths.
      peak: `costs.measure_peak_matmul()`'s result, for MFU; None leaves MFU out.
      workdir: scratch space for the loop run and the checkpoints; a temporary
        directory, removed afterwards, when None.
      skip_loop: a reason to skip the training-loop figure (recorded in its place).
      log: where progress lines go (stderr by default).
    """
    check_precision(settings.precision)
    num_devices = jax.local_device_count()
    label = f"[{num_devices} dev] {name}" + (
        "" if settings.precision == "float32" else f" {settings.precision}"
    )

    def say(line: str) -> None:
        (log or log_to_stderr)(f"{label}: {line}")

    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_"))
        config = synthetic_config(name, settings, num_devices)
        say(f"batch {config.batch_size}, building")
        built_at = time.perf_counter()
        experiment = build_experiment(config)
        timed, input_pipeline = variants.build_variants(name, config, experiment, settings, stack)
        say(f"built in {time.perf_counter() - built_at:.1f} s")
        result = _step_figures(name, config, settings, experiment.updater, timed, peak, say)
        result["input_pipeline"] = input_pipeline
        run_dir = _fresh_directory(Path(workdir), f"{name}_{num_devices}dev_{settings.precision}_")
        # The Updater on pre-sharded batches as the loop runs it (several steps a call where
        # the experiment takes them), and the rest.
        bare = next((v for v in timed if v.name == "updater_steps"), timed[0])
        others = [variant for variant in timed if variant is not bare]
        settings = dataclasses.replace(settings, steps_per_call=bare.steps_per_call)
        one_step_batch = timed[0].batches[0]  # The `updater` variant's, for `update`.
        result["checkpoint"] = _checkpoint_figures(
            experiment.updater, bare, one_step_batch, settings, run_dir
        )
        say(f"checkpoint {checkpoints.summary_line(result['checkpoint'])}")
        for variant in others:  # Free the timed states before the loop builds its own.
            variant.release()
        result["loop"] = _loop_figures(name, settings, bare, result, run_dir, skip_loop, say)
        bare.release()
        return result


def _failure(error: Exception) -> str:
    """What a figure records in place of its values when measuring it raised."""
    return f"failed: {type(error).__name__}: {error}"[:500]


def _fresh_directory(workdir: Path, prefix: str) -> Path:
    """A new directory per call: a loop run in a used workdir would resume, not train, and a
    Checkpointer does not save a step that exists."""
    workdir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))


def _warm_up(
    updater: Updater, timed: Sequence[timing.Variant], settings: Settings, say: Log
) -> tuple[int, dict[str, float], dict[str, Any]]:
    """Compiles and warms up every variant; returns the steps per timed window, the seconds
    each program took to compile side by side, and the compiled programs by variant
    (`_compile_side_by_side`)."""
    compile_s, compiled = _compile_side_by_side(updater, timed, say)
    step_s = []
    for variant in timed:
        step_s.append(timing.warm_up(variant, settings.warmup_steps))
        say(f"{variant.name} first call {variant.first_call_s:.1f} s")
    steps = timing.window_length(settings.steps_per_window, settings.target_window_s, step_s[0])
    return steps, compile_s, compiled


# Variants that run another variant's program: compiled with it.
_SAME_PROGRAM = {"updater_with_input": "updater"}


def _lowered(updater: Updater, variant: timing.Variant) -> jax.stages.Lowered:
    """The variant's step lowered for its own train state and first batch."""
    if variant.name in ("updater", "updater_steps", "updater_with_norms"):
        return updater.lower(
            "update_steps" if variant.steps_per_call > 1 else "update",
            variant.carry,
            variant.batches[0],
            with_global_norms=variant.name == "updater_with_norms",
        )
    if variant.name in (*variants.JIT_VARIANTS, "updater_shard_map"):
        other = variant.step.func.__self__  # functools.partial(updater.update, ...)
        return other.lower("update", variant.carry, variant.batches[0], with_global_norms=False)
    return variant.step.lower(variant.carry, variant.batches[0])


def _compile_side_by_side(
    updater: Updater, timed: Sequence[timing.Variant], say: Log
) -> tuple[dict[str, float], dict[str, Any]]:
    """Compiles the variants' programs at once, one thread each, into the compilation cache.

    XLA compiles in C++ without the GIL, so on a many-core accelerator host the
    programs compile side by side (four ResNet-50 steps in 76 s on a TPU v5e
    host, against 47 to 74 s each alone): the first calls then load them from the
    cache. Without a compilation cache (`jax_compilation_cache_dir`) nothing is
    done here and each compiles at its first call. Returns each program's
    compile seconds, longer than alone (they share the host's cores), and the compiled
    programs (for their costs). Raises `MemoryError` before anything runs if the variants'
    train states and the largest program's working memory would not fit the device.
    """
    if not jax.config.jax_compilation_cache_dir:
        return {}, {}
    lowered = {
        variant.name: _lowered(updater, variant)
        for variant in timed
        if variant.name not in _SAME_PROGRAM
    }

    def compile_one(lowered_program: jax.stages.Lowered) -> tuple[float, Any]:
        began = time.perf_counter()
        compiled = lowered_program.compile()
        return time.perf_counter() - began, compiled

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(lowered)) as pool:
        done = dict(zip(lowered, pool.map(compile_one, lowered.values()), strict=True))
    say(f"{len(lowered)} programs compiled side by side in {time.perf_counter() - began:.1f} s")
    compiled = {name: program for name, (_, program) in done.items()}
    costs.check_fits_on_device(compiled.values())
    return {name: seconds for name, (seconds, _) in done.items()}, compiled


def _step_costs(
    updater: Updater, timed: Sequence[timing.Variant], compiled: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """XLA's analyses of the Updater's steps (each backend timed), the hand-written's, Flax's:
    of the programs compiled side by side, else compiled (from the cache) now."""
    by_name = {variant.name: variant for variant in timed}
    names = ("updater", "updater_steps", *variants.JIT_VARIANTS, "hand_written", "flax")
    return {
        name: costs.compiled_costs(compiled.get(name) or _lowered(updater, by_name[name]).compile())
        for name in names
        if name in by_name
    }


def _throughput_line(throughput: dict[str, Any], ratios: dict[str, float | None]) -> str:
    parts = [f"updater {throughput['updater']['examples_per_s']:,.0f} ex/s"]
    for label, ratio in (
        ("/hand-written", "updater_vs_hand_written"),
        ("/flax", "updater_vs_flax"),
        ("shard_map/pmap", "updater_shard_map_vs_pmap"),
        ("jit/pmap", "updater_jit_vs_pmap"),
        ("fsdp/pmap", "updater_fsdp_vs_pmap"),
    ):
        if ratios[ratio]:
            parts.append(f"{label} {ratios[ratio]:.3f}")
    return ", ".join(parts)


def _analytic_flops_per_example(name: str, config: Any) -> float | None:
    """ResNet-50's training FLOPs per example by hand (3 x forward), for its image size."""
    if name != "resnet50":
        return None
    image_size = config.data.image_shape[0]
    return 3 * 2 * flops.resnet50_forward_macs(image_size, config.data.num_classes)


def _model_flops_per_step(step_flops: dict[str, Any], batch_size: int) -> float:
    """The FLOPs MFU counts: the model's, the literature's where there is a figure (ResNet-50's
    space-to-depth stem multiplies zeros too, 0.6% of its step), else the jaxpr's count."""
    analytic = step_flops.get("analytic_per_example")
    return analytic * batch_size if analytic else step_flops["per_step"]


def _step_figures(
    name: str,
    config: Any,
    settings: Settings,
    updater: Updater,
    timed: Sequence[timing.Variant],
    peak: dict[str, Any] | None,
    say: Log,
) -> dict[str, Any]:
    """Every figure of the timed steps: throughput, ratios, FLOPs, MFU, memory."""
    num_devices, batch_size = jax.local_device_count(), config.batch_size
    steps_per_window, side_by_side_compile_s, compiled = _warm_up(updater, timed, settings, say)
    step_costs = _step_costs(updater, timed, compiled)
    updater_variant = next(variant for variant in timed if variant.name == "updater")
    counted = flops.count_flops(
        functools.partial(updater.update, with_global_norms=False),
        updater_variant.carry,
        updater_variant.batches[0],
    )
    say(f"costs analysed; {steps_per_window} steps per window")
    timing.time_interleaved(timed, settings.windows, steps_per_window)
    throughput = {v.name: timing.throughput(v, steps_per_window, batch_size) for v in timed}
    for variant_name, seconds in side_by_side_compile_s.items():
        # The first call loaded the program from the cache: its compile is this.
        throughput[variant_name]["compile_s"] = seconds
        throughput[variant_name]["compiled_side_by_side"] = True
    ratios = timing.paired_ratios(timed, steps_per_window)
    say(_throughput_line(throughput, ratios))
    step_flops = costs.flops_figures(
        step_costs, counted, num_devices, batch_size, _analytic_flops_per_example(name, config)
    )
    return {
        "experiment": name,
        "num_devices": num_devices,
        **costs.device_info(),
        "precision": settings.precision,
        "model": dict(config.model.items()),
        "model_overrides": dict(settings.model_overrides),
        "data": "synthetic",
        "image_shape": list(config.data.image_shape),
        "num_classes": config.data.num_classes,
        "batch_size": batch_size,
        "per_device_batch": batch_size // num_devices,
        "steps_per_window": steps_per_window,
        "windows": settings.windows,
        "throughput": throughput,
        "ratios": ratios,
        "targets": targets_for(name, costs.device_info()["platform"]),
        "flops": step_flops,
        "utilisation": costs.utilisation(
            _model_flops_per_step(step_flops, batch_size),
            throughput["updater"]["steps_per_s"],
            peak,
            settings.precision,
            costs.device_info()["device_kind"],
            num_devices,
        ),
        "memory": {
            "compiled_update_per_device": step_costs["updater"]["memory_per_device"],
            **_jit_memory(timed, step_costs),
            # The process's peak over everything so far (all variants), where reported.
            "device_peak_bytes_in_use": costs.device_memory_peak(),
        },
    }


def params_and_opt_state_bytes(train_state: Any) -> tuple[int, int]:
    """Bytes of params and `opt_state` on the fullest local device, and of one whole copy.

    Read from the arrays' addressable shards, as `sharding.bytes_per_device` reads a
    whole train state (of either layout).
    """
    held: collections.Counter = collections.Counter()
    leaves = jax.tree.leaves((train_state.params, train_state.opt_state))
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    copies = 1 if sharding.is_global(train_state) else jax.local_device_count()
    return max(held.values()), sum(leaf.nbytes for leaf in leaves) // copies


def _jit_memory(
    timed: Sequence[timing.Variant], step_costs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Per-device memory of the pmap and jit Updaters' train states, where the jit ones ran.

    `params_and_opt_state_per_device`: from the arrays' shards, with the whole copy
    (`whole`) and the bound fsdp must meet (`fsdp_bound`: the split leaves' 1/N plus
    the leaves it keeps whole). `compiled_update_per_device_by_backend`: XLA's memory
    analysis of each compiled step (the arguments hold the train state and the batch).
    """
    by_name = {variant.name: variant for variant in timed}
    if not all(name in by_name for name in variants.JIT_VARIANTS):
        return {}
    per_device = {}
    for name in ("updater", *variants.JIT_VARIANTS):
        per_device[name], whole = params_and_opt_state_bytes(by_name[name].carry)
    fsdp_state = by_name["updater_fsdp"].carry
    leaves = jax.tree.leaves((fsdp_state.params, fsdp_state.opt_state))
    kept_whole = sum(leaf.nbytes for leaf in leaves if leaf.sharding.is_fully_replicated)
    num_devices = jax.device_count()
    per_device["whole"] = whole
    per_device["fsdp_bound"] = -(-(whole - kept_whole) // num_devices) + kept_whole
    per_device["fsdp_vs_replicated"] = per_device["updater_fsdp"] / per_device["updater_jit"]
    return {
        "params_and_opt_state_per_device": per_device,
        "compiled_update_per_device_by_backend": {
            "pmap": step_costs["updater"]["memory_per_device"],
            "jit": step_costs["updater_jit"]["memory_per_device"],
            "fsdp": step_costs["updater_fsdp"]["memory_per_device"],
        },
    }


def _checkpoint_figures(
    updater: Updater, bare: timing.Variant, batch: Any, settings: Settings, run_dir: Path
) -> dict[str, Any]:
    """`checkpoints.benchmark_checkpoint` on the Updater variant's state, or why not."""
    if not settings.checkpoint_saves:
        return {"skipped": "checkpoint_saves=0"}
    try:
        figures, bare.carry = checkpoints.benchmark_checkpoint(
            updater,
            bare.carry,
            batch,
            settings.checkpoint_saves,
            run_dir / "checkpoint_bench",
        )
    except Exception as e:  # Recorded; the figures of the steps stand.
        figures = {"skipped": _failure(e)}
    return figures


def _loop_figures(
    name: str,
    settings: Settings,
    bare: timing.Variant,
    result: dict[str, Any],
    run_dir: Path,
    skip_loop: str | None,
    say: Log,
) -> dict[str, Any]:
    """The median of `loop_runs` training-loop runs, each against the bare update around it.

    Records the bare update's windows after each loop in `result`'s Updater throughput.
    """
    bare_update = loop.BareUpdate(
        bare, settings.windows, result["steps_per_window"], result["batch_size"]
    )
    after_loops = bare_update.window_steps_per_s_after_loop
    result["throughput"]["updater"]["window_steps_per_s_after_loop"] = after_loops
    if skip_loop is not None or settings.loop_steps == 0:
        return {"skipped": skip_loop or "loop_steps=0"}
    try:
        runs = [
            loop.benchmark_training_loop(name, settings, bare_update, run_dir / f"loop_{index}")
            for index in range(settings.loop_runs)
        ]
    except Exception as e:  # Recorded; the figures above stand.
        say(f"loop {_failure(e)}")
        return {"skipped": _failure(e)}
    figures = loop.median_loop_run(runs)
    say(loop.summary_line(figures))
    return figures
