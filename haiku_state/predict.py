r"""Using a trained run: `load_run(workdir)`, and `python -m haiku_state.predict`.

    python -m haiku_state.predict --workdir=runs/photos photo.jpg more_photos/ [--top=3]
    python -m haiku_state.predict --workdir=runs/photos --export=runs/photos/model.npz

`load_run` reads one checkpoint step of a run, whatever backend and device count trained it:
the run's record names the network and the data, the step gives the params and state (its
moving averages, if kept, as evaluation uses them) on one device. The command exits 0; 1 with
an `error:` line for each image or input at fault; 130 on Ctrl-C, with one line.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import haiku as hk
import jax
import numpy as np
from absl import app, flags

from haiku_state import checkpoint, data, errors, tpu_host
from haiku_state import config as config_lib
from haiku_state.checkpoint import step_format
from haiku_state.data.imagefolder import IMAGE_EXTENSIONS
from haiku_state.experiment import network_of
from haiku_state.guards import checkpoint_integrity, damaged_steps, quiet_logs
from haiku_state.guards import workdir as workdir_lib

EXPORT_FORMAT = "haiku_state-export-1"  # The `format` in an export's metadata.
PREDICT_BATCH = 256  # Images per forward pass (and per batch of files decoded).
# The largest image file read (twice a 100-megapixel camera's JPEG): a disk image or a video
# named .jpg is refused before it is read into memory.
MAX_IMAGE_BYTES = 128 << 20
READ_ATTEMPTS = 5  # Reads of the newest step, each deleted by a training run's retention.
DELETION_SECS = 0.5  # Time for a deletion under way to remove a step's commit marker.


class TrainedModel:
    """A step of a trained run on one device, ready to predict (`load_run` makes it).

    `params` and `state` are those evaluation uses (`moving_averages`: the run's averages);
    `class_names` come from the run's data record (the class folders), else "0", "1", ...;
    `predict` takes images of `image_shape` as the run's data holds them.
    """

    def __init__(
        self,
        network: hk.TransformedWithState,
        params: hk.Params,
        state: hk.State,
        *,
        config: Any,
        data_record: dict[str, Any],
        step: int,
        moving_averages: bool,
    ):
        self.network, self.config, self.step = network, config, step
        self.params, self.state = jax.device_put((params, state))
        self.moving_averages = moving_averages
        self.num_classes = int(data_record["num_classes"])
        self.class_names = tuple(data_record.get("classes") or map(str, range(self.num_classes)))
        self.image_mean, self.image_std = data_record.get("mean"), data_record.get("std")
        self.image_shape = data.image_shape_of(
            config.data.name, config.data.image_size, tuple(config.data.image_shape)
        )
        self.image_dtype = np.dtype(np.float32 if self.image_mean is None else np.uint8)
        self._apply = jax.jit(functools.partial(network.apply, is_training=False))

    def predict(self, images: Any) -> np.ndarray:
        """Class probabilities `[N, num_classes]` (float32) of `images` `[N, *image_shape]`,
        pixels as the run's data holds them (uint8; float32 standardised for synthetic)."""
        images = np.asarray(images)
        if images.shape[1:] != self.image_shape:
            raise errors.InvalidValue(
                f"predict takes images [N, {', '.join(map(str, self.image_shape))}] (the run's "
                f"{self.config.data.name} images); got shape {images.shape}."
            )
        probabilities = [np.zeros((0, self.num_classes), np.float32)]
        for start in range(0, len(images), PREDICT_BATCH):
            batch = {"image": images[start : start + PREDICT_BATCH]}
            logits, _ = self._apply(self.params, self.state, None, batch)
            probabilities.append(jax.nn.softmax(logits.astype(np.float32)))
        return np.concatenate(jax.device_get(probabilities))

    def read_image(self, path: str) -> np.ndarray:
        """The image file at `path` as the run's data holds an image, for `predict`: the
        evaluation's centre crop of an encoded dataset, or the centred square resized to the
        size of one held in memory (the digits: grey, written dark on light paper).
        An `errors.Refused` naming the file if it cannot be read."""
        try:
            encoded = _image_bytes(path)
            return data.image_from_file(self.config.data.name, encoded, self.image_shape)
        except errors.Refused:
            raise
        except Exception as e:  # Whatever the bytes are: one line naming the file.
            reason = re.sub(r" <_io\.BytesIO object at \w+>", "", str(e))  # PIL's, of our bytes.
            raise data.CorruptImageError(
                f"{path} cannot be read as an image: {type(e).__name__}: {reason}"
            ) from None

    def export(self, path: str) -> None:
        """Writes `params`, `state` and `metadata()` to a `.npz` file at `path` (replaced whole,
        never left half-written): numpy alone reads it, without pickle."""
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise errors.MissingFile(
                f"Cannot export to {path}: the folder {folder} does not exist."
            )
        if os.path.isdir(path):
            raise errors.CannotWrite(f"Cannot export to {path}: it is a folder; name a .npz file.")
        arrays = {"metadata": np.array(json.dumps(self.metadata()))}
        for name, tree in (("params", self.params), ("state", self.state)):
            for module, values in jax.device_get(tree).items():
                arrays.update({f"{name}/{module}/{leaf}": v for leaf, v in values.items()})
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            with open(temporary, "wb") as f:
                np.savez(f, **arrays)
            os.replace(temporary, path)
        except OSError as e:  # A full disk's says "[Errno 28] No space left on device" alone.
            raise errors.CannotWrite(f"Cannot export to {path}: {e.strerror or e}.") from None
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)

    def metadata(self) -> dict[str, Any]:
        """What an export records besides the arrays: the network's config, the classes, how
        images are shaped and standardised, and where the params come from."""
        return {
            "format": EXPORT_FORMAT,
            "model": self.config.model.to_dict(),
            "precision": self.config.precision,
            "num_classes": self.num_classes,
            "class_names": list(self.class_names),
            "image_shape": list(self.image_shape),
            "image_dtype": self.image_dtype.name,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "data": self.config.data.name,
            "step": self.step,
            "moving_averages": self.moving_averages,
        }


def load_run(workdir: str, step: int | None = None) -> TrainedModel:
    """Step `step` (None: the newest complete one) of the run in `workdir`, ready to predict.
    FileNotFoundError without it; ValueError if it is damaged, of a format version not read
    here, or does not fit the network its record names."""
    if not workdir:
        raise errors.InvalidValue(
            f"workdir={workdir!r}: expected the directory of a trained run (train's --workdir)."
        )
    if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer)):
        raise errors.InvalidValue(
            f"step={step!r} ({type(step).__name__}): expected an int, a checkpoint's step, or "
            "None for the newest."
        )
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise errors.MissingFile(f"No checkpoints in {workdir} ({directory} does not exist).")
    with quiet_logs.read_only_note_kept_quiet():
        checkpointer = checkpoint.Checkpointer(directory, read_only=True)
    with checkpointer:
        step, trees, metadata = _read_step(checkpointer, None if step is None else int(step))
    record = workdir_lib.run_record(workdir, metadata)
    if record.config is None:
        why = f"{workdir_lib.CONFIG_FILE} {record.problem}" if record.problem else "no config.json"
        raise errors.InvalidValue(
            f"{workdir} holds no record of the run's config ({why}, and the checkpoint's "
            "metadata has none): nothing names the network to load the params into."
        )
    config, data_record = _config_of(record), record.data
    if "num_classes" not in data_record:
        raise errors.InvalidValue(
            f"The record of the run in {workdir} holds no data record (num_classes, classes, "
            "mean, std): written by a run that did not record its data."
        )
    evaluated = trees.get("ema", trees)  # The moving averages, when the run kept them.
    mean, std = data_record.get("mean"), data_record.get("std")
    network = network_of(config, data_record["num_classes"], mean, std, cross_replica_axis=None)
    model = TrainedModel(
        network,
        evaluated["params"],
        evaluated["state"],
        config=config,
        data_record=data_record,
        step=step,
        moving_averages="ema" in trees,
    )
    _check_fits(model, f"Checkpoint step {step} of {workdir}")
    return model


def _read_step(checkpointer: checkpoint.Checkpointer, step: int | None) -> tuple[int, Any, Any]:
    """`(step, trees, metadata)` of `step` (None: the newest complete one). A step deleted as
    it is read (by the retention, max_to_keep, of a training run beside) is not damaged: the
    newest is read instead, or one asked for is missing."""
    directory, deleted = checkpointer.directory, ""
    for _ in range(READ_ATTEMPTS):
        steps = checkpointer.all_steps()
        if not steps:
            raise errors.MissingFile(f"No complete checkpoint in {directory}; train first.")
        chosen = steps[-1] if step is None else step
        if chosen not in steps:
            raise errors.MissingFile(
                f"No complete checkpoint of step {step} in {directory}{deleted} (complete "
                f"steps: {steps})."
            )
        try:
            return chosen, checkpointer.read_trees(chosen), checkpointer.metadata(chosen)
        except errors.InvalidValue as e:
            if not isinstance(e.__context__, step_format.DamagedCheckpointError):
                raise
            time.sleep(DELETION_SECS)  # Orbax's deletion removes the commit marker early on.
            steps = checkpointer.all_steps()
            if chosen in steps and (step is not None or chosen == steps[-1]):
                raise errors.InvalidValue(
                    f"Checkpoint {directory / str(chosen)} is damaged: "
                    f"{damaged_steps.one_line(e.__context__)}"
                ) from None
            deleted = " (deleted as it was read: a training run's retention?)"
    raise errors.CannotContinue(
        f"The newest checkpoint in {directory} was deleted as it was read, {READ_ATTEMPTS} times: "
        "a training run beside saves and deletes steps faster than one is read. Read a step it "
        "keeps (keep_every_steps), or after it ends."
    )


def _config_of(record: workdir_lib.RunRecord) -> Any:
    """The schema's config of the recorded model with the recorded values (a key a run older
    than it did not record: what that run ran with, `Key.legacy_default`, else its default)."""
    model = (record.config.get("model") or {}).get("name")  # None: its own (model.network).
    config, _ = workdir_lib.with_recorded(config_lib.default_config(model), record.config, ())
    return workdir_lib.with_legacy_values(config, record.config, record.source)


def _check_fits(model: TrainedModel, what: str) -> None:
    """Refuses params and state whose leaves are not those of the network, naming the first."""
    image = jax.ShapeDtypeStruct((1, *model.image_shape), model.image_dtype)
    init = functools.partial(model.network.init, is_training=True)
    params, state = jax.eval_shape(init, jax.random.key(0), {"image": image})
    problem = checkpoint_integrity.first_mismatch(
        {"params": params, "state": state}, {"params": model.params, "state": model.state}
    )
    if problem is not None:
        raise errors.InvalidValue(
            f"{what} does not fit the network its config names "
            f"({model.config.model.name or model.config.model.network}): {problem}."
        )


# The command line.


def _image_bytes(path: str) -> bytes:
    """The bytes of the regular file at `path` (or its symlink's), `MAX_IMAGE_BYTES` at most:
    a FIFO or a device is refused before it is read, without waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise errors.MissingFile(f"{path}: no such file or folder.") from None
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise data.DataError(f"{path} is not a regular file (a FIFO, a device?): not read.")
        encoded = f.read(MAX_IMAGE_BYTES + 1)
    if len(encoded) > MAX_IMAGE_BYTES:
        raise data.DataError(
            f"{path} is over {MAX_IMAGE_BYTES >> 20} MiB, more than an image file: not read."
        )
    return encoded


def image_files(paths: Sequence[str]) -> Iterator[str]:
    """The paths given, and the image files under the folders given (sorted, recursively,
    hidden ones apart); `read_image` says what is wrong with one that is no image file."""
    for path in paths:
        if not os.path.isdir(path):
            yield path
        else:
            for root, folders, files in os.walk(path):
                folders[:] = sorted(f for f in folders if not f.startswith("."))
                for name in sorted(files):
                    extension = os.path.splitext(name)[1].lower()
                    if not name.startswith(".") and extension in IMAGE_EXTENSIONS:
                        yield os.path.join(root, name)


def predictions(model: TrainedModel, paths: Sequence[str], top: int) -> Iterator[str]:
    """`path: class 97.21%, ...` for each image file, the `top` classes by probability, or
    `error: ...` for one that cannot be read; decoded and predicted a batch at a time."""
    files = list(image_files(paths))
    for start in range(0, len(files), PREDICT_BATCH):
        read, failed = [], {}
        for path in files[start : start + PREDICT_BATCH]:
            try:
                read.append((path, model.read_image(path)))
            except errors.Refused as e:
                failed[path] = f"error: {e}"
        probabilities = model.predict(np.stack([image for _, image in read])) if read else []
        by_path = dict(zip([path for path, _ in read], probabilities, strict=True))
        for path in files[start : start + PREDICT_BATCH]:
            if path in failed:
                yield failed[path]
                continue
            best = np.argsort(-by_path[path], kind="stable")[:top]
            ranked = (f"{model.class_names[i]} {by_path[path][i]:.2%}" for i in best)
            yield f"{path}: {', '.join(ranked)}"


def _define_flags() -> dict[str, flags.FlagHolder]:
    return {
        "workdir": flags.DEFINE_string(
            "workdir", None, "The run's directory (--workdir of train)."
        ),
        "step": flags.DEFINE_string("step", None, "The step to load; default: the newest."),
        "top": flags.DEFINE_integer("top", 3, "The classes shown per image.", lower_bound=1),
        "export": flags.DEFINE_string(
            "export", None, "Also write params, state and metadata to this .npz file."
        ),
    }


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, a bad flag or value refused in one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"error: {e} (--helpfull lists the flags)")


def _main(command_line: dict[str, flags.FlagHolder], argv: list[str]) -> None:
    paths, export, step = argv[1:], command_line["export"].value, command_line["step"].value
    if command_line["workdir"].value is None:
        sys.exit("error: --workdir is required: the directory of a trained run.")
    if not paths and not export:
        sys.exit("error: nothing to do: give image files or folders, or --export=FILE.")
    if step is not None and not step.isdecimal():
        sys.exit(f"error: --step={step}: expected a step number (left out: the newest step).")
    quiet_logs.keep_the_log_to_this_package()
    tpu_host.size_premapped_buffer()  # Before `load_run` starts the runtime, which reads it.
    failed = False
    try:
        model = load_run(command_line["workdir"].value, None if step is None else int(step))
        for line in predictions(model, paths, command_line["top"].value):
            failed |= line.startswith("error: ")
            print(line, file=sys.stderr if line.startswith("error: ") else sys.stdout, flush=True)
        if export:
            model.export(export)
            print(f"Exported step {model.step} to {export}.", flush=True)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    sys.exit(1 if failed else 0)


def main(argv: Sequence[str] | None = None) -> None:
    """Defines the flags, parses `argv` (default: `sys.argv`) and predicts or exports."""
    command_line = _define_flags()
    try:
        app.run(functools.partial(_main, command_line), argv=argv, flags_parser=_parse_flags)
    except KeyboardInterrupt:  # An export is never left half-written (`export`).
        print("\nInterrupted (Ctrl-C): stopped; nothing more predicted.", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    from haiku_state.guards import processes

    processes.run_then_exit_at_once(main)
