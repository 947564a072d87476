"""Tests of haiku_state.guards.workdir: one run per workdir, the config record and its check."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from image_trees import CLASSES, image_bytes, swap_keeping_times, write_imagefolder

from haiku_state import config as config_lib
from haiku_state import data
from haiku_state.guards import config_checks, data_identity
from haiku_state.guards import workdir as workdir_lib


def _config(**changes):
    config = ml_collections.ConfigDict(
        {
            "seed": 0,
            "steps": 100,
            "log_every": 10,
            "max_to_keep": 3,
            "backend": "pmap",
            "optimizer": {"name": "sgd", "learning_rate": 0.1, "schedule": "warmup_cosine"},
            "model": {"name": "mlp", "hidden_sizes": (32,)},
            "data": {"name": "digits", "workers": 0},
        }
    )
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


_HOLD_LOCK = """
import sys, time
from haiku_state.guards import workdir
with workdir.exclusive_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_run_is_refused_naming_the_live_one_and_a_dead_ones_lock_is_taken(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(workdir_lib.WorkdirError, match=rf"pid {holder.pid}\b.*one run per"):
            with workdir_lib.exclusive_lock(str(tmp_path)):
                pass
    finally:
        holder.kill()
        holder.wait()
    # Killed while holding it: the file still names it, but the kernel released the flock.
    assert f'"pid": {holder.pid}' in (tmp_path / "lock").read_text()
    with workdir_lib.exclusive_lock(str(tmp_path)):
        assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
    assert (tmp_path / "lock").read_text() == ""  # Released cleanly.


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(workdir_lib.WorkdirError, match="is a file"):
        workdir_lib.check_usable(str(tmp_path / "file"))
    workdir_lib.check_usable(str(tmp_path / "new" / "deeper"))  # Creatable: fine.


def test_a_checkpoints_folder_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "checkpoints").symlink_to("/proc/self")  # Not writable, even for root.
    with pytest.raises(workdir_lib.WorkdirError, match="checkpoints is not writable"):
        workdir_lib.check_usable(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_a_workdir_whose_checkpoint_paths_would_be_too_long_is_refused(tmp_path):
    with pytest.raises(workdir_lib.WorkdirError, match="the filesystem allows 255"):
        workdir_lib.check_usable(str(tmp_path / ("n" * 256)))
    deep = os.path.join(str(tmp_path), *["d" * 250] * 16)  # About 4000 characters.
    with pytest.raises(workdir_lib.WorkdirError, match="would pass the filesystem's limit"):
        workdir_lib.check_usable(deep)
    assert os.listdir(tmp_path) == []


def test_a_workdir_that_cannot_be_created_is_refused_naming_it():
    workdir = "/proc/self/haiku_state_test/w"  # Not writable, even for root.
    with pytest.raises(workdir_lib.WorkdirError, match=f"--workdir={workdir} cannot be written"):
        with workdir_lib.exclusive_lock(workdir):
            pass


def test_the_config_is_recorded_and_a_trajectory_change_refused_listing_the_keys(tmp_path):
    workdir = str(tmp_path)
    workdir_lib.record_config(workdir, _config(), allow_change=False)
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["config"]["model"]["hidden_sizes"] == [32] and recorded["changes"] == []
    # Cadence, retention and the backend change nothing that is computed.
    workdir_lib.record_config(
        workdir, _config(log_every=5, max_to_keep=1, backend="shard_map"), allow_change=False
    )
    changed = _config(**{"steps": 200, "optimizer.learning_rate": 0.2, "seed": 1})
    with pytest.raises(workdir_lib.WorkdirError) as refused:
        workdir_lib.record_config(workdir, changed, allow_change=False)
    message = str(refused.value)
    for expected in ("optimizer.learning_rate: 0.1 -> 0.2", "seed: 0 -> 1", "steps: 100 -> 200"):
        assert expected in message
    assert "--allow_config_change" in message
    assert json.loads((tmp_path / "config.json").read_text())["config"]["seed"] == 0
    workdir_lib.record_config(workdir, changed, allow_change=True)
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["config"]["seed"] == 1
    assert len(recorded["changes"]) == 1 and "seed: 0 -> 1" in recorded["changes"][0]["changes"]


def test_data_that_changed_size_since_the_record_is_refused_like_a_config_change(tmp_path):
    workdir, data = str(tmp_path), {"train_examples": 1000, "test_examples": 100, "num_classes": 10}
    workdir_lib.record_config(workdir, _config(), allow_change=False, data=data)
    workdir_lib.record_config(workdir, _config(), allow_change=False, data=data)
    grown = {**data, "train_examples": 1001}
    with pytest.raises(workdir_lib.WorkdirError, match=r"dataset.train_examples: 1000 -> 1001"):
        workdir_lib.record_config(workdir, _config(), allow_change=False, data=grown)
    workdir_lib.record_config(workdir, _config(), allow_change=True, data=grown)
    assert json.loads((tmp_path / "config.json").read_text())["data"] == grown


def test_the_record_holds_the_keys_the_run_reads_and_an_older_full_one_still_binds(tmp_path):
    workdir, path = str(tmp_path), tmp_path / "config.json"
    digits = config_lib.default_config("mlp")
    workdir_lib.record_config(workdir, digits, allow_change=False)
    recorded = config_lib.flatten(json.loads(path.read_text())["config"])
    synthetic_shape = ("data.image_shape", "data.num_classes", "data.num_train", "data.num_test")
    in_memory = ("data.dir", "data.workers", "data.decoder", "data.skip_corrupt")
    not_read = {*synthetic_shape, *in_memory, "data.max_corrupt_fraction", "data.verify"}
    not_read.add("model.network")  # A built-in network's config reads no network file.
    every_key = config_lib.flatten(workdir_lib._as_json(digits))
    assert recorded == {key: value for key, value in every_key.items() if key not in not_read}
    synthetic = config_lib.default_config("mlp")
    synthetic.data.name = "synthetic"
    os.makedirs(tmp_path / "synthetic")
    workdir_lib.record_config(str(tmp_path / "synthetic"), synthetic, allow_change=False)
    record = json.loads((tmp_path / "synthetic" / "config.json").read_text())
    recorded = config_lib.flatten(record["config"])
    assert all(name in recorded for name in synthetic_shape)
    # A record of an older version holds every key: it still binds what the run reads, and
    # the keys the run ignores may differ.
    older = workdir_lib._as_json(digits)
    older["data"]["num_classes"] = 100
    path.write_text(json.dumps({"config": older, "data": {}, "changes": []}))
    workdir_lib.record_config(workdir, digits, allow_change=False)
    assert "num_classes" not in json.loads(path.read_text())["config"]["data"]
    path.write_text(json.dumps({"config": older, "data": {}, "changes": []}))
    with pytest.raises(workdir_lib.WorkdirError, match=r"seed: 0 -> 1"):
        workdir_lib.record_config(workdir, _with(digits, seed=1), allow_change=False)


def _with(config, **changes):
    config = config.copy_and_resolve_references()
    config.update(changes)
    return config


def test_steps_may_change_when_the_schedule_does_not_depend_on_them(tmp_path):
    workdir = str(tmp_path)
    constant = {"optimizer.schedule": "constant"}
    workdir_lib.record_config(workdir, _config(**constant), allow_change=False)
    workdir_lib.record_config(workdir, _config(steps=400, **constant), allow_change=False)


def test_keys_the_code_added_since_the_record_are_not_compared(tmp_path):
    workdir = str(tmp_path)
    old = _config()
    del old["data"]["workers"]
    old["data"]["legacy"] = 1
    workdir_lib.record_config(workdir, old, allow_change=False)
    workdir_lib.record_config(workdir, _config(), allow_change=False)


def _another_value(key: config_lib.Key, value):
    """A value of `key` other than `value`."""
    if key.choices:
        return next(choice for choice in key.choices if choice != value)
    if value is None:
        return {int: 1, str: "x"}[key.type]
    return {
        int: lambda v: v + 1,
        float: lambda v: v / 2 + 0.25,
        bool: lambda v: not v,
        str: lambda v: v + "x",
        tuple: lambda v: (*v, 1),
    }[key.type](value)


@pytest.mark.parametrize("key", config_lib.SCHEMA, ids=lambda key: key.name)
def test_a_resumed_run_may_change_exactly_the_free_keys_and_those_it_ignores(tmp_path, key):
    workdir, model = str(tmp_path), (key.for_models or ("mlp",))[0]
    workdir_lib.record_config(workdir, config_lib.default_config(model), allow_change=False)
    changed = config_lib.default_config(model)
    *parents, leaf = key.name.split(".")
    node = changed
    for parent in parents:
        node = node[parent]
    node[leaf] = _another_value(key, node[leaf])
    # A key this combination never reads (data.num_classes of digits) may change too.
    ignored = any(
        line.startswith(f"config.{key.name}=") for line in config_checks.ignored_settings(changed)
    )
    if key.free or ignored:
        workdir_lib.record_config(workdir, changed, allow_change=False)
    else:
        with pytest.raises(workdir_lib.WorkdirError, match=rf"\b{key.name}: "):
            workdir_lib.record_config(workdir, changed, allow_change=False)


def test_a_workdir_that_is_a_dangling_symlink_or_a_loop_is_refused_naming_it(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(workdir_lib.WorkdirError, match=r"dangling is a dangling symlink \(to "):
        workdir_lib.check_usable(str(tmp_path / "dangling"))
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(workdir_lib.WorkdirError, match=r"loop is a symlink loop"):
        workdir_lib.check_usable(str(tmp_path / "loop"))
    with pytest.raises(workdir_lib.WorkdirError, match=r"run: .*dangling is a dangling symlink"):
        workdir_lib.check_usable(str(tmp_path / "dangling" / "run"))
    (tmp_path / "file").write_text("")
    with pytest.raises(workdir_lib.WorkdirError, match=r"run: .*file is a file, not a directory"):
        workdir_lib.check_usable(str(tmp_path / "file" / "run"))
    assert sorted(os.listdir(tmp_path)) == ["dangling", "file", "loop"]  # Nothing written.


def test_the_record_binds_only_a_run_that_has_a_checkpoint(tmp_path, caplog):
    workdir = str(tmp_path)
    workdir_lib.record_config(workdir, _config(seed=7), allow_change=False)
    # The run that wrote it died before its first checkpoint: a corrected config replaces it.
    with caplog.at_level("INFO"):
        record = workdir_lib.check_config(
            workdir, _config(), allow_change=False, has_checkpoint=False
        )
    assert "saved no checkpoint; it is replaced" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text())["config"]["seed"] == 7  # Not yet.
    record.write()
    assert json.loads((tmp_path / "config.json").read_text())["config"]["seed"] == 0
    # Checking writes nothing, allowed change or not: the run writes the record once resumed.
    before = (tmp_path / "config.json").read_text()
    workdir_lib.check_config(workdir, _config(seed=1), allow_change=True)
    assert (tmp_path / "config.json").read_text() == before


def test_without_a_readable_record_the_checkpoint_metadata_is_checked_against(tmp_path, caplog):
    workdir, path = str(tmp_path), tmp_path / "config.json"
    metadata = {"config": workdir_lib._as_json(_config()), "data": {"num_classes": 10}}
    check = functools.partial(
        workdir_lib.check_config, workdir, allow_change=False, checkpoint_metadata=metadata
    )
    for content in (None, "{}", '{"config": {"seed": 0}, "da'):  # Missing, not a record, cut.
        if content is not None:
            path.write_text(content)
        with pytest.raises(workdir_lib.WorkdirError, match=r"checkpoint's metadata.*seed: 0 -> 1"):
            check(_config(seed=1))
        with pytest.raises(workdir_lib.WorkdirError, match=r"num_classes: 10 -> 100"):
            check(_config(), data={"num_classes": 100})
        assert path.read_text() == content if content is not None else not path.exists()
    # Accepted: the unreadable file is set aside (never deleted) when the record is written.
    with caplog.at_level("WARNING"):
        check(_config(log_every=5)).write()
    assert "cannot be read" in caplog.text and "moved aside to" in caplog.text
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("config.json.unreadable-")]
    assert aside.read_text() == '{"config": {"seed": 0}, "da'
    assert json.loads(path.read_text())["config"]["log_every"] == 5


def test_data_identity_changes_name_the_class_and_older_records_compare_what_they_have(tmp_path):
    workdir = str(tmp_path)
    old_record = {"train_examples": 20, "test_examples": 8, "num_classes": 4}  # No identity yet.
    workdir_lib.record_config(workdir, _config(), allow_change=False, data=old_record)
    current = {**old_record, "classes": ["ant", "bee", "cat", "dog"], "train_digest": "a"}
    workdir_lib.record_config(workdir, _config(), allow_change=False, data=current)
    renamed = {**current, "classes": ["ant", "bee", "cow", "dog"], "train_digest": "b"}
    with pytest.raises(workdir_lib.WorkdirError) as refused:
        workdir_lib.record_config(workdir, _config(), allow_change=False, data=renamed)
    assert "class 2 was 'cat', now 'cow'" in str(refused.value)
    assert "the train examples differ" in str(refused.value)


def test_an_imagefolder_with_a_renamed_class_folder_is_other_data(tmp_path):
    tree = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    before = data_identity.identity(data.load_dataset("imagefolder", data_dir=tree, image_size=8))
    for split in ("train", "val"):
        os.rename(os.path.join(tree, split, CLASSES[0]), os.path.join(tree, split, "zz"))
    after = data_identity.identity(data.load_dataset("imagefolder", data_dir=tree, image_size=8))
    assert before["train_examples"] == after["train_examples"]  # Same sizes: counts alone pass.
    changes = data_identity.identity_changes(before, after)
    assert changes[0] == f"dataset.classes: class 0 was {CLASSES[0]!r}, now {CLASSES[1]!r}"
    assert any("the train examples differ" in change for change in changes)


def test_eval_takes_the_recorded_keys_but_its_own(tmp_path):
    recorded = workdir_lib._as_json(_config(steps=400, **{"model.hidden_sizes": (8, 8)}))
    given = _config(**{"data.workers": 3})
    config, changed = workdir_lib.with_recorded(given, recorded, keep=("data.workers",))
    assert config.steps == 400 and config.model.hidden_sizes == (8, 8)
    assert config.data.workers == 3 and given.steps == 100
    assert changed == ["model.hidden_sizes: [32] -> [8, 8]", "steps: 100 -> 400"]


def _imagefolder(tree):
    """The config and data record of a run on the ImageFolder `tree`."""
    config = _config(**{"data.name": "imagefolder"})
    config.data.dir = str(tree)
    return config, data_identity.identity(
        data.load_dataset("imagefolder", data_dir=tree, image_size=8)
    )


def test_an_image_overwritten_under_its_name_is_other_data(tmp_path):
    tree = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    config, before = _imagefolder(tree)
    workdir_lib.record_config(workdir, config, allow_change=False, data=before)
    # Another picture of the same size (padded, as JPEG decoders allow) under the same name.
    victim = os.path.join(
        tree, "train", CLASSES[1], sorted(os.listdir(os.path.join(tree, "train", CLASSES[1])))[-1]
    )
    size = os.path.getsize(victim)
    other = image_bytes(np.random.default_rng(9), 16, 16, "JPEG")
    assert len(other) < size
    with open(victim, "wb") as f:
        f.write(other + bytes(size - len(other)))
    config, after = _imagefolder(tree)
    assert after["train_digest"] == before["train_digest"]  # The same names: the index passes.
    with pytest.raises(
        workdir_lib.WorkdirError,
        match="dataset.train_content: the content of the train examples differs",
    ):
        workdir_lib.record_config(workdir, config, allow_change=False, data=after)


def test_two_images_of_one_size_swapped_with_their_times_pass_unless_content_is_verified(
    tmp_path, caplog
):
    tree = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    folder = os.path.join(tree, "train", CLASSES[0])
    first, second = (os.path.join(folder, name) for name in sorted(os.listdir(folder))[:2])
    images = [image_bytes(np.random.default_rng(seed), 24, 24, "PNG") for seed in (1, 2)]
    size = max(map(len, images))
    for path, image in zip((first, second), images, strict=True):
        with open(path, "wb") as f:
            f.write(image + bytes(size - len(image)))  # One size, as PNG decoders allow.

    def loaded():
        return data.load_dataset("imagefolder", data_dir=tree, image_size=8)

    stat_record = data_identity.identity(loaded())
    content_record = data_identity.identity(loaded(), content=True)
    assert stat_record["train_bytes"] is None and content_record["train_bytes"]
    swap_keeping_times(first, second)
    # The known blind spot: sizes and times are those recorded.
    assert data_identity.identity_changes(stat_record, data_identity.identity(loaded())) == []
    swapped = data_identity.identity(loaded(), content=True)
    assert data_identity.identity_changes(content_record, swapped) == [
        f"dataset.train_bytes: the bytes of the train images differ (data.verify=content: an "
        f"image rewritten with its size and time kept, or two swapped): "
        f"{content_record['train_bytes']} -> {swapped['train_bytes']}"
    ]
    # A run recorded without the bytes and resumed with them says what it could not compare.
    assert data_identity.unchecked_keys(stat_record, swapped) == ["test_bytes", "train_bytes"]


def test_the_same_data_moved_resumes_and_other_data_is_still_refused(tmp_path, caplog):
    tree = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    config, recorded = _imagefolder(tree)
    workdir_lib.record_config(workdir, config, allow_change=False, data=recorded)
    moved = str(tmp_path / "elsewhere")
    os.rename(tree, moved)
    with caplog.at_level(logging.INFO):
        config, identity = _imagefolder(moved)
        workdir_lib.record_config(workdir, config, allow_change=False, data=identity)
    assert f"The data moved: data.dir was {tree!r}, now {moved!r}" in caplog.text
    assert (
        json.loads((tmp_path / "run" / "config.json").read_text())["config"]["data"]["dir"] == moved
    )
    # Other data in another folder: the folder's change is refused with the data's.
    other = write_imagefolder(tmp_path / "other", per_class=(2, 1), seed=1)
    config, identity = _imagefolder(other)
    with pytest.raises(workdir_lib.WorkdirError) as refused:
        workdir_lib.record_config(workdir, config, allow_change=False, data=identity)
    assert f"data.dir: {moved!r} -> {other!r}" in str(refused.value)
    assert "dataset.train_content" in str(refused.value)


def test_a_new_run_in_another_runs_workdir_is_refused_in_a_short_line(tmp_path, caplog):
    # The README's own-photos recipe in the workdir of `make train EXP=mlp`: digits, then
    # an ImageFolder: every key of the data differs, and a content digest only one knows.
    digits = {"train_examples": 1437, "test_examples": 360, "num_classes": 10, "classes": None,
              "mean": [4.878142397355602], "std": [6.013962657438725], "train_digest": "a" * 32,
              "test_digest": "b" * 32, "train_content": None, "test_content": None}  # fmt: skip
    photos = {"train_examples": 36, "test_examples": 12, "num_classes": 3,
              "classes": ["cat", "dog", "eel"], "mean": [125.78, 124.947, 127.129],
              "std": [46.163, 46.415, 45.325], "train_digest": "c" * 32, "test_digest": "d" * 32,
              "train_content": "e" * 32, "test_content": "f" * 32}  # fmt: skip
    workdir, config = str(tmp_path), config_lib.default_config("mlp")
    workdir_lib.record_config(workdir, config, allow_change=False, data=digits)
    changed = {"data.name": "imagefolder", "data.dir": "~/photos", "data.image_size": 32,
               "batch_size": 36}  # fmt: skip
    for key, value in changed.items():
        parent, leaf = key.rsplit(".", 1) if "." in key else ("", key)
        (config_lib.value_of(config, parent) if parent else config)[leaf] = value
    with caplog.at_level(logging.WARNING), pytest.raises(workdir_lib.WorkdirError) as refused:
        workdir_lib.record_config(workdir, config, allow_change=False, data=photos)
    message = str(refused.value)
    assert len(message.replace(workdir, "W")) < 450, message  # It was over 1,000.
    assert message.startswith(
        f"The config or data differs from what {workdir} was trained with (as its config.json "
        "records it): batch_size: 128 -> 36; data.image_size: None -> 32; data.name: 'digits' "
        "-> 'imagefolder'; "
    ), message
    # data.dir is no key of a run on the digits: not recorded, so not a change.
    for key in [*changed, *(f"dataset.{key}" for key in photos if "content" not in key)]:
        assert (key in message) == (key != "data.dir"), key
    assert message.endswith("Use another --workdir, or --allow_config_change to continue that "
                            "run anyway.")  # fmt: skip
    assert "records no" not in caplog.text  # Not "written by an older version": other data.


def test_a_record_without_the_newer_keys_says_what_it_does_not_check(tmp_path, caplog):
    tree = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    config, current = _imagefolder(tree)
    older = {
        k: v
        for k, v in current.items()
        if k not in ("mean", "std", "train_content", "test_content")
    }
    workdir = str(tmp_path)
    workdir_lib.record_config(workdir, config, allow_change=False, data=older)
    with caplog.at_level(logging.WARNING):
        workdir_lib.record_config(workdir, config, allow_change=False, data=current)
    assert (
        "records no dataset.mean, dataset.std, dataset.test_content, dataset.train_content of "
        "the data" in caplog.text
    )


def test_keys_unknown_on_both_sides_are_not_named_as_unchecked():
    recorded = {"train_examples": 10, "train_content": None}
    current = {"train_examples": 10, "train_content": None, "test_content": None, "mean": [1.0]}
    assert data_identity.unchecked_keys(recorded, current) == ["mean"]
    assert data_identity.unchecked_keys({**recorded, "train_content": "a"}, current) == [
        "mean",
        "train_content",
    ]


def test_a_resume_without_content_verification_keeps_the_recorded_bytes_digests(tmp_path, caplog):
    workdir, config = str(tmp_path), _config()
    identity = {"train_digest": "a", "test_digest": "b", "train_bytes": "c", "test_bytes": "d"}
    workdir_lib.record_config(workdir, config, allow_change=False, data=identity)  # content
    unread = {**identity, "train_bytes": None, "test_bytes": None}  # data.verify=stat
    with caplog.at_level(logging.WARNING):
        workdir_lib.record_config(workdir, config, allow_change=False, data=unread)
    assert "records no" not in caplog.text  # It does record them.
    assert json.loads((tmp_path / "config.json").read_text())["data"] == identity
    # A later data.verify=content resume on swapped images is still refused.
    with pytest.raises(workdir_lib.WorkdirError, match=r"dataset.train_bytes: the bytes"):
        workdir_lib.record_config(
            workdir, config, allow_change=False, data={**identity, "train_bytes": "x"}
        )


def test_a_digits_run_has_no_data_dir_whether_it_is_none_or_empty(tmp_path, caplog):
    workdir, config = str(tmp_path), config_lib.default_config("mlp")  # data.dir="".
    identity = {"train_digest": "a", "test_digest": "b"}
    workdir_lib.record_config(workdir, config, allow_change=False, data=identity)
    assert "dir" not in json.loads((tmp_path / "config.json").read_text())["config"]["data"]
    with caplog.at_level(logging.INFO):
        workdir_lib.record_config(workdir, config, allow_change=False, data=identity)
    assert "The data moved" not in caplog.text


def test_the_run_record_is_config_json_and_the_checkpoint_metadata_for_what_it_lacks(tmp_path):
    workdir, path = str(tmp_path), tmp_path / "config.json"
    metadata = {"config": {"seed": 1, "keep_best_mode": "max"}, "data": {"num_classes": 10}}
    record = workdir_lib.run_record(workdir, metadata)  # No config.json.
    assert (record.config, record.data, record.source) == (
        {"seed": 1, "keep_best_mode": ""},  # The old default, that kept no best step.
        {"num_classes": 10},
        "the checkpoint's metadata",
    )
    path.write_text(
        json.dumps({"config": {"seed": 2, "keep_best_by": "loss", "keep_best_mode": "min"}})
    )
    record = workdir_lib.run_record(workdir, metadata)  # An older config.json: no data.
    assert (record.config["seed"], record.data, record.source) == (
        2,
        {"num_classes": 10},
        str(path),
    )
    assert record.config["keep_best_mode"] == "min"
    assert workdir_lib.run_record(workdir).data == {}
