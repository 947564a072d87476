"""Tests of haiku_state.prepare and haiku_state.data.arrayrecord: shards of the same examples."""

import io
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from image_trees import write_cifar10_batch, write_imagefolder
from PIL import Image

from haiku_state import data, prepare
from haiku_state.data import arrayrecord, pipeline, preprocess
from haiku_state.guards import data_identity
from haiku_state.guards import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_SIZE = 16
# The usual ImageNet constants, which prepare recorded for any ImageFolder until it measured.
IMAGENET_MEAN = (123.675, 116.28, 103.53)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("tree"), per_class=(7, 3))


@pytest.fixture(scope="module")
def prepared(tree, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shards"))
    prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=8)
    return out


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _batches(iterator):
    return [{name: np.array(leaf) for name, leaf in batch.items()} for batch in iterator]


def test_the_shards_hold_every_example_in_the_order_of_the_tree(tree, prepared):
    with open(os.path.join(prepared, arrayrecord.DATASET_FILE)) as f:
        metadata = json.load(f)
    assert metadata["num_classes"] == 3 and metadata["classes"] == ["cat", "dog", "eel"]
    train_shards = metadata["splits"]["train"]["shards"]
    assert [s["num_examples"] for s in train_shards] == [8, 8, 5]
    assert train_shards[0]["file"] == "train-00000-of-00003.array_record"
    folder = data.load_dataset("imagefolder", data_dir=tree, image_size=IMAGE_SIZE)
    shards = data.load_dataset("arrayrecord", data_dir=prepared, image_size=IMAGE_SIZE)
    assert (shards.num_classes, shards.mean, shards.std) == (3, folder.mean, folder.std)
    # The run's record identifies the shards: class names, and their names and sizes.
    identity = data_identity.identity(shards)
    assert identity["classes"] == ["cat", "dog", "eel"] and identity["train_digest"]
    assert identity["train_digest"] != identity["test_digest"]
    for split in ("train", "test"):
        a, b = getattr(folder, split).records, getattr(shards, split).records
        assert len(a) == len(b)
        for i in range(len(a)):
            assert a[i] == b[i]
            assert b.describe(i).endswith(f"({a.name(i)})")


def test_an_imagefolder_and_its_shards_give_identical_batches(tree, prepared):
    folder = data.load_dataset("imagefolder", data_dir=tree, image_size=IMAGE_SIZE)
    shards = data.load_dataset("arrayrecord", data_dir=prepared, image_size=IMAGE_SIZE)

    def train(dataset):
        return _batches(
            pipeline.encoded_train_batches(dataset.train, 6, seed=5, num_steps=5, workers=0)
        )

    def evaluate(dataset):
        return _batches(pipeline.encoded_eval_batches(dataset.test, 4, workers=0))

    expected_batches = train(folder) + evaluate(folder)
    for expected, got in zip(expected_batches, train(shards) + evaluate(shards), strict=True):
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_an_interrupted_conversion_resumes_writing_only_the_missing_shards(
    tree, tmp_path, monkeypatch
):
    out = str(tmp_path / "out")
    prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=8)
    complete = {name: _read(os.path.join(out, name)) for name in os.listdir(out)}
    # As if killed while writing the last training shard: it is a temporary file, and the
    # conversion never got to dataset.json.
    last = arrayrecord.shard_name("train", 2, 3)
    os.rename(os.path.join(out, last), os.path.join(out, f"{last}.incomplete"))
    os.remove(os.path.join(out, arrayrecord.DATASET_FILE))
    with pytest.raises(data.MissingDataError, match="did not finish"):
        data.load_dataset("arrayrecord", data_dir=out, image_size=IMAGE_SIZE)
    written = []
    write_shard = arrayrecord.write_shard
    monkeypatch.setattr(
        arrayrecord,
        "write_shard",
        lambda path, records: written.append(path) or write_shard(path, records),
    )
    prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=8)
    assert written == [os.path.join(out, last)]
    for name, content in complete.items():
        if name != arrayrecord.DATASET_FILE:
            assert _read(os.path.join(out, name)) == content, name
    # The same record, but for the time the last shard was written.
    with open(os.path.join(out, arrayrecord.DATASET_FILE)) as f:
        assert _without_times(json.load(f)) == _without_times(
            json.loads(complete[arrayrecord.DATASET_FILE])
        )


def _without_times(metadata):
    for split in metadata["splits"].values():
        for shard in split["shards"]:
            del shard["mtime_ns"]
    return metadata


def test_resuming_a_conversion_of_another_source_is_refused(tree, tmp_path):
    out = str(tmp_path / "out")
    prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=8)
    with pytest.raises(data.DataError, match="examples_per_shard differ"):
        prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=4)
    with pytest.raises(data.DataError, match="num_examples, source differ"):
        prepare.convert("digits", out, examples_per_shard=8)


def test_the_same_folder_named_another_way_resumes_the_conversion(tree, tmp_path):
    out = str(tmp_path / "out")
    prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=8)
    other_name = os.path.relpath(str(tree)) + os.sep
    prepare.convert(f"imagefolder:{other_name}", out, examples_per_shard=8)  # Not refused.


def test_a_file_name_that_is_not_utf8_converts_and_keeps_its_bytes(tmp_path):
    root = write_imagefolder(tmp_path / "tree", per_class=(2, 1))
    class_dir = os.path.join(root, "train", sorted(os.listdir(os.path.join(root, "train")))[0])
    first = next(name for name in sorted(os.listdir(class_dir)) if name.endswith("JPEG"))
    odd = os.fsdecode(b"caf\xe9" + os.fsencode(os.path.splitext(first)[1]))
    os.rename(os.path.join(class_dir, first), os.path.join(class_dir, odd))
    out = str(tmp_path / "shards")
    prepare.convert(f"imagefolder:{root}", out, examples_per_shard=8)
    split = data.load_dataset("arrayrecord", data_dir=out, image_size=IMAGE_SIZE).train
    descriptions = [split.records.describe(i) for i in range(len(split.records))]
    assert sum("caf" in description for description in descriptions) == 1


def test_digits_and_cifar10_convert_to_pngs_of_the_same_pixels(tmp_path):
    out = str(tmp_path / "digits")
    prepare.convert("digits", out, examples_per_shard=500)
    digits = data.load_dataset("digits")
    shards = data.load_dataset("arrayrecord", data_dir=out, image_size=8)
    assert data.num_examples(shards.train) == len(digits.train.labels)
    assert shards.mean == digits.mean
    image, label = shards.train.records[5]
    np.testing.assert_array_equal(preprocess.eval_image(image, 8)[..., 0].shape, (8, 8))
    assert label == digits.train.labels[5]

    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
        write_cifar10_batch(cifar / name, images, [1, 9], b"x")
    prepare.convert(f"cifar10:{cifar}", str(tmp_path / "c10"))
    shards = data.load_dataset("arrayrecord", data_dir=str(tmp_path / "c10"), image_size=32)
    source = data.load_dataset("cifar10", data_dir=str(cifar))
    image, label = shards.test.records[1]
    np.testing.assert_array_equal(
        preprocess.decode_crop(image, lambda w, h: (0, 0, w, h), 32), source.test.images[1]
    )
    assert label == 9


def test_a_record_with_a_label_outside_the_classes_is_refused_naming_it(tree, tmp_path):
    out = str(tmp_path / "out")
    prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=100)
    image, _ = data.load_dataset("imagefolder", data_dir=tree, image_size=IMAGE_SIZE).test.records[
        0
    ]
    name = arrayrecord.shard_name("val", 0, 1)
    records = [
        arrayrecord.encode_example(image, label, f"val/x/{i}") for i, label in enumerate([0, 7])
    ]
    arrayrecord.write_shard(os.path.join(out, name), records)
    path = os.path.join(out, arrayrecord.DATASET_FILE)
    with open(path) as f:
        metadata = json.load(f)
    metadata["splits"]["val"] = {"num_examples": 2, "shards": [{"file": name, "num_examples": 2}]}
    with open(path, "w") as f:
        json.dump(metadata, f)
    split = data.load_dataset("arrayrecord", data_dir=out, image_size=IMAGE_SIZE).test
    with pytest.raises(
        data.DataError, match=rf"record 1 of {out}/{name} \(val/x/1\): label 7 outside \[0, 3\)"
    ):
        list(pipeline.encoded_eval_batches(split, 2, workers=0))


def test_the_command_line_names_a_bad_source_in_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "haiku_state.prepare",
            f"--from=imagefolder:{tmp_path}/none",
            f"--to={tmp_path}/out",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: ImageFolder data.dir")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "threads, to_a_file, message",
    [
        (0, False, "error: --threads=0 must be positive: the files read at once."),
        (16, True, "error: --to={file} is a file; expected a folder (made if missing)."),
    ],
)
def test_a_bad_argument_is_one_line_before_anything_is_written(
    tree, tmp_path, threads, to_a_file, message
):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"mine")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        prepare.run(f"imagefolder:{tree}", str(a_file if to_a_file else out), threads=threads)
    assert exit_.value.code == message.format(file=a_file)
    assert not out.exists() and a_file.read_bytes() == b"mine"


def test_short_side_re_encodes_larger_images_and_keeps_the_rest(tree, tmp_path):
    out = str(tmp_path / "short")
    metadata = prepare.convert(f"imagefolder:{tree}", out, examples_per_shard=8, short_side=40)
    assert metadata["short_side"] == 40
    folder = data.load_dataset("imagefolder", data_dir=tree, image_size=IMAGE_SIZE)
    shards = data.load_dataset("arrayrecord", data_dir=out, image_size=IMAGE_SIZE)
    assert shards.short_side == 40 and folder.short_side is None
    resized = 0
    for i in range(len(folder.train.records)):
        original, label = folder.train.records[i]
        stored, stored_label = shards.train.records[i]
        assert stored_label == label
        width, height = preprocess.encoded_size(original)
        if min(width, height) <= 40:
            assert stored == original
            continue
        resized += 1
        scale = 40 / min(width, height)
        size = (round(width * scale), round(height * scale))
        assert preprocess.encoded_size(stored) == size
        assert stored[:4] == original[:4] or original[:3] == b"\xff\xd8\xff"  # PNG stays PNG.
        # The same picture, smaller: close to the original resized by PIL.
        with Image.open(io.BytesIO(original)) as image:
            expected = np.asarray(image.convert("RGB").resize(size, Image.Resampling.BICUBIC))
        with Image.open(io.BytesIO(stored)) as image:
            assert np.abs(np.asarray(image.convert("RGB"), float) - expected).mean() < 6
    assert resized >= 5


def test_short_side_keeps_an_unreadable_file_as_it_is():
    assert prepare.shorten(b"not an image", 16) == b"not an image"
    with pytest.raises(ValueError, match="--short_side=0 must be positive"):
        prepare.convert("digits", "/nonexistent/never-written", short_side=0)


def test_a_rerun_with_another_short_side_is_refused(tree, prepared):
    with pytest.raises(data.DataError, match="short_side differ"):
        prepare.convert(f"imagefolder:{tree}", prepared, examples_per_shard=8, short_side=32)


def test_a_run_does_not_resume_on_shards_of_another_short_side(prepared, tmp_path):
    short = str(tmp_path / "short")
    prepare.convert("digits", short, examples_per_shard=500, short_side=4)
    full = str(tmp_path / "full")
    prepare.convert("digits", full, examples_per_shard=500)
    records = {
        out: data_identity.identity(data.load_dataset("arrayrecord", data_dir=out, image_size=8))
        for out in (full, short)
    }
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    workdir_lib.record_config(workdir, {"seed": 0}, allow_change=False, data=records[full])
    with pytest.raises(workdir_lib.WorkdirError, match="dataset.short_side: None -> 4"):
        workdir_lib.record_config(workdir, {"seed": 0}, allow_change=False, data=records[short])


def test_ctrl_c_leaves_no_partial_shard_and_exits_130_in_one_line(
    tree, tmp_path, capsys, monkeypatch
):
    def interrupted():
        yield arrayrecord.encode_example(b"\x00", 0, "a.png")
        raise KeyboardInterrupt

    shard = str(tmp_path / "train-00000-of-00001.array_record")
    with pytest.raises(KeyboardInterrupt):
        arrayrecord.write_shard(shard, interrupted())
    assert os.listdir(tmp_path) == []  # Neither the shard nor its temporary file.

    def convert(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "convert", convert)
    with pytest.raises(SystemExit) as exit_:
        prepare.run(f"imagefolder:{tree}", f"{tmp_path}/out")
    assert exit_.value.code == 130
    assert capsys.readouterr().err.strip().startswith("Interrupted: the complete shards in")


def test_help_lists_the_sources_and_says_what_every_flag_means():
    result = subprocess.run(
        [sys.executable, "-m", "haiku_state.prepare", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Try --helpfull" in result.stdout, result.stderr[-2000:]  # absl's help exits 1.
    for source in ("imagefolder:DIR", "cifar10:DIR", "digits"):
        assert source in result.stdout
    for flag, meaning in [
        ("--from", "What to convert"),
        ("--to", "The output folder"),
        ("--examples_per_shard", "Examples per shard file"),
        ("--threads", "Files read"),
        ("--short_side", "Re-encode every image"),
    ]:
        assert f"{flag}: {meaning}" in result.stdout, flag
    assert "mean and\nstd" in result.stdout and "1,000 training images" in result.stdout


def _copy(prepared, to, *, keep_times=True):
    shutil.copytree(prepared, to, copy_function=shutil.copy2 if keep_times else shutil.copy)
    return str(to)


def test_dataset_json_records_the_datas_own_statistics_which_training_uses(
    tree, prepared, tmp_path
):
    with open(os.path.join(prepared, arrayrecord.DATASET_FILE)) as f:
        metadata = json.load(f)
    train = data.load_dataset("imagefolder", data_dir=tree, image_size=IMAGE_SIZE).train.records
    sample = preprocess.statistics_sample(len(train))
    mean, std = preprocess.pixel_statistics(train[i][0] for i in sample)
    assert (metadata["mean"], metadata["std"]) == (list(mean), list(std))
    assert not np.allclose(mean, IMAGENET_MEAN, atol=5)  # Not ImageNet's: these images'.
    # Training standardises with what dataset.json records, whatever it records.
    copy = _copy(prepared, tmp_path / "copy")
    metadata["mean"], metadata["std"] = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
    with open(os.path.join(copy, arrayrecord.DATASET_FILE), "w") as f:
        json.dump(metadata, f)
    shards = data.load_dataset("arrayrecord", data_dir=copy, image_size=IMAGE_SIZE)
    assert (shards.mean, shards.std) == ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))


@pytest.mark.parametrize("replacement", ["a byte changed", "another conversion"])
def test_a_replaced_shard_is_refused_naming_it(tree, prepared, tmp_path, replacement):
    copy = _copy(prepared, tmp_path / "copy")
    shard = os.path.join(copy, arrayrecord.shard_name("train", 1, 3))
    if replacement == "a byte changed":
        content = bytearray(_read(shard))
        content[len(content) // 2] ^= 0xFF
    else:
        other_tree = write_imagefolder(tmp_path / "other", per_class=(7, 3), seed=1)
        other = str(tmp_path / "other shards")
        prepare.convert(f"imagefolder:{other_tree}", other, examples_per_shard=8)
        content = _read(os.path.join(other, os.path.basename(shard)))
    assert len(content) == os.path.getsize(shard)  # Names, counts and sizes all match.
    with open(shard, "wb") as f:
        f.write(content)
    with pytest.raises(data.DataError, match=rf"{shard} is not the shard .* its SHA-256 differs"):
        data.load_dataset("arrayrecord", data_dir=copy, image_size=IMAGE_SIZE)


def test_a_copy_without_its_times_is_read_once_and_then_recognised(prepared, tmp_path, monkeypatch):
    copy = _copy(prepared, tmp_path / "copy", keep_times=False)
    read = []
    file_sha256 = data_identity.file_sha256
    monkeypatch.setattr(data_identity, "file_sha256", lambda p: read.append(p) or file_sha256(p))
    first = data_identity.identity(
        data.load_dataset("arrayrecord", data_dir=copy, image_size=IMAGE_SIZE)
    )
    assert len(read) == 5  # Every shard: 3 train, 2 val.
    second = data_identity.identity(
        data.load_dataset("arrayrecord", data_dir=copy, image_size=IMAGE_SIZE)
    )
    original = data_identity.identity(
        data.load_dataset("arrayrecord", data_dir=prepared, image_size=IMAGE_SIZE)
    )
    assert len(read) == 5 and first == second == original


def test_shards_of_an_older_prepare_load_with_a_warning_naming_what_is_not_checked(
    prepared, tmp_path, caplog
):
    copy = _copy(prepared, tmp_path / "copy")
    path = os.path.join(copy, arrayrecord.DATASET_FILE)
    with open(path) as f:
        metadata = json.load(f)
    for split in metadata["splits"].values():
        split["shards"] = [
            {"file": s["file"], "num_examples": s["num_examples"]} for s in split["shards"]
        ]
    with open(path, "w") as f:
        json.dump(metadata, f)
    with caplog.at_level(logging.WARNING):
        shards = data.load_dataset("arrayrecord", data_dir=copy, image_size=IMAGE_SIZE)
    assert f"{path} records no SHA-256 of 5 shard(s)" in caplog.text
    assert "checked by name, record count and size only" in caplog.text
    assert data_identity.identity(shards)["train_content"] is None
