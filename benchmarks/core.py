"""The measurements, in process: one experiment on the devices this process has.

`benchmark_experiment` measures, for one experiment at `jax.local_device_count()`:

1. `Updater.update` throughput on synthetic data, a few device batches sharded
   once and cycled, at most two steps in flight (after dispatching step k, wait
   for step k-1's metrics, as `haiku_state.train` does);
2. the hand-written `jax.pmap` step (`benchmarks.baselines`), the Updater
   with `backend="shard_map"`, the Updater fed by the input pipeline
   `train.train_and_evaluate` uses and, for the ResNets, the Flax linen peer
   (`benchmarks.flax_models`), with their timed windows interleaved with the
   Updater's, so machine noise hits all alike;
3. FLOPs per step from XLA's cost analysis and the model FLOP utilisation
   against `measure_peak_matmul`;
4. compile time and memory;
5. the whole training loop (`train.train_and_evaluate`) against the bare update,
   timed again right after the loop;
6. `Checkpointer.save` blocking time, asynchronous against synchronous.

`benchmarks.run` calls it once per experiment in one subprocess per device
count; the test calls it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import baselines
from haiku_state import config as config_lib
from haiku_state import data, losses, models, optim, replication, summaries, train
from haiku_state.updater import Updater

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS_DIR = REPO_ROOT / "experiments"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1

EXPERIMENTS = ("mlp", "resnet", "resnet50")
# (image_shape, num_classes) of the synthetic data each experiment is timed on.
SYNTHETIC_SHAPES = {
    "mlp": ((8, 8, 1), 10),
    "resnet": ((8, 8, 1), 10),
    "resnet50": ((224, 224, 3), 1000),
}
FLAX_PEERS = ("resnet", "resnet50")
# Updater / hand-written throughput the library aims for, and loop / bare update.
UPDATER_TARGETS = {"mlp": 0.95, "resnet": 0.97, "resnet50": 0.97}
LOOP_TARGET = 0.90

# PRECISION: the mixed-precision axis is the library's `config.precision`
# (`haiku_state.models.PRECISIONS`: Haiku mixed-precision policies, params in float32,
# float16 with a dynamic loss scale in `opt_state`). Every variant computes in the same
# precision: the Updater through `config.precision`, the hand-written step with the same
# network and loss scaling, the Flax peer with the model `dtype` (and `DynamicScale` for
# float16), as the Flax example does. A library without `PRECISIONS` runs float32 only.
SUPPORTED_PRECISIONS = tuple(getattr(models, "PRECISIONS", ("float32",)))
HALF_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def check_precision(precision: str) -> None:
    """Raises ValueError for a precision the library cannot run, saying why."""
    if precision in SUPPORTED_PRECISIONS:
        return
    raise ValueError(
        f"precision {precision!r} is not supported by haiku_state (config.precision takes "
        f"{SUPPORTED_PRECISIONS}); see PRECISION in benchmarks/core.py."
    )


def _set_precision(config: Any, precision: str) -> None:
    if "precision" in config:
        config.precision = precision
    elif precision != "float32":
        raise ValueError(
            f"precision {precision!r}: the experiment config has no `precision` key, so the "
            "library would silently run float32; refusing to label that as a half-precision "
            "figure."
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long and how big one experiment's measurement is.

    Attributes:
      batch_size: the global batch size; None takes the experiment config's.
      steps_per_window: steps in one timed window; None picks the count that makes a
        window of the Updater last about `target_window_s` (from its warm-up steps).
      target_window_s: see `steps_per_window`.
      windows: timed windows per variant (interleaved across variants).
      warmup_steps: untimed steps after the compiling first call (at least 1).
      num_batches: device batches sharded once and cycled.
      loop_steps: length of the `train_and_evaluate` run; None takes the experiment
        config's `steps`, 0 skips the loop benchmark.
      loop_log_every: its logging window; None takes the config's `log_every`. The
        first window (compilation) is dropped from the steady state.
      loop_runs: how many times the loop runs, each in a fresh workdir and each
        compared with the bare update timed right before and after it; the run
        with the median ratio is reported, every run's ratio is recorded.
      loop_synthetic_data: run the loop on synthetic data of the timed shape
        (`SYNTHETIC_SHAPES`) instead of the experiment's own data (for a smoke
        run: loading the digits imports scikit-learn, 3.5 s on 2 cores).
      checkpoint_saves: timed saves per mode (async, sync), after one warm-up save;
        0 skips the checkpoint benchmark.
      hand_written: whether to time the hand-written pmap step
        (`throughput.hand_written`, `ratios.updater_vs_hand_written`).
      flax: whether to time the Flax peer where there is one.
      shard_map: whether to also time the hand-written step as `jit(shard_map)`
        (`baselines.make_shard_map_step`): what `jax.pmap`'s own dispatch costs.
      updater_shard_map: whether to also time the library's `Updater` built with
        `backend="shard_map"` (`throughput.updater_shard_map`), against the pmap
        Updater (`ratios.updater_shard_map_vs_pmap`).
      precision: one of `SUPPORTED_PRECISIONS`, set as `config.precision`.
      model_overrides: `(key, value)` pairs set on `config.model` (e.g. a smaller
        ResNet for `--quick`); recorded in the result. Applies to every variant
        and to the training-loop run.
    """

    batch_size: int | None = None
    steps_per_window: int | None = None
    target_window_s: float = 1.0
    windows: int = 5
    warmup_steps: int = 3
    num_batches: int = 4
    loop_steps: int | None = None
    loop_log_every: int | None = None
    loop_runs: int = 1
    loop_synthetic_data: bool = False
    checkpoint_saves: int = 3
    hand_written: bool = True
    flax: bool = True
    shard_map: bool = False
    updater_shard_map: bool = True
    precision: str = "float32"
    model_overrides: tuple[tuple[str, Any], ...] = ()


def load_experiment_config(name: str) -> Any:
    """`get_config()` of `experiments/<name>.py`, loaded as the library loads it."""
    path = EXPERIMENTS_DIR / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"Unknown experiment {name!r}; expected one of {EXPERIMENTS}.")
    return config_lib.load_config_file(str(path))


def _override_model(config: Any, settings: Settings) -> None:
    for key, value in settings.model_overrides:
        if key not in config.model:
            raise ValueError(f"config.model has no key {key!r}; its keys: {list(config.model)}.")
        config.model[key] = value


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _synthetic_config(name: str, settings: Settings, num_devices: int) -> Any:
    """The experiment's config with its data replaced by synthetic data of its shape."""
    config = load_experiment_config(name)
    batch_size = settings.batch_size or config.batch_size
    if batch_size % num_devices:
        raise ValueError(
            f"{name}: batch_size={batch_size} is not divisible by the {num_devices} devices."
        )
    image_shape, num_classes = SYNTHETIC_SHAPES[name]
    _override_model(config, settings)
    _set_precision(config, settings.precision)
    config.batch_size = batch_size
    config.data.name = "synthetic"
    config.data.image_shape = image_shape
    config.data.num_classes = num_classes
    config.data.num_train = batch_size * settings.num_batches
    config.data.num_test = num_devices
    return config


# -- Timing -----------------------------------------------------------------------------------


StepFn = Callable[[Any, Any], tuple[Any, Any]]


@dataclasses.dataclass
class _Variant:
    """One implementation of the step being timed, with its own state and batches."""

    name: str
    step: StepFn
    carry: Any
    batches: list[Any]  # Device batches, cycled; or empty when `source` feeds the steps.
    source: Iterator[Any] | None = None
    first_call_s: float = math.nan
    window_s: list[float] = dataclasses.field(default_factory=list)
    next_batch: int = 0

    def batch(self) -> Any:
        if self.source is not None:
            return next(self.source)
        self.next_batch += 1
        return self.batches[(self.next_batch - 1) % len(self.batches)]


def _run_steps(variant: _Variant, num_steps: int) -> float:
    """Runs `num_steps` steps with at most two in flight; returns the wall time.

    The clock starts with nothing in flight and stops when the last step's
    metrics are on hand, so back-to-back windows do not overlap.
    """
    jax.block_until_ready(variant.carry)
    start = time.perf_counter()
    in_flight = None
    for _ in range(num_steps):
        variant.carry, metrics = variant.step(variant.carry, variant.batch())
        if in_flight is not None:
            jax.block_until_ready(in_flight)
        in_flight = metrics
    jax.block_until_ready(in_flight)
    return time.perf_counter() - start


MAX_STEPS_PER_WINDOW = 500


def _warm_up(variant: _Variant, warmup_steps: int) -> float:
    """Runs the compiling first call and `warmup_steps` more; returns their seconds per step."""
    variant.first_call_s = _run_steps(variant, 1)
    warmup_steps = max(warmup_steps, 1)
    return _run_steps(variant, warmup_steps) / warmup_steps


def _window_length(settings: Settings, step_s: float) -> int:
    if settings.steps_per_window:
        return settings.steps_per_window
    return int(min(max(round(settings.target_window_s / step_s), 2), MAX_STEPS_PER_WINDOW))


def _time_interleaved(variants: Sequence[_Variant], windows: int, steps_per_window: int) -> None:
    """Times `windows` windows of each variant, alternating ABC, CBA, ABC, ..."""
    for window in range(windows):
        order = variants if window % 2 == 0 else list(reversed(variants))
        for variant in order:
            variant.window_s.append(_run_steps(variant, steps_per_window))


def _throughput(variant: _Variant, steps_per_window: int, batch_size: int) -> dict[str, Any]:
    step_s = statistics.median(variant.window_s) / steps_per_window
    return {
        "examples_per_s": batch_size / step_s,
        "steps_per_s": 1.0 / step_s,
        "step_ms": 1e3 * step_s,
        "window_steps_per_s": [steps_per_window / s for s in variant.window_s],
        "first_call_s": variant.first_call_s,
        # The first call traces, compiles and runs one step.
        "compile_s": max(variant.first_call_s - step_s, 0.0),
    }


def _paired_ratio(numerator: _Variant, denominator: _Variant) -> float:
    """Median over windows of throughput(numerator) / throughput(denominator)."""
    return statistics.median(
        b / a for a, b in zip(numerator.window_s, denominator.window_s, strict=True)
    )


# -- FLOPs, peak, memory ----------------------------------------------------------------------


def compiled_costs(pmapped: Any, *args: Any) -> dict[str, Any]:
    """XLA's cost and memory analysis of a pmapped function compiled for `args`.

    On JAX 0.10 `pmap(f).lower(*args).compile().cost_analysis()` returns one dict
    (older releases returned a list of one dict per module) whose "flops" are those
    of ONE device's program: the SPMD-partitioned module, measured to halve from 1
    to 2 devices at the same global batch. `memory_analysis()` is per device too.
    Lowering does not consume donated arguments, and the executable comes from the
    compilation cache when the function has already run with these shapes.
    """
    compiled = pmapped.lower(*args).compile()
    costs = compiled.cost_analysis()
    if isinstance(costs, (list, tuple)):
        costs = {
            key: sum(float(c.get(key, 0.0)) for c in costs) for key in ("flops", "bytes accessed")
        }
    costs = costs or {}
    flops = float(costs.get("flops", math.nan))
    memory = compiled.memory_analysis()
    memory_fields = {}
    if memory is not None:
        for field in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
            "generated_code_size_in_bytes",
        ):
            memory_fields[field] = int(getattr(memory, field, 0))
        memory_fields["total_bytes"] = (
            memory_fields["argument_size_in_bytes"]
            + memory_fields["output_size_in_bytes"]
            - memory_fields["alias_size_in_bytes"]
            + memory_fields["temp_size_in_bytes"]
        )
    return {
        "flops_per_device": flops if flops > 0 else None,
        "bytes_accessed_per_device": float(costs.get("bytes accessed", math.nan)),
        "memory_per_device": memory_fields or None,
    }


def default_matmul_size() -> int:
    """4096 on accelerators, 1024 on CPU (a 4096^2 f32 matmul takes seconds there)."""
    return 1024 if jax.default_backend() == "cpu" else 4096


def measure_peak_matmul(
    size: int | None = None, repeats: int = 5, calls_per_repeat: int = 5
) -> dict[str, Any]:
    """The device's matmul throughput: the peak that MFU is measured against.

    `single_device` is one jitted `size x size` matmul on device 0;
    `all_devices` the same matmul pmapped over every local device at once (on
    simulated CPU devices they share the host's cores, so this is the machine's
    peak, not N times one device's). Each is the median of `repeats` runs of
    `calls_per_repeat` back-to-back calls. On GPU an f32 matmul runs at JAX's
    default precision (TF32 on Ampere and later), which is also what the
    models' f32 convolutions get.
    """
    size = size or default_matmul_size()
    num_devices = jax.local_device_count()
    flops = 2.0 * size**3
    result: dict[str, Any] = {"size": size}
    for dtype in ("float32", "bfloat16"):
        a = jnp.ones((size, size), dtype)
        single = jax.jit(jnp.matmul)
        stacked = replication.shard(np.ones((num_devices * size, size), dtype))
        every = jax.pmap(jnp.matmul)
        timings = {}
        for label, fn, args, total_flops in (
            ("single_device", single, (a, a), flops),
            ("all_devices", every, (stacked, stacked), flops * num_devices),
        ):
            jax.block_until_ready(fn(*args))
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls_per_repeat):
                    out = fn(*args)
                jax.block_until_ready(out)
                runs.append((time.perf_counter() - start) / calls_per_repeat)
            timings[f"{label}_tflop_per_s"] = total_flops / statistics.median(runs) / 1e12
        result[dtype] = timings
    return result


def device_memory_peak() -> int | None:
    """The largest `peak_bytes_in_use` over the local devices; None where unreported (CPU)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # Some backends raise instead of returning None.
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def device_info() -> dict[str, Any]:
    """What this process runs on."""
    devices = jax.local_devices()
    return {
        "platform": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "local_device_count": len(devices),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
    }


# -- The benchmark of one experiment ----------------------------------------------------------


def _host_batches(dataset: data.Dataset, batch_size: int, count: int) -> list[dict[str, Any]]:
    images, labels = dataset.train.images, dataset.train.labels
    return [
        {
            "image": images[i * batch_size : (i + 1) * batch_size],
            "label": labels[i * batch_size : (i + 1) * batch_size],
        }
        for i in range(count)
    ]


def training_input(dataset: data.Dataset, batch_size: int, seed: int) -> tuple[str, Iterator[Any]]:
    """The input pipeline `train.train_and_evaluate` uses for `dataset`, and its name.

    `data.sharded_train_batches`: a split that fits on the devices is kept there and
    batched by a jitted gather (`data.device_train_batches`); a larger one is batched
    on the host and sharded by `data.prefetch_to_device`'s thread.
    """
    name = (
        "device_train_batches"
        if data.fits_on_device(dataset.train)
        else "train_batches+prefetch_to_device"
    )
    return name, data.sharded_train_batches(dataset.train, batch_size, seed=seed)


def _flax_variant(
    config: Any,
    dataset: data.Dataset,
    host_batches: list[dict[str, Any]],
    loss_fn: Any,
    augment_fn: Any,
) -> _Variant:
    from benchmarks import flax_models

    # The experiment's optimizer, its weight decay on the linen names of the same weights.
    optimizer = optim.make_optimizer(
        config.optimizer, config.steps, weight_decay_mask=flax_models.kernels
    )
    precision = config.get("precision", "float32")
    model = flax_models.make_model(config, dataset.num_classes, dtype=HALF_DTYPES[precision])
    dynamic_scale = None
    if precision == "float16":
        from flax.training.dynamic_scale import DynamicScale

        dynamic_scale = DynamicScale()
    state = flax_models.create_train_state(
        model, jax.random.key(config.seed), dataset.image_shape, optimizer, dynamic_scale
    )
    state = replication.replicate(state, flax_models.AXIS_NAME)
    step = flax_models.make_train_step(loss_fn, augment_fn, seed=config.seed)
    batches = [replication.shard(b, flax_models.AXIS_NAME) for b in host_batches]
    return _Variant("flax", step, state, batches)


_PROCESS_START = time.monotonic()


def _log_to_stderr(line: str) -> None:
    print(f"{time.monotonic() - _PROCESS_START:6.1f}s {line}", file=sys.stderr, flush=True)


def benchmark_experiment(
    name: str,
    settings: Settings,
    *,
    peak: dict[str, Any] | None = None,
    workdir: str | os.PathLike | None = None,
    skip_loop: str | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measures one experiment on this process's devices; returns a JSON-ready dict.

    Args:
      name: one of `EXPERIMENTS`.
      settings: sizes and lengths.
      peak: `measure_peak_matmul()`'s result, for MFU; None leaves MFU out.
      workdir: scratch space for the loop run and the checkpoints; a temporary
        directory, removed afterwards, when None.
      skip_loop: a reason to skip the training-loop figure (recorded in its place).
      log: where progress lines go (stderr by default).
    """
    log = log or _log_to_stderr
    check_precision(settings.precision)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_"))
        return _benchmark_experiment(name, settings, peak, Path(workdir), skip_loop, log, stack)


def _benchmark_experiment(
    name: str,
    settings: Settings,
    peak: dict[str, Any] | None,
    workdir: Path,
    skip_loop: str | None,
    log: Callable[[str], None],
    stack: contextlib.ExitStack,
) -> dict[str, Any]:
    num_devices = jax.local_device_count()
    config = _synthetic_config(name, settings, num_devices)
    batch_size = config.batch_size
    log(f"[{num_devices} dev] {name}: batch {batch_size}, building")
    built_at = time.perf_counter()

    experiment = train.build_experiment(config)
    updater, dataset = experiment.updater, experiment.dataset
    host_batches = _host_batches(dataset, batch_size, settings.num_batches)
    batches = [replication.shard(b, updater.axis_name) for b in host_batches]

    # The same pieces, built again from the config as train.build_experiment builds them,
    # for the baselines (a drift between the two shows as a FLOP mismatch below).
    precision_option = {"precision": settings.precision} if "precision" in config else {}
    network = models.make_network(
        config.model.name,
        dataset.num_classes,
        cross_replica_axis=updater.axis_name,
        **precision_option,
        **{k: v for k, v in config.model.items() if k != "name"},
    )
    optimizer = optim.make_optimizer(config.optimizer, config.steps)
    loss_fn = losses.classification_loss(dataset.num_classes, config.label_smoothing)
    augment_fn = data.make_augment_fn(max_shift=config.data.max_shift, flip=config.data.flip)

    per_device = baselines.per_device_step(
        network, optimizer, loss_fn, augment_fn, updater.axis_name, experiment.loss_scale
    )
    variants = [_Variant("updater", updater.update, updater.init(config.seed, batches[0]), batches)]
    if settings.hand_written:
        variants.append(
            _Variant(
                "hand_written",
                baselines.make_hand_written_step(per_device, updater.axis_name),
                updater.init(config.seed, batches[0]),
                batches,
            )
        )
    # The same Updater fed by the input pipeline `train.train_and_evaluate` picks for this
    # data instead of pre-sharded batches.
    input_pipeline_name, input_pipeline = training_input(dataset, batch_size, config.seed)
    stack.callback(input_pipeline.close)
    variants.append(
        _Variant(
            "updater_with_input",
            updater.update,
            updater.init(config.seed, batches[0]),
            [],
            source=input_pipeline,
        )
    )
    if settings.shard_map:
        variants.append(
            _Variant(
                "shard_map",
                baselines.make_shard_map_step(per_device, updater.axis_name),
                updater.init(config.seed, batches[0]),
                batches,
            )
        )
    if settings.updater_shard_map:
        # The library's other backend: the same step under jit(shard_map), on the same
        # TrainState layout, so the pmap Updater's init serves it.
        shard_map_config = config.copy_and_resolve_references()
        shard_map_config.backend = "shard_map"
        shard_map_updater = train.build_experiment(shard_map_config).updater
        variants.append(
            _Variant(
                "updater_shard_map",
                shard_map_updater.update,
                updater.init(config.seed, batches[0]),
                batches,
            )
        )
    if settings.flax and name in FLAX_PEERS:
        variants.append(_flax_variant(config, dataset, host_batches, loss_fn, augment_fn))
    by_name = {v.name: v for v in variants}

    log(f"[{num_devices} dev] {name}: built in {time.perf_counter() - built_at:.1f} s")
    warmup_step_s = {}
    for variant in variants:
        warmup_step_s[variant.name] = _warm_up(variant, settings.warmup_steps)
        log(f"[{num_devices} dev] {name}: {variant.name} first call {variant.first_call_s:.1f} s")
    steps_per_window = _window_length(settings, warmup_step_s["updater"])
    costs = {"updater": _updater_costs(updater, by_name["updater"])}
    if "hand_written" in by_name:
        costs["hand_written"] = _costs(
            by_name["hand_written"].step,
            per_device,
            updater.axis_name,
            by_name["hand_written"].carry,
            batches[0],
        )
    if "flax" in by_name:
        costs["flax"] = compiled_costs(
            by_name["flax"].step, by_name["flax"].carry, by_name["flax"].batches[0]
        )

    log(f"[{num_devices} dev] {name}: costs analysed; {steps_per_window} steps per window")
    _time_interleaved(variants, settings.windows, steps_per_window)
    throughput = {v.name: _throughput(v, steps_per_window, batch_size) for v in variants}
    ratios = {
        "updater_vs_hand_written": (
            _paired_ratio(by_name["updater"], by_name["hand_written"])
            if "hand_written" in by_name
            else None
        ),
        "updater_vs_flax": (
            _paired_ratio(by_name["updater"], by_name["flax"]) if "flax" in by_name else None
        ),
        "input_pipeline_vs_presharded": _paired_ratio(
            by_name["updater_with_input"], by_name["updater"]
        ),
        "updater_shard_map_vs_pmap": (
            _paired_ratio(by_name["updater_shard_map"], by_name["updater"])
            if "updater_shard_map" in by_name
            else None
        ),
        "shard_map_vs_hand_written": (
            _paired_ratio(by_name["shard_map"], by_name["hand_written"])
            if "shard_map" in by_name and "hand_written" in by_name
            else None
        ),
    }
    log(
        f"[{num_devices} dev] {name}: updater {throughput['updater']['examples_per_s']:,.0f} ex/s"
        + (
            f", /hand-written {ratios['updater_vs_hand_written']:.3f}"
            if ratios["updater_vs_hand_written"]
            else ""
        )
        + (f", /flax {ratios['updater_vs_flax']:.3f}" if ratios["updater_vs_flax"] else "")
        + (
            f", shard_map/pmap {ratios['updater_shard_map_vs_pmap']:.3f}"
            if ratios["updater_shard_map_vs_pmap"]
            else ""
        )
    )

    flops_per_device = costs["updater"]["flops_per_device"]
    hand_flops = costs.get("hand_written", {}).get("flops_per_device")
    flops = {
        "per_device_per_step": flops_per_device,
        "per_step": flops_per_device * num_devices if flops_per_device else None,
        "per_example": flops_per_device * num_devices / batch_size if flops_per_device else None,
        "source": costs["updater"]["source"],
        "hand_written_per_device": hand_flops,
        "flax_per_device": costs.get("flax", {}).get("flops_per_device"),
        "updater_matches_hand_written": (
            bool(abs(flops_per_device - hand_flops) <= 0.01 * hand_flops)
            if flops_per_device and hand_flops
            else None
        ),
    }
    utilisation = _utilisation(flops["per_step"], throughput["updater"]["steps_per_s"], peak)

    result: dict[str, Any] = {
        "experiment": name,
        "num_devices": num_devices,
        **device_info(),
        "precision": settings.precision,
        "model": {k: v for k, v in config.model.items()},
        "model_overrides": dict(settings.model_overrides),
        "data": "synthetic",
        "image_shape": list(dataset.image_shape),
        "num_classes": dataset.num_classes,
        "batch_size": batch_size,
        "input_pipeline": input_pipeline_name,
        "per_device_batch": batch_size // num_devices,
        "steps_per_window": steps_per_window,
        "windows": settings.windows,
        "throughput": throughput,
        "ratios": ratios,
        "targets": {
            "updater_vs_hand_written": UPDATER_TARGETS[name],
            "loop_vs_update": LOOP_TARGET,
        },
        "flops": flops,
        "utilisation": utilisation,
        "memory": {
            "compiled_update_per_device": costs["updater"]["memory_per_device"],
            # The process's peak over everything so far (all variants), where reported.
            "device_peak_bytes_in_use": device_memory_peak(),
        },
    }

    # A fresh directory per call: a loop run in a used workdir would resume, not train, and a
    # Checkpointer does not save a step that exists.
    workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(
        tempfile.mkdtemp(prefix=f"{name}_{num_devices}dev_{settings.precision}_", dir=workdir)
    )
    updater_variant = by_name["updater"]
    if settings.checkpoint_saves:
        try:
            result["checkpoint"], updater_variant.carry = benchmark_checkpoint(
                updater,
                updater_variant.carry,
                batches[0],
                settings.checkpoint_saves,
                workdir / "checkpoint_bench",
            )
        except Exception as e:  # Recorded; the figures above stand.
            result["checkpoint"] = {"skipped": f"failed: {type(e).__name__}: {e}"[:500]}
        log(f"[{num_devices} dev] {name}: checkpoint {_checkpoint_line(result['checkpoint'])}")
    else:
        result["checkpoint"] = {"skipped": "checkpoint_saves=0"}
    input_pipeline.close()
    for variant in variants:  # Free the timed states before the loop builds its own.
        if variant is not updater_variant:
            variant.carry, variant.batches = None, []

    windows_before_loop = [updater_variant.window_s]  # The bare update's, before each loop.
    result["throughput"]["updater"]["window_steps_per_s_after_loop"] = []

    def bare_update_around_loop() -> float:
        """The Updater's examples/s: median over its windows right before and after a loop."""
        after = _Variant("updater_after_loop", updater.update, updater_variant.carry, batches)
        _time_interleaved([after], settings.windows, steps_per_window)
        updater_variant.carry = after.carry
        result["throughput"]["updater"]["window_steps_per_s_after_loop"].append(
            [steps_per_window / s for s in after.window_s]
        )
        window_s = statistics.median(windows_before_loop[-1] + after.window_s)
        windows_before_loop.append(after.window_s)
        return batch_size * steps_per_window / window_s

    if skip_loop is None and settings.loop_steps != 0:
        try:
            runs = [
                benchmark_training_loop(
                    name, settings, bare_update_around_loop, workdir / f"loop_{run}"
                )
                for run in range(settings.loop_runs)
            ]
            result["loop"] = _median_loop_run(runs)
            loop, saves = result["loop"], result["loop"]["checkpoint_windows"]
            without = loop["ratio_vs_update_without_checkpoints"]
            cost = saves["cost_per_save_s"]
            log(
                f"[{num_devices} dev] {name}: loop/update {loop['ratio_vs_update']:.3f}"
                + ("" if len(runs) == 1 else f" (median of {_loop_ratios(runs)})")
                + ("" if without is None else f", {without:.3f} in the windows without a save")
                + ("" if cost is None else f", {1e3 * cost:.0f} ms per save")
            )
        except Exception as e:  # Recorded; the figures above stand.
            result["loop"] = {"skipped": f"failed: {type(e).__name__}: {e}"[:500]}
            log(f"[{num_devices} dev] {name}: loop failed: {result['loop']['skipped']}")
    else:
        result["loop"] = {"skipped": skip_loop or "loop_steps=0"}
    updater_variant.carry, updater_variant.batches = None, []
    return result


def _flat_pmap_costs(per_device: Callable, axis_name: str, *args: Any) -> dict[str, Any]:
    """`compiled_costs` of `pmap(per_device)` with the arguments passed as flat leaves.

    `pmap(f).lower(*args)` rebuilds the argument pytree from `ArgInfo` placeholders,
    which `jmp.DynamicLossScale` refuses (its `__post_init__` checks the dtype of its
    leaves): float16 train states cannot be lowered as they are on JAX 0.10. Flat
    leaves lower the same computation; nothing is donated, so the memory analysis
    counts inputs and outputs apart.
    """
    leaves, treedef = jax.tree.flatten(args)

    def flat(*leaves):
        return per_device(*jax.tree.unflatten(treedef, leaves))

    return compiled_costs(jax.pmap(flat, axis_name=axis_name), *leaves)


def _costs(pmapped: Any, per_device: Callable | None, axis_name: str, *args: Any) -> dict[str, Any]:
    """`compiled_costs(pmapped, *args)`, via flat leaves where the tree cannot be lowered."""
    try:
        costs = compiled_costs(pmapped, *args)
        costs["lowered"] = "as called"
    except TypeError as e:
        if per_device is None:
            raise
        costs = _flat_pmap_costs(per_device, axis_name, *args)
        costs["lowered"] = f"flat leaves, not donated ({type(e).__name__} lowering the tree)"
    return costs


def _updater_costs(updater: Updater, variant: _Variant) -> dict[str, Any]:
    pmapped = getattr(updater, "_update_pmap", None)  # The Updater's one pmapped step.
    if pmapped is None or not hasattr(pmapped, "lower"):
        return {
            "flops_per_device": None,
            "bytes_accessed_per_device": None,
            "memory_per_device": None,
            "source": "unavailable: Updater has no lowerable _update_pmap",
        }
    per_device = getattr(updater, "_update_per_device", None)
    costs = _costs(pmapped, per_device, updater.axis_name, variant.carry, variant.batches[0])
    costs["source"] = (
        "Updater._update_pmap.lower(...).compile().cost_analysis()['flops'], per device"
    )
    return costs


def _utilisation(
    flops_per_step: float | None, steps_per_s: float, peak: dict[str, Any] | None
) -> dict[str, Any]:
    achieved = flops_per_step * steps_per_s / 1e12 if flops_per_step else None
    peak_tflops = peak["float32"]["all_devices_tflop_per_s"] if peak else None
    return {
        "achieved_tflop_per_s": achieved,
        "peak_tflop_per_s": peak_tflops,
        "peak_source": "measured f32 matmul, pmapped over all local devices" if peak else None,
        "mfu": achieved / peak_tflops if achieved and peak_tflops else None,
    }


def _checkpoint_line(checkpoint: dict[str, Any]) -> str:
    if "skipped" in checkpoint:
        return checkpoint["skipped"]
    return (
        f"{checkpoint['size_mb']:.1f} MB, blocked async {checkpoint['async']['blocked_s']:.3f} s"
        f" / sync {checkpoint['sync']['blocked_s']:.3f} s"
    )


# -- Checkpoints ------------------------------------------------------------------------------


def _tree_bytes(tree: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def benchmark_checkpoint(
    updater: Updater, train_state: Any, batch: Any, saves: int, directory: Path
) -> tuple[dict[str, Any], Any]:
    """Times `Checkpointer.save` with `async_save=True` and `False`.

    Each mode saves once untimed (Orbax sets up its threads and directories), then
    `saves` times, one training step between saves (each save needs a new step
    number). `blocked_s` is how long `save` holds the training loop; `total_s`
    adds `wait_until_finished`, the time until the step is on disk.

    Returns:
      The figures, and the train state to continue with (the input is donated).
    """
    try:
        from haiku_state.checkpoint import Checkpointer
    except ImportError as e:
        return {"skipped": f"haiku_state.checkpoint is not importable: {e}"}, train_state

    unreplicated = replication.unreplicate(train_state._replace(rng=()))
    size = _tree_bytes(unreplicated) + _tree_bytes(jax.random.key_data(train_state.rng))
    result: dict[str, Any] = {"size_mb": size / 1e6, "saves": saves}
    for mode in ("async", "sync"):
        blocked, total = [], []
        with Checkpointer(directory / mode, max_to_keep=2, async_save=mode == "async") as saver:
            for index in range(saves + 1):
                train_state, metrics = updater.update(train_state, batch)
                jax.block_until_ready((train_state, metrics))
                start = time.perf_counter()
                saver.save(train_state)
                returned = time.perf_counter()
                saver.wait_until_finished()
                finished = time.perf_counter()
                if index:
                    blocked.append(returned - start)
                    total.append(finished - start)
        blocked_s, total_s = statistics.median(blocked), statistics.median(total)
        result[mode] = {
            "blocked_s": blocked_s,
            "total_s": total_s,
            "write_mb_per_s": size / 1e6 / total_s,
            "blocked_mb_per_s": size / 1e6 / blocked_s,
        }
    result["async_vs_sync_blocked"] = result["async"]["blocked_s"] / result["sync"]["blocked_s"]
    return result, train_state


# -- The training loop ------------------------------------------------------------------------


def loop_config(name: str, settings: Settings, num_devices: int) -> Any:
    """The experiment's own config and data, with evaluation only at the end.

    Logging, replica checks and asynchronous checkpoints keep the experiment's
    cadence (`log_every`, `check_every`, `checkpoint_every`), as a real run has
    them; `loop_steps` and `loop_log_every` shorten a run for a quick look, with
    a checkpoint and a replica check kept half-way.
    """
    config = load_experiment_config(name)
    _override_model(config, settings)
    _set_precision(config, settings.precision)
    config.batch_size = settings.batch_size or config.batch_size
    config.eval_batch_size = _round_up(config.eval_batch_size, num_devices)
    steps = settings.loop_steps or config.steps
    log_every = settings.loop_log_every or config.log_every
    if steps < 3 * log_every:
        raise ValueError(
            f"loop_steps={steps} must be at least 3 x log_every={log_every}: the first "
            "window (compilation) is dropped and a steady state needs two more."
        )
    if steps != config.steps:
        config.check_every = min(config.check_every, steps // 2)
        config.checkpoint_every = min(config.checkpoint_every, _round_up(steps // 2, log_every))
    config.steps = steps
    config.log_every = log_every
    config.eval_every = steps
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, steps // 4)
    if settings.loop_synthetic_data:
        config.data.name = "synthetic"
        config.data.image_shape, config.data.num_classes = SYNTHETIC_SHAPES[name]
        config.data.num_test = config.eval_batch_size
    if config.data.name == "synthetic":
        config.data.num_train = max(config.data.get("num_train", 0), 4 * config.batch_size)
    return config


def benchmark_training_loop(
    name: str, settings: Settings, bare_update: Callable[[], float], workdir: Path
) -> dict[str, Any]:
    """Runs `train.train_and_evaluate` and compares its steady state to the bare update.

    The steady state is the time-weighted mean of the logged `examples_per_s`
    over every window but the first (which compiles): total examples over total
    time, so the window holding the half-way checkpoint counts in full.

    Args:
      name: the experiment.
      settings: its settings (`loop_config`).
      bare_update: called once the loop has run; returns the examples/s of the bare
        update to compare with. The loop cannot be interleaved with the bare update,
        so the caller times the update on both sides of it.
      workdir: a fresh directory for the run.
    """
    config = loop_config(name, settings, jax.local_device_count())
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # Its final-eval line; stdout is the table's.
        final = train.train_and_evaluate(config, str(workdir))
    wall_s = time.perf_counter() - start
    bare_examples_per_s = bare_update()
    records = [r for r in summaries.read_metrics(str(workdir)) if r["split"] == "train"]
    records.sort(key=lambda r: r["step"])
    windows = [
        (previous["step"], record["step"], record["examples_per_s"])
        for previous, record in zip(records, records[1:], strict=False)
    ]
    window_rates = [rate for _, _, rate in windows]
    steady = _time_weighted_examples_per_s(windows, config.batch_size)
    save_steps = range(config.checkpoint_every, config.steps, config.checkpoint_every)
    saves = checkpoint_windows(windows, config.batch_size, save_steps)
    return {
        "data": config.data.name,
        "steps": config.steps,
        "log_every": config.log_every,
        "checkpoint_every": config.checkpoint_every,
        "batch_size": config.batch_size,
        "examples_per_s": steady,
        "window_examples_per_s": window_rates,
        "median_window_examples_per_s": statistics.median(window_rates) if window_rates else None,
        "update_examples_per_s": bare_examples_per_s,
        "ratio_vs_update": steady / bare_examples_per_s,
        # Robust to the few windows holding one-time costs (first lr evaluation after the
        # first log, the first checkpoint's jit compiles): the loop's per-step overhead.
        "median_window_ratio_vs_update": (
            statistics.median(window_rates) / bare_examples_per_s if window_rates else None
        ),
        "checkpoint_windows": saves,
        "ratio_vs_update_without_checkpoints": (
            saves["examples_per_s_without"] / bare_examples_per_s
            if saves["examples_per_s_without"] is not None
            else None
        ),
        "wall_s": wall_s,
        "final_eval": {k: float(v) for k, v in final.items()},
    }


def _loop_ratios(runs: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{run['ratio_vs_update']:.3f}" for run in runs)


def _median_loop_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of median loop / update (the lower middle one of an even count), with every
    run's figures under `runs`: one drift of the machine's load between a loop and the bare
    update around it does not decide the figure."""
    ranked = sorted(runs, key=lambda run: run["ratio_vs_update"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["runs"] = [
        {
            "ratio_vs_update": run["ratio_vs_update"],
            "ratio_vs_update_without_checkpoints": run["ratio_vs_update_without_checkpoints"],
            "cost_per_save_s": run["checkpoint_windows"]["cost_per_save_s"],
            "examples_per_s": run["examples_per_s"],
            "update_examples_per_s": run["update_examples_per_s"],
        }
        for run in runs
    ]
    return median


def _time_weighted_examples_per_s(
    windows: Sequence[tuple[int, int, float]], batch_size: int
) -> float:
    """Total examples over total time of `(first_step, last_step, examples_per_s)` windows."""
    examples = sum((end - start) * batch_size for start, end, _ in windows)
    seconds = sum((end - start) * batch_size / rate for start, end, rate in windows)
    return examples / seconds if seconds else math.nan


def checkpoint_windows(
    windows: Sequence[tuple[int, int, float]], batch_size: int, save_steps: Sequence[int]
) -> dict[str, Any]:
    """Splits a loop's logged windows into those that hold a checkpoint save and the rest.

    `train_and_evaluate` saves step `s` after it has logged step `s`, so the save
    (the replica and finite checks before it, its blocking part, and its writer
    thread competing for the host) lands in the window `(start, end]` with
    `start <= s < end`. Comparing those windows with the others gives the loop's
    own per-step overhead (`examples_per_s_without`) apart from what each save
    costs the training (`cost_per_save_s`: the time of the save windows beyond
    their steps at the rate without saves, per save).

    Args:
      windows: `(first_step, last_step, examples_per_s)` of each steady window.
      batch_size: the global batch size of a step.
      save_steps: the steps saved inside the loop (not the final one, saved after
        the last window).

    Returns:
      `window_ends` (the last step of each window holding a save), `saves` (how
      many saves they hold), `examples_per_s_without` (time-weighted over the
      other windows) and `cost_per_save_s`; None where there is nothing to compare.
    """
    held = [[s for s in save_steps if start <= s < end] for start, end, _ in windows]
    with_saves = [w for w, h in zip(windows, held, strict=True) if h]
    without = [w for w, h in zip(windows, held, strict=True) if not h]
    saves = sum(len(h) for h in held)
    rate_without = _time_weighted_examples_per_s(without, batch_size) if without else None
    cost = None
    if with_saves and rate_without is not None:
        extra = sum(
            (end - start) * batch_size * (1 / rate - 1 / rate_without)
            for start, end, rate in with_saves
        )
        cost = extra / saves
    return {
        "window_ends": [end for _, end, _ in with_saves],
        "saves": saves,
        "examples_per_s_without": rate_without,
        "cost_per_save_s": cost,
    }


# -- Run records ------------------------------------------------------------------------------


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "dm-haiku", "optax", "flax", "chex", "orbax-checkpoint"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def machine_info() -> dict[str, Any]:
    return {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "system": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _json_ready(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither); numpy scalars become Python."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_run_record(record: dict[str, Any], output_dir: str | os.PathLike) -> Path:
    """Writes one run's record as `<output_dir>/<UTC timestamp>_<platform>.json`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = output_dir / f"{stamp}_{record.get('platform') or 'unknown'}.json"
    suffix = 1
    while path.exists():
        path = output_dir / f"{stamp}_{record.get('platform') or 'unknown'}_{suffix}.json"
        suffix += 1
    path.write_text(json.dumps(_json_ready(record), indent=2, allow_nan=False) + "\n")
    return path


def make_run_record(
    device_runs: list[dict[str, Any]],
    *,
    settings: dict[str, Any],
    command: list[str],
    wall_s: float,
    notes: list[str] = (),
) -> dict[str, Any]:
    """Assembles the run's JSON: machine, versions, and every device count's figures.

    Args:
      device_runs: one dict per device count: `device_info()` fields, `num_devices`,
        `peak_matmul`, `experiments` (results of `benchmark_experiment`) and
        `skipped` notes.
    """
    measured = [run for run in device_runs if run.get("experiments")]
    first = measured[0] if measured else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(command),
        "settings": settings,
        "machine": machine_info(),
        "versions": package_versions(),
        "platform": first.get("platform"),
        "device_kind": first.get("device_kind"),
        "device_counts": [run["num_devices"] for run in measured],
        "runs": device_runs,
        "results": [result for run in measured for result in run["experiments"]],
        "wall_s": wall_s,
        "notes": list(notes),
    }
