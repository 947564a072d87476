"""A start that does not fit in the host's memory, refused in one line before anything runs.

The initial params and state are drawn on the host (`initialization`). XLA:CPU would leave an
output it failed to allocate never ready, a wait no signal ends: a draw that does not fit in
what this process may still allocate is refused (`HostMemoryError`). On a CPU backend under
`ulimit -v`, the whole run's needs are checked before anything is compiled
(`run_address_space_needs`): XLA aborts a compile it cannot map (exit 134, no error line).
"""

from __future__ import annotations

import os
import resource
from typing import Any

import haiku as hk
import jax

from haiku_state import errors


class HostMemoryError(errors.Refused, MemoryError):
    """The program that draws the initial params and state needs more host memory than this
    process may allocate."""


# What a CPU run maps beyond what it has mapped when it draws the params and state: XLA's and
# the compiles' own, RUN_STATE_COPIES copies of the params and state and one more per device,
# with a RUN_MARGIN margin. Measured on the MLP (VmPeak at the end less VmSize at the draw,
# jaxlib 0.10): 0.6 GiB with 0.3 MiB of params; 10.3x them on 1 device, 11.3x-12.2x on 2.
RUN_FIXED_BYTES = int(0.6 * 2**30)
RUN_STATE_COPIES = 10
RUN_MARGIN = 1.25


def check_fits_in_host_memory(memory: Any, shapes: tuple[hk.Params, hk.State]) -> None:
    """`HostMemoryError` if the program's outputs and work space (XLA's `memory`) exceed what
    this process may still allocate."""
    headroom = host_memory_headroom()
    if memory is None or headroom is None:
        return
    _refuse_beyond(
        memory.output_size_in_bytes + memory.temp_size_in_bytes,
        headroom,
        f"The initial params and state take {_gib(memory.output_size_in_bytes)} and drawing "
        f"them {_gib(memory.temp_size_in_bytes)} more",
        shapes,
    )


def run_address_space_needs(state_bytes: int, devices: int) -> int:
    """The address space a run on `devices` CPU devices maps beyond what the process has
    mapped when it draws params and state of `state_bytes` (the constants' comment)."""
    copies = RUN_STATE_COPIES + devices
    return int(RUN_MARGIN * (RUN_FIXED_BYTES + copies * state_bytes))


def check_run_fits_in_address_space(shapes: tuple[hk.Params, hk.State]) -> None:
    """On the CPU backend under an address-space limit, `HostMemoryError` if the run (drawing
    the params and state, compiling and training with them) needs more than it leaves."""
    headroom = address_space_headroom() if jax.default_backend() == "cpu" else None
    if headroom is None:
        return
    state_bytes = sum(_bytes(leaf) for leaf in jax.tree.leaves(shapes))
    devices = jax.local_device_count()
    needed = run_address_space_needs(state_bytes, devices)
    _refuse_beyond(
        needed,
        headroom,
        f"The initial params and state take {_gib(state_bytes)} and drawing and training them "
        f"here about {_gib(needed)} more ({RUN_STATE_COPIES + devices}x them on {devices} CPU "
        f"device(s) and {_gib(RUN_FIXED_BYTES)} for XLA and its compiles, with a "
        f"{RUN_MARGIN - 1:.0%} margin)",
        shapes,
    )


def _refuse_beyond(
    needed: int, headroom: tuple[int, str], needs: str, shapes: tuple[hk.Params, hk.State]
) -> None:
    """`HostMemoryError` if `needed` bytes exceed the `headroom`, in one line: what is needed
    (`needs`, in words), the headroom and its bound, the largest leaf of `shapes`."""
    available, bound = headroom
    if needed <= available:
        return
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    path, largest = max(leaves, key=lambda named: _bytes(named[1]))
    name = "/".join(str(getattr(part, "key", part)) for part in path[1:])
    shape = "x".join(map(str, largest.shape))
    raise HostMemoryError(
        f"{needs}, beyond the {_gib(max(available, 0))} this process may still allocate on "
        f"the host ({bound}). The largest: {name}, {shape} {largest.dtype} "
        f"({_gib(_bytes(largest))}); a smaller model or input (data.image_size) fits."
    )


def _bytes(leaf: jax.ShapeDtypeStruct) -> int:
    return leaf.size * leaf.dtype.itemsize


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def host_memory_headroom() -> tuple[int, str] | None:
    """The bytes this process may still allocate on the host and what bounds them: its
    address-space limit (`ulimit -v`), its container's (cgroup v2 `memory.max`), the memory
    the host has available; None if none can be read."""
    address_space = address_space_headroom()
    bounds = [address_space] if address_space else []
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            most, used = f.read().strip(), int(g.read())
        if most != "max":
            bounds.append((int(most) - used, "its container's limit, cgroup memory.max"))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = sum(int(fields[name].split()[0]) * 1024 for name in ("MemAvailable", "SwapFree"))
        bounds.append((free, "the memory and swap this host has available"))
    except (OSError, KeyError, ValueError):
        pass
    return min(bounds, default=None)


def address_space_headroom() -> tuple[int, str] | None:
    """The bytes this process may still map under its address-space limit (`ulimit -v`), and
    the limit in words; None without a limit (or if what is mapped cannot be read)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
    return limit - mapped, f"its address-space limit, ulimit -v {limit // 1024}"
