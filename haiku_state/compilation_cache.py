"""JAX's persistent compilation cache: a repeated or resumed run loads its programs, not compiles.

Process 0 writes entries, every process reads them; a directory this process cannot use turns the
cache off with one warning that says why. At `enable`, an entry that does not hold what JAX wrote
under its name (truncated, overwritten, swapped) is removed, said in one line, and compiled anew
(JAX never replaces an entry): one whose stat changed since `MANIFEST` recorded it must hash as
recorded, one without a record must decompress into a program of its file's name. Damage after
`enable` is JAX's own warning or error.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import tempfile
import zlib

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

CACHE_ENV = "HAIKU_STATE_CACHE"  # The same root as the ImageFolder index cache.
ENTRY_SUFFIX = "-cache"  # Of an entry's file after its key (JAX's `lru_cache`).
MANIFEST = "haiku_state-entries.json"  # {entry: [size, mtime_ns, ctime_ns, inode, sha256]}.
_TIME_BYTES = 4  # JAX's entry: the compile time, then the serialized program, compressed.
_active: dict = {"directory": None, "writer": False}  # The directory in use; process 0's?

# The compressions JAX writes: zstd if installed, else zlib.
_DECOMPRESSORS = [zlib.decompress]
with contextlib.suppress(ImportError):
    from compression import zstd  # Python 3.14.

    _DECOMPRESSORS.append(zstd.decompress)
with contextlib.suppress(ImportError):
    import zstandard

    _DECOMPRESSORS.append(zstandard.ZstdDecompressor().decompress)


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
        _remove_damaged(path, writer)
    _active.update(directory=path, writer=writer)
    jax.config.update("jax_compilation_cache_dir", path)
    jax_cache.reset_cache()  # JAX opens its cache once; the next compile opens this one.
    logging.info("Compilation cache: %s (config.compilation_cache_dir).", path or "off")


def record_written() -> None:
    """Records in `MANIFEST` the entries of the directory in use that have no record yet (those
    written since `enable`) and fit their names. Process 0, at exit and as `enable` moves on."""
    directory = _active["directory"]
    if not directory or not _active["writer"]:
        return
    records = _read_manifest(directory)
    try:
        entries = _entries(directory)
    except OSError as e:  # The directory removed meanwhile.
        logging.debug("Compilation cache: %s not recorded (%s).", directory, e)
        return
    new = {entry.name: _checked(entry, None) for entry in entries if entry.name not in records}
    new = {name: record for name, record in new.items() if record}
    if new:
        _write_manifest(directory, {**records, **new})


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


def _remove_damaged(directory: str, writer: bool) -> None:
    """Removes the entries of `directory` that do not hold what JAX wrote (see the module's
    docstring), said in one line; process 0 records the others."""
    records = _read_manifest(directory)
    kept, damaged = {}, []
    for entry in _entries(directory):
        record = _checked(entry, records.get(entry.name))
        if record:
            kept[entry.name] = record
        else:
            damaged.append(entry.name)
    failed = []
    for name in damaged:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(f"{name} ({e.strerror or e})")
    if damaged:
        logging.warning(
            "Compilation cache: %d entr%s of %s (%s%s) did not hold what JAX wrote there "
            "(truncated, overwritten or swapped); %s.",
            len(damaged),
            "y" if len(damaged) == 1 else "ies",
            directory,
            damaged[0],
            ", ..." if len(damaged) > 1 else "",
            f"cannot remove {', '.join(failed)}, so their programs are compiled"
            if failed
            else "removed, so their programs are compiled and written anew",
        )
    if kept != records and writer:
        _write_manifest(directory, kept)


def _entries(directory: str) -> list[os.DirEntry]:
    with os.scandir(directory) as entries:
        found = [e for e in entries if e.name.endswith(ENTRY_SUFFIX) and e.is_file()]
    return sorted(found, key=lambda e: e.name)


def _signature(stat: os.stat_result) -> list[int]:
    """Changes with any write, rename or copy onto the file (the ctime cannot be set back)."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _checked(entry: os.DirEntry, record: list | None) -> list | None:
    """The record of an entry that holds what JAX wrote, else None: its stat as in `record`,
    or its bytes hashing as recorded, or with no record, a whole program of its name."""
    try:
        if record and record[:4] == _signature(entry.stat()):
            return record
        with open(entry.path, "rb") as f:
            data, stat = f.read(), os.fstat(f.fileno())
    except OSError:  # Removed meanwhile, or unreadable: JAX cannot read it either.
        return None
    digest = hashlib.sha256(data).hexdigest()
    good = record[4] == digest if record else _fits(entry.name, data)
    return [*_signature(stat), digest] if good else None


def _fits(name: str, data: bytes) -> bool:
    """Whether `data` is a whole entry, in one of the compressions JAX writes (zstd if installed,
    else zlib: both check the stream's end, so a truncated entry does not pass), of a program
    that carries the name its file starts with (JAX's key: the module's name, "-", a digest)."""
    program_name = name.removesuffix(ENTRY_SUFFIX).rpartition("-")[0].encode()
    for decompress in _DECOMPRESSORS:
        try:
            program = decompress(data)
        except Exception:  # zlib.error, ZstdError: not this compression, or damaged.
            continue
        return len(program) > _TIME_BYTES and program_name in program
    return False


def _read_manifest(directory: str) -> dict[str, list]:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            records = json.load(f)
        if isinstance(records, dict):
            return {k: v for k, v in records.items() if isinstance(v, list) and len(v) == 5}
    except (OSError, ValueError):
        pass  # None yet, or damaged itself: every entry is checked as unrecorded.
    return {}


def _write_manifest(directory: str, records: dict[str, list]) -> None:
    """Whole or not at all (another run may read it meanwhile); a directory removed meanwhile or
    a full disk leaves the entries unrecorded, not lost."""
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=".haiku_state-entries")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, separators=(",", ":"))
            os.replace(temporary, os.path.join(directory, MANIFEST))
        except BaseException:
            os.remove(temporary)
            raise
    except OSError as e:
        logging.debug("Compilation cache: %s not recorded (%s).", directory, e)
