"""Tests of haiku_state.checkpoint.step_format: what a step holds and its version, exact round
trips, fingerprints and checksums, shape mismatches, other device counts, meshes and
backends."""

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from checkpoint_helpers import (
    NUM_DEVICES,
    Setup,
    as_version_1,
    assert_bit_identical,
    at_step,
    host_copy,
    listing,
    make_jit_updater,
    make_setup,
    make_updater,
    read_step_item,
    save_steps,
    set_aside_dirs,
    set_format_version,
    step_dirs,
    write_step_item,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import haiku_state as hs
from haiku_state import checkpoint, losses, models, sharding
from haiku_state.checkpoint import FORMAT_VERSION, Checkpointer, package_versions
from haiku_state.guards import checkpoint_integrity
from haiku_state.guards.checkpoint_integrity import fingerprint, leaf_name
from haiku_state.updater import Ema, LossScaledOptState, per_device_keys

# A failed read of a damaged file leaves Orbax callbacks scheduled on a closed asyncio loop;
# they surface as unraisable exceptions whenever garbage collection runs, in any later test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup() -> Setup:
    return make_setup()


# What a step holds.


def test_round_trip_is_bit_identical_and_the_step_matches_the_format(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:2])
    expected = host_copy(train_state)
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(train_state, metadata={"config": {"model": "mlp", "width": 16}})
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(setup.init(seed=1))
        assert checkpointer.latest_step() == 2
        assert checkpointer.all_steps() == [2]
        metadata = checkpointer.metadata()

    assert_bit_identical(restored, expected)
    for leaf, like_leaf in zip(
        jax.tree.leaves(restored), jax.tree.leaves(train_state), strict=True
    ):
        assert leaf.sharding == like_leaf.sharding  # Ready for the pmapped step as it is.

    step_dir = directory / "2"
    assert {p.name for p in step_dir.iterdir() if p.is_dir()} == {
        "train_state",
        "step",
        "metadata",
    }
    assert (step_dir / "commit_success.txt").is_file()
    with open(step_dir / "metadata" / "metadata") as f:
        on_disk = json.load(f)
    assert on_disk == metadata
    assert on_disk["config"] == {"model": "mlp", "width": 16}
    assert on_disk["device_count"] == NUM_DEVICES
    assert on_disk["package_versions"] == package_versions()
    assert set(on_disk["package_versions"]) >= {"jax", "jaxlib", "dm-haiku", "orbax-checkpoint"}
    step_item = read_step_item(step_dir)
    fingerprints = step_item.pop("fingerprints")  # Checked below.
    assert step_item == {
        "format_version": FORMAT_VERSION,
        "step": 2,
        "key_impl": "threefry2x32",
        "key_layout": "per_device",
    }
    assert checkpoint.FORMAT_VERSION == 3 and checkpoint.READABLE_FORMAT_VERSIONS == (1, 2, 3)
    saved = ocp.StandardCheckpointer().restore(step_dir / "train_state")
    assert set(saved) == {"params", "state", "opt_state", "rng"}
    # One fingerprint per saved array, computed on device 0 at save: that of the saved values.
    assert fingerprints == {
        leaf_name(path): int(fingerprint(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(saved)
    }
    np.testing.assert_array_equal(saved["rng"]["key_data"], expected.rng)  # Every device's.
    assert_bit_identical(saved["params"], jax.tree.map(lambda x: x[0], expected.params))


def test_empty_opt_state_round_trips(setup, tmp_path):
    # Plain SGD has no optimizer state: a subtree without arrays.
    train_state = setup.init()
    sgd_state = optax.sgd(0.1).init(hs.unreplicate(train_state.params))
    train_state = train_state._replace(opt_state=hs.replicate(sgd_state))
    assert not jax.tree.leaves(train_state.opt_state)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(train_state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(train_state)
    assert_bit_identical(restored, train_state)


def test_float16_run_with_dynamic_loss_scale_resumes_bit_identically(tmp_path):
    # The loss scale lives in opt_state (LossScaledOptState) and must survive Orbax.
    network = models.make_network(
        "mlp", 10, cross_replica_axis="i", hidden_sizes=(16,), precision="float16"
    )
    updater = hs.Updater(
        network,
        optax.sgd(0.1, momentum=0.9),
        losses.classification_loss(10),
        loss_scale=jmp.DynamicLossScale(jnp.float32(2**15), period=2),
    )
    half = make_setup(updater)
    uninterrupted = host_copy(half.train(half.init(), half.batches))

    first_half = half.train(half.init(), half.batches[:3])
    assert isinstance(first_half.opt_state, LossScaledOptState)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(first_half)
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(half.init(seed=7))
    assert_bit_identical(restored.opt_state, host_copy(first_half.opt_state))
    resumed = half.train(restored, half.batches[3:])

    assert_bit_identical(resumed, uninterrupted)


# The format version.


def test_a_version_1_step_without_the_field_is_read_and_resumes_bit_identically(setup, tmp_path):
    uninterrupted = host_copy(setup.train(setup.init(), setup.batches))
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(setup.train(setup.init(), setup.batches[:3]), metadata={"run": 1})
    as_version_1(tmp_path / "3")  # As every step was written before versions were.
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.metadata(3)["run"] == 1
        restored = checkpointer.restore(setup.init(seed=7))
    assert int(restored.step[0]) == 3
    assert_bit_identical(setup.train(restored, setup.batches[3:]), uninterrupted)


@pytest.fixture(scope="module")
def ema_setup() -> Setup:
    return make_setup(make_updater(16, ema_decay=0.9))


def test_moving_averages_round_trip_bit_identically_and_resume_exactly(ema_setup, tmp_path):
    uninterrupted = host_copy(ema_setup.train(ema_setup.init(), ema_setup.batches))
    save_steps(tmp_path, [ema_setup.train(ema_setup.init(), ema_setup.batches[:3])])
    saved = ocp.StandardCheckpointer().restore(tmp_path / "3" / "train_state")
    assert set(saved) == {"params", "state", "opt_state", "rng", "ema"}
    assert set(saved["ema"]) == {"params", "state"}
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(ema_setup.init(seed=7))
    assert_bit_identical(ema_setup.train(restored, ema_setup.batches[3:]), uninterrupted)


@pytest.mark.parametrize(
    "version, written",
    [
        (1, "written in format version 1, before version 3 added them"),
        (2, "written in format version 2, before version 3 added them"),
        (3, "written by a run without optimizer.ema_decay"),
    ],
)
def test_a_step_without_averages_starts_them_from_its_params_and_state_saying_why(
    setup, ema_setup, tmp_path, caplog, version, written
):
    save_steps(tmp_path, [setup.train(setup.init(), setup.batches[:2])])
    if version < 3:
        set_format_version(tmp_path / "2", 2)
    if version == 1:
        as_version_1(tmp_path / "2")
    caplog.set_level(logging.INFO)
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(ema_setup.init(seed=7))
    assert f"holds no moving averages (ema) of params and state ({written})" in caplog.text
    assert_bit_identical(restored.ema, Ema(restored.params, restored.state))
    # The averages are arrays of their own: the step donates them beside the params.
    ema_setup.train(restored, ema_setup.batches[2:3])


def test_a_step_with_averages_restores_into_a_train_state_without_them(
    setup, ema_setup, tmp_path, caplog
):
    trained = ema_setup.train(ema_setup.init(), ema_setup.batches[:2])
    expected = host_copy(trained._replace(ema=None))
    save_steps(tmp_path, [trained])
    caplog.set_level(logging.INFO)
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(setup.init(seed=7))
    assert restored.ema is None and "they are not restored" in caplog.text
    assert_bit_identical(restored, expected)


def test_a_step_of_version_2_holding_averages_is_damaged(ema_setup, tmp_path, caplog):
    train_state = ema_setup.init()
    save_steps(tmp_path, [at_step(train_state, 1), at_step(train_state, 2)])
    set_format_version(tmp_path / "2", 2)  # Version 2 has no `ema`: the items do not match.
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        assert int(checkpointer.restore(train_state).step[0]) == 1
    [warning] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert (
        "its step item says format_version 2 but it holds moving averages (ema), which only "
        "version 3 writes: the version and the items do not match" in warning
    ), warning
    assert set_aside_dirs(tmp_path, 2)


@pytest.fixture(scope="module")
def clipped_setup() -> Setup:  # The module's `setup` with clipping: the same arrays.
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    return make_setup(make_updater(16, clipped))


def test_clipping_turned_on_or_off_carries_the_optimizer_state_over(
    setup, clipped_setup, tmp_path, caplog
):
    trained = setup.train(setup.init(), setup.batches[:2])
    expected = jax.tree.leaves(host_copy(trained.opt_state))
    save_steps(tmp_path, [trained])
    caplog.set_level(logging.INFO)
    with Checkpointer(tmp_path) as checkpointer:
        clipped = checkpointer.restore(clipped_setup.init(seed=7))
    assert "its optimizer state (opt_state) holds the arrays" in caplog.text
    assert_bit_identical(jax.tree.leaves(clipped.opt_state), expected)
    clipped = clipped_setup.train(clipped, clipped_setup.batches[2:3])
    expected = jax.tree.leaves(host_copy(clipped.opt_state))
    save_steps(tmp_path, [clipped])
    with Checkpointer(tmp_path) as checkpointer:  # And off again.
        unclipped = checkpointer.restore(setup.init(seed=7))
    assert int(unclipped.step[0]) == 3
    assert_bit_identical(jax.tree.leaves(unclipped.opt_state), expected)
    setup.train(unclipped, setup.batches[3:4])


def test_an_optimizer_state_of_other_arrays_is_refused_naming_the_keys_that_change_it(
    setup, tmp_path
):
    save_steps(tmp_path, [setup.init()])
    without_momentum = make_setup(make_updater(16, optax.sgd(0.1)))
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(ValueError, match=r"opt_state.*in the checkpoint .* but not in the "
                           r"model \(the optimizer state's arrays change with optimizer.name "
                           r".*optimizer.momentum turned on or off for sgd"):  # fmt: skip
            checkpointer.restore(without_momentum.init())


def test_a_step_of_an_unknown_format_version_is_refused_by_name_and_left_where_it_is(
    setup, tmp_path, caplog
):
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, 10), at_step(train_state, 40)])
    set_format_version(tmp_path / "40", 99)
    before = listing(tmp_path)
    refused = re.escape(
        f"Checkpoint {tmp_path / '40'} has format version 99; this haiku_state reads format "
        "versions [1, 2, 3]."
    )
    for read_only in (False, True):
        with Checkpointer(tmp_path, read_only=read_only) as checkpointer:
            with caplog.at_level(logging.WARNING):
                # The newest step: refused, with no fallback to step 10 behind it.
                with pytest.raises(checkpoint.UnsupportedFormatError, match=refused):
                    checkpointer.restore(train_state)
                with pytest.raises(checkpoint.UnsupportedFormatError, match=refused):
                    checkpointer.restore(train_state, step=40)
                with pytest.raises(checkpoint.UnsupportedFormatError, match=refused):
                    checkpointer.read_trees(40)
                with pytest.raises(checkpoint.UnsupportedFormatError, match=refused):
                    checkpointer.metadata()
            assert checkpointer.all_steps() == [10, 40]
            assert int(checkpointer.restore(train_state, step=10).step[0]) == 10  # Asked for.
    assert listing(tmp_path) == before and step_dirs(tmp_path) == {"10", "40"}
    assert sorted(os.listdir(tmp_path)) == ["10", "40"]  # Nothing set aside.
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]
    assert issubclass(checkpoint.UnsupportedFormatError, ValueError)  # One line on the CLI.


@pytest.mark.parametrize("version", ["1", True, None, 1.0])
def test_a_format_version_that_is_not_an_integer_this_code_reads_is_refused(
    setup, tmp_path, version
):
    train_state = setup.init()
    save_steps(tmp_path, [train_state])
    set_format_version(tmp_path / "0", version)
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(checkpoint.UnsupportedFormatError, match=f"version {version!r};"):
            checkpointer.restore(train_state)
    assert sorted(os.listdir(tmp_path)) == ["0"]


def test_eval_mode_refuses_a_step_of_an_unknown_format_version_in_one_line(setup, tmp_path):
    save_steps(tmp_path / "checkpoints", [at_step(setup.init(), 40)])
    set_format_version(tmp_path / "checkpoints" / "40", 7)
    before = listing(tmp_path / "checkpoints")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-m", "haiku_state.train", "--config=experiments/mlp.py",
         "--cpu_devices=4", f"--workdir={tmp_path}", "--mode=eval"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert f"{tmp_path / 'checkpoints' / '40'} has format version 7" in error
    assert "reads format versions [1, 2, 3]" in error and error.endswith("from an earlier step.")
    assert listing(tmp_path / "checkpoints") == before


@pytest.mark.parametrize(
    "says, holds, lacks, instead",
    [
        (1, 2, "checksums", "key_layout, fingerprints"),
        (2, 1, "key_layout, fingerprints", "checksums"),
    ],
)
def test_a_step_whose_version_and_items_do_not_match_names_the_mismatch(
    setup, tmp_path, caplog, says, holds, lacks, instead
):
    train_state = setup.init()
    save_steps(tmp_path, [at_step(train_state, 1), at_step(train_state, 2)])
    if holds == 1:
        as_version_1(tmp_path / "2")
    set_format_version(tmp_path / "2", says)
    mismatch = (
        f"its step item says format_version {says} but lacks {lacks}, which version {says} "
        f"writes; it holds version {holds}'s {instead} instead: the version and the items do "
        "not match"
    )
    for read_only in (True, False):  # --mode=eval skips it; a training run sets it aside.
        caplog.clear()
        with Checkpointer(tmp_path, read_only=read_only) as checkpointer:
            with caplog.at_level(logging.WARNING):
                assert int(checkpointer.restore(train_state).step[0]) == 1
        [warning] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
        assert f"{tmp_path / '2'} is damaged ({mismatch})" in warning, warning
    assert set_aside_dirs(tmp_path, 2)


# Damage found by the fingerprints (checksums in version 1) and the finiteness check.


@pytest.mark.parametrize("version", [1, FORMAT_VERSION])
def test_a_fingerprint_or_checksum_that_does_not_match_is_damage(setup, tmp_path, caplog, version):
    train_state = setup.train(setup.init(), setup.batches[:1])
    save_steps(tmp_path, [at_step(train_state, 1), at_step(train_state, 2)])
    if version == 1:
        as_version_1(tmp_path / "2")
    step_item = read_step_item(tmp_path / "2")
    integrity = "checksums" if version == 1 else "fingerprints"
    name = next(iter(step_item[integrity]))
    step_item[integrity][name] ^= 1
    write_step_item(tmp_path / "2", step_item)
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        assert int(checkpointer.restore(train_state).step[0]) == 1
    expected = "bytes do not match the checksum" if version == 1 else "values do not match"
    assert any(f"{name}: its {expected}" in r.getMessage() for r in caplog.records)
    assert set_aside_dirs(tmp_path, 2)


def test_non_finite_params_are_damage(setup, tmp_path, caplog):
    train_state = setup.init()
    nan_params = jax.tree.map(lambda x: x * np.nan, train_state.params)
    save_steps(
        tmp_path, [at_step(train_state, 1), at_step(train_state, 2)._replace(params=nan_params)]
    )
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        assert int(checkpointer.restore(train_state).step[0]) == 1
    assert any("holds non-finite values" in r.getMessage() for r in caplog.records)


# Mismatches, device counts and other hardware.


def test_mismatches_name_the_first_path_and_change_nothing(setup, tmp_path):
    train_state = setup.init()
    save_steps(tmp_path, [train_state])
    before = listing(tmp_path)
    wider = make_updater(32).init(0, setup.batches[0])
    no_momentum = train_state._replace(
        opt_state=hs.replicate(optax.sgd(0.1).init(hs.unreplicate(train_state.params)))
    )
    with Checkpointer(tmp_path) as checkpointer:
        expected = "params['mlp/batch_norm']['offset']: checkpoint (16,) vs model (32,)"
        with pytest.raises(ValueError, match=re.escape(expected)):
            checkpointer.restore(wider)
        expected = "opt_state[0]['trace']['mlp/batch_norm']['offset']: in the checkpoint"
        with pytest.raises(ValueError, match=re.escape(expected)):
            checkpointer.restore(no_momentum)
    assert listing(tmp_path) == before


_RESTORE_ON_TWO_DEVICES = """
import sys

import jax
import numpy as np

import haiku_state as hs
from checkpoint_helpers import make_batch, make_updater
from haiku_state.checkpoint import Checkpointer

assert jax.local_device_count() == 2
updater = make_updater(16)
batch = make_batch(0)
like = updater.init(5, batch)
with Checkpointer(sys.argv[1]) as checkpointer:
    restored = checkpointer.restore(like)
with Checkpointer(sys.argv[1]) as checkpointer:  # Again, from scratch.
    again = checkpointer.restore(like)
hs.assert_replicas_identical(restored.params)
arrays = {
    "params" + jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored.params)
}
arrays["key_data"] = np.asarray(jax.random.key_data(restored.rng))
arrays["key_data_again"] = np.asarray(jax.random.key_data(again.rng))
arrays["step"] = np.asarray(restored.step)
_, metrics = updater.update(restored, batch)
arrays["loss"] = np.asarray(metrics["loss"])
np.savez(sys.argv[2], **arrays)
"""


def test_restore_onto_fewer_devices_rederives_the_keys(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:1])
    saved = host_copy(train_state)
    save_steps(tmp_path / "checkpoints", [train_state])
    script = tmp_path / "restore_on_two_devices.py"
    script.write_text(_RESTORE_ON_TWO_DEVICES)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            [REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "checkpoints"), str(tmp_path / "out.npz")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "re-deriving the per-device keys" in run.stderr
    restored = dict(np.load(tmp_path / "out.npz"))

    for path, leaf in jax.tree_util.tree_leaves_with_path(saved.params):
        params = restored["params" + jax.tree_util.keystr(path)]
        assert params.shape == (2,) + leaf.shape[1:]
        for device in range(2):
            assert params[device].tobytes() == leaf[0].tobytes()  # Device 0's saved copy.
    np.testing.assert_array_equal(restored["step"], [1, 1])
    assert np.isfinite(restored["loss"])  # The pmapped step runs on the restored state.
    hs.assert_keys_distinct(restored["key_data"])
    # Deterministic: the same in a second restore, and as derived here in another process.
    np.testing.assert_array_equal(restored["key_data"], restored["key_data_again"])
    expected_keys = per_device_keys(jax.random.wrap_key_data(saved.rng[0]), 2)
    np.testing.assert_array_equal(restored["key_data"], jax.random.key_data(expected_keys))


def test_restores_a_checkpoint_written_on_other_hardware(setup, tmp_path):
    # Arrays are saved from host copies, so no saved sharding names a device: a
    # checkpoint written on a GPU restores on a CPU. Any sharding Orbax does record is
    # rewritten to name a device this process lacks, as if written on a GPU.
    train_state = setup.train(setup.init(), setup.batches[:1])
    expected = host_copy(train_state)
    save_steps(tmp_path, [train_state])
    for root, _, files in os.walk(tmp_path / "1"):
        for name in files:
            if name == "_sharding":
                path = os.path.join(root, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace("cpu:0", "cuda:0"))
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(setup.init(seed=1))
    assert_bit_identical(restored, expected)


# Global arrays (backend="jit"): any mesh, any backend.


@pytest.fixture(scope="module")
def jit_setup() -> Setup:
    """The MLP under jit with fsdp: its first layer is split over the 4 devices."""
    return make_setup(make_jit_updater())


def _on_mesh(train_state: hs.TrainState, devices: list) -> hs.TrainState:
    """`train_state` laid out by the fsdp rule on a mesh of `devices`: another device count."""
    device_mesh = Mesh(np.array(devices), ("i",))
    return jax.device_put(
        train_state, sharding.train_state_shardings(train_state, device_mesh, "fsdp")
    )


def _assert_placed_like(actual: hs.TrainState, like: hs.TrainState) -> None:
    for (path, leaf), want in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(like), strict=True
    ):
        assert leaf.sharding == want.sharding, jax.tree_util.keystr(path)


def test_fingerprints_are_the_same_on_any_sharding_and_catch_paired_changes():
    values = np.random.RandomState(0).randn(64, 256).astype(np.float32)
    devices = jax.devices()
    placements = [
        values,
        jax.device_put(values, devices[1]),
        jax.device_put(values, NamedSharding(Mesh(np.array(devices), ("i",)), P(None, "i"))),
        jax.device_put(values, NamedSharding(Mesh(np.array(devices[2:]), ("i",)), P("i"))),
    ]
    assert len({int(fingerprint(x)) for x in placements}) == 1
    swapped = values.copy()
    swapped[0, :2] = swapped[0, 1::-1]
    signs = values.copy()
    signs[3, 7] *= -1  # Two sign bits: a plain odd-weighted sum of the words misses these.
    signs[9, 1] *= -1
    for changed in (swapped, signs):  # (Shapes are checked against the saved metadata.)
        assert int(fingerprint(changed)) != int(fingerprint(values))


def test_host_fingerprints_match_the_devices_to_the_bit(monkeypatch):
    # A save fingerprints its host copies; a restore, the arrays on the devices.
    rng = np.random.RandomState(0)
    trees = {
        "params": {
            "f32": rng.randn(33, 17).astype(np.float32),
            "bf16": rng.randn(5, 7).astype(jnp.bfloat16),
            "f16": rng.randn(9).astype(np.float16),
            "i8": rng.randint(-128, 127, (6, 3)).astype(np.int8),
            "flag": np.array([True, False, True]),
            "scalar": np.float32(2.5),
        },
        "rng": {
            "key_data": np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 4)))
        },
    }
    on_devices = checkpoint_integrity.named_values(
        checkpoint_integrity.device_fingerprints(jax.tree.map(jnp.asarray, trees)), int
    )
    assert checkpoint_integrity.host_fingerprints(trees) == on_devices
    # In chunks: the flat index runs on across them.
    small_chunks = functools.partial(checkpoint_integrity._host_fingerprint, chunk=16)
    monkeypatch.setattr(checkpoint_integrity, "_host_fingerprint", small_chunks)
    assert checkpoint_integrity.host_fingerprints(trees) == on_devices


def test_a_jit_checkpoint_resumes_exactly_with_every_leaf_in_its_sharding(jit_setup, tmp_path):
    uninterrupted = host_copy(jit_setup.train(jit_setup.init(), jit_setup.batches[:3]))
    train_state = jit_setup.train(jit_setup.init(), jit_setup.batches[:2])
    expected = host_copy(train_state)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(train_state)
        like = jit_setup.init(seed=1)
        restored = checkpointer.restore(like)
    assert_bit_identical(restored, expected)
    _assert_placed_like(restored, like)
    step_item = read_step_item(tmp_path / "2")
    assert step_item["key_layout"] == "global" and step_item["format_version"] == FORMAT_VERSION
    assert_bit_identical(jit_setup.train(restored, jit_setup.batches[2:3]), uninterrupted)


def test_a_jit_checkpoint_restores_onto_fewer_and_more_devices(jit_setup, tmp_path):
    train_state = jit_setup.train(jit_setup.init(), jit_setup.batches[:1])
    expected = host_copy(train_state)
    two_devices = _on_mesh(jit_setup.init(seed=1), jax.devices()[:2])
    save_steps(tmp_path / "four", [train_state])
    with Checkpointer(tmp_path / "four") as checkpointer:
        on_two = checkpointer.restore(two_devices)
    _assert_placed_like(on_two, two_devices)
    assert on_two.params["mlp/linear"]["w"].sharding.spec == P(None, "i")  # Split in two.
    assert_bit_identical(on_two, expected)
    save_steps(tmp_path / "two", [on_two])  # Written from 2 devices, read onto 4.
    with Checkpointer(tmp_path / "two") as checkpointer:
        like = jit_setup.init(seed=1)
        on_four = checkpointer.restore(like)
    _assert_placed_like(on_four, like)
    assert_bit_identical(on_four, expected)


def test_keys_cross_backends_by_one_rule(jit_setup, tmp_path):
    """jit -> pmap: device d's key is fold_in(the jit key, d); pmap -> jit: device 0's key."""
    network = models.make_network("mlp", 10, cross_replica_axis=None, hidden_sizes=(256,))
    pmap = hs.Updater(network, optax.adam(1e-3), losses.classification_loss(10))
    pmap_like = pmap.init(1, jit_setup.batches[0])
    jit_state = jit_setup.train(jit_setup.init(), jit_setup.batches[:1])
    jit_saved = host_copy(jit_state)
    save_steps(tmp_path / "jit", [jit_state])
    with Checkpointer(tmp_path / "jit") as checkpointer:
        on_pmap = checkpointer.restore(pmap_like)
    _assert_placed_like(on_pmap, pmap_like)
    expected_keys = per_device_keys(jax.random.wrap_key_data(jit_saved.rng), NUM_DEVICES)
    np.testing.assert_array_equal(host_copy(on_pmap.rng), jax.random.key_data(expected_keys))
    for field in ("params", "state", "opt_state", "step"):
        replicas = host_copy(getattr(on_pmap, field))
        assert_bit_identical(
            jax.tree.map(lambda x: x[NUM_DEVICES - 1], replicas), getattr(jit_saved, field)
        )

    pmap_saved = host_copy(on_pmap)
    save_steps(tmp_path / "pmap", [on_pmap])
    for version in (FORMAT_VERSION, 1):
        if version == 1:
            as_version_1(tmp_path / "pmap" / "1")
        with Checkpointer(tmp_path / "pmap") as checkpointer:
            like = jit_setup.init(seed=1)
            on_jit = checkpointer.restore(like)
        _assert_placed_like(on_jit, like)
        np.testing.assert_array_equal(host_copy(on_jit.rng), pmap_saved.rng[0])
        assert_bit_identical(on_jit._replace(rng=()), jit_saved._replace(rng=()))


def test_a_jit_step_whose_arrays_changed_on_disk_is_set_aside(jit_setup, tmp_path, caplog):
    # Step 2's arrays replaced by step 1's: every file reads, only the fingerprints notice.
    train_state = jit_setup.train(jit_setup.init(), jit_setup.batches[:1])
    expected = host_copy(train_state)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(train_state)
        checkpointer.save(jit_setup.train(train_state, jit_setup.batches[1:2]))
    shutil.rmtree(tmp_path / "2" / "train_state")
    shutil.copytree(tmp_path / "1" / "train_state", tmp_path / "2" / "train_state")
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        restored = checkpointer.restore(jit_setup.init(seed=1))
    assert_bit_identical(restored, expected)  # Step 1, the newest undamaged step.
    assert any(
        "opt_state/0/count: its values do not match the fingerprint" in r.getMessage()
        for r in caplog.records
    )
    assert set_aside_dirs(tmp_path, 2) and step_dirs(tmp_path) == {"1"}
