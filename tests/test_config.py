"""Tests of haiku_state.config: the schema, experiment files, the shared base, validation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from haiku_state import config as config_lib
from haiku_state import errors, models
from haiku_state.guards import config_checks
from haiku_state.guards import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_experiments_are_the_files_not_starting_with_an_underscore():
    experiments = ["mlp", "own_network", "resnet", "resnet50", "wide_mlp"]
    assert config_lib.available_experiments() == experiments


@pytest.mark.parametrize("name", ["mlp", "resnet", "resnet50"])
def test_every_experiment_extends_the_base_and_passes_validation(name):
    base = config_lib.load_config_file(os.path.join(REPO, "experiments", "_base.py"))
    config = config_lib.load_config_file(os.path.join(REPO, "experiments", f"{name}.py"))
    assert set(config_lib.flatten(base)) <= set(config_lib.flatten(config))
    assert config.model.name == name
    config_checks.validate_config(config, num_devices=4)


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
        config_checks.validate_config(config, num_devices=1)


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
    config_checks.validate_config(config, num_devices=8)
    config.optimizer.learning_rate = 0.3  # Given explicitly, it no longer follows the batch.
    config.batch_size = 2048
    assert config.optimizer.learning_rate == 0.3
    with pytest.raises(ValueError, match="Unknown resnet50 variant 'imagnet'"):
        config_lib.load_config_file(os.path.join(REPO, "experiments", "resnet50.py:imagnet"))


# The schema: one entry per key, from which the defaults, validation and resume check derive.

EXPERIMENT_FILES = ["mlp.py", "resnet.py", "resnet50.py", "resnet50.py:imagenet", "wide_mlp.py"]


def _experiment(name):
    return config_lib.load_config_file(os.path.join(REPO, "experiments", name))


def _set(config, dotted_key, value):
    *parents, leaf = dotted_key.split(".")
    for parent in parents:
        config = config[parent]
    config[leaf] = value


@pytest.mark.parametrize("name", EXPERIMENT_FILES)
def test_an_experiment_has_exactly_the_keys_of_the_schema_for_its_model(name):
    config = _experiment(name)
    expected = {key.name for key in config_lib.keys_of(config.model.name)}
    assert set(config_lib.flatten(config)) == expected


@pytest.mark.parametrize("name", EXPERIMENT_FILES)
def test_an_experiment_sets_no_key_its_own_combination_ignores(name):
    assert config_checks.ignored_settings(_experiment(name)) == []


def test_keys_both_configs_ignore_may_change_on_resume():
    recorded = {"data.name": "imagefolder", "data.num_classes": 1000, "num_epochs": 90}
    recorded["steps"] = 200
    new = {**recorded, "data.num_classes": 10, "steps": 600}
    assert {"data.num_classes", "steps"} <= config_lib.free_keys(recorded, new)
    synthetic = {**new, "data.name": "synthetic", "num_epochs": None}
    assert not {"data.num_classes", "steps"} & config_lib.free_keys(recorded, synthetic)


def test_the_base_config_is_every_key_of_the_schema_at_its_default():
    base = config_lib.load_config_file(os.path.join(REPO, "experiments", "_base.py"))
    shared = [key for key in config_lib.SCHEMA if not key.for_models]
    assert set(config_lib.flatten(base)) == {key.name for key in shared}
    for key in shared:
        assert config_lib.value_of(base, key.name) == key.default, key.name
    resnet = config_lib.default_config("resnet")
    assert (resnet.model.name, resnet.model.width, resnet.model.bn_decay_rate) == (
        "resnet",
        16,
        0.9,
    )
    with pytest.raises(ValueError, match="Unknown model 'vit'"):
        config_lib.default_config("vit")


def test_every_schema_entry_is_well_formed_and_its_default_valid():
    names = [key.name for key in config_lib.SCHEMA]
    assert len(names) == len(set(names)), "a key has two entries"
    for key in config_lib.SCHEMA:
        assert key.help and key.type in (int, float, str, bool, tuple), key.name
        assert set(key.for_models) <= set(models.MODELS), key.name
        assert not key.for_models or key.name.startswith("model."), key.name
        if key.default is not None or key.allow_none:
            config_checks.check_value(key, key.default)


def test_a_none_default_is_a_placeholder_of_the_keys_type():
    config = config_lib.default_config("mlp")
    config.num_epochs = 3
    with pytest.raises(TypeError):
        config.data.workers = "many"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("steps", None, r"config.steps=None must be a positive integer \(the training steps"),
        ("steps", True, r"config.steps=True must be a positive integer"),
        ("data.flip", None, r"config.data.flip=None must be True or False"),
        ("data.dir", None, r"config.data.dir=None must be a string"),
        ("data.prefetch", 0, r"config.data.prefetch=0 must be a positive integer \(batches kept"),
        ("data.image_size", 0, r"config.data.image_size=0 must be a positive integer or None"),
        ("max_to_keep", 0, r"config.max_to_keep=0 must be a positive integer or None"),
        ("optimizer.learning_rate", 0.0, r"config.optimizer.learning_rate=0.0 must be positive"),
        ("optimizer.warmup_steps", -1, r"config.optimizer.warmup_steps=-1 must be >= 0"),
        ("label_smoothing", float("nan"), r"config.label_smoothing=nan must be finite"),
        ("model.hidden_sizes", (32, float("inf")), r"hidden_sizes=\(32, inf\) must be finite"),
        ("precision", "float64", r"Unknown config.precision 'float64'; expected one of"),
        ("keep_best_by", "bogus", r"Unknown config.keep_best_by 'bogus'; expected one of \('', "),
        ("data.max_corrupt_fraction", 1.0, r"config.data.max_corrupt_fraction=1.0 must be in"),
        ("backend", "vmap", r"^Unknown config.backend 'vmap'; expected one of \('pmap', 'shard_"),
        ("param_sharding", "zero3", r"^Unknown config.param_sharding 'zero3'; expected one of"),
    ],
)
def test_a_value_the_schema_does_not_allow_is_refused_naming_the_key_and_what_it_must_be(
    key, value, message
):
    config = _experiment("mlp.py")
    _set(config, key, value)
    with pytest.raises(ValueError, match=message):
        config_checks.validate_config(config, num_devices=1)


def test_a_key_the_schema_does_not_know_is_refused():
    config = _experiment("mlp.py")
    config.chekpoint_every = 5
    with pytest.raises(
        ValueError,
        match=r"keys \['chekpoint_every'\], which .*SCHEMA does not know \(did you mean "
        r"'checkpoint_every'\?\)",
    ):
        config_checks.validate_config(config, num_devices=1)


def test_a_config_has_the_options_of_its_model_and_no_other():
    config = _experiment("mlp.py")
    config.model.name = "resnet"
    with pytest.raises(ValueError, match=r"Config lacks the keys \['model.width', 'model.blocks"):
        config_checks.validate_config(config, num_devices=1)
    config.model.width = 4
    config.model.blocks_per_stage = (1,)
    with pytest.raises(
        ValueError,
        match=r"Model 'resnet' does not take \['dropout_rate', 'hidden_sizes'\]; its options "
        r"are \['batch_norm', 'blocks_per_stage', 'bn_decay_rate', 'width'\]",
    ):
        config_checks.validate_config(config, num_devices=1)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"batch_size": 6}, r"config.batch_size=6 is not divisible by the 4 local devices"),
        ({"eval_batch_size": 6}, r"config.eval_batch_size=6 is not divisible by the 4 local"),
        ({"optimizer.warmup_steps": 600}, r"warmup_steps=600 must be in \[0, steps=600\)"),
        ({"profile_steps": (3,)}, r"config.profile_steps=\(3,\) must be \(\) or \(start, stop\)"),
        ({"init_skip": "linear"}, r"config.init_skip is set but config.init_from is empty"),
        (
            {"keep_best_by": "loss", "keep_best_mode": "min", "eval_every": 70},
            r"keep_best_by='loss' ranks .*checkpoint_every=100 is not a multiple of "
            r"config.eval_every=70",
        ),
        (
            {"keep_best_by": "loss", "keep_best_mode": "max"},
            r"keep_best_mode='max' would keep the worst step; set .*'min'",
        ),
        ({"keep_best_by": "accuracy", "keep_best_mode": "min"}, r"set keep_best_mode='max'"),
        ({"keep_best_mode": "min"}, r"keep_best_mode='min' is set but config.keep_best_by is"),
        (
            {"keep_every_steps": 150},
            r"keep_every_steps=150 .* saves only the multiples of 100: use a multiple of 100",
        ),
        (
            {"data.name": "imagefolder", "data.image_size": 100_000},
            r"config.data.image_size=100000: the \d+ crops of 100000x100000 .* GiB, more than "
            r"this host's",
        ),
        (
            {"param_sharding": "fsdp"},
            r"^config.param_sharding='fsdp' needs config.backend='jit'; config.backend='pmap' "
            r"[^\n]*$",
        ),
        (
            {"backend": "shard_map", "param_sharding": "fsdp"},
            r"^config.param_sharding='fsdp' needs config.backend='jit'; config.backend='shard_map'",
        ),
    ],
)
def test_the_rules_between_keys(changes, message):
    config = _experiment("mlp.py")
    config.checkpoint_every = 100
    for key, value in changes.items():
        _set(config, key, value)
    with pytest.raises(ValueError, match=message):
        config_checks.validate_config(config, num_devices=4)


def test_retention_on_the_evaluated_saves_and_images_that_fit_pass():
    config = _experiment("mlp.py")
    config.keep_best_by, config.keep_best_mode = "loss", "min"
    config.eval_every, config.checkpoint_every, config.keep_every_steps = 50, 100, 300
    config.data.name, config.data.image_size = "imagefolder", 224
    config_checks.validate_config(config, num_devices=4)


@pytest.mark.parametrize(("metric", "mode"), [("loss", "min"), ("accuracy", "max")])
def test_keep_best_by_alone_keeps_the_best_in_its_metrics_direction(metric, mode):
    config = _experiment("mlp.py")
    config.keep_best_by, config.eval_every, config.checkpoint_every = metric, 50, 100
    config_checks.validate_config(config, num_devices=4)
    assert config_lib.keep_best_mode(config) == mode


def test_a_setting_the_configured_combination_ignores_is_named_in_a_warning(caplog, monkeypatch):
    config = _experiment("mlp.py")
    assert config_checks.ignored_settings(config) == []
    config.steps, config.num_epochs, config.data.workers = 100, 2, 50
    config.optimizer.name = "adam"
    config.optimizer.momentum, config.data.num_classes = 0.5, 3
    config.max_to_keep, config.keep_every_steps = None, config.checkpoint_every
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level("WARNING"):
        config_checks.validate_config(config, num_devices=1)
    assert config_checks.ignored_settings(config) == [
        "config.steps=100 is ignored: num_epochs sets the run's length.",
        f"config.keep_every_steps={config.checkpoint_every} is ignored: max_to_keep=None keeps "
        "every step.",
        "config.data.num_classes=3 is ignored: only synthetic data reads it.",
        "config.data.workers=50 is ignored: the data is held in memory.",
        "config.optimizer.momentum=0.5 is ignored: only sgd reads it.",
    ]
    assert "config.data.workers=50 decoding processes, but this process may use 2 cores" in (
        caplog.text
    )
    assert "config.optimizer.momentum=0.5 is ignored" in caplog.text


def test_the_jit_backend_takes_either_param_sharding():
    config = _experiment("mlp.py")
    config.backend = "jit"
    for param_sharding in ("replicated", "fsdp"):
        config.param_sharding = param_sharding
        config_checks.validate_config(config, num_devices=4)


def test_the_warmup_is_checked_against_steps_only_without_num_epochs():
    config = _experiment("mlp.py")
    config.optimizer.warmup_steps, config.num_epochs = 600, 2
    config_checks.validate_config(config, num_devices=1)


def test_a_new_schema_entry_is_a_default_is_validated_and_is_checked_on_resume(
    monkeypatch, tmp_path
):
    # The one edit a new key takes: its entry. Nothing else learns of it.
    monkeypatch.setattr(
        config_lib,
        "SCHEMA",
        config_lib.SCHEMA
        + (
            config_lib.Key("data.new_option", 3, int, bounds=config_lib.POSITIVE_INT, help="h"),
            config_lib.Key("report_every", 7, int, free=True, help="a logging cadence"),
        ),
    )
    config = _experiment("mlp.py")
    assert (config.data.new_option, config.report_every) == (3, 7)
    config_checks.validate_config(config, num_devices=1)
    config.data.new_option = 0
    with pytest.raises(ValueError, match=r"config.data.new_option=0 must be a positive integer"):
        config_checks.validate_config(config, num_devices=1)
    workdir = str(tmp_path)
    workdir_lib.record_config(workdir, _experiment("mlp.py"), allow_change=False)
    cadence = _experiment("mlp.py")
    cadence.report_every = 1
    workdir_lib.record_config(workdir, cadence, allow_change=False)
    changed = _experiment("mlp.py")
    changed.data.new_option = 4
    with pytest.raises(workdir_lib.WorkdirError, match=r"data.new_option: 3 -> 4"):
        workdir_lib.record_config(workdir, changed, allow_change=False)


# Every problem at once, and the keys that follow the data.


def test_every_bad_value_is_named_in_one_error():
    config = _experiment("mlp.py")
    config.steps, config.precision, config.optimizer.momentum = 0, "float64", 1.5
    with pytest.raises(ValueError) as refused:
        config_checks.validate_config(config, num_devices=4)
    message = str(refused.value)
    assert message.startswith("The config has 3 problems: (1) config.steps=0 must be a positive")
    assert "(2) Unknown config.precision 'float64'" in message
    assert "(3) config.optimizer.momentum=1.5 must be in [0.0, 1.0)" in message
    assert "\n" not in message


def test_every_broken_rule_is_named_in_one_error():
    config = _experiment("mlp.py")
    config.batch_size, config.keep_best_mode, config.profile_steps = 6, "min", (3,)
    with pytest.raises(ValueError) as refused:
        config_checks.validate_config(config, num_devices=4)
    message = str(refused.value)
    assert message.startswith("The config has 3 problems: (1) config.batch_size=6 is not")
    assert "(2) config.profile_steps=(3,) must be" in message
    assert "(3) config.keep_best_mode='min' is set but config.keep_best_by is empty" in message


def test_the_defaults_that_follow_the_data_fit_a_small_folder_and_say_so():
    config = _experiment("mlp.py")  # batch_size 128 and warmup_steps 50: the defaults.
    config.num_epochs = 10
    fitted, changes = config_lib.fit_to_data(config, num_train_examples=81, num_devices=4)
    assert (fitted.batch_size, fitted.optimizer.warmup_steps) == (80, 1)
    assert changes == [
        "config.batch_size=128 (the default) is more than the 81 training examples: batches "
        "of 80 instead, a multiple of the 4 devices.",
        "config.optimizer.warmup_steps=50 (the default) is not shorter than the run's 10 steps: "
        "a warmup of 1 steps instead, a tenth of the run.",
    ]
    assert (config.batch_size, config.optimizer.warmup_steps) == (128, 50)  # Not modified.
    # The default warmup follows a short run given in steps too, which validation lets pass.
    short = _experiment("mlp.py")
    short.steps = 20
    config_checks.validate_config(short, num_devices=4)
    fitted, changes = config_lib.fit_to_data(short, num_train_examples=1000, num_devices=4)
    assert (fitted.batch_size, fitted.optimizer.warmup_steps, len(changes)) == (128, 2, 1)
    # Data that allows the defaults leaves the config as it is.
    assert config_lib.fit_to_data(_experiment("mlp.py"), 1000, 4) == (_experiment("mlp.py"), [])


@pytest.mark.parametrize(
    "changes, examples, message",
    [
        (
            {"batch_size": 96},
            81,
            r"^config.batch_size=96 is larger than the 81 training .*at most 80",
        ),
        ({"num_epochs": 1, "optimizer.warmup_steps": 3}, 81, r"warmup_steps=3 must be in \[0, ste"),
        ({}, 3, r"^The 3 training examples are fewer than the 4 devices"),
    ],
)
def test_a_value_set_away_from_its_default_that_the_data_does_not_allow_is_refused(
    changes, examples, message
):
    config = _experiment("mlp.py")
    for key, value in changes.items():
        _set(config, key, value)
    with pytest.raises(ValueError, match=message):
        config_lib.fit_to_data(config, examples, num_devices=4)


# What an unknown key is told, and --helpconfig's text.


@pytest.mark.parametrize(
    "name, message",
    [
        ("stepz", "Unknown config key 'stepz' (did you mean 'steps'?); --helpconfig lists"),
        ("optimizer.lerning_rate", "(did you mean 'optimizer.learning_rate'?)"),
        ("optimiser.learning_rate", "(did you mean 'optimizer.learning_rate'?)"),
        ("data.batch_size", "(did you mean 'batch_size'?)"),
        (
            "model.width",
            "config.model.width is an option of the resnet model, not of 'mlp', whose options "
            "are model.hidden_sizes, model.dropout_rate, model.bn_decay_rate, model.batch_norm.",
        ),
        ("model.widht", "Unknown config key 'model.widht' (the 'mlp' model's options are model.h"),
        ("zzz", "Unknown config key 'zzz'; --helpconfig lists every key and what it sets."),
    ],
)
def test_an_unknown_key_is_told_the_nearest_key_or_the_models_that_take_it(name, message):
    assert message in config_checks.unknown_key_error(name, _experiment("mlp.py"))


def test_describe_keys_gives_every_key_its_value_default_range_and_help():
    config = _experiment("resnet.py")
    text = config_lib.describe_keys(config)
    for key in config_lib.keys_of("resnet"):
        assert f"  --config.{key.name}=" in text and f"\n      {key.help}" in text, key.name
    assert "--config.model.hidden_sizes" not in text  # The MLP's option.
    assert "  --config.steps=400  (a positive integer; default 600)\n" in text
    assert "  --config.backend='pmap'  (one of ('pmap', 'shard_map', 'jit'); may change on " in text
    every = config_lib.describe_keys()
    assert every.count("\n  --config.") + 1 == len(config_lib.SCHEMA)
    assert "  --config.model.width=16  (a positive integer; for the resnet model)\n" in every


@pytest.mark.parametrize(
    "body, says",
    [
        ("def get_config():\n    return 42\n", "get_config() returned 42 (int); expected an "
         "ml_collections.ConfigDict"),
        ("X = 1\n", "defines no get_config(), which returns the config"),
    ],
)  # fmt: skip
def test_a_config_file_without_a_config_is_refused_naming_it(tmp_path, body, says):
    path = tmp_path / "broken.py"
    path.write_text(body)
    with pytest.raises(errors.InvalidValue) as refused:
        config_lib.load_config_file(str(path))
    assert str(refused.value).startswith(str(path)) and says in str(refused.value)


def test_the_names_config_keys_take_are_those_the_registries_hold():
    from haiku_state import choices, data

    assert tuple(data.sources.SOURCES) == choices.DATASETS == data.DATASETS
    encoded = tuple(name for name, source in data.sources.SOURCES.items() if source.encoded)
    assert encoded == choices.ENCODED_DATASETS == data.ENCODED_DATASETS
    assert tuple(data.pipeline.DECODERS) == choices.DECODERS == data.DECODER_NAMES


def test_loading_every_experiment_file_imports_nothing_a_run_needs_beside_jax():
    # What lets `python -m haiku_state.train` import those while the TPU runtime starts.
    heavy = ("haiku", "optax", "orbax.checkpoint", "tensorstore", "grain", "cv2", "matplotlib")
    code = (
        "import sys\n"
        "from haiku_state import config\n"
        "for name in config.available_experiments():\n"
        "    if name != 'own_network':  # A user's network: it imports Haiku itself.\n"
        "        config.load_config_file(f'experiments/{name}.py')\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
