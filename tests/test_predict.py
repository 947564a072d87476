"""Tests of haiku_state.predict on trained `mlp` runs: `load_run` (the evaluation's params and
images, any backend), `python -m haiku_state.predict` (files, folders, unreadable images,
one-line errors), `export`, and the README's examples of them."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from configs import mlp_config
from image_trees import CLASSES, write_imagefolder
from PIL import Image

import haiku_state as hs
from haiku_state import checkpoint, data, driver
from haiku_state.data import preprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DECAY = 0.8


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
    with pytest.raises(IsADirectoryError, match=r"it is a folder; name a .npz file"):
        model.export(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["empty", "other"]  # No file left behind.


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


def _command(*args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "haiku_state.predict", *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
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
