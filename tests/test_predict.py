"""Tests of haiku_state.predict on trained `mlp` runs: `load_run` (the evaluation's params and
images, any backend), `python -m haiku_state.predict` (files, folders, unreadable images,
one-line errors), `export`, and the README's examples of them."""

from __future__ import annotations

import errno
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from configs import mlp_config
from etils import epath
from image_trees import CLASSES, write_imagefolder
from PIL import Image

import haiku_state as hs
from haiku_state import checkpoint, data, driver, errors
from haiku_state import predict as predict_lib
from haiku_state.data import preprocess
from haiku_state.guards import damaged_steps

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DECAY = 0.8
# A failed read of a damaged file leaves Orbax callbacks on a closed asyncio loop; they surface
# as unraisable exceptions whenever garbage collection runs, in any later test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`runs/mlp` under a fresh folder: 30 pmap steps keeping moving averages; its final eval."""
    root = tmp_path_factory.mktemp("predict")
    workdir = root / "runs" / "mlp"
    final = driver.train_and_evaluate(mlp_config(**{"optimizer.ema_decay": DECAY}), str(workdir))
    return root, workdir, final


@pytest.fixture(scope="module")
def digits():
    return data.load_dataset("digits")


def test_load_run_predicts_as_the_evaluation_with_the_moving_averages(run, digits, caplog):
    _, workdir, final = run
    model = hs.load_run(str(workdir))
    assert "read only" not in caplog.text  # Orbax's note on a reader opened so on purpose.
    assert (model.step, model.moving_averages, model.image_shape) == (30, True, (8, 8, 1))
    assert model.class_names == tuple("0123456789")
    with checkpoint.Checkpointer(workdir / "checkpoints", read_only=True) as reader:
        saved = reader.read_trees(30)
    averages = saved["ema"]["params"]
    for got, want in zip(jax.tree.leaves(model.params), jax.tree.leaves(averages), strict=True):
        np.testing.assert_array_equal(got, want)
    probabilities = model.predict(digits.test.images)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    accuracy = np.mean(probabilities.argmax(axis=1) == digits.test.labels)
    assert accuracy == pytest.approx(final["accuracy"], abs=1.5 / len(digits.test.labels))


def test_load_run_restores_a_run_of_the_jit_backend_on_one_device(tmp_path, digits):
    cadences = dict(log_every=2, eval_every=4, check_every=2, checkpoint_every=4)
    config = mlp_config(steps=4, backend="jit", **cadences, **{"optimizer.warmup_steps": 1})
    final = driver.train_and_evaluate(config, str(tmp_path))
    model = hs.load_run(str(tmp_path))
    assert (model.step, model.moving_averages) == (4, False)
    accuracy = np.mean(model.predict(digits.test.images).argmax(axis=1) == digits.test.labels)
    assert accuracy == pytest.approx(final["accuracy"], abs=1.5 / len(digits.test.labels))


def test_a_run_on_a_folder_of_images_predicts_its_files_as_its_evaluation_reads_them(tmp_path):
    photos = write_imagefolder(tmp_path / "photos", per_class=(6, 3))
    config = mlp_config(steps=2, log_every=1, eval_every=2, check_every=2, checkpoint_every=2)
    config.batch_size, config.eval_batch_size = 16, 8
    config.data.name, config.data.dir, config.data.image_size = "imagefolder", photos, 16
    config.data.workers, config.optimizer.warmup_steps = 0, 1
    final = driver.train_and_evaluate(config, str(tmp_path / "run"))
    model = hs.load_run(str(tmp_path / "run"))
    assert model.class_names == CLASSES and model.image_shape == (16, 16, 3)
    files = sorted(glob.glob(os.path.join(photos, "val", "*", "*")))
    files = [f for f in files if os.path.splitext(f)[1].lower() in (".jpeg", ".jpg", ".png")]
    images = np.stack([model.read_image(path) for path in files])
    with open(files[0], "rb") as f:
        np.testing.assert_array_equal(images[0], preprocess.eval_image(f.read(), 16))
    labels = [CLASSES.index(os.path.basename(os.path.dirname(path))) for path in files]
    accuracy = np.mean(model.predict(images).argmax(axis=1) == labels)
    assert accuracy == pytest.approx(final["accuracy"])


def test_load_run_refuses_what_it_cannot_load_in_one_line(run, tmp_path):
    _, workdir, _ = run
    with pytest.raises(FileNotFoundError, match=r"No checkpoints in .*nowhere \(.* does not exist"):
        hs.load_run(str(tmp_path / "nowhere"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"No complete checkpoint in .*; train first"):
        hs.load_run(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"of step 7 in .* \(complete steps: \[15, 30\]\)"):
        hs.load_run(str(workdir), step=7)
    assert hs.load_run(str(workdir), step=15).step == 15
    # A record that names another network: refused naming the first leaf that misfits.
    other = tmp_path / "other"
    shutil.copytree(workdir, other)
    record = json.loads((other / "config.json").read_text())
    record["config"]["model"]["hidden_sizes"] = [16]
    (other / "config.json").write_text(json.dumps(record))
    misfit = r"names \(mlp\): params\['mlp/batch_norm'\]\['offset'\]: checkpoint \(32,\) vs"
    with pytest.raises(ValueError, match=misfit):
        hs.load_run(str(other))
    model = hs.load_run(str(workdir))
    with pytest.raises(ValueError, match=r"predict takes images \[N, 8, 8, 1\].*got shape \(8, 8"):
        model.predict(np.zeros((8, 8, 1), np.uint8))
    with pytest.raises(
        FileNotFoundError, match=r"Cannot export to .*: the folder .* does not exist"
    ):
        model.export(str(tmp_path / "no" / "model.npz"))
    with pytest.raises(errors.CannotWrite, match=r"it is a folder; name a .npz file"):
        model.export(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["empty", "other"]  # No file left behind.


def test_load_run_and_export_name_the_value_at_fault(run, tmp_path, monkeypatch):
    _, workdir, _ = run
    with pytest.raises(ValueError, match=r"^workdir='': expected the directory of a trained run"):
        hs.load_run("")
    for step, kind in (("30", "str"), (30.0, "float"), (True, "bool")):
        with pytest.raises(ValueError, match=rf"^step={step!r} \({kind}\): expected an int"):
            hs.load_run(str(workdir), step=step)
    model = hs.load_run(str(workdir), step=np.int64(15))
    assert model.step == 15

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", full_disk)
    target = tmp_path / "model.npz"
    with pytest.raises(errors.CannotWrite, match=rf"^Cannot export to {target}: No space left"):
        model.export(str(target))
    assert os.listdir(tmp_path) == []  # The temporary file is removed.


def _a_copy(workdir: pathlib.Path, tmp_path: pathlib.Path, name: str = "copy") -> pathlib.Path:
    shutil.copytree(workdir, tmp_path / name)
    return tmp_path / name


def test_a_step_deleted_as_it_is_read_is_not_damaged_the_newest_is_read(run, tmp_path, monkeypatch):
    _, workdir, _ = run
    read_trees = checkpoint.Checkpointer.read_trees

    def deleted_as_read(self, step):  # As a training run's retention (max_to_keep) does.
        shutil.rmtree(self.directory / str(step))
        monkeypatch.setattr(checkpoint.Checkpointer, "read_trees", read_trees)
        return read_trees(self, step)

    monkeypatch.setattr(checkpoint.Checkpointer, "read_trees", deleted_as_read)
    assert hs.load_run(str(_a_copy(workdir, tmp_path))).step == 15
    monkeypatch.setattr(checkpoint.Checkpointer, "read_trees", deleted_as_read)
    deleted = r"of step 30 in .* \(deleted as it was read.*\(complete steps: \[15\]\)"
    with pytest.raises(FileNotFoundError, match=deleted):
        hs.load_run(str(_a_copy(workdir, tmp_path, "another")), step=30)


def test_a_damaged_step_is_refused_in_one_line_and_so_is_trainings_warning(run, tmp_path, caplog):
    _, workdir, _ = run
    copy = _a_copy(workdir, tmp_path)
    arrays = glob.glob(str(copy / "checkpoints" / "30" / "train_state" / "**" / "d" / "*"))
    largest = max(arrays, key=os.path.getsize)
    os.truncate(largest, 10)
    with pytest.raises(ValueError) as refused:
        hs.load_run(str(copy))
    message = str(refused.value)
    assert message.startswith(f"Checkpoint {copy / 'checkpoints' / '30'} is damaged: ValueError")
    assert "\n" not in message and "TensorStore" not in message and len(message) < 500
    # What a training run warns as it sets the step aside and resumes from an earlier one.
    steps = damaged_steps.StepDirectories(epath.Path(copy / "checkpoints"))
    steps.set_aside_damaged(30, refused.value.__context__, then="resumed from step 15")
    [warning] = [r.getMessage() for r in caplog.records if " is damaged (" in r.getMessage()]
    assert warning.startswith(f"Checkpoint {copy / 'checkpoints' / '30'} is damaged (ValueError")
    assert "\n" not in warning and "TensorStore" not in warning


def _digit_files(folder: pathlib.Path, images: np.ndarray) -> list[pathlib.Path]:
    """The digits as PNGs, written dark on light paper; `read_image` gives the pixels back."""
    paths = []
    for index, image in enumerate(images):
        path = folder / ("nested" if index % 2 else "") / f"digit_{index}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grey = 255 - np.round(image[..., 0].astype(np.float64) * 255 / 16)
        Image.fromarray(grey.astype(np.uint8), "L").save(path)
        paths.append(path)
    return paths


def _command(
    *args: str, timeout: int = 300, python_code: bool = False
) -> subprocess.CompletedProcess:
    """`python -m haiku_state.predict args` (`python -c args` with `python_code`)."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = ["-c", *args] if python_code else ["-m", "haiku_state.predict", *args]
    return subprocess.run(
        [sys.executable, *command], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_the_command_predicts_files_and_folders_and_names_each_unreadable_image(
    run, digits, tmp_path
):
    _, workdir, _ = run
    model = hs.load_run(str(workdir))
    images = digits.test.images[:6]
    paths = _digit_files(tmp_path / "photos", images)
    for path, image in zip(paths, images, strict=True):
        np.testing.assert_array_equal(model.read_image(str(path)), image)
    (tmp_path / "photos" / "notes.txt").write_text("not an image, and not a .png: passed over")
    (tmp_path / "photos" / "broken.png").write_bytes(b"not a png")
    exported = tmp_path / "model.npz"
    photos = str(tmp_path / "photos")
    result = _command(f"--workdir={workdir}", "--top=2", photos, f"--export={exported}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'photos' / 'broken.png'} cannot be read as an image: "
        "UnidentifiedImageError: cannot identify image file"
    )
    lines = [line for line in result.stdout.splitlines() if line.endswith("%")]
    assert len(lines) == len(paths), result.stdout
    probabilities = model.predict(images)
    for path, row in zip(paths, probabilities, strict=True):
        best = np.argsort(-row, kind="stable")[:2]
        expected = ", ".join(f"{model.class_names[i]} {row[i]:.2%}" for i in best)
        assert f"{path}: {expected}" in lines
    assert result.stdout.splitlines()[-1] == f"Exported step 30 to {exported}."
    with np.load(exported) as export:
        assert json.loads(str(export["metadata"]))["moving_averages"] is True


def test_the_command_reads_regular_files_only_and_predicts_the_others(run, digits, tmp_path):
    _, workdir, _ = run
    [good] = _digit_files(tmp_path / "photos", digits.test.images[:1])
    os.mkfifo(tmp_path / "photos" / "b.jpg")  # No writer: opening it to read would wait forever.
    os.symlink("/dev/zero", tmp_path / "photos" / "z.jpg")  # Read to its end: never.
    missing = tmp_path / "missing.png"
    result = _command(f"--workdir={workdir}", str(tmp_path / "photos"), str(missing), timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {tmp_path / 'photos' / 'b.jpg'} is not a regular file (a FIFO, a device?): "
        "not read.",
        f"error: {tmp_path / 'photos' / 'z.jpg'} is not a regular file (a FIFO, a device?): "
        "not read.",
        f"error: {missing}: no such file or folder.",
    ]
    assert result.stdout.startswith(f"{good}: ")


def test_an_image_file_is_read_up_to_a_bound(run, digits, tmp_path, monkeypatch):
    _, workdir, _ = run
    [path] = _digit_files(tmp_path, digits.test.images[:1])
    model = hs.load_run(str(workdir))
    monkeypatch.setattr(predict_lib, "MAX_IMAGE_BYTES", os.path.getsize(path) - 1)
    with pytest.raises(data.DataError, match=rf"^{path} is over .* more than an image file"):
        model.read_image(str(path))


def test_ctrl_c_ends_the_command_in_one_line_with_status_130(tmp_path):
    interrupted = (
        "import os, signal, time\n"
        "from haiku_state import predict\n"
        # As a terminal's Ctrl-C finds it (a shell's background job starts with it ignored).
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "def load_run(*args):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
        "predict.load_run = load_run\n"
        f"predict.main(['predict', '--workdir={tmp_path}', 'photo.png'])\n"
    )
    result = _command(interrupted, python_code=True)
    assert result.returncode == 128 + signal.SIGINT
    assert result.stderr.strip() == "Interrupted (Ctrl-C): stopped; nothing more predicted."


def test_the_command_sizes_the_tpu_host_buffer_before_it_loads_the_run(tmp_path):
    # On a host without transparent hugepages always, as `train` does (test_start_up).
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    loading = (
        "import os\n"
        "from haiku_state import predict, tpu_host\n"
        f"tpu_host.HUGEPAGES_SETTING = {str(tmp_path / 'enabled')!r}\n"
        "os.environ.pop('TPU_PREMAPPED_BUFFER_SIZE', None)\n"
        "def load_run(*args):\n"
        "    raise ValueError('loading with ' + os.environ['TPU_PREMAPPED_BUFFER_SIZE'])\n"
        "predict.load_run = load_run\n"
        f"predict.main(['predict', '--workdir={tmp_path}', 'photo.png'])\n"
    )
    result = _command(loading, python_code=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: loading with {512 << 20}"


def test_the_command_refuses_a_missing_step_and_nothing_to_do_in_one_line(run):
    _, workdir, _ = run
    result = _command(f"--workdir={workdir}", "--step=7", str(workdir))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: No complete checkpoint of step 7 in {workdir / 'checkpoints'} "
        "(complete steps: [15, 30])."
    )
    result = _command(f"--workdir={workdir}")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: nothing to do: give image files or folders, or --export=FILE."
    )
    result = _command(f"--workdir={workdir}", "--step=best", str(workdir))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: --step=best: expected a step number (left out: the newest step)."
    )
    result = _command("--workdir=", str(workdir))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: workdir='': expected the directory of a trained run (train's --workdir)."
    )


def _readme_block(marker: str) -> str:
    [block] = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if marker in b]
    return block


def _printed(text: str) -> list[tuple[str, float]]:
    """`class percent%` lines as (class, percent)."""
    return [(name, float(p)) for name, p in re.findall(r"^(\S+) ([\d.]+)%$", text, re.M)]


def test_the_readmes_load_run_example_and_its_plain_script_print_the_same(run, monkeypatch, capsys):
    root, workdir, _ = run
    monkeypatch.chdir(root)  # The examples' paths are relative: runs/mlp.
    exec(_readme_block("hs.load_run("), {})
    printed = _printed(capsys.readouterr().out)
    assert len(printed) == 5
    plain = _readme_block('np.load("runs/mlp/mlp.npz")')
    assert "import haiku_state" not in plain and "from haiku_state" not in plain
    # Run where haiku_state cannot be imported: the script needs only numpy, Haiku and JAX.
    result = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['haiku_state'] = None\n" + plain],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    from_plain_script = _printed(result.stdout)
    assert [name for name, _ in from_plain_script] == [name for name, _ in printed]
    percents = [[p for _, p in lines] for lines in (from_plain_script, printed)]
    np.testing.assert_allclose(*percents, atol=0.011)
    with np.load(workdir / "mlp.npz") as export:
        metadata = json.loads(str(export["metadata"]))
        assert metadata["moving_averages"] is True and metadata["step"] == 30
        assert metadata["model"]["hidden_sizes"] == [32] and metadata["class_names"][3] == "3"
