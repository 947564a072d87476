"""The TPU runtime's pinned host buffer, sized before the runtime starts.

libtpu pins a buffer of host memory for the transfers between host and chips
(`TPU_PREMAPPED_BUFFER_SIZE`, 4 GiB by default); one array larger than it goes by a slower
path. Where the kernel gives no transparent hugepages (JAX warns of it at the start), pinning
4 GiB page by page is most of the runtime's start and of the process's end: on a TPU v5e host,
`jax.devices()` took 6.5-7.1 s with it and 2.0-2.3 s with 512 MiB, the process ending 1.5 s
sooner, with the same transfer speeds (benchmarks/README.md, "The TPU host's pinned buffer").
The commands size it where that is so and the user has not.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PREMAPPED_BUFFER_ENV = "TPU_PREMAPPED_BUFFER_SIZE"  # libtpu's, read when the runtime starts.
# Above any one array a run moves whole: a recipe batch is 38 MB a chip at 256 images; the
# slow path took 4.4x as long for 100 MB past a 64 MiB buffer.
PREMAPPED_BUFFER_BYTES = 512 << 20
HUGEPAGES_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def size_premapped_buffer(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Sets `PREMAPPED_BUFFER_ENV` to `PREMAPPED_BUFFER_BYTES` in `environ` where the host
    pins memory slowly (transparent hugepages not `always`) and it is not set already; the
    bytes set, or None. Call it before the runtime starts (the first `jax.devices()`); without
    a TPU nothing reads it."""
    if PREMAPPED_BUFFER_ENV in environ or _transparent_hugepages_always():
        return None
    environ[PREMAPPED_BUFFER_ENV] = str(PREMAPPED_BUFFER_BYTES)
    return PREMAPPED_BUFFER_BYTES


def _transparent_hugepages_always() -> bool:
    """Whether the kernel backs every large mapping with huge pages (JAX's own test)."""
    try:
        with open(HUGEPAGES_SETTING) as f:
            return f.read().split() == ["[always]", "madvise", "never"]
    except OSError:  # No such setting (not Linux, or no THP in the kernel).
        return False
