"""Tests of haiku_state.config: experiment files, the shared base, validation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from haiku_state import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_experiments_are_the_files_not_starting_with_an_underscore():
    assert config_lib.available_experiments() == ["mlp", "resnet", "resnet50"]


@pytest.mark.parametrize("name", ["mlp", "resnet", "resnet50"])
def test_every_experiment_extends_the_base_and_passes_validation(name):
    base = config_lib.load_config_file(os.path.join(REPO, "experiments", "_base.py"))
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", f"{name}.py"))
    assert set(config_lib.config_keys(base)) <= set(config_lib.config_keys(config))
    assert config.model.name == name
    config_lib.validate_config(config, num_devices=4)


def test_loading_a_config_leaves_sys_path_as_it_was():
    before = list(sys.path)
    config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))
    assert sys.path == before


def test_a_config_file_elsewhere_imports_its_own_siblings(tmp_path):
    (tmp_path / "_shared.py").write_text("STEPS = 7\n")
    (tmp_path / "mine.py").write_text(
        "import _shared\nimport ml_collections\n\n"
        "def get_config():\n    return ml_collections.ConfigDict({'steps': _shared.STEPS})\n"
    )
    assert config_lib.load_config_file(str(tmp_path / "mine.py")).steps == 7


def test_a_missing_key_is_named():
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", "mlp.py"))
    del config["precision"]
    with pytest.raises(ValueError, match=r"lacks the keys \['precision'\]"):
        config_lib.validate_config(config, num_devices=1)


def test_importing_the_library_defines_no_flags():
    code = (
        "from absl import flags\n"
        "import haiku_state.train, haiku_state.checkpoint\n"
        "assert 'workdir' not in flags.FLAGS and 'config' not in flags.FLAGS, 'flags defined'\n"
        "import haiku_state.cli\n"
        "assert 'workdir' in flags.FLAGS and 'config' in flags.FLAGS\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
