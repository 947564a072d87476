"""A run's directory: who may train in it, and the record of the config it was trained with.

    WORKDIR/
      lock              host and pid of the run training here (held with flock)
      config.json       the resolved config (the keys it reads) and the data as read
      checkpoints/      haiku_state.checkpoint
      metrics.jsonl, tensorboard/, curves.png   haiku_state.summaries
      profile/          jax.profiler traces (config.profile_steps)

One training run at a time (evaluation beside it takes no lock). A resume that would
change the trajectory is refused unless allowed; a refused run writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import functools
import hashlib
import json
import os
import socket
import tempfile
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from haiku_state import config as config_lib
from haiku_state import errors
from haiku_state.guards import data_identity, processes

CONFIG_FILE = "config.json"
LOCK_FILE = "lock"


class WorkdirError(errors.InvalidValue):
    """The workdir cannot be used as asked: locked, unwritable, or trained with another config."""


# The longest path Orbax writes below the workdir (its temporary step folders), with room.
CHECKPOINT_PATH_ROOM = 200


def check_usable(workdir: str) -> None:
    """Refuses, before anything is written, a workdir under a file or a broken symlink, one
    (or its `checkpoints`) not writable, or a path past the filesystem's PATH_MAX or NAME_MAX."""
    existing = workdir
    while not os.path.exists(existing):
        if os.path.islink(existing):  # A link that leads nowhere: `exists` follows it.
            _refuse_broken_link(workdir, existing)
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        where = "" if existing == workdir else f": {existing}"
        raise WorkdirError(f"--workdir={workdir}{where} is a file, not a directory.")
    for folder in (existing, os.path.join(workdir, "checkpoints")):
        if os.path.isdir(folder):
            try:
                tempfile.TemporaryFile(dir=folder).close()  # O_TMPFILE: nothing appears there.
            except OSError as e:
                raise WorkdirError(
                    f"--workdir={workdir}: {folder} is not writable ({e.strerror}); a run could "
                    "not save its checkpoints there. Make it writable or choose another --workdir."
                ) from None
    path = os.path.abspath(workdir)
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    long_names = [name for name in path.split(os.sep) if len(name) > name_max]
    if long_names:
        raise WorkdirError(
            f"--workdir={workdir}: the name {long_names[0][:40]}... is {len(long_names[0])} "
            f"characters; the filesystem allows {name_max}."
        )
    if len(path) + CHECKPOINT_PATH_ROOM > path_max:
        raise WorkdirError(
            f"--workdir={workdir[:60]}... is {len(path)} characters long: the paths of its "
            f"checkpoints would pass the filesystem's limit of {path_max}; choose a path "
            f"shorter than {path_max - CHECKPOINT_PATH_ROOM} characters."
        )


def _refuse_broken_link(workdir: str, link: str) -> None:
    try:
        os.stat(link)
        problem = "a symlink that cannot be followed"
    except OSError as e:
        problem = "a symlink loop" if e.errno == errno.ELOOP else "a dangling symlink"
    where = "" if link == workdir else f": {link}"
    raise WorkdirError(
        f"--workdir={workdir}{where} is {problem} (to {os.readlink(link)!r}); point it at a "
        "directory, or remove the link."
    )


@contextlib.contextmanager
def exclusive_lock(workdir: str) -> Iterator[None]:
    """Holds `WORKDIR/lock` (an `flock`, released by the kernel when the holder dies) for a
    training run; the file names the holder for the error a second run gets."""
    path = os.path.join(workdir, LOCK_FILE)
    try:
        os.makedirs(workdir, exist_ok=True)
        lock = open(path, "a+")  # noqa: SIM115 (closed below; closing releases the flock)
    except OSError as e:  # E.g. a read-only filesystem.
        raise WorkdirError(f"--workdir={workdir} cannot be written: {e}") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkdirError(
                f"{workdir} is being trained by another run ({_read_holder(path)}); one run "
                "per workdir. Wait for it, stop it, or pick another --workdir. "
                "(--mode=eval and --mode=eval_follow may run beside it.)"
            ) from None
        previous = _read_holder(path)
        if previous != "nobody":
            logging.warning("Taking over the lock of a run that is gone (%s).", previous)
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": _stamp(iso=True)}
        lock.truncate(0)
        lock.write(json.dumps(holder) + "\n")
        lock.flush()
        os.fsync(lock.fileno())
        try:
            yield
        finally:
            lock.truncate(0)  # Released cleanly: nobody holds it.


def _read_holder(path: str) -> str:
    try:
        with open(path) as f:
            holder = json.loads(f.read() or "null")
    except (OSError, ValueError):
        return "an unreadable lock file"
    if not holder:
        return "nobody"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"


def _as_json(config: Any) -> dict[str, Any]:
    """The config as JSON would give it back (tuples become lists)."""
    return json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else config))


def recorded_config(config: Any) -> dict[str, Any]:
    """The config as `config.json` records it: the keys its combination reads, as JSON."""
    record = _as_json(config)
    for name in config_lib.ignored_keys(config_lib.flatten(record)):
        *parents, leaf = name.split(".")
        node = record
        for parent in parents:
            node = node.get(parent, {})
        node.pop(leaf, None)
    if record.get("model", {}).get("network"):  # Found again from any working directory.
        record["model"]["network"] = os.path.abspath(record["model"]["network"])
    return record


def network_record(path: str) -> dict[str, str]:
    """The absolute path and SHA-256 of a run's own network's file (`config.model.network`);
    {} for no path or a file not there."""
    if not path or not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        return {"file": os.path.abspath(path), "sha256": hashlib.sha256(f.read()).hexdigest()}


@functools.cache  # Once a process: a run reads its record more than once.
def _warn_network_changed(path: str, recorded: str, now: str, workdir: str) -> None:
    logging.warning(
        "%s changed since the run in %s recorded it (sha256 %s... -> %s...): its network is "
        "built from the file as it is now; a checkpoint that does not fit it is refused.",
        *(path, workdir, recorded[:12], now[:12]),
    )


def check_network_source(
    recorded: Mapping[str, Any], network: Mapping[str, str], workdir: str
) -> None:
    """Warns when the run's own network (`network_record`) is not the one it `recorded`."""
    if recorded.get("sha256") and network and network["sha256"] != recorded["sha256"]:
        _warn_network_changed(network["file"], recorded["sha256"], network["sha256"], workdir)


def trajectory_changes(
    recorded: Mapping[str, Any], config: Any, also_free: Collection[str] = ()
) -> list[str]:
    """`key: old -> new` for each key of both whose change alters what a resumed run computes
    (all but `config.free_keys` and `also_free`)."""
    old, new = config_lib.flatten(recorded), config_lib.flatten(_as_json(config))
    return _changes(old, new, config_lib.free_keys(old, new) | set(also_free))


def _changes(
    old: Mapping[str, Any], new: Mapping[str, Any], free: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """`key: old -> new` for every key of both whose value differs, `free` keys aside."""
    return [
        f"{key}: {old[key]!r} -> {new[key]!r}"
        for key in sorted(set(old) & set(new))
        if key not in free and old[key] != new[key]
    ]


@dataclasses.dataclass(frozen=True)
class ConfigRecord:
    """The `config.json` a checked run writes once it has resumed: its `record`, the allowed
    `changes`, and why the file there now is set aside (not replaced), if it is."""

    path: str
    record: dict[str, Any]
    changes: tuple[str, ...] = ()
    set_aside: str = ""

    def write(self) -> None:
        """Writes the record; an unreadable file there first is renamed, never deleted."""
        if self.set_aside and os.path.exists(self.path):
            moved = f"{self.path}.unreadable-{_stamp()}"
            os.replace(self.path, moved)
            logging.warning("%s %s; moved aside to %s.", self.path, self.set_aside, moved)
        if self.changes:
            logging.warning("Resuming with a changed config: %s", "; ".join(self.changes))
        temporary = f"{self.path}.tmp-{os.getpid()}"
        with open(temporary, "w") as f:
            f.write(json.dumps(self.record, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.path)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a run recorded of itself: its `config` (None: nothing records it), `data`
    (`data_identity.identity`), the `changes` allowed on its resumes, and its `network`;
    `source` names where the config was read, `problem` why `config.json` was not."""

    config: dict[str, Any] | None
    data: dict[str, Any]
    changes: list[Any]
    source: str
    problem: str = ""
    network: dict[str, str] = dataclasses.field(default_factory=dict)


def run_record(workdir: str, metadata: Mapping[str, Any] | None = None) -> RunRecord:
    """The record of the run in `workdir`: `config.json` (each resume rewrites it, so it holds
    every allowed change), and what it lacks from `metadata`, a checkpoint's run metadata. A
    `keep_best_mode` recorded without `keep_best_by` (an old default) is read as none."""
    path, file, problem = os.path.join(workdir, CONFIG_FILE), None, ""
    try:
        with open(path) as f:
            file = json.load(f)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        problem = f"cannot be read ({e})"
    is_record = (
        isinstance(file, dict)
        and isinstance(file.get("config"), dict)
        and isinstance(file.get("data", {}), dict)
        and isinstance(file.get("changes", []), list)
    )
    if file is not None and not is_record:
        problem = 'is not a record of a run (expected {"config": {...}, "data": {...}})'
    file = file if is_record else {}
    saved = metadata if metadata and isinstance(metadata.get("config"), Mapping) else {}
    config = dict(file.get("config") or saved.get("config") or {}) or None
    source = path if file else "the checkpoint's metadata"
    if not file and saved:
        why = problem or "is missing"
        logging.warning("%s %s; reading the run's record from %s instead.", path, why, source)
    if config and not config.get("keep_best_by") and config.get("keep_best_mode"):
        config["keep_best_mode"] = ""
    data = dict(file.get("data") or saved.get("data") or {})
    network = dict(file.get("network") or {})
    if network.get("file"):
        check_network_source(network, network_record(network["file"]), workdir)
    changes = list(file.get("changes", []))
    return RunRecord(config, data, changes, source, problem, network)


def check_config(
    workdir: str,
    config: Any,
    *,
    allow_change: bool,
    data: Mapping[str, Any] | None = None,
    has_checkpoint: bool = True,
    checkpoint_metadata: Mapping[str, Any] | None = None,
) -> ConfigRecord:
    """Checks `config` and `data` against the run's record (`run_record`); writes nothing, and
    a workdir without a checkpoint binds nothing. Returns the record to `write()` once the run
    resumed; WorkdirError for a change of the trajectory unless `allow_change`."""
    path, data = os.path.join(workdir, CONFIG_FILE), dict(data or {})
    model = config.get("model", {})
    network = network_record(model.get("network", "") if model.get("name") is None else "")
    record = {"config": recorded_config(config), "data": data, "changes": []}
    record |= {"network": network} if network else {}
    previous = run_record(workdir, checkpoint_metadata if has_checkpoint else None)
    if not has_checkpoint or previous.config is None:
        if has_checkpoint:
            logging.warning("%s: no record of the config to check against.", workdir)
        elif previous.config is not None:
            logging.info(
                "%s records a run that saved no checkpoint; it is replaced by this run's config.",
                path,
            )
        return ConfigRecord(path, record, set_aside=previous.problem)
    check_network_source(previous.network, network, workdir)
    changes, known = _changes_since(previous, config, data)
    if changes and not allow_change:
        raise WorkdirError(
            f"The config or data differs from what {workdir} was trained with (as "
            f"{'its config.json' if previous.source == path else previous.source} records it): "
            f"{_listing(changes)}. Use another --workdir, or --allow_config_change to "
            "continue that run anyway."
        )
    record["data"] = {**data, **known}
    record["changes"] = previous.changes
    if changes:
        record["changes"].append({"at": _stamp(iso=True), "changes": changes})
    return ConfigRecord(path, record, tuple(changes), previous.problem)


def _listing(changes: list[str], budget: int = 160) -> str:
    """The changes, the first whole and the others while they fit in `budget` characters; the
    rest named by their keys."""
    shown = changes[:1]
    while len(shown) < len(changes) and len("; ".join(changes[: len(shown) + 1])) <= budget:
        shown.append(changes[len(shown)])
    rest = [change.split(":", 1)[0] for change in changes[len(shown) :]]
    return "; ".join(shown) + (f"; and {', '.join(rest)}" if rest else "")


def _changes_since(
    previous: RunRecord, config: Any, data: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """The changes from the record `previous` to `config` with `data`, and, on the same data,
    the digests the record knows and `data` does not. The same data (both splits' digests
    equal) at another `data.dir` resumes."""
    recorded_data = previous.data
    data_changes = data_identity.identity_changes(recorded_data, data)  # They change the order.
    old_dir = config_lib.flatten(previous.config).get("data.dir") or ""
    new_dir = config_lib.flatten(_as_json(config)).get("data.dir") or ""
    moved = (
        old_dir != new_dir
        and not data_changes
        and all(
            recorded_data.get(key) and recorded_data[key] == data.get(key)
            for key in ("train_digest", "test_digest")
        )
    )
    if moved:
        logging.info(
            "The data moved: data.dir was %r, now %r, and is the data %s records (the same "
            "classes, files and content); resuming on it.",
            *(old_dir, new_dir, previous.source),
        )
    changes = trajectory_changes(previous.config, config, ("data.dir",) if moved else ())
    changes += data_changes
    if data_changes:  # On other data, a digest one side lacks is no sign of an older record.
        return changes, {}
    unchecked = data_identity.unchecked_keys(recorded_data, data)
    unrecorded = [key for key in unchecked if recorded_data.get(key) is None]
    if unrecorded:
        logging.warning(
            "%s records no %s of the data (written by an older version, or not known then): "
            "not checked on this resume; the record written now holds what is known.",
            *(previous.source, ", ".join(f"dataset.{key}" for key in unrecorded)),
        )
    known = {key: recorded_data[key] for key in unchecked if data.get(key) is None}
    return changes, known


def record_config(
    workdir: str, config: Any, *, allow_change: bool, data: Mapping[str, Any] | None = None
) -> None:
    """`check_config` and write the record at once (for a workdir with a checkpoint)."""
    check_config(workdir, config, allow_change=allow_change, data=data).write()


def with_recorded(
    config: Any,
    recorded: Mapping[str, Any],
    keep: Collection[str],
    unreported: Collection[str] = (),
) -> tuple[Any, list[str]]:
    """`config` with the recorded values of every key of both but `keep`, and the keys that
    differed, but the `unreported` ones (a default the run fitted to its data)."""
    config = config.copy_and_resolve_references()
    old, new = config_lib.flatten(recorded), config_lib.flatten(_as_json(config))
    changed = _changes(new, old, frozenset(keep) | frozenset(unreported))
    for key in sorted(set(old) & set(new) - set(keep)):
        if old[key] != new[key]:
            _set(config, key, old[key])
    return config, changed


def with_legacy_values(config: Any, recorded: Mapping[str, Any], source: str) -> Any:
    """`config` with the values a run recorded before some keys existed ran with
    (`config.legacy_values`), said in a line: it goes on as it was trained."""
    legacy = config_lib.legacy_values(config_lib.flatten(recorded), config)
    if not legacy:
        return config
    config = config.copy_and_resolve_references()
    for key, value in legacy.items():
        _set(config, key, value)
    logging.info(
        "%s predates %s: the run goes on as it was trained, with %s.",
        *(source, ", ".join(f"config.{key}" for key in legacy)),
        ", ".join(f"{key}={value!r}" for key, value in legacy.items()),
    )
    return config


def _set(config: Any, key: str, value: Any) -> None:
    """Sets the dotted `key` of `config` to `value` (a tuple where it holds one)."""
    parent, _, leaf = key.rpartition(".")
    node = config_lib.value_of(config, parent) if parent else config
    node[leaf] = tuple(value) if isinstance(node[leaf], tuple) else value


def recorded_config_of(workdir: str, config: Any) -> Any:
    """`config` with the legacy values of the run `config.json` records, if any."""
    record = run_record(workdir)
    if record.config is None:
        return config
    return with_legacy_values(config, record.config, record.source)


def _stamp(iso: bool = False) -> str:
    now = datetime.datetime.now(datetime.UTC)
    return now.isoformat(timespec="seconds") if iso else now.strftime("%Y%m%dT%H%M%SZ")


# Where a host finds things or how hard it works, not what the run computes: hosts may differ.
PER_HOST_KEYS = ("compilation_cache_dir", "data.dir", "data.workers", "data.prefetch")


def check_same_config_on_every_process(config: Any) -> None:
    """Refuses processes started with different configs (`PER_HOST_KEYS` aside), naming the
    keys and the processes: their replicas would drift apart."""
    if jax.process_count() == 1:
        return
    flat = {
        key: value
        for key, value in sorted(config_lib.flatten(config.to_dict()).items())
        if key not in PER_HOST_KEYS
    }
    digests = np.array([zlib.crc32(repr(item).encode()) for item in flat.items()], np.uint32)
    shape = np.array([len(flat), zlib.crc32(digests.tobytes())], np.uint32).view(np.int32)
    every_shape = np.asarray(multihost_utils.process_allgather(shape))
    if (every_shape == every_shape[0]).all():
        return
    differ = [k for k in range(jax.process_count()) if (every_shape[k] != every_shape[0]).any()]
    if (every_shape[:, 0] == every_shape[0, 0]).all():  # The same keys: say which values differ.
        every = np.asarray(multihost_utils.process_allgather(digests.view(np.int32)))
        keys = [key for i, key in enumerate(flat) if (every[:, i] != every[0, i]).any()]
    else:
        keys = ["(the set of keys)"]
    raise errors.InvalidValue(
        f"Processes {differ} were started with a config that differs from process 0's in "
        f"{', '.join(keys)}; start every process with the same --config and overrides."
    )


def on_process_0(what: str, fn: Callable[[], Any]) -> Any:
    """`fn()` on process 0 (None on the others); if it raises, every process raises."""
    result = error = None
    if jax.process_index() == 0:
        try:
            result = fn()
        except WorkdirError as e:
            error = e
    if processes.any_process(error is not None):
        raise error or WorkdirError(f"{what} failed on process 0; see its log.")
    return result


@contextlib.contextmanager
def owning(workdir: str) -> Iterator[None]:
    """This run holds the workdir's lock (process 0 takes it)."""
    with contextlib.ExitStack() as lock:
        on_process_0("Locking the workdir", lambda: lock.enter_context(exclusive_lock(workdir)))
        yield


def check_config_on_process_0(workdir: str, config: Any, **kwargs: Any) -> ConfigRecord | None:
    """`check_config` on process 0 (None on the others); a refusal raises on every process."""
    return on_process_0("Checking the config", lambda: check_config(workdir, config, **kwargs))


def write_record_on_process_0(record: ConfigRecord | None) -> None:
    """Writes `check_config_on_process_0`'s record (process 0 holds it)."""
    on_process_0("Recording the config", lambda: record.write() if record else None)
