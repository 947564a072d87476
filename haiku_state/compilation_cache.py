"""JAX's persistent compilation cache: a repeated or resumed run loads its programs, not compiles.

Process 0 writes entries, every process reads them. A directory this process cannot use
turns the cache off with one warning that says why; the run goes on, compiling. An entry that
cannot be read (a truncated or overwritten file) is a miss said in one line, not JAX's
warning per entry on every rerun: process 0 removes it, and the program it compiles instead
is written in its place (JAX never replaces an entry that exists).
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
from absl import logging
from jax._src import compilation_cache as jax_internal_cache
from jax.experimental.compilation_cache import compilation_cache as jax_cache

CACHE_ENV = "HAIKU_STATE_CACHE"  # The same root as the ImageFolder index cache.
ENTRY_SUFFIX = "-cache"  # Of an entry's file after its key (JAX's `lru_cache`).
_damaged_said: set[str] = set()  # The cache directories whose damage was said.


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
    read = jax_internal_cache.get_executable_and_time
    if not hasattr(read, "replacing_damaged"):
        jax_internal_cache.get_executable_and_time = _replacing_damaged(read)
    if jax.config.jax_compilation_cache_dir == path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax_cache.reset_cache()  # JAX opens its cache once; the next compile opens this one.
    logging.info("Compilation cache: %s (config.compilation_cache_dir).", path or "off")


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


def _replacing_damaged(read):
    """JAX's read of a cache entry, for which an entry it cannot read is a miss: said once per
    directory, and removed by process 0 so the program compiled instead is written there."""

    @functools.wraps(read)
    def read_or_miss(cache_key: str, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except jax_internal_cache.CacheVerificationError:
            raise  # Not damage: JAX raises it on purpose.
        except Exception as e:  # JAX warns and goes on for any of them: damage, a miss.
            _set_aside_damaged(cache_key, e)
            return None, None

    read_or_miss.replacing_damaged = True
    return read_or_miss


def _set_aside_damaged(cache_key: str, error: Exception) -> None:
    directory = jax.config.jax_compilation_cache_dir
    path = os.path.join(directory, f"{cache_key}{ENTRY_SUFFIX}")
    replaced = "its program is compiled and written anew"
    if jax.process_index() == 0:
        try:
            os.remove(path)
        except OSError as e:
            replaced = f"it cannot be removed ({e.strerror or e}), so its program is compiled"
    if directory in _damaged_said:
        logging.debug("Compilation cache entry %s cannot be read: %s", path, error)
        return
    _damaged_said.add(directory)
    logging.warning(
        "Compilation cache: the entry %s cannot be read (%s: %s); %s, as is any other damaged "
        "entry of %s (not said again).",
        path,
        type(error).__name__,
        str(error)[:200],
        replaced,
        directory,
    )
