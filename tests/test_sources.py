"""Tests of haiku_state.data.sources: the registry of datasets and `load_dataset`'s checks."""

import pytest

from haiku_state import data


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ValueError, match="digits.*cifar10.*synthetic.*imagefolder.*arrayrecord"):
        data.load_dataset("mnist")


def test_in_memory_sources_refuse_an_image_size_they_do_not_have():
    with pytest.raises(ValueError, match=r"digits images are 8x8 and are not resized"):
        data.load_dataset("digits", image_size=32)
    assert data.load_dataset("digits", image_size=8).image_shape == (8, 8, 1)


def test_the_dataset_names_are_the_registry_s_and_its_encoded_sources():
    assert data.DATASETS == tuple(data.SOURCES)
    assert data.ENCODED_DATASETS == ("imagefolder", "arrayrecord")
    assert all(isinstance(source, data.Source) for source in data.SOURCES.values())


def test_an_encoded_source_without_image_size_is_refused_before_anything_is_read(tmp_path):
    for name in data.ENCODED_DATASETS:
        with pytest.raises(ValueError, match=f"{name} needs data.image_size"):
            data.load_dataset(name, data_dir=str(tmp_path / "not there"))


def test_a_source_added_to_the_registry_loads_by_name_with_the_arguments_it_asks_for(monkeypatch):
    seen = []

    def load(args: data.SourceArgs) -> data.Dataset:
        seen.append(args)
        return data.load_dataset("synthetic", image_shape=(2, 2, 1), num_train=4, num_test=2)

    monkeypatch.setitem(data.SOURCES, "mine", data.Source(load, encoded=False))
    dataset = data.load_dataset("mine", data_dir="~/d", num_classes=3, seed=7)
    assert dataset.image_shape == (2, 2, 1)
    (args,) = seen
    assert args.data_dir.endswith("/d") and not args.data_dir.startswith("~")
    assert (args.num_classes, args.seed, args.image_size) == (3, 7, None)
    with pytest.raises(ValueError, match=r"synthetic images are 2x2 and are not resized"):
        data.load_dataset("mine", image_size=4)
