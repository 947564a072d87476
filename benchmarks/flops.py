"""FLOPs of a step counted from its jaxpr: the convolutions and matmuls, on every backend.

XLA's cost analysis (`benchmarks.costs.compiled_costs`) is the compiler's view of
the program it built, and on a GPU it misses the convolutions: cuDNN convolutions
are custom calls, which carry no cost (0.40 GFLOP per ResNet-50 training example
on an H200, against about 24.6). Counting from the jaxpr gives the same figure on
CPU, GPU and TPU, and the one the analytic figures of papers use:

* `dot_general`: 2 x the multiply-adds of the contraction;
* `conv_general_dilated`: 2 x (output elements) x (kernel elements per output
  feature), where the input is dilated (the gradient of a strided convolution
  with respect to its input) divided by the dilation: the zeros a transposed
  convolution inserts are not work, so that gradient counts as the forward does.

Everything else (BatchNorm, activations, the optimizer) is left out, as the
analytic figures leave it out. Sub-jaxprs are walked (jit, custom_jvp/vjp,
remat, cond's most expensive branch, scan times its length, a while loop's body
once) and a `shard_map` or `pmap` body, whose shapes are one device's, counts
once per device of its mesh: the result is the work of the whole step over all
devices.

Counting the jaxpr of the whole training step (`jax.make_jaxpr` of the function
with `value_and_grad` inside) counts the backward pass as JAX differentiates it:
about twice the forward, less the gradients nobody asked for (that of the images,
for the first layer).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.extend import core

COUNTED = ("conv_general_dilated", "dot_general")
# Sub-jaxprs that run once per call of their equation.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def dot_general_flops(lhs_shape, rhs_shape, dimension_numbers) -> int:
    """2 x multiply-adds: every element of `lhs` meets every free element of `rhs`."""
    (_, rhs_contracting), (_, rhs_batch) = dimension_numbers
    rhs_free = [d for d in range(len(rhs_shape)) if d not in (*rhs_contracting, *rhs_batch)]
    return 2 * math.prod(lhs_shape) * math.prod(rhs_shape[d] for d in rhs_free)


def conv_flops(out_shape, rhs_shape, dimension_numbers, lhs_dilation) -> int:
    """2 x multiply-adds of a convolution, the zeros of an input dilation left out.

    Each output element sums over one output feature's kernel: the kernel's size
    over its output-feature dimension (`rhs_spec[0]`), whatever the feature or
    batch grouping.
    """
    out_feature_dim = dimension_numbers.rhs_spec[0]
    per_output = math.prod(rhs_shape) // rhs_shape[out_feature_dim]
    return 2 * math.prod(out_shape) * per_output // math.prod(lhs_dilation or (1,))


def _eqn_flops(eqn: core.JaxprEqn) -> int:
    params = eqn.params
    if eqn.primitive.name == "dot_general":
        lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
        return dot_general_flops(lhs, rhs, params["dimension_numbers"])
    out, rhs = eqn.outvars[0].aval.shape, eqn.invars[1].aval.shape
    return conv_flops(out, rhs, params["dimension_numbers"], params.get("lhs_dilation"))


def _as_jaxpr(value: Any) -> core.Jaxpr | None:
    if isinstance(value, core.ClosedJaxpr):
        return value.jaxpr
    return value if isinstance(value, core.Jaxpr) else None


def _devices_of(eqn: core.JaxprEqn) -> int:
    """How many devices run one copy of a shard_map or pmap body (1 for anything else)."""
    params = eqn.params
    if eqn.primitive.name == "shard_map":
        mesh = params["mesh"]
        manual = params.get("newly_manual_axes", params.get("manual_axes"))
        if manual is None:  # Older JAX: the axes not left to the compiler.
            manual = set(mesh.axis_names) - set(params.get("auto", ()))
        return math.prod(mesh.shape[name] for name in manual)
    return params.get("axis_size", 1) if eqn.primitive.name == "xla_pmap" else 1


def _add(total: dict[str, int], part: Mapping[str, int], times: int = 1) -> None:
    for name, flops in part.items():
        total[name] += times * flops


def _count(jaxpr: core.Jaxpr, notes: set[str]) -> dict[str, int]:
    total: dict[str, int] = collections.defaultdict(int)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in COUNTED:
            total[name] += _eqn_flops(eqn)
            continue
        params = eqn.params
        if name == "cond":  # One branch runs: count the most expensive.
            branches = [_count(_as_jaxpr(b), notes) for b in params["branches"]]
            _add(total, max(branches, key=lambda b: sum(b.values())))
            continue
        if name == "while":
            notes.add("a while loop's body is counted once")
            _add(total, _count(_as_jaxpr(params["body_jaxpr"]), notes))
            continue
        times = params["length"] if name == "scan" else _devices_of(eqn)
        for key in _CALL_PARAMS:
            sub = _as_jaxpr(params.get(key))
            if sub is not None:
                _add(total, _count(sub, notes), times)
                break
    return total


def count_jaxpr(jaxpr: core.ClosedJaxpr | core.Jaxpr) -> dict[str, Any]:
    """FLOPs of the convolutions and matmuls of a jaxpr, over every device it runs on.

    Returns:
      `total`, and the FLOPs per primitive of `COUNTED` under its name; `notes`
      says what was counted approximately (a while loop's body, once).
    """
    notes: set[str] = set()
    counts = _count(_as_jaxpr(jaxpr), notes)
    by_primitive = {name: counts.get(name, 0) for name in COUNTED}
    return {"total": sum(by_primitive.values()), **by_primitive, "notes": sorted(notes)}


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`count_jaxpr` of `jax.make_jaxpr(fn)(*args, **kwargs)`: traced, never compiled or run.

    `args` may be arrays or `jax.ShapeDtypeStruct`s.
    """
    return count_jaxpr(jax.make_jaxpr(fn)(*args, **kwargs))


def resnet50_forward_macs(image_size: int = 224, num_classes: int = 1000) -> int:
    """Multiply-adds of one ResNet-50 forward pass (v1.5: stride on the 3x3), by hand.

    The analytic figure of the literature (4.09 GMAC at 224x224, torchvision's
    `resnet50`; the network of `hk.nets.ResNet50`), layer by layer with SAME
    padding: convolutions and the final linear layer.
    """

    def conv(size: int, kernel: int, stride: int, channels_in: int, channels_out: int):
        out = -(-size // stride)
        return out, out * out * kernel * kernel * channels_in * channels_out

    size, macs = conv(image_size, 7, 2, 3, 64)
    size = -(-size // 2)  # The 3x3 max-pool of stride 2.
    channels = 64
    for blocks, width, stride in ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)):
        for block in range(blocks):
            block_stride = stride if block == 0 else 1
            if block == 0:  # The projection shortcut.
                macs += conv(size, 1, block_stride, channels, 4 * width)[1]
            macs += conv(size, 1, 1, channels, width)[1]
            out, block_macs = conv(size, 3, block_stride, width, width)
            macs += block_macs + conv(out, 1, 1, width, 4 * width)[1]
            size, channels = out, 4 * width
    return macs + channels * num_classes
