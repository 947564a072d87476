"""Tests of haiku_state.config: experiment files, the shared base, validation."""

from __future__ import annotations

import os
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


def test_the_resnet50_imagenet_recipe_scales_the_learning_rate_and_warmup_with_the_batch():
    path = os.path.join(REPO, "experiments", "resnet50.py:imagenet")
    config = config_lib.load_config_file(path)
    assert (config.num_epochs, config.batch_size, config.label_smoothing) == (90, 1024, 0.1)
    assert config.data.name == "imagefolder" and config.data.image_size == 224
    assert config.optimizer.learning_rate == pytest.approx(0.4)
    assert config.optimizer.warmup_steps == 5 * (1_281_167 // 1024)
    config.batch_size = 4096
    assert config.optimizer.learning_rate == pytest.approx(1.6)
    assert config.optimizer.warmup_steps == 5 * (1_281_167 // 4096)
    config_lib.validate_config(config, num_devices=8)
    config.optimizer.learning_rate = 0.3  # Given explicitly, it no longer follows the batch.
    config.batch_size = 2048
    assert config.optimizer.learning_rate == 0.3
    with pytest.raises(ValueError, match="Unknown resnet50 variant 'imagnet'"):
        config_lib.load_config_file(os.path.join(REPO, "experiments", "resnet50.py:imagnet"))
