"""What a stretch of code compiled: programs, persistent-cache hits and writes, and the seconds.

Read from JAX's monitoring events, so it sees every compile of the process,
the library's and JAX's own (an eager op is a small program too).
"""

from __future__ import annotations

import collections
from typing import Any

import jax

_PREFIX = "/jax/compilation_cache/"
_HIT, _WRITE = _PREFIX + "cache_hits", _PREFIX + "cache_misses"  # A "miss" is written.
_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    # XLA's compile, or the load of a cached executable in its place.
    "/jax/core/compile/backend_compile_duration": "compile_s",
}


class CompileEvents:
    """Counts the compiles between `__enter__` and `__exit__`, and `programs` by name;
    `figures()` sums them up."""

    def __init__(self):
        self._events: collections.Counter[str] = collections.Counter()
        self._seconds: dict[str, float] = dict.fromkeys(_DURATIONS.values(), 0.0)
        self.programs: collections.Counter[str] = collections.Counter()  # By name: "jit(step)".

    def _on_event(self, event: str, **kwargs: Any) -> None:
        self._events[event] += 1

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event in _DURATIONS:
            self._seconds[_DURATIONS[event]] += duration
            if event.endswith("backend_compile_duration"):
                self.programs[kwargs.get("fun_name", "?")] += 1

    def __enter__(self) -> CompileEvents:
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def figures(self) -> dict[str, Any]:
        """`programs` compiled or loaded, `cache_hits` (loaded), `cache_writes`, and the
        seconds of tracing, lowering and compiling (loads included)."""
        return {
            "programs": self.programs.total(),
            "cache_hits": self._events[_HIT],
            "cache_writes": self._events[_WRITE],
            **self._seconds,
        }
