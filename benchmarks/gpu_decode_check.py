r"""The GPU decoder on a GPU host: its pixels against the CPU decoder's, and its speed.

    python -m benchmarks.gpu_decode_check [--quick] [--out=gpu_decode.json]

Needs JAX on a GPU and nvImageCodec (`pip install '.[gpu-decode-cu13]'`);
refuses in one line otherwise. What it checks, with the figures in one JSON
record (exit status 1 if a check fails):

1. pixels: on generated JPEGs (photo-like 500x375, a 1600x1200 one, a grey
   one, a progressive one) each training request decoded on the device is
   within `MAX_MEAN_DIFFERENCE` levels (mean over the image) of the CPU
   decoder's pixels for the same box and flip;
2. regions: a region reaching past the image comes back zero-filled there and
   equal to the host's decode inside (nvImageCodec's out-of-bounds fill);
3. refusal: what nvImageCodec makes of a JPEG whose scan is noise (a header
   that reads, an end marker): refused (None, then the host's error) or decoded;
4. speed (not with --quick): the device half alone on batches of `--batch_size`
   (images/s after the compiles), and the whole pipeline with
   `--workers` workers and the GPU decoder, beside the CPU decoder's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
import simplejpeg
from PIL import Image

from benchmarks import input_pipeline
from haiku_state import data
from haiku_state.data import gpu_decode, preprocess

MAX_MEAN_DIFFERENCE = 4.0


def _jpeg(pixels: np.ndarray, **options: Any) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def _samples(rng: np.random.Generator) -> dict[str, bytes]:
    photo = input_pipeline.photo_like(rng)
    large = np.asarray(Image.fromarray(photo).resize((1600, 1200), Image.Resampling.BICUBIC))
    return {
        "photo": _jpeg(photo),
        "large": _jpeg(large),
        "grey": _jpeg(photo[..., 0]),
        "progressive": _jpeg(photo, progressive=True),
    }


def check_pixels(image_size: int, seeds: int) -> dict[str, Any]:
    """Mean |GPU - CPU| per image for each sample, over `seeds` crops and flips each."""
    decoder = gpu_decode.DeviceDecoder(image_size, host_load=_no_host_load)
    result = {}
    for name, encoded in _samples(np.random.default_rng(0)).items():
        requests = [
            gpu_decode.train_request(encoded, np.random.default_rng(s), image_size)
            for s in range(seeds)
        ]
        batch = {key: np.stack([r[key] for r in requests]) for key in requests[0]}
        batch["label"] = np.zeros(seeds, np.int32)
        batch["slot"] = np.zeros((seeds, 3), np.int64)
        on_device = np.asarray(decoder(_per_device(batch))["image"])
        cpu = [
            preprocess.train_image(encoded, np.random.default_rng(s), image_size)
            for s in range(len(on_device))
        ]
        means = [
            float(np.abs(g.astype(float) - c).mean()) for g, c in zip(on_device, cpu, strict=True)
        ]
        result[name] = {"mean_difference_max": max(means), "mean_difference_mean": np.mean(means)}
    result["ok"] = all(r["mean_difference_max"] <= MAX_MEAN_DIFFERENCE for r in result.values())
    return result


def _per_device(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch trimmed to a multiple of the local devices."""
    keep = len(batch["label"]) // jax.local_device_count() * jax.local_device_count()
    return {key: value[:keep] for key, value in batch.items()}


def _no_host_load(slot: tuple[int, ...]) -> dict[str, np.ndarray]:
    raise RuntimeError(f"the device refused an image of the check (slot {slot})")


def check_regions() -> dict[str, Any]:
    """A region past the image's bottom-right corner: zeros there, the host's pixels inside."""
    encoded = _samples(np.random.default_rng(1))["photo"]
    regions = gpu_decode.nvimgcodec_regions()
    top, left, height, width = 300, 400, 128, 128  # 75 x 100 inside a 500x375 image.
    (canvas,) = regions([encoded], [(top, left, height, width)], jax.local_devices()[0])
    canvas = np.asarray(canvas)
    host = simplejpeg.decode_jpeg(encoded, colorspace="RGB")
    inside = canvas[: 375 - top, : 500 - left].astype(float)
    difference = float(np.abs(inside - host[top:, left:]).mean())
    outside_zero = not canvas[375 - top :].any() and not canvas[:, 500 - left :].any()
    return {
        "shape": list(canvas.shape),
        "inside_mean_difference": difference,
        "outside_zero": outside_zero,
        "ok": canvas.shape == (height, width, 3) and outside_zero and difference <= 2.0,
    }


def check_refusal() -> dict[str, Any]:
    """What nvImageCodec does with a JPEG whose scan is noise (the CPU decoder refuses it)."""
    encoded = _samples(np.random.default_rng(2))["photo"]
    scan = encoded.index(b"\xff\xda") + 14
    broken = encoded[:scan] + np.random.default_rng(0).bytes(3000) + b"\xff\xd9"
    try:
        preprocess.eval_image(broken, 32)
        cpu = "decoded"
    except Exception as e:  # noqa: BLE001 - reported, whatever it is.
        cpu = f"refused: {type(e).__name__}"
    (canvas,) = gpu_decode.nvimgcodec_regions()(
        [broken], [(0, 0, 384, 512)], jax.local_devices()[0]
    )
    return {"cpu": cpu, "gpu": "refused (None)" if canvas is None else "decoded", "ok": True}


def device_rate(image_size: int, batch_size: int, seconds: float) -> float:
    """Images/s of the device half alone on requests of photo-like JPEGs, after compiling."""
    rng = np.random.default_rng(3)
    photos = [_jpeg(input_pipeline.photo_like(rng)) for _ in range(32)]
    decoder = gpu_decode.DeviceDecoder(image_size, host_load=_no_host_load)
    requests = [
        gpu_decode.train_request(photos[i % 32], np.random.default_rng(i), image_size)
        for i in range(batch_size)
    ]
    batch = {key: np.stack([r[key] for r in requests]) for key in requests[0]}
    batch["label"] = np.zeros(batch_size, np.int32)
    batch["slot"] = np.zeros((batch_size, 3), np.int64)
    batch = _per_device(batch)
    jax.block_until_ready(decoder(dict(batch))["image"])  # Compiles.
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        jax.block_until_ready(decoder(dict(batch))["image"])
        count += len(batch["label"])
    return count / (time.perf_counter() - start)


def pipeline_rates(image_size: int, batch_size: int, workers: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="gpu_decode_check_") as root:
        input_pipeline.write_tree(root, max(2048, 4 * batch_size), 256)
        split = data.load_dataset("imagefolder", data_dir=root, image_size=image_size).train
        return {
            decoder: input_pipeline.pipeline_rate(split, batch_size, workers, steps, decoder)[
                "images_per_s"
            ]
            for decoder in ("gpu", "cpu")
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_decode_check")
    parser.add_argument("--quick", action="store_true", help="the checks, not the speed")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=None, help="default: cores - 1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if reason := gpu_decode.unavailable_reason():
        parser.error(f"the GPU decoder cannot run here: {reason}.")
    record: dict[str, Any] = {
        "devices": [str(d) for d in jax.local_devices()],
        "pixels": check_pixels(args.image_size, 8 if args.quick else 32),
        "regions": check_regions(),
        "refusal": check_refusal(),
    }
    if not args.quick:
        workers = data.default_workers() if args.workers is None else args.workers
        record["device_images_per_s"] = device_rate(args.image_size, args.batch_size, 10.0)
        record["pipeline_images_per_s"] = pipeline_rates(
            args.image_size, args.batch_size, workers, args.steps
        )
        record["workers"] = workers
    text = json.dumps(record, indent=1, default=float)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(record[k]["ok"] for k in ("pixels", "regions", "refusal")) else 1


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # Beside the workers.
    sys.exit(main())
