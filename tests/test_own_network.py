"""The user's own Haiku network, `network(config, num_classes, cross_replica_axis)` beside
`get_config()` (`config.model.network`): trained on 4 devices from the command line, resumed,
evaluated, followed, predicted, exported and loaded again from what the run recorded; a moved
or changed file said so, a config naming no network refused."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from configs import REPO, StopAfterChecks
from PIL import Image

import haiku_state as hs
from haiku_state import config as config_lib
from haiku_state import data, errors, evaluation, experiment
from haiku_state.guards import config_checks

NETWORK_FILE = """
from __future__ import annotations

import dataclasses

import haiku as hk
import jax

from haiku_state import config as config_lib
from haiku_state import models

WIDTH = 32


@dataclasses.dataclass
class Net(hk.Module):  # A dataclass module, as haiku_state.models writes them.
    num_classes: int
    cross_replica_axis: str | None
    name: str | None = None

    def __call__(self, images, is_training):
        x = hk.Linear(WIDTH)(hk.Flatten()(images))
        x = models.BatchNorm(cross_replica_axis=self.cross_replica_axis)(x, is_training)
        return hk.Linear(self.num_classes)(jax.nn.relu(x))


def network(config, num_classes, cross_replica_axis):
    net = lambda: Net(num_classes, cross_replica_axis)
    return lambda batch, is_training: net()(batch["image"], is_training)


def get_config():
    config = config_lib.default_config()  # No model.name: network() above.
    config.model.network = __file__
    config.update(steps=20, batch_size=64, log_every=10, eval_every=10, check_every=10)
    config.checkpoint_every = 10
    config.optimizer.schedule = "constant"  # Its steps may grow on resume.
    config.optimizer.learning_rate = 0.05
    return config
"""


def _train(cwd, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "haiku_state.train", "--cpu_devices=4", *flags]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """20 steps from the command line in `root` (the file and workdir given relative to it),
    then resumed to 30: the network file, the workdir and both outputs."""
    root = tmp_path_factory.mktemp("own")
    network = root / "nets" / "my_net.py"
    network.parent.mkdir()
    network.write_text(NETWORK_FILE)
    flags = ("--config=nets/my_net.py", "--workdir=run")
    first = _train(root, *flags)
    resumed = _train(root, *flags, "--config.steps=30")
    return network, root / "run", first, resumed


def test_an_own_network_trains_on_4_devices_resumes_and_records_its_file(run):
    network, workdir, first, resumed = run
    assert "Starting at step 0 of 20" in first and "on 4 cpu device(s)" in first
    assert "Resuming at step 20 of 30" in resumed and "Final eval at step 30" in resumed
    record = json.loads((workdir / "config.json").read_text())
    assert record["network"] == {"file": str(network), "sha256": _sha256(network)}
    assert record["config"]["model"] == {"name": None, "network": str(network)}  # Absolute.
    assert {"metrics.jsonl", "tensorboard", "curves.png"} <= set(os.listdir(workdir))
    evals = [json.loads(line) for line in open(workdir / "metrics.jsonl") if '"eval"' in line]
    assert evals and evals[-1]["step"] == 30 and evals[-1]["accuracy"] > 0.7


def test_the_network_is_given_the_replicas_axis_and_standardised_images(monkeypatch):
    seen = {}

    def network(config, num_classes, cross_replica_axis):
        seen["axis"] = cross_replica_axis
        return lambda batch, is_training: seen.setdefault("image", batch["image"])

    monkeypatch.setattr(experiment, "network_function", lambda path: network)
    digits = data.load_dataset("digits")
    config = config_lib.default_config()
    for backend, axis in (("pmap", "i"), ("shard_map", "i"), ("jit", None)):
        config.backend = backend  # BatchNorm binds the axis given; under jit XLA reduces.
        forward = experiment.make_network(config, digits)
        assert seen.pop("axis") == axis, backend
    forward.init(None, {"image": digits.train.images[:2]}, True)
    mean, std = np.float32(digits.mean), np.float32(digits.std)
    want = (digits.train.images[:2].astype(np.float32) - mean) / std
    assert seen["image"].dtype == jnp.float32
    np.testing.assert_allclose(seen["image"], want, rtol=1e-6)


def test_eval_and_eval_follow_rebuild_the_network_from_the_record(run):
    network, workdir, _, _ = run
    given = config_lib.load_config_file(str(network))
    metrics = evaluation.evaluate_checkpoint(given, str(workdir))
    evals = [json.loads(line) for line in open(workdir / "metrics.jsonl") if '"eval"' in line]
    assert metrics["accuracy"] == pytest.approx(evals[-1]["accuracy"])
    results = evaluation.follow_checkpoints(given, str(workdir), stop=StopAfterChecks(2000))
    assert sorted(results) == [10, 20, 30]


def test_load_run_predict_and_export_find_the_network_again(run, tmp_path):
    network, workdir, _, _ = run
    model = hs.load_run(str(workdir))
    digits = data.load_dataset("digits")
    accuracy = np.mean(model.predict(digits.test.images).argmax(1) == digits.test.labels)
    evals = [json.loads(line) for line in open(workdir / "metrics.jsonl") if '"eval"' in line]
    assert accuracy == pytest.approx(evals[-1]["accuracy"], abs=1.5 / len(digits.test.labels))
    image = digits.test.images[0]
    grey = 255 - np.round(image[..., 0].astype(np.float64) * 255 / 16)
    Image.fromarray(grey.astype(np.uint8), "L").save(tmp_path / "digit.png")
    export = tmp_path / "own.npz"
    command = [sys.executable, "-m", "haiku_state.predict", f"--workdir={workdir}"]
    command += [str(tmp_path / "digit.png"), f"--export={export}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    best = model.class_names[int(model.predict(image[None]).argmax())]
    assert result.stdout.startswith(f"{tmp_path / 'digit.png'}: {best} ")
    assert "Exported step 30" in result.stdout
    metadata = json.loads(str(np.load(export)["metadata"]))
    assert metadata["model"] == {"name": None, "network": str(network)}


def test_a_changed_file_is_warned_of_and_one_that_does_not_fit_or_moved_refused(run, caplog):
    network, workdir, _, _ = run
    source = network.read_text()
    try:
        network.write_text(source + "# A comment: the same params.\n")
        with caplog.at_level(logging.WARNING):
            assert hs.load_run(str(workdir)).step == 30
        assert f"{network} changed since the run in {workdir} recorded it" in caplog.text
        network.write_text(source.replace("WIDTH = 32", "WIDTH = 16"))
        with pytest.raises(errors.InvalidValue, match=rf"does not fit .*\({network}\).*\(32,\)"):
            hs.load_run(str(workdir))
        network.rename(network.with_name("moved.py"))
        with pytest.raises(errors.MissingFile, match=rf"network file {network} .* moved"):
            hs.load_run(str(workdir))
    finally:
        network.with_name("moved.py").unlink(missing_ok=True)
        network.write_text(source)


def test_a_config_with_neither_model_name_nor_network_is_refused_naming_both():
    with pytest.raises(
        errors.InvalidValue, match=r"config.model.name .* network\(config, num_classes\)"
    ):
        experiment.network_of(config_lib.default_config(), 10, None, None, None)


def test_the_experiment_file_is_a_valid_config_of_an_own_network():
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "own_network.py"))
    config_checks.validate_config(config, num_devices=4)
    assert config.model.name is None and config.model.network.endswith("own_network.py")
    network = experiment.network_of(config, 10, (8.0,), (6.0,), None)
    params, state = network.init(
        jax.random.key(0), {"image": np.zeros((2, 8, 8, 1), np.uint8)}, True
    )
    assert set(params) == {"conv2_d", "batch_norm", "linear"} and set(state) == {"batch_norm"}


def test_the_readme_shows_the_experiment_file_as_it_is():
    readme = open(os.path.join(REPO, "README.md")).read()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "def network(" in b]
    source = open(os.path.join(REPO, "experiments", "own_network.py")).read()
    assert source.endswith(block)
