"""What a step costs the device: its FLOPs, XLA's memory, the peak matmul, MFU, device memory.

A step's FLOPs are counted from its jaxpr (`benchmarks.flops`): the same figure on
every backend. XLA's cost analysis is recorded beside it: on a GPU it misses the
cuDNN convolutions (custom calls carry no cost). On JAX 0.10
`Lowered.compile().cost_analysis()` is one dict whose "flops" are those of ONE
device's program (the SPMD-partitioned module: they halve from 1 to 2 devices
at the same global batch), and `memory_analysis()` is per device too; so XLA's
FLOPs of a step are the per-device figure times the devices.

MFU is against the matmul peak measured in the run's own precision: a bfloat16
step against the bfloat16 matmul, a float32 one against float32 (TF32 on recent
NVIDIA GPUs, as the models' float32 convolutions run there).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import flops as flops_lib
from haiku_state import replication

UPDATER_COST_SOURCE = (
    "Updater.lower('update', train_state, batch, with_global_norms=False).compile()"
    ".cost_analysis()['flops'], per device"
)
JAXPR_SOURCE = (
    "jaxpr of Updater.update(train_state, batch, with_global_norms=False): conv_general_dilated "
    "and dot_general, forward and backward, over all devices (benchmarks.flops)"
)
ANALYTIC_SOURCE = (
    "3 x the forward pass's multiply-adds x 2 (benchmarks.flops.resnet50_forward_macs)"
)
# The precisions whose matmul peak every run measures; a run adds its own.
PEAK_PRECISIONS = ("float32", "bfloat16")
_MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


def compiled_costs(compiled: jax.stages.Compiled) -> dict[str, Any]:
    """Per-device FLOPs, bytes accessed and memory of a compiled step."""
    costs = compiled.cost_analysis() or {}
    flops = float(costs.get("flops", math.nan))
    memory = compiled.memory_analysis()
    memory_fields = None
    if memory is not None:
        memory_fields = {field: int(getattr(memory, field, 0)) for field in _MEMORY_FIELDS}
        memory_fields["total_bytes"] = (
            memory_fields["argument_size_in_bytes"]
            + memory_fields["output_size_in_bytes"]
            - memory_fields["alias_size_in_bytes"]
            + memory_fields["temp_size_in_bytes"]
        )
    return {
        "flops_per_device": flops if flops > 0 else None,
        "bytes_accessed_per_device": float(costs.get("bytes accessed", math.nan)),
        "memory_per_device": memory_fields,
    }


def flops_figures(
    costs: dict[str, dict[str, Any]],
    counted: dict[str, Any],
    num_devices: int,
    batch_size: int,
    analytic_per_example: float | None = None,
) -> dict[str, Any]:
    """The record's `flops`: the step's counted from its jaxpr, XLA's beside them.

    Args:
      costs: `compiled_costs` of the Updater's step (`updater`) and its peers'.
      counted: `flops.count_flops` of the Updater's step, over all devices.
      num_devices: the devices of the step.
      batch_size: its global batch.
      analytic_per_example: the literature's figure for the model, where there is one.
    """
    per_step = counted["total"]
    xla_per_device = costs["updater"]["flops_per_device"]
    hand_written = costs.get("hand_written", {}).get("flops_per_device")
    return {
        "per_step": per_step,
        "per_device_per_step": per_step / num_devices,
        "per_example": per_step / batch_size,
        "by_primitive": {name: counted[name] for name in flops_lib.COUNTED},
        "source": JAXPR_SOURCE,
        "analytic_per_example": analytic_per_example,
        "counted_vs_analytic": (
            per_step / batch_size / analytic_per_example if analytic_per_example else None
        ),
        "analytic_source": ANALYTIC_SOURCE if analytic_per_example else None,
        "xla_per_device_per_step": xla_per_device,
        "xla_per_step": xla_per_device * num_devices if xla_per_device else None,
        "xla_per_example": xla_per_device * num_devices / batch_size if xla_per_device else None,
        "xla_source": UPDATER_COST_SOURCE,
        "hand_written_per_device": hand_written,
        "flax_per_device": costs.get("flax", {}).get("flops_per_device"),
        "updater_matches_hand_written": (
            bool(abs(xla_per_device - hand_written) <= 0.01 * hand_written)
            if xla_per_device and hand_written
            else None
        ),
    }


# Datasheet peaks of dense matrix math, TFLOP/s per chip: (part of the device kind, half
# precision, float32 as the models' matmuls run it at JAX's default precision: bfloat16
# passes on a TPU, TF32 on an NVIDIA GPU). The first that matches is taken.
DATASHEET_TFLOPS = (
    ("TPU v5 lite", 197.0, 197.0),
    ("TPU v6 lite", 918.0, 918.0),
    ("TPU v5", 459.0, 459.0),
    ("TPU v4", 275.0, 275.0),
    ("H200", 989.0, 494.7),
    ("H100", 989.0, 494.7),
    ("A100", 312.0, 156.0),
)


def datasheet_tflops(device_kind: str, precision: str) -> float | None:
    """The datasheet's dense peak of one chip in `precision`, or None for an unknown chip."""
    for part, half, single in DATASHEET_TFLOPS:
        if part in device_kind:
            return single if precision == "float32" else half
    return None


def utilisation(
    flops_per_step: float | None,
    steps_per_s: float,
    peak: dict[str, Any] | None,
    precision: str = "float32",
    device_kind: str = "",
    num_devices: int = 1,
) -> dict[str, Any]:
    """Achieved TFLOP/s; MFU against the datasheet's peak of the chips (`mfu_datasheet`), and
    against the all-devices matmul peak measured in `precision` (`mfu`).

    `peak` is `measure_peak_matmul`'s result; without a figure for `precision`
    there is no measured MFU (never one against another precision's peak).
    """
    achieved = flops_per_step * steps_per_s / 1e12 if flops_per_step else None
    measured = (peak or {}).get(precision)
    peak_tflops = measured["all_devices_tflop_per_s"] if measured else None
    datasheet = datasheet_tflops(device_kind, precision)
    datasheet = datasheet * num_devices if datasheet else None
    return {
        "achieved_tflop_per_s": achieved,
        "peak_tflop_per_s": peak_tflops,
        "peak_precision": precision if measured else None,
        "peak_source": (
            f"measured {precision} matmul, pmapped over all local devices" if measured else None
        ),
        "mfu": achieved / peak_tflops if achieved and peak_tflops else None,
        "datasheet_tflop_per_s": datasheet,
        "mfu_datasheet": achieved / datasheet if achieved and datasheet else None,
    }


def default_matmul_size() -> int:
    """4096 on accelerators, 1024 on CPU (where a 4096^2 matmul would dominate the run)."""
    return 1024 if jax.default_backend() == "cpu" else 4096


def _median_call_s(fn: Any, args: tuple, repeats: int, calls_per_repeat: int) -> float:
    """Median over `repeats` of the seconds per call of `calls_per_repeat` back-to-back calls."""
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls_per_repeat):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / calls_per_repeat)
    return statistics.median(runs)


def measure_peak_matmul(
    size: int | None = None,
    repeats: int = 5,
    calls_per_repeat: int = 5,
    precisions: Sequence[str] = PEAK_PRECISIONS,
) -> dict[str, Any]:
    """The device's matmul throughput: the peak that MFU is measured against.

    `single_device` is one jitted `size x size` matmul on device 0;
    `all_devices` the same matmul pmapped over every local device at once (on
    simulated CPU devices they share the host's cores, so this is the machine's
    peak, not N times one device's), for each of `precisions`. On GPU an f32
    matmul runs at JAX's default precision (TF32 on Ampere and later), which is
    also what the models' f32 convolutions get.
    """
    size = size or default_matmul_size()
    num_devices = jax.local_device_count()
    flops = 2.0 * size**3
    result: dict[str, Any] = {"size": size}
    for dtype in precisions:
        one = jnp.ones((size, size), dtype)
        stacked = replication.shard(np.ones((num_devices * size, size), dtype))
        single_s = _median_call_s(jax.jit(jnp.matmul), (one, one), repeats, calls_per_repeat)
        every_s = _median_call_s(
            jax.pmap(jnp.matmul), (stacked, stacked), repeats, calls_per_repeat
        )
        result[dtype] = {
            "single_device_tflop_per_s": flops / single_s / 1e12,
            "all_devices_tflop_per_s": flops * num_devices / every_s / 1e12,
        }
    return result


def working_bytes(compiled: jax.stages.Compiled) -> int:
    """What running a compiled program needs beyond its arguments: outputs not aliased to
    (donated) arguments, and temporaries; 0 where XLA reports nothing."""
    memory = compiled.memory_analysis()
    if memory is None:
        return 0
    fields = ("output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    output, alias, temp = (int(getattr(memory, field, 0)) for field in fields)
    return max(output - alias, 0) + temp


# Of the device's memory a benchmark plans to use at most: XLA keeps some for itself.
MEMORY_HEADROOM = 0.92


def check_fits_on_device(compiled: Any) -> None:
    """Raises MemoryError, saying by how much, when what is on the first device now and the
    working memory of the largest of the `compiled` programs exceed its memory (where the
    platform reports a limit: a GPU or TPU): the variant states are all resident at once,
    the programs run one at a time."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # Some backends raise instead of returning None.
        stats = {}
    if "bytes_limit" not in stats:
        return
    limit, in_use = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    largest = max((working_bytes(program) for program in compiled), default=0)
    if in_use + largest > MEMORY_HEADROOM * limit:
        raise MemoryError(
            f"the variants' states ({in_use / 2**30:.2f} GiB on the device) and the largest "
            f"step's working memory ({largest / 2**30:.2f} GiB) exceed "
            f"{MEMORY_HEADROOM:.0%} of the device's {limit / 2**30:.2f} GiB"
        )


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
