"""Tests of haiku_state.checkpoint: layout, exact resume, async saves under donation,
partial and damaged checkpoints, mismatches, device-count changes and retention."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import haiku_state as hs
from haiku_state import losses, models
from haiku_state.checkpoint import Checkpointer, package_versions
from haiku_state.updater import LossScaledOptState, per_device_keys

# A failed read of a damaged file leaves Orbax callbacks scheduled on a closed asyncio loop;
# they surface as unraisable exceptions whenever garbage collection runs, in any later test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

NUM_DEVICES = 4
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_updater(width: int, optimizer: optax.GradientTransformation | None = None) -> hs.Updater:
    network = models.make_network("mlp", 10, cross_replica_axis="i", hidden_sizes=(width,))
    optimizer = optimizer or optax.sgd(0.1, momentum=0.9)
    return hs.Updater(network, optimizer, losses.classification_loss(10))


def _make_batch(seed: int) -> dict:
    rng = np.random.RandomState(seed)
    return hs.shard(
        {
            "image": rng.randn(32, 8, 8, 1).astype(np.float32),
            "label": rng.randint(0, 10, size=32).astype(np.int32),
        }
    )


class Setup(NamedTuple):
    updater: hs.Updater
    batches: list

    def init(self, seed: int = 0) -> hs.TrainState:
        return self.updater.init(seed, self.batches[0])

    def train(self, train_state: hs.TrainState, batches: list) -> hs.TrainState:
        for batch in batches:
            train_state, metrics = self.updater.update(train_state, batch)
            jax.block_until_ready(metrics)  # One step in flight at a time on simulated devices.
        return train_state


@pytest.fixture(scope="module")
def setup() -> Setup:
    assert jax.local_device_count() == NUM_DEVICES
    return Setup(_make_updater(16), [_make_batch(seed) for seed in range(6)])


def _at_step(train_state: hs.TrainState, step: int) -> hs.TrainState:
    """The same state relabelled with another step, for tests about step numbers."""
    return train_state._replace(step=hs.replicate(jnp.int32(step)))


def _host_copy(tree: Any) -> Any:
    """Host numpy copies of every leaf; typed keys as their key data."""

    def copy(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.array(jax.device_get(leaf), copy=True)

    return jax.tree.map(copy, tree)


def _assert_bit_identical(actual: Any, expected: Any) -> None:
    actual, expected = _host_copy(actual), _host_copy(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        assert a.tobytes() == b.tobytes(), f"leaf {name} differs"


def _read_checksums(step_dir) -> dict[str, int]:
    with open(step_dir / "step" / "metadata") as f:
        return json.load(f)["checksums"]


def _listing(directory) -> dict:
    """Every file under `directory` with its size and modification time."""
    entries = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            entries[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return entries


def _step_dirs(directory) -> set[str]:
    return {name for name in os.listdir(directory) if name.isdigit()}


def _largest_file(directory) -> str:
    files = [os.path.join(directory, name) for name in os.listdir(directory)]
    return max(files, key=os.path.getsize)


def _save_steps(directory, train_states: list, **kwargs) -> None:
    with Checkpointer(directory, **kwargs) as checkpointer:
        for train_state in train_states:
            assert checkpointer.save(train_state)


# Layout and round trip.


def test_round_trip_is_bit_identical_and_layout_matches_the_contract(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:2])
    expected = _host_copy(train_state)
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as checkpointer:
        assert checkpointer.save(train_state, metadata={"config": {"model": "mlp", "width": 16}})
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(setup.init(seed=1))
        assert checkpointer.latest_step() == 2
        assert checkpointer.all_steps() == [2]
        metadata = checkpointer.metadata()

    _assert_bit_identical(restored, expected)
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
    with open(step_dir / "step" / "metadata") as f:
        step_item = json.load(f)
    assert step_item.pop("checksums")  # Checked below.
    assert step_item == {"step": 2, "key_impl": "threefry2x32"}
    saved = ocp.StandardCheckpointer().restore(step_dir / "train_state")
    assert set(saved) == {"params", "state", "opt_state", "rng"}
    # One CRC-32 per saved array, of its bytes.
    saved_leaves = jax.tree_util.tree_leaves_with_path(saved)
    assert len(checksums := _read_checksums(step_dir)) == len(saved_leaves)
    assert set(checksums.values()) == {
        zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))
        for _, leaf in saved_leaves
    }
    np.testing.assert_array_equal(saved["rng"]["key_data"], expected.rng)  # Every device's.
    _assert_bit_identical(saved["params"], jax.tree.map(lambda x: x[0], expected.params))


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
    _assert_bit_identical(restored, train_state)


def test_no_checkpoint_and_existing_steps_and_bad_metadata(setup, tmp_path):
    train_state = setup.init()
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.restore(train_state) is None
        assert checkpointer.latest_step() is None
        assert checkpointer.metadata() is None
        with pytest.raises(ValueError, match="replicated TrainState"):
            checkpointer.save(hs.unreplicate(train_state))
        with pytest.raises(TypeError, match="JSON-serialisable"):
            checkpointer.save(train_state, metadata={"seed": object()})
        assert checkpointer.save(train_state)
        checkpointer.wait_until_finished()
        before = _listing(tmp_path)
        # A final save at the step of the last periodic one: nothing is overwritten.
        assert not checkpointer.save(train_state)
        assert _listing(tmp_path) == before
        with pytest.raises(FileNotFoundError, match="step 5"):
            checkpointer.restore(train_state, step=5)


# Resumption.


def test_resume_continues_bit_identically(setup, tmp_path):
    uninterrupted = _host_copy(setup.train(setup.init(), setup.batches))

    first_half = setup.train(setup.init(), setup.batches[:3])
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(first_half)
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(setup.init(seed=7))
    assert int(restored.step[0]) == 3
    resumed = setup.train(restored, setup.batches[3:])

    _assert_bit_identical(resumed, uninterrupted)


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
    half = Setup(updater, [_make_batch(seed) for seed in range(6)])
    uninterrupted = _host_copy(half.train(half.init(), half.batches))

    first_half = half.train(half.init(), half.batches[:3])
    assert isinstance(first_half.opt_state, LossScaledOptState)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(first_half)
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(half.init(seed=7))
    _assert_bit_identical(restored.opt_state, _host_copy(first_half.opt_state))
    resumed = half.train(restored, half.batches[3:])

    _assert_bit_identical(resumed, uninterrupted)


def test_async_save_is_unaffected_by_donating_the_state_right_after(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:1])
    expected = _host_copy(train_state)
    with Checkpointer(tmp_path, async_save=True) as checkpointer:
        checkpointer.save(train_state)
        donated = train_state
        train_state = setup.train(train_state, setup.batches[1:4])
        # The update really donated the buffers the save was given.
        assert jax.tree.leaves(donated.params)[0].is_deleted()
        assert donated.rng.is_deleted()
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(setup.init(seed=1), step=1)
    _assert_bit_identical(restored, expected)


# Partial and damaged checkpoints.


def _set_aside(directory, step: int, reason: str = "damaged") -> list:
    """The directories step `step` was moved aside to."""
    return sorted(p for p in directory.iterdir() if p.name.startswith(f"{step}.{reason}-"))


def test_partial_checkpoints_are_never_loaded_and_unmarked_ones_are_moved_aside(setup, tmp_path):
    train_state = setup.init()
    _save_steps(tmp_path, [_at_step(train_state, 1)])
    # Killed mid-save: Orbax writes into `<step>.orbax-checkpoint-tmp` and renames it when done.
    shutil.copytree(tmp_path / "1", tmp_path / "5.orbax-checkpoint-tmp")
    # A step directory without Orbax's commit marker (e.g. an interrupted copy).
    shutil.copytree(tmp_path / "1", tmp_path / "7")
    os.remove(tmp_path / "7" / "commit_success.txt")
    unmarked = _listing(tmp_path / "7")

    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1]
        assert checkpointer.latest_step() == 1
        assert int(checkpointer.restore(train_state).step[0]) == 1
        # The unmarked directory is moved aside, so its step can be saved; the killed
        # save's step is redone.
        [moved] = _set_aside(tmp_path, 7)
        assert _listing(moved) == unmarked
        assert checkpointer.save(_at_step(train_state, 7))
        assert checkpointer.save(_at_step(train_state, 5))
        checkpointer.wait_until_finished()
        assert checkpointer.all_steps() == [1, 5, 7]
        assert int(checkpointer.restore(train_state).step[0]) == 7
    assert not (tmp_path / "5.orbax-checkpoint-tmp").exists()


def _damage(data_file, how: str) -> None:
    if how == "truncate":
        with open(data_file, "r+b") as f:
            f.truncate(os.path.getsize(data_file) // 2)
    elif how == "delete":
        os.remove(data_file)
    else:  # Sixteen bytes overwritten mid-file, as a bad disk or a stray write would.
        with open(data_file, "r+b") as f:
            f.seek(os.path.getsize(data_file) // 2)
            f.write(np.float32(0.5).tobytes() * 4)


@pytest.mark.parametrize("damage", ["truncate", "delete", "overwrite"])
def test_damaged_latest_checkpoint_is_moved_aside_and_falls_back(setup, tmp_path, caplog, damage):
    one_step = setup.train(setup.init(), setup.batches[:1])
    expected = _host_copy(one_step)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(one_step)
        checkpointer.save(setup.train(one_step, setup.batches[1:2]))
    _damage(_largest_file(tmp_path / "2" / "train_state" / "d"), damage)
    damaged = _listing(tmp_path / "2")

    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        restored = checkpointer.restore(setup.init(seed=3))
    _assert_bit_identical(restored, expected)
    [moved] = _set_aside(tmp_path, 2)
    assert _listing(moved) == damaged  # Renamed as it was, never deleted.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tmp_path / "2") in w and str(moved) in w for w in warnings), warnings


def test_a_checksum_that_does_not_match_is_damage(setup, tmp_path, caplog):
    train_state = setup.train(setup.init(), setup.batches[:1])
    _save_steps(tmp_path, [_at_step(train_state, 1), _at_step(train_state, 2)])
    item = tmp_path / "2" / "step" / "metadata"
    step_item = json.loads(item.read_text())
    name = next(iter(step_item["checksums"]))
    step_item["checksums"][name] ^= 1
    item.write_text(json.dumps(step_item))
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        assert int(checkpointer.restore(train_state).step[0]) == 1
    assert any(f"{name}: its bytes do not match" in r.getMessage() for r in caplog.records)


def test_non_finite_params_are_damage(setup, tmp_path, caplog):
    train_state = setup.init()
    nan_params = jax.tree.map(lambda x: x * np.nan, train_state.params)
    _save_steps(
        tmp_path, [_at_step(train_state, 1), _at_step(train_state, 2)._replace(params=nan_params)]
    )
    with Checkpointer(tmp_path) as checkpointer, caplog.at_level(logging.WARNING):
        assert int(checkpointer.restore(train_state).step[0]) == 1
    assert any("holds non-finite values" in r.getMessage() for r in caplog.records)


def test_a_damaged_final_step_is_saved_again(setup, tmp_path):
    train_state = setup.train(setup.init(), setup.batches[:1])
    _save_steps(tmp_path, [_at_step(train_state, 1), _at_step(train_state, 2)])
    _damage(_largest_file(tmp_path / "2" / "train_state" / "d"), "truncate")
    with Checkpointer(tmp_path) as checkpointer:
        assert int(checkpointer.restore(train_state).step[0]) == 1
        assert checkpointer.save(_at_step(train_state, 2))  # Its number is free again.
        checkpointer.wait_until_finished()
        assert int(checkpointer.restore(train_state).step[0]) == 2


def test_damaged_checkpoints_do_not_count_towards_max_to_keep(setup, tmp_path):
    train_state = setup.init()
    _save_steps(tmp_path, [_at_step(train_state, step) for step in (1, 2, 3)], max_to_keep=2)
    assert _step_dirs(tmp_path) == {"2", "3"}
    os.remove(tmp_path / "3" / "_CHECKPOINT_METADATA")  # Harmless: Orbax does not need it.
    manifest = tmp_path / "3" / "train_state" / "manifest.ocdbt"
    with open(manifest, "r+b") as f:
        f.truncate(10)

    with Checkpointer(tmp_path, max_to_keep=2) as checkpointer:
        restored = checkpointer.restore(train_state)
        assert int(restored.step[0]) == 2
        assert _step_dirs(tmp_path) == {"2"}  # 3 is set aside, still on disk.
        checkpointer.save(_at_step(restored, 3))
        checkpointer.save(_at_step(restored, 4))
        checkpointer.wait_until_finished()
        assert _step_dirs(tmp_path) == {"3", "4"}
        assert len(_set_aside(tmp_path, 3)) == 1  # Retention never deletes what was set aside.


def test_only_damaged_checkpoints_raise(setup, tmp_path):
    train_state = setup.init()
    _save_steps(tmp_path, [train_state])
    os.remove(_largest_file(tmp_path / "0" / "train_state" / "d"))
    with Checkpointer(tmp_path, read_only=True) as reader:
        with pytest.raises(ValueError, match="step 0 is damaged"):
            reader.restore(train_state, step=0)
        assert _step_dirs(tmp_path) == {"0"}  # A reader moves nothing.
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(RuntimeError, match="Every complete checkpoint .* is damaged"):
            checkpointer.restore(train_state)
    assert len(_set_aside(tmp_path, 0)) == 1


def test_milestones_and_the_best_step_are_kept_beside_the_newest(setup, tmp_path):
    train_state = setup.init()
    accuracy = {1: 0.5, 2: 0.9, 3: 0.6, 4: None, 5: 0.7, 6: 0.8}
    options = {"max_to_keep": 1, "keep_every_steps": 3, "keep_best_by": "accuracy"}
    with Checkpointer(tmp_path, **options) as checkpointer:
        for step, value in accuracy.items():
            metrics = None if value is None else {"accuracy": value, "loss": 1 - value}
            assert checkpointer.save(_at_step(train_state, step), metrics=metrics)
        checkpointer.wait_until_finished()
        assert checkpointer.best_step() == 2
    # The newest (6), the milestones (3, 6) and the best by accuracy (2).
    assert _step_dirs(tmp_path) == {"2", "3", "6"}
    # Read back from disk by a fresh Checkpointer: the best is still known, so a save
    # does not delete it.
    with Checkpointer(tmp_path, **options) as checkpointer:
        assert checkpointer.best_step() == 2
        checkpointer.save(_at_step(train_state, 7), metrics={"accuracy": 0.1})
        checkpointer.wait_until_finished()
    assert _step_dirs(tmp_path) == {"2", "3", "6", "7"}
    with Checkpointer(tmp_path, keep_best_by="loss", keep_best_mode="min") as checkpointer:
        assert checkpointer.best_step() == 2


# Mismatches and device counts.


def test_mismatches_name_the_first_path_and_change_nothing(setup, tmp_path):
    train_state = setup.init()
    _save_steps(tmp_path, [train_state])
    before = _listing(tmp_path)
    wider = _make_updater(32).init(0, setup.batches[0])
    no_momentum = train_state._replace(
        opt_state=hs.replicate(optax.sgd(0.1).init(hs.unreplicate(train_state.params)))
    )
    with Checkpointer(tmp_path) as checkpointer:
        expected = "params['mlp/batch_norm']['offset']: checkpoint (1, 16) vs model (1, 32)"
        with pytest.raises(ValueError, match=re.escape(expected)):
            checkpointer.restore(wider)
        expected = "opt_state[0]['trace']['mlp/batch_norm']['offset']: in the checkpoint"
        with pytest.raises(ValueError, match=re.escape(expected)):
            checkpointer.restore(no_momentum)
    assert _listing(tmp_path) == before


_RESTORE_ON_TWO_DEVICES = """
import sys

import jax
import numpy as np
import optax

import haiku_state as hs
from haiku_state import losses, models
from haiku_state.checkpoint import Checkpointer

assert jax.local_device_count() == 2
network = models.make_network("mlp", 10, cross_replica_axis="i", hidden_sizes=(16,))
updater = hs.Updater(network, optax.sgd(0.1, momentum=0.9), losses.classification_loss(10))
rng = np.random.RandomState(0)
batch = hs.shard(
    {
        "image": rng.randn(32, 8, 8, 1).astype(np.float32),
        "label": rng.randint(0, 10, size=32).astype(np.int32),
    }
)
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
    saved = _host_copy(train_state)
    _save_steps(tmp_path / "checkpoints", [train_state])
    script = tmp_path / "restore_on_two_devices.py"
    script.write_text(_RESTORE_ON_TWO_DEVICES)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
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


# Retention.


def test_max_to_keep_keeps_the_newest(setup, tmp_path):
    train_state = setup.init()
    _save_steps(tmp_path, [_at_step(train_state, step) for step in range(1, 6)], max_to_keep=2)
    assert _step_dirs(tmp_path) == {"4", "5"}
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [4, 5]
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path, max_to_keep=0)


def test_restores_a_checkpoint_written_on_other_hardware(setup, tmp_path):
    # Arrays are saved from host copies, so no saved sharding names a device: a
    # checkpoint written on a GPU restores on a CPU. Any sharding Orbax does record is
    # rewritten to name a device this process lacks, as if written on a GPU.
    train_state = setup.train(setup.init(), setup.batches[:1])
    expected = _host_copy(train_state)
    _save_steps(tmp_path, [train_state])
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
    _assert_bit_identical(restored, expected)
