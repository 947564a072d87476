"""JAX's persistent compilation cache: a repeated or resumed run loads its programs, not compiles.

Process 0 writes entries, every process reads them; a directory this process cannot use turns the
cache off with one warning that says why. At `enable`, the entries that do not hold what JAX wrote
under their names are removed and compiled anew (`guards.cache_entries`).
"""

from __future__ import annotations

import atexit
import os
import tempfile

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from haiku_state.guards import cache_entries
from haiku_state.guards.cache_entries import MANIFEST  # noqa: F401 - importable from here

CACHE_ENV = "HAIKU_STATE_CACHE"  # The same root as the ImageFolder index cache.
_active: dict = {"directory": None, "writer": False}  # The directory in use; process 0's?


def default_directory() -> str:
    """`$HAIKU_STATE_CACHE/jax_compilation_cache`, else under `$XDG_CACHE_HOME` or `~/.cache`."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "haiku_state"
    )
    return os.path.join(root, "jax_compilation_cache")


def enable(directory: str) -> None:
    """Makes every later compile of this process use the cache in `directory` ("": off),
    caching every program however short its compile or small. Idempotent."""
    path = os.path.abspath(os.path.expanduser(directory)) if directory else None
    problem = path and _why_unusable(path)
    if problem:
        logging.warning(
            "Compilation cache off: config.compilation_cache_dir=%s cannot be used (%s); "
            "every program is compiled afresh. Point it to a writable directory, or set it "
            "to '' to turn the cache off.",
            path,
            problem,
        )
        path = None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if _active["directory"] == path and jax.config.jax_compilation_cache_dir == path:
        return
    record_written()  # The directory left behind: what this process wrote there.
    writer = bool(path) and jax.process_index() == 0
    if path:
        cache_entries.remove_damaged(path, writer)
    _active.update(directory=path, writer=writer)
    jax.config.update("jax_compilation_cache_dir", path)
    jax_cache.reset_cache()  # JAX opens its cache once; the next compile opens this one.
    logging.info("Compilation cache: %s (config.compilation_cache_dir).", path or "off")


def record_written() -> None:
    """Records in `MANIFEST` the entries written in the directory in use since `enable`
    (`guards.cache_entries.record_new`). Process 0, at exit and as `enable` moves on."""
    if _active["directory"] and _active["writer"]:
        cache_entries.record_new(_active["directory"])


atexit.register(record_written)


def _why_unusable(path: str) -> str | None:
    """Why this process cannot use `path` (made if missing; process 0 writes there), or None."""
    try:
        os.makedirs(path, exist_ok=True)
        if jax.process_index() == 0:
            with tempfile.TemporaryFile(dir=path):
                pass
        elif not os.access(path, os.R_OK | os.X_OK):
            return "it cannot be read"
    except OSError as e:
        return e.strerror or str(e)  # "Read-only file system", "Not a directory", ...
    return None
