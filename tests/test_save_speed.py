"""Tests of how a step's arrays are written (haiku_state.checkpoint.step_format's handler of
numpy arrays): together, not one event-loop wait each, and into the same files as Orbax's own
handler writes, so that either's steps restore through the other."""

import json
import os

import jax
import orbax.checkpoint as ocp
import pytest
import tensorstore
from checkpoint_helpers import assert_bit_identical, host_copy, make_setup
from orbax.checkpoint._src.path import deleter as orbax_deleter  # Its parallel deleter.

from haiku_state.checkpoint import Checkpointer, step_format


@pytest.fixture(scope="module")
def setup():
    return make_setup()


@pytest.fixture(scope="module")
def train_state(setup):
    return setup.train(setup.init(), setup.batches[:1])


def _save(directory, train_state) -> None:
    """One step of `train_state`, written in this process by `step_format`'s manager."""
    manager = step_format.orbax_manager(directory, None, read_only=False)
    encoded = step_format.encode(train_state)
    manager.save(encoded.step, args=step_format.save_args(encoded, {}))
    manager.close()


def _save_with_orbax_handler(directory, train_state, monkeypatch) -> None:
    """The same step, its arrays written by Orbax's own `StandardCheckpointHandler`."""
    with monkeypatch.context() as patch:
        patch.setattr(step_format, "_train_state_handler", ocp.StandardCheckpointHandler)
        _save(directory, train_state)


def _stored(step_dir) -> dict:
    """Every key and value of a step's `train_state` OCDBT store, and its pytree metadata."""
    store = tensorstore.KvStore.open(
        {"driver": "ocdbt", "base": f"file://{step_dir / 'train_state'}/"}
    ).result()
    values = {key: store.read(key).result().value for key in store.list().result()}
    return {
        "values": values,
        "metadata": json.loads((step_dir / "train_state/_METADATA").read_text()),
    }


class _Watched:
    """A TensorStore open future that records how it is waited for."""

    def __init__(self, future, ways: list[str]):
        self._future, self._ways = future, ways

    def result(self, *args, **kwargs):
        self._ways.append("result")
        return self._future.result(*args, **kwargs)

    def __await__(self):
        self._ways.append("await")
        return self._future.__await__()


def test_a_save_waits_for_its_arrays_together_not_each_on_the_event_loop(
    train_state, tmp_path, monkeypatch
):
    # Orbax's NumpyHandler awaits each array's TensorStore on its asyncio loop: about 50
    # system calls an array, most of a save's cost per array (step_format._BatchedNumpyHandler).
    # Its writes are one transaction: one OCDBT commit, not one for each batch of writes.
    ways, transactions = [], []
    open_store = tensorstore.open

    def watched_open(*args, **kwargs):
        transactions.append(kwargs.get("transaction"))
        return _Watched(open_store(*args, **kwargs), ways)

    monkeypatch.setattr(tensorstore, "open", watched_open)
    _save(tmp_path, train_state)
    arrays = len(jax.tree.leaves(step_format.encode(train_state).trees))
    assert ways == ["result"] * arrays
    assert transactions[0] is not None and transactions == [transactions[0]] * arrays


def test_a_save_writes_the_files_orbax_own_handler_writes(train_state, tmp_path, monkeypatch):
    _save(tmp_path / "ours", train_state)
    _save_with_orbax_handler(tmp_path / "orbax", train_state, monkeypatch)
    step = str(int(step_format.encode(train_state).step))
    ours, orbax = _stored(tmp_path / "ours" / step), _stored(tmp_path / "orbax" / step)
    assert len(ours["values"]) == 2 * len(jax.tree.leaves(step_format.encode(train_state).trees))
    assert ours == orbax
    names = [
        json.loads((tmp_path / where / step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
        for where in ("ours", "orbax")
    ]
    assert names[0] == names[1]  # Any Orbax reader finds the handler it names.


def test_a_step_written_by_orbax_own_handler_restores_bit_identically(
    setup, train_state, tmp_path, monkeypatch
):
    # Steps of format 3 written before this handler are read as they were.
    expected = host_copy(train_state)
    _save_with_orbax_handler(tmp_path, train_state, monkeypatch)
    with Checkpointer(tmp_path, read_only=True) as checkpointer:
        restored = checkpointer.restore(setup.init(seed=1))
    assert_bit_identical(restored, expected)


def test_retention_deletes_a_step_in_the_saving_thread_not_by_orbax_parallel_deleter(
    setup, tmp_path, monkeypatch
):
    # Orbax deletes with a pool of threads where os.cpu_count() >= 4, and its scheduler
    # waits 0.1 s on an empty queue before it sees the work is done: 115 ms a save on a
    # 13-core TPU host, against about 4 ms for one rmtree (step_format.orbax_manager).
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    parallel = []
    monkeypatch.setattr(
        orbax_deleter._ParallelDirectoryDeleter, "delete", lambda self, path: parallel.append(path)
    )
    earlier, later = (setup.train(setup.init(), setup.batches[:n]) for n in (1, 2))
    with Checkpointer(tmp_path, max_to_keep=1, async_save=False) as checkpointer:
        checkpointer.save(earlier)
        checkpointer.save(later)
        assert checkpointer.all_steps() == [int(step_format.encode(later).step)]
    assert parallel == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(checkpointer.latest_step())]
