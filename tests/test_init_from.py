"""Tests of haiku_state.checkpoint.init_from: another run's params and state in a fresh
run, skipped leaves initialised afresh, every other difference and unreadable formats refused.

`test_run_controls.py` runs it end to end, through `config.init_from`."""

import logging
import os
import re

import configs
import jax
import pytest
from checkpoint_helpers import (
    Setup,
    assert_bit_identical,
    at_step,
    host_copy,
    listing,
    make_jit_updater,
    make_setup,
    make_updater,
    save_steps,
    set_format_version,
)

from haiku_state import checkpoint, train
from haiku_state.checkpoint.init_from import locate
from haiku_state.guards.checkpoint_integrity import leaf_name
from haiku_state.updater import Ema


@pytest.fixture(scope="module")
def setup() -> Setup:
    return make_setup()


def _by_name(tree) -> dict:
    return {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_the_moving_averages_of_a_warm_start_start_from_the_params_and_state_loaded(
    setup, tmp_path
):
    save_steps(tmp_path / "checkpoints", [setup.train(setup.init(), setup.batches[:2])])
    keeping = make_setup(make_updater(16, ema_decay=0.9))
    warm = checkpoint.warm_start(keeping.init(seed=1), str(tmp_path), "linear_1", "i")
    assert_bit_identical(warm.ema, Ema(warm.params, warm.state))
    keeping.train(warm, keeping.batches[:1])  # Arrays of their own: donated beside the params.


def test_locate_names_the_checkpoint_directory_and_step(tmp_path):
    checkpoints = str(tmp_path / "run" / "checkpoints")
    os.makedirs(checkpoints)
    assert locate(os.path.join(checkpoints, "600")) == (checkpoints, 600)
    assert locate(checkpoints) == (checkpoints, None)
    assert locate(str(tmp_path / "run")) == (checkpoints, None)
    from haiku_state.checkpoint.init_from import warm_start

    assert checkpoint.warm_start is warm_start  # The package exports the function.


def test_params_and_state_are_taken_except_the_skipped_leaves(setup, tmp_path):
    trained = setup.train(setup.init(), setup.batches[:2])
    saved = host_copy(trained)
    save_steps(tmp_path / "checkpoints", [trained])
    fresh = setup.init(seed=1)
    expected_fresh = host_copy(fresh)

    warm = host_copy(checkpoint.warm_start(fresh, str(tmp_path), "linear_1", "i"))

    for tree in ("params", "state"):
        saved_leaves, fresh_leaves = (_by_name(getattr(s, tree)) for s in (saved, expected_fresh))
        for name, leaf in _by_name(getattr(warm, tree)).items():
            assert saved_leaves[name].tobytes() != fresh_leaves[name].tobytes(), name
            source = fresh_leaves if "linear_1" in name else saved_leaves
            assert leaf.tobytes() == source[name].tobytes(), f"{tree}/{name}"
    # The optimizer state, the step and the keys stay the fresh run's own.
    for field in ("opt_state", "step", "rng"):
        assert_bit_identical(getattr(warm, field), getattr(expected_fresh, field))


def test_the_log_says_how_many_leaves_were_loaded_and_warns_when_none_were(setup, tmp_path, caplog):
    save_steps(tmp_path, [setup.init()])
    fresh = setup.init(seed=1)
    leaves = len(jax.tree.leaves((fresh.params, fresh.state)))
    with caplog.at_level(logging.INFO):
        checkpoint.warm_start(fresh, str(tmp_path), "linear_1", "i")
    [loaded] = [r for r in caplog.records if "Warm start" in r.getMessage()]
    assert loaded.levelno == logging.INFO
    assert re.fullmatch(
        rf"Warm start: {leaves - 2} of {leaves} leaves of params and state from {tmp_path} "
        r"step 0; 2 freshly initialised \(config.init_skip='linear_1'\): "
        r"params/mlp/linear_1/b, params/mlp/linear_1/w\.",
        loaded.getMessage(),
    ), loaded.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        warm = checkpoint.warm_start(fresh, str(tmp_path), ".*", "i")
    assert_bit_identical(warm, fresh)
    [nothing] = [r for r in caplog.records if "Warm start" in r.getMessage()]
    assert nothing.levelno == logging.WARNING
    assert nothing.getMessage() == (
        f"Warm start from {tmp_path} step 0 loaded nothing: config.init_skip='.*' matches all "
        f"{leaves} leaves of params and state, which keep their fresh initialisation."
    )


def test_a_jit_train_state_is_warm_started_in_its_own_shardings(setup, tmp_path):
    saved = setup.train(setup.init(), setup.batches[:1])
    save_steps(tmp_path, [saved])
    fresh = make_jit_updater(16).init(3, setup.batches[0])
    warm = checkpoint.warm_start(fresh, str(tmp_path), "linear_1", "i")
    saved_params = _by_name(host_copy(saved.params))
    for name, leaf in _by_name(warm.params).items():
        expected = _by_name(fresh.params)[name] if "linear_1" in name else saved_params[name][0]
        assert host_copy(leaf).tobytes() == host_copy(expected).tobytes(), name
        assert leaf.sharding == _by_name(fresh.params)[name].sharding, name
    assert_bit_identical(warm.opt_state, fresh.opt_state)


def test_every_difference_that_is_not_skipped_is_refused_by_name(setup, tmp_path):
    save_steps(tmp_path, [setup.init()])
    wider = make_updater(32).init(0, setup.batches[0])
    expected = "params/mlp/linear/w: checkpoint (64, 16) float32 vs model (64, 32) float32"
    with pytest.raises(ValueError, match=re.escape(expected)) as error:
        checkpoint.warm_start(wider, str(tmp_path), "", "i")
    assert "params/mlp/linear_1/w" in str(error.value) and "config.init_skip" in str(error.value)
    # A skip that matches nothing would skip nothing: said so, with leaf names to aim at.
    with pytest.raises(ValueError, match=r"init_skip='logits' matches none of the leaves .* "
                       r"skip nothing; the leaves are params/mlp/"):  # fmt: skip
        checkpoint.warm_start(wider, str(tmp_path), "logits", "i")
    warm = checkpoint.warm_start(wider, str(tmp_path), "mlp/(linear|batch_norm)", "i")
    assert_bit_identical(warm, wider)  # Every leaf skipped: nothing was taken.


def test_a_step_of_an_unknown_format_version_is_refused_and_left_where_it_is(setup, tmp_path):
    train_state = setup.init()
    save_steps(tmp_path / "checkpoints", [at_step(train_state, 10), at_step(train_state, 40)])
    set_format_version(tmp_path / "checkpoints" / "40", 99)
    before = listing(tmp_path)
    refused = re.escape(
        f"Checkpoint {tmp_path / 'checkpoints' / '40'} has format version 99; this "
        "haiku_state reads format versions [1, 2, 3]."
    )
    # A workdir and its checkpoint directory name the newest step: no fallback to 10.
    for path in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "40"):
        with pytest.raises(checkpoint.UnsupportedFormatError, match=refused):
            checkpoint.warm_start(train_state, str(path), "", "i")
    config = configs.mlp_config(steps=10, init_from=str(tmp_path))
    with pytest.raises(checkpoint.UnsupportedFormatError, match=refused):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # Refused before the new run wrote anything.
    assert listing(tmp_path) == before
