"""The "before" of `benchmarks.input_pipeline`'s decoder comparison: the CPU decoder of 6e7fcfe.

The library's CPU decoder as it was before `preprocess` resized with OpenCV:
libjpeg-turbo (or PIL) at the same DCT scale, the decoded array copied into a
PIL image, PIL's antialiased bilinear resize of the exact box, and numpy's
mirror copy. Kept here, frozen, so that one run of the benchmark times the
before and the after on the same files, through the same grain pipeline
(`DECODER`), interleaved: a ratio that the machine's load moves little.
Not part of the library: nothing else imports it.
"""

from __future__ import annotations

import io

import numpy as np
import simplejpeg
from PIL import Image

from haiku_state.data import pipeline, preprocess
from haiku_state.data.preprocess import Box, CropFn


def decode_crop(data: bytes, crop: CropFn, image_size: int) -> np.ndarray:
    """6e7fcfe's `preprocess.decode_crop`."""
    size = preprocess._turbo_size(data)
    if size is None:
        return np.asarray(decode_crop_pil(data, crop, image_size))
    box = crop(*size)
    try:
        return np.asarray(decode_crop_turbo(data, size, box, image_size))
    except ValueError:
        return np.asarray(decode_crop_pil(data, lambda width, height: box, image_size))


def _resized(
    image: Image.Image, box: Box, scale: tuple[float, float], image_size: int
) -> Image.Image:
    sx, sy = scale
    scaled_box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    return image.resize((image_size, image_size), Image.Resampling.BILINEAR, box=scaled_box)


def decode_crop_turbo(data: bytes, size: tuple[int, int], box: Box, image_size: int) -> Image.Image:
    """6e7fcfe's libjpeg-turbo path: decode, copy into PIL, PIL's resize."""
    width, height = size
    scale = preprocess._dct_scale(box, image_size)
    pixels = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_height=-(-height // scale), min_width=-(-width // scale)
    )
    decoded = (pixels.shape[1] / width, pixels.shape[0] / height)
    return _resized(Image.fromarray(pixels), box, decoded, image_size)


def decode_crop_pil(data: bytes, crop: CropFn, image_size: int) -> Image.Image:
    """6e7fcfe's PIL path."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        box = crop(width, height)
        scale = preprocess._dct_scale(box, image_size)
        if scale > 1:
            image.draft("RGB", (width // scale, height // scale))
        rgb = preprocess._to_rgb(image)
        decoded = (rgb.width / width, rgb.height / height)
        return _resized(rgb, box, decoded, image_size)


def train_image(data: bytes, rng: np.random.Generator, image_size: int) -> np.ndarray:
    """6e7fcfe's `preprocess.train_image`: the same box and flip draws as today's."""
    pixels = decode_crop(
        data, lambda width, height: preprocess.random_crop_box(width, height, rng), image_size
    )
    if rng.uniform() < 0.5:
        pixels = pixels[:, ::-1]
    return np.ascontiguousarray(pixels)


def eval_image(data: bytes, image_size: int) -> np.ndarray:
    """6e7fcfe's `preprocess.eval_image`."""
    return np.ascontiguousarray(decode_crop(data, preprocess.center_crop_box, image_size))


def train_example(data: bytes, rng: np.random.Generator, image_size: int) -> dict[str, np.ndarray]:
    return {"image": train_image(data, rng, image_size)}


def eval_example(data: bytes, image_size: int) -> dict[str, np.ndarray]:
    return {"image": eval_image(data, image_size)}


# What the pipeline's workers run for the "before" (module-level: the workers are spawned).
DECODER = pipeline.Decoder(train_example, eval_example, pipeline.cpu_blank_example)
