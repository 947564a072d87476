"""Tests of haiku_state.data.gpu_decode: everything around nvJPEG, which needs a GPU.

The workers' requests (bytes, boxes, flips, the pixels the device does not
decode), their order for any worker count, the device half with a host region
decoder standing in for nvImageCodec (canvas geometry, resize, flips, sharding,
what happens to an image the device refuses), and the refusal of
`config.data.decoder="gpu"` on a machine without a GPU. nvImageCodec itself
runs in `benchmarks/gpu_decode_check.py`, on a GPU host; the last test runs it
where the package is installed.
"""

import importlib.util
import io
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from configs import mlp_config
from image_trees import image_bytes, write_imagefolder
from PIL import Image

from haiku_state import data, train
from haiku_state.data import gpu_decode, order, pipeline, preprocess
from haiku_state.guards import config_checks
from haiku_state.guards import workdir as workdir_lib
from haiku_state.replication import DEFAULT_AXIS_NAME

IMAGE_SIZE = 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = write_imagefolder(tmp_path_factory.mktemp("tree"), per_class=(6, 2))
    return data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).train


def _plain(batch):
    return {name: np.array(leaf) for name, leaf in batch.items()}


def _gpu_batches(split, steps=3, **kwargs):
    kwargs.setdefault("workers", 0)
    batches = pipeline.encoded_train_batches(
        split, 8, seed=3, num_steps=steps, decoder="gpu", **kwargs
    )
    return [_plain(b) for b in batches]


def test_a_jpeg_request_carries_its_bytes_and_the_box_and_flip_the_cpu_decoder_draws():
    jpeg = image_bytes(np.random.default_rng(0), 120, 90, "JPEG")
    for seed in range(6):
        request = gpu_decode.train_request(jpeg, np.random.default_rng([1, seed]), IMAGE_SIZE)
        plan = preprocess.train_plan(120, 90, np.random.default_rng([1, seed]))
        assert request["encoded"].item() == jpeg
        np.testing.assert_array_equal(request["box"], np.float32(plan.box))
        assert bool(request["flip"]) == plan.flip
        assert not request["image"].any()
        # The CPU decoder crops and mirrors exactly that plan.
        np.testing.assert_array_equal(
            preprocess.train_image(jpeg, np.random.default_rng([1, seed]), IMAGE_SIZE),
            preprocess.decode_crop(jpeg, lambda w, h, plan=plan: plan.box, IMAGE_SIZE, plan.flip),
        )


@pytest.mark.parametrize(
    "kind", ["png", "cmyk-jpeg", "jpeg-without-end-marker"], ids=lambda kind: kind
)
def test_what_the_device_does_not_decode_is_decoded_in_the_worker_as_the_cpu_decoder_does(kind):
    rng = np.random.default_rng(1)
    encoded = {
        "png": image_bytes(rng, 70, 50, "PNG", "RGBA"),
        "cmyk-jpeg": image_bytes(rng, 70, 50, "JPEG", "CMYK"),
        "jpeg-without-end-marker": image_bytes(rng, 70, 50, "JPEG") + b"\x00\x00",
    }[kind]
    assert not gpu_decode.device_decodes(encoded)
    request = gpu_decode.train_request(encoded, np.random.default_rng(5), IMAGE_SIZE)
    assert request["encoded"].item() == b""
    expected = preprocess.train_image(encoded, np.random.default_rng(5), IMAGE_SIZE)
    np.testing.assert_array_equal(request["image"], expected)


def test_gpu_batches_hold_the_cpu_decoders_examples_boxes_and_flips_for_any_worker_count(split):
    runs = {workers: _gpu_batches(split, workers=workers) for workers in (0, 2)}
    cpu = [
        _plain(b) for b in pipeline.encoded_train_batches(split, 8, seed=3, num_steps=3, workers=0)
    ]
    split_order = order.batch_order(len(split.records), 8, 3)
    for step, batch in enumerate(runs[0]):
        assert set(batch) == {"encoded", "box", "flip", "image", "slot", "label"}
        np.testing.assert_array_equal(batch["label"], cpu[step]["label"])
        indices = order.step_indices(split_order, step)
        np.testing.assert_array_equal(batch["slot"][:, 0], step)
        np.testing.assert_array_equal(batch["slot"][:, 1], np.arange(8))
        np.testing.assert_array_equal(batch["slot"][:, 2], indices)
        for position, index in enumerate(indices):
            encoded = split.records[index][0]
            seed = order.example_seed(3, step, position)
            plan = preprocess.train_plan(
                *preprocess.encoded_size(encoded), np.random.default_rng(seed)
            )
            np.testing.assert_array_equal(batch["box"][position], np.float32(plan.box))
            assert batch["flip"][position] == plan.flip
            on_device = gpu_decode.device_decodes(encoded)
            assert batch["encoded"][position] == (encoded if on_device else b"")
            if not on_device:  # Pixels of the CPU decoder, decoded in the worker.
                np.testing.assert_array_equal(
                    batch["image"][position], cpu[step]["image"][position]
                )
    for got, want in zip(runs[2], runs[0], strict=True):  # Bytes through the workers too.
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _region_from_pil(encoded, regions, device):
    """A host stand-in for nvImageCodec: each region of the full decode, zeros beyond the image."""
    out = []
    for data_, (top, left, height, width) in zip(encoded, regions, strict=True):
        with Image.open(io.BytesIO(data_)) as image:
            pixels = np.asarray(image.convert("RGB"))
        canvas = np.zeros((height, width, 3), np.uint8)
        part = pixels[top : top + height, left : left + width]
        canvas[: part.shape[0], : part.shape[1]] = part
        out.append(jax.device_put(canvas, device))
    return out


def _antialiased(encoded, box, flip):
    with Image.open(io.BytesIO(encoded)) as image:
        out = np.asarray(image.convert("RGB").resize((IMAGE_SIZE,) * 2, Image.BILINEAR, box=box))
    return out[:, ::-1] if flip else out


def test_region_rounds_the_box_out_and_pads_it_to_the_quantum():
    top, left, height, width = gpu_decode.region((10.5, 3.2, 140.1, 60.0), quantum=64)
    assert (top, left) == (3, 10) and (height, width) == (64, 192)
    assert gpu_decode.region((0, 0, 128, 128), quantum=128) == (0, 0, 128, 128)


def test_crop_resize_is_an_antialiased_bilinear_resize_of_the_exact_box():
    encoded = image_bytes(np.random.default_rng(2), 200, 150, "PNG")
    with Image.open(io.BytesIO(encoded)) as image:
        pixels = np.asarray(image.convert("RGB"))
    for box, flip in (((10.5, 20.25, 150.5, 140.0), False), ((0, 0, 40, 30), True)):
        out = gpu_decode.crop_resize(pixels, np.float32(box), np.bool_(flip), IMAGE_SIZE)
        assert out.dtype == np.uint8 and out.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
        assert np.abs(np.asarray(out, float) - _antialiased(encoded, box, flip)).max() <= 2


def test_device_decoder_decodes_every_region_on_its_device_and_keeps_the_rest(split):
    host_load = pipeline.LoadTrainExample(split, 3, False)
    decoder = gpu_decode.DeviceDecoder(IMAGE_SIZE, host_load, regions=_region_from_pil)
    requests = _gpu_batches(split, steps=2)
    cpu = [
        _plain(b) for b in pipeline.encoded_train_batches(split, 8, seed=3, num_steps=2, workers=0)
    ]
    for request, expected in zip(requests, cpu, strict=True):
        batch = decoder(request)
        assert set(batch) == {"image", "label"}
        image = batch["image"]
        assert image.dtype == np.uint8 and image.shape == (8, IMAGE_SIZE, IMAGE_SIZE, 3)
        assert image.sharding.spec == jax.sharding.PartitionSpec(DEFAULT_AXIS_NAME)
        assert len(image.sharding.device_set) == jax.local_device_count()
        pixels = np.asarray(image)
        for i in range(8):
            if request["encoded"][i]:  # Decoded "on the device": the exact box, antialiased.
                reference = _antialiased(
                    request["encoded"][i], request["box"][i], request["flip"][i]
                )
                assert np.abs(pixels[i].astype(float) - reference).mean() < 2.0
            else:
                np.testing.assert_array_equal(pixels[i], expected["image"][i])
        np.testing.assert_array_equal(batch["label"], expected["label"])


def _refusing(refused: set[bytes]):
    """`_region_from_pil`, but None (nvImageCodec's failure) for the `refused` bytes."""

    def regions(encoded, boxes, device):
        return [
            None if e in refused else _region_from_pil([e], [box], device)[0]
            for e, box in zip(encoded, boxes, strict=True)
        ]

    return regions


def test_an_image_the_device_refuses_is_loaded_again_as_the_cpu_decoder_loads_it(split):
    request = _gpu_batches(split, steps=1)[0]
    refused = next(i for i in range(8) if request["encoded"][i])
    decoder = gpu_decode.DeviceDecoder(
        IMAGE_SIZE,
        pipeline.LoadTrainExample(split, 3, False),
        regions=_refusing({request["encoded"][refused]}),
    )
    pixels = np.asarray(decoder(dict(request))["image"])
    cpu = _plain(next(pipeline.encoded_train_batches(split, 8, seed=3, num_steps=1, workers=0)))
    np.testing.assert_array_equal(pixels[refused], cpu["image"][refused])


def _with_broken_jpeg(tmp_path):
    """A tree with a JPEG whose header reads and that ends with its marker, but noise between."""
    root = write_imagefolder(tmp_path / "tree", per_class=(4, 2))
    jpeg = image_bytes(np.random.default_rng(7), 64, 48, "JPEG")
    scan = jpeg.index(b"\xff\xda") + 14  # The scan's header, then noise, then the end.
    broken = jpeg[:scan] + np.random.default_rng(0).bytes(300) + b"\xff\xd9"
    path = os.path.join(root, "train", "dog", "dog_broken.jpg")
    with open(path, "wb") as f:
        f.write(broken)
    split = data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).train
    index = next(i for i in range(len(split.records)) if split.records.describe(i) == path)
    assert gpu_decode.device_decodes(broken)
    return split, path, index


def _step_of(split, index, batch_size=4):
    split_order = order.batch_order(len(split.records), batch_size, 3)
    return next(s for s in range(100) if index in order.step_indices(split_order, s))


def _device_decoded(split, steps, skip_corrupt, refused):
    host_load = pipeline.LoadTrainExample(split, 3, skip_corrupt)
    decoder = gpu_decode.DeviceDecoder(IMAGE_SIZE, host_load, regions=_refusing(refused))
    host = pipeline.encoded_train_batches(
        split, 4, seed=3, num_steps=steps, workers=0, decoder="gpu", skip_corrupt=skip_corrupt
    )
    return [_plain(b) for b in gpu_decode.decoded_batches(host, decoder)]


def test_a_file_only_the_device_finds_unreadable_stops_naming_it_and_its_step(tmp_path):
    split, path, index = _with_broken_jpeg(tmp_path)
    step = _step_of(split, index)
    broken = split.records[index][0]
    with pytest.raises(data.CorruptImageError, match=f"{path}.*for step {step + 1}"):
        _device_decoded(split, step + 1, False, {broken})


def test_with_skip_corrupt_it_is_replaced_as_the_cpu_decoder_replaces_it(tmp_path):
    split, path, index = _with_broken_jpeg(tmp_path)
    step = _step_of(split, index)
    gpu = _device_decoded(split, step + 1, True, {split.records[index][0]})[step]
    cpu = pipeline.encoded_train_batches(
        split, 4, seed=3, num_steps=step + 1, workers=0, skip_corrupt=True
    )
    cpu = [_plain(b) for b in cpu][step]
    np.testing.assert_array_equal(gpu["replaced"], cpu["replaced"])
    assert gpu["replaced"].sum() == 1
    np.testing.assert_array_equal(gpu["label"], cpu["label"])
    position = int(np.argmax(cpu["replaced"]))
    np.testing.assert_array_equal(gpu["image"][position], cpu["image"][position])


def test_eval_requests_are_centre_crops_and_a_left_out_image_is_blank(tmp_path):
    root = write_imagefolder(tmp_path / "tree", per_class=(2, 2))
    with open(os.path.join(root, "val", "cat", "cat_empty.jpg"), "wb"):
        pass
    split = data.load_dataset("imagefolder", data_dir=root, image_size=IMAGE_SIZE).test
    batches = [
        _plain(b)
        for b in pipeline.encoded_eval_batches(
            split, 4, workers=0, skip_corrupt=True, decoder="gpu"
        )
    ]
    requests = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    for position, index in enumerate(requests["slot"][:, 0]):
        encoded = split.records[index][0]
        if not encoded:
            assert requests["mask"][position] == 0 and not requests["image"][position].any()
            continue
        box = preprocess.center_crop_box(*preprocess.encoded_size(encoded))
        np.testing.assert_allclose(requests["box"][position], box, rtol=1e-6)
        assert not requests["flip"][position]


def test_an_unknown_decoder_is_refused_naming_the_choices(split):
    with pytest.raises(ValueError, match="unknown decoder 'tpu'.*'cpu', 'gpu'"):
        pipeline.encoded_train_batches(split, 4, seed=0, decoder="tpu")
    with pytest.raises(ValueError, match=r"config.data.decoder 'tpu'.*\('cpu', 'gpu'\)"):
        config_checks.validate_config(mlp_config(**{"data.decoder": "tpu"}), jax.device_count())


def test_the_decoder_may_change_when_a_run_resumes():
    recorded = workdir_lib._as_json(mlp_config())
    assert recorded["data"]["decoder"] == "cpu"
    assert workdir_lib.trajectory_changes(recorded, mlp_config(**{"data.decoder": "gpu"})) == []


@pytest.mark.skipif(
    gpu_decode.unavailable_reason() is None, reason="this machine can run the GPU decoder"
)
def test_the_gpu_decoder_is_refused_where_it_cannot_run_before_the_workdir_is_touched(tmp_path):
    config = mlp_config(**{"data.decoder": "gpu"})
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"config.data.decoder='gpu'.*(no GPU|nvImageCodec)"):
        train.train_and_evaluate(config, str(workdir))
    assert not workdir.exists()


def _nvimgcodec_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except ModuleNotFoundError:  # Not even the `nvidia` namespace package.
        return False


@pytest.mark.skipif(
    not _nvimgcodec_installed(),
    reason="nvImageCodec is not installed (the gpu-decode extra); it runs on a GPU host",
)
def test_nvimgcodec_decodes_like_the_cpu_decoder_on_the_gpu():
    # The suite runs on CPU devices (conftest): the check runs in a process of its own.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_decode_check", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
