"""Where metrics go: `metrics.jsonl`, TensorBoard event files, a progress line, curves.png
(drawn by `curves`).

A training run and an evaluator beside it both write `metrics.jsonl`, under a lock on
`metrics.jsonl.lock`, so every writer's records land in the current file, whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import math
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from absl import logging

from haiku_state import curves, errors
from haiku_state.curves import curves_figure  # noqa: F401 - importable from here

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"
PERCENT_METRICS = ("accuracy",)  # Shown as percentages; the files keep the fraction.
# The most of `metrics.jsonl` that is read (about two million records): a file over it, or one
# that is no regular file (a FIFO, a device, a link to one), is refused, not read.
MAX_METRICS_BYTES = 512 << 20


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_metric(name: str, value: float) -> str:
    """`accuracy 95.31%`, `loss 0.2113`, `5,210 ex/s`: one metric as every line shows it."""
    if name in PERCENT_METRICS:
        return f"{name} {value:.2%}"
    return f"{value:,.0f} ex/s" if name == "examples_per_s" else f"{name} {value:.4f}"


def format_metrics(metrics: Mapping[str, float]) -> str:
    """`accuracy 95.31%, loss 0.2113`: the metrics of an evaluation, in one line."""
    return ", ".join(format_metric(name, float(value)) for name, value in metrics.items())


def tensorboard_command() -> str:
    """The command that starts TensorBoard here: `tensorboard` if the one on PATH is this
    Python's, else the one beside this Python (a virtualenv's, e.g. `.venv/bin/tensorboard`,
    relative to the working directory when under it), else `tensorboard`."""
    beside = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    on_path = shutil.which("tensorboard")
    if not os.path.isfile(beside) or (on_path and os.path.samefile(on_path, beside)):
        return "tensorboard"
    relative = os.path.relpath(beside)
    return beside if relative.startswith(os.pardir) else relative


def describe_outputs(workdir: str, *others: str) -> str:
    """Where a run's records are, for its last line: the files this module writes, and `others`,
    and the command that shows them in TensorBoard."""
    names = ", ".join((CURVES_FILE, METRICS_FILE, f"{TENSORBOARD_DIR}/", *others))
    return f"In {workdir}: {names} (view with: {tensorboard_command()} --logdir {workdir})."


def format_progress(
    step: int, total_steps: int, metrics: Mapping[str, float], elapsed_s: float, eta_s: float
) -> str:
    """`step 300/1200 | loss 0.2113 | accuracy 95.31% | 5,210 ex/s | elapsed 0:00:01 | ETA ...`."""
    fields = [f"step {step}/{total_steps}"]
    fields += [format_metric(name, value) for name, value in metrics.items()]
    fields += [f"elapsed {_format_duration(elapsed_s)}", f"ETA {_format_duration(eta_s)}"]
    return " | ".join(fields)


def import_tensorboard_ahead() -> None:
    """Imports tensorboardX in a thread of its own, beside what the caller waits on (a run's
    compiles): a `MetricWriter` then opens its TensorBoard runs without waiting for it."""

    def load() -> None:
        with contextlib.suppress(ImportError):  # Raised where it is used.
            importlib.import_module("tensorboardX")

    threading.Thread(target=load, name="import tensorboardX", daemon=True).start()


class MetricWriter:
    """Writes each event to `metrics.jsonl` and TensorBoard, and reports progress (training's
    on one line updated in place on a terminal). Only process 0 is `enabled`; the records past
    a resumed run's `resume_step` are superseded and purged from TensorBoard. The TensorBoard
    runs of `open_now` are opened at once: a training run's first write, the import and the
    event file, took 0.37 s of its first logged window on a TPU v5e host.
    """

    def __init__(
        self,
        workdir: str,
        total_steps: int,
        *,
        enabled: bool = True,
        resume_step: int | None = None,
        open_now: Sequence[str] = (),
    ):
        self._total_steps = total_steps
        self._enabled = enabled
        self._created = time.monotonic()
        self._rate_start: tuple[int, float] | None = None  # (step, time) of the first event.
        self._interactive = sys.stderr.isatty()
        self._progress_shown = False
        self._jsonl_path = os.path.join(workdir, METRICS_FILE)
        self._tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
        self._purge_step = None if resume_step is None else resume_step + 1
        self._tensorboard: dict[str, Any] = {}  # A tensorboardX SummaryWriter by split.
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            if resume_step is not None:
                supersede_after(workdir, resume_step)
            for split in open_now:  # Not at their first write, inside a training loop.
                self._tensorboard_run(split)

    def write(
        self,
        step: int,
        split: str,
        metrics: Mapping[str, float],
        marks: Mapping[str, Any] | None = None,
    ) -> None:
        """Records `{"step": step, "split": split, **metrics, **marks}`; `marks` are JSON-only
        fields, e.g. `{"separate": True}` for an evaluation run apart from training."""
        if not self._enabled:
            return
        record = {"step": step, "split": split, **{k: float(v) for k, v in metrics.items()}}
        _append_record(self._jsonl_path, {**record, **(marks or {})})
        tensorboard = self._tensorboard_run(split)
        for name, value in metrics.items():
            tensorboard.add_scalar(name, float(value), step)
        if split == "train":
            self._report_progress(step, metrics)
        else:
            self._end_progress_line()
            logging.info("[%s] step %d: %s", split, step, format_metrics(metrics))

    def _tensorboard_run(self, split: str) -> Any:
        """The TensorBoard run of `split`, `tensorboard/<split>/`: its metrics under their own
        names, so that TensorBoard draws train and eval on one chart per metric."""
        if split not in self._tensorboard:
            from tensorboardX import SummaryWriter

            self._tensorboard[split] = SummaryWriter(
                os.path.join(self._tensorboard_dir, split), purge_step=self._purge_step
            )
        return self._tensorboard[split]

    def _report_progress(self, step: int, metrics: Mapping[str, float]) -> None:
        now, eta = time.monotonic(), float("nan")
        if self._rate_start is None:
            self._rate_start = (step, now)  # The first window includes compilation.
        elif step > self._rate_start[0]:
            rate = (step - self._rate_start[0]) / (now - self._rate_start[1])
            eta = (self._total_steps - step) / rate
        line = format_progress(step, self._total_steps, metrics, now - self._created, eta)
        if not self._interactive:
            logging.info("%s", line)
            return
        sys.stderr.write("\r\033[K" + line)
        sys.stderr.flush()
        self._progress_shown = True

    def _end_progress_line(self) -> None:
        if self._progress_shown:
            sys.stderr.write("\n")
            self._progress_shown = False

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        try:
            self.close()
        except OSError as e:  # A full disk: the run's own error, if any, is the one to tell.
            if error is None:
                raise errors.CannotWrite(
                    f"TensorBoard events in {self._tensorboard_dir} cannot be written: "
                    f"{e.strerror or e}."
                ) from e
            logging.warning("TensorBoard events in %s not closed: %s", self._tensorboard_dir, e)

    def close(self) -> None:
        self._end_progress_line()
        tensorboards, self._tensorboard = list(self._tensorboard.values()), {}
        for tensorboard in tensorboards:
            tensorboard.close()


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Holds the exclusive lock of the metrics file `path` (a lock file beside it)."""
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # Also releases the lock.


def _check_metrics_file(path: str, fd: int, size: int | None = None) -> int:
    """The size of the open metrics file `fd` (`size`: of what was read of it); refused in one
    line unless it is a regular file of at most `MAX_METRICS_BYTES`."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise errors.InvalidValue(
            f"{path} is not a regular file (a FIFO, a device, a link to one?): not read or "
            "written; move it aside."
        )
    size = info.st_size if size is None else size
    if size > MAX_METRICS_BYTES:
        raise errors.InvalidValue(
            f"{path} is over {MAX_METRICS_BYTES >> 20} MiB, more than a run's metrics: not read; "
            "move it aside."
        )
    return size


def _append_record(path: str, record: Mapping[str, Any]) -> None:
    """Appends one line to `path`, first dropping a last line a kill cut short."""
    with _locked(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o644)
        try:
            size = _check_metrics_file(path, fd)
            if size and os.pread(fd, 1, size - 1) != b"\n":
                end = os.pread(fd, size, 0).rfind(b"\n") + 1
                logging.warning(
                    "%s: dropping its last line, cut short (%d bytes).", path, size - end
                )
                os.ftruncate(fd, end)
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)


def _parse_records(path: str) -> tuple[list[dict[str, Any]], list[int], int]:
    """The records of a metrics file, the numbers of its other lines, and of its last line."""
    records, bad, last = [], [], 0
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # A FIFO: no wait.
    with open(fd, "rb") as f:
        _check_metrics_file(path, fd)
        content = f.read(MAX_METRICS_BYTES + 1)  # Bounded: the file may grow as it is read.
        _check_metrics_file(path, fd, len(content))
    for number, line in enumerate(content.split(b"\n"), 1):
        if not line.strip():
            continue
        last = number
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "split" in record:
            records.append(record)
        else:
            bad.append(number)
    return records, bad, last


def _numbers(lines: list[int]) -> str:
    more = f" and {len(lines) - 10} more" if len(lines) > 10 else ""
    return ", ".join(map(str, lines[:10])) + more


def supersede_after(workdir: str, step: int) -> None:
    """Marks the records past `step` `"superseded": true` (a resumed run logs them again),
    rewriting the file atomically; a file damaged in the middle is first moved aside whole
    (`metrics.jsonl.damaged-<time>`), never deleted, and its readable records kept."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return
    with _locked(path):
        records, bad, last = _parse_records(path)
        if bad and bad != [last]:  # Not only a last line a kill cut short.
            aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            os.rename(path, aside)
            logging.warning(
                "%s: line(s) %s are not JSON records; the file as it was is moved aside to %s, "
                "and its %d readable records are kept.",
                *(path, _numbers(bad), aside, len(records)),
            )
        later = [r for r in records if r["step"] > step and not r.get("superseded")]
        if not later and not bad:
            return  # Nothing to mark and nothing unreadable: the file stays as it is.
        for record in later:
            record["superseded"] = True
        temporary = f"{path}.tmp-{os.getpid()}"
        with open(temporary, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """The current events of `metrics.jsonl`, by split and step: the last record of each,
    none superseded; lines that are not records are skipped with a warning."""
    path = os.path.join(workdir, METRICS_FILE)
    records, bad, _ = _parse_records(path)
    if bad:
        logging.warning("%s: skipping line(s) %s, not JSON records.", path, _numbers(bad))
    latest = {(r["split"], r["step"]): r for r in records if not r.get("superseded")}
    return sorted(latest.values(), key=lambda r: (r["split"], r["step"]))


def plot_curves(workdir: str, title: str | None = None) -> str:
    """Draws loss, accuracy (in percent) and the learning rate against step, train and eval,
    into `curves.png`, under `title` (default: the workdir)."""
    path = os.path.join(workdir, CURVES_FILE)
    curves.save_figure(read_metrics(workdir), workdir if title is None else title, path)
    return path


def trees_table(params: Any, state: Any, *, device_axis: bool) -> str:
    """The Haiku params and state, a line per module: each leaf's dtype and shape, the module's
    size, and the totals (as Haiku's example logs `hk.experimental.tabulate` at start). Shapes
    suffice; `device_axis`: the leaves' leading axis of devices is left out."""

    def describe(tree: Any) -> tuple[dict[str, list[str]], dict[str, int]]:
        leaves, sizes = {}, {}
        for module, values in tree.items():
            for name, leaf in values.items():
                shape = tuple(leaf.shape[1:] if device_axis else leaf.shape)
                dims = ",".join(map(str, shape))
                leaves.setdefault(module, []).append(f"{name} {leaf.dtype.name}[{dims}]")
                sizes[module] = sizes.get(module, 0) + math.prod(shape)
        return leaves, sizes

    (param_leaves, param_sizes), (state_leaves, state_sizes) = describe(params), describe(state)
    lines = []
    for module in sorted({*param_leaves, *state_leaves}):
        parts = [f"params {', '.join(param_leaves[module])}"] if module in param_leaves else []
        parts += [f"state {', '.join(state_leaves[module])}"] if module in state_leaves else []
        size = f" ({param_sizes[module]:,} params)" if module in param_sizes else ""
        lines.append(f"  {module}: {'; '.join(parts)}{size}")
    total_params, total_state = sum(param_sizes.values()), sum(state_sizes.values())
    lines.append(f"  total: {total_params:,} params, {total_state:,} state values")
    return "\n".join(["Params and state, by module:", *lines])
