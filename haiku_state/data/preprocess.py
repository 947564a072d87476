"""Host preprocessing of encoded images: decode by content, crop, resize, flip; uint8 out.

Training takes torchvision's `RandomResizedCrop`, mirrored half the time; evaluation the
centred square of `0.875 x` the short side; both drawn from the header, whichever decoder
computes the pixels. RGB and grey JPEGs go through libjpeg-turbo at the largest DCT scale
that keeps the crop `image_size` wide, the rest through PIL; OpenCV resizes (area-averaged
from twice `image_size` or more, not to alias).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from haiku_state import errors

Box = tuple[float, float, float, float]  # left, top, right, bottom, in pixels of the image.
CropFn = Callable[[int, int], Box]  # (width, height) -> the box to resize to the output.

AREA_RANGE = (0.08, 1.0)
ASPECT_RANGE = (3 / 4, 4 / 3)
CROP_ATTEMPTS = 10
EVAL_CROP_FRACTION = 0.875
_JPEG_MAGIC = b"\xff\xd8\xff"
# The JPEG colour spaces libjpeg-turbo turns into RGB; CMYK and YCCK go to PIL.
_TURBO_COLORSPACES = ("YCbCr", "Gray", "RGB")
_DCT_SCALES = (8, 4, 2)
_SIXTEEN_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")
# `pixel_statistics`' images, and the side of the crops it measures (smaller: a lower std).
STATISTICS_SAMPLE = 1000
STATISTICS_SIZE = 128


class Plan(NamedTuple):
    """A training example's crop `box` (in pixels of the full image) and mirroring."""

    box: Box
    flip: bool


def random_crop_box(width: int, height: int, rng: np.random.Generator) -> Box:
    """torchvision's `RandomResizedCrop.get_params`: a box of 8-100% of the area and aspect
    3/4-4/3 (uniform in log); if 10 draws do not fit, the centre at the nearest aspect."""
    log_aspect = (math.log(ASPECT_RANGE[0]), math.log(ASPECT_RANGE[1]))
    for _ in range(CROP_ATTEMPTS):
        area = width * height * rng.uniform(*AREA_RANGE)
        aspect = math.exp(rng.uniform(*log_aspect))
        crop_width = round(math.sqrt(area * aspect))
        crop_height = round(math.sqrt(area / aspect))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            top = int(rng.integers(0, height - crop_height + 1))
            left = int(rng.integers(0, width - crop_width + 1))
            return (left, top, left + crop_width, top + crop_height)
    crop_width, crop_height = width, height
    if width / height < ASPECT_RANGE[0]:
        crop_height = round(width / ASPECT_RANGE[0])
    elif width / height > ASPECT_RANGE[1]:
        crop_width = round(height * ASPECT_RANGE[1])
    left, top = (width - crop_width) // 2, (height - crop_height) // 2
    return (left, top, left + crop_width, top + crop_height)


def center_crop_box(width: int, height: int, fraction: float = EVAL_CROP_FRACTION) -> Box:
    """The centred square of `fraction` x the short side."""
    side = fraction * min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    return (left, top, left + side, top + side)


def train_plan(width: int, height: int, rng: np.random.Generator) -> Plan:
    """The random crop and flip of a training image, drawn in this order."""
    return Plan(random_crop_box(width, height, rng), bool(rng.uniform() < 0.5))


def encoded_size(data: bytes) -> tuple[int, int]:
    size = _turbo_size(data)
    if size is not None:
        return size
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def decode_crop(data: bytes, crop: CropFn, image_size: int, flip: bool = False) -> np.ndarray:
    """The box `crop(width, height)` picks, resized to uint8 RGB `[S, S, 3]`, maybe mirrored."""
    pixels, box = _decode(data, crop, image_size)
    return resize_crop(pixels, box, image_size, flip)


def train_image(data: bytes, rng: np.random.Generator, image_size: int) -> np.ndarray:
    """A random crop, resized, mirrored half the time; planned from the size the decoder
    reads (the header is parsed once)."""
    plans = []

    def crop(width: int, height: int) -> Box:
        plans.append(train_plan(width, height, rng))
        return plans[0].box

    pixels, box = _decode(data, crop, image_size)
    return resize_crop(pixels, box, image_size, plans[0].flip)


def eval_image(data: bytes, image_size: int) -> np.ndarray:
    return decode_crop(data, center_crop_box, image_size)


def square_image(data: bytes, image_size: int) -> np.ndarray:
    """The centred square of the whole short side, resized: as CIFAR-10 and the digits hold
    their small whole images."""
    return decode_crop(data, lambda width, height: center_crop_box(width, height, 1.0), image_size)


def statistics_sample(num_examples: int, sample: int = STATISTICS_SAMPLE) -> list[int]:
    """At most `sample` indices spread evenly over `num_examples`, ascending."""
    return sorted({round(i) for i in np.linspace(0, num_examples - 1, min(sample, num_examples))})


def pixel_statistics(images: Iterable[bytes]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std of the evaluation crops of `images` that decode."""
    total, total_of_squares, count = np.zeros(3), np.zeros(3), 0
    for data in images:
        try:
            pixels = eval_image(data, STATISTICS_SIZE).reshape(-1, 3).astype(np.float64)
        except Exception:  # Unreadable: training meets it as it will (skip_corrupt or not).
            continue
        total += pixels.sum(axis=0)
        total_of_squares += np.square(pixels).sum(axis=0)
        count += len(pixels)
    if not count:
        raise errors.InvalidValue("not one of the images sampled for the pixel statistics decodes")
    mean = total / count
    std = np.sqrt(np.maximum(total_of_squares / count - np.square(mean), 0.0))
    std = np.maximum(std, 1.0)  # A constant channel (a blank test tree) would divide by 0.
    return tuple(round(float(m), 3) for m in mean), tuple(round(float(s), 3) for s in std)


def resize_crop(pixels: np.ndarray, box: Box, image_size: int, flip: bool) -> np.ndarray:
    """`box` of `pixels`, rounded to whole pixels, resized, maybe mirrored."""
    height, width = pixels.shape[:2]
    left, right = _pixel_span(box[0], box[2], width)
    top, bottom = _pixel_span(box[1], box[3], height)
    crop = pixels[top:bottom, left:right]
    shrink_twice = min(right - left, bottom - top) >= 2 * image_size
    interpolation = cv2.INTER_AREA if shrink_twice else cv2.INTER_LINEAR
    out = cv2.resize(crop, (image_size, image_size), interpolation=interpolation)
    return cv2.flip(out, 1) if flip else out


def _pixel_span(start: float, end: float, limit: int) -> tuple[int, int]:
    first = min(max(round(start), 0), limit - 1)
    return first, min(max(round(end), first + 1), limit)


def _turbo_size(data: bytes) -> tuple[int, int] | None:
    """`(width, height)` of a JPEG libjpeg-turbo decodes to RGB; None for the rest."""
    if data[:3] != _JPEG_MAGIC:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (width, height) if colorspace in _TURBO_COLORSPACES else None


def _dct_scale(box: Box, image_size: int) -> int:
    """The largest JPEG DCT scale that keeps `box` at least `image_size` wide."""
    shortest = min(box[2] - box[0], box[3] - box[1])
    return next((s for s in _DCT_SCALES if shortest / s >= image_size), 1)


def _decode(data: bytes, crop: CropFn, image_size: int) -> tuple[np.ndarray, Box]:
    size = _turbo_size(data)
    if size is None:
        return _decode_pil(data, crop, image_size)
    box = crop(*size)
    scale = _dct_scale(box, image_size)
    try:
        pixels = simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_height=-(-size[1] // scale), min_width=-(-size[0] // scale)
        )
    except ValueError:  # A defect libjpeg-turbo refuses (strictly): PIL decides, same box.
        return _decode_pil(data, lambda width, height: box, image_size)
    return pixels, _scaled(box, size, pixels)


def _scaled(box: Box, size: tuple[int, int], pixels: np.ndarray) -> Box:
    sx, sy = pixels.shape[1] / size[0], pixels.shape[0] / size[1]
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def _decode_pil(data: bytes, crop: CropFn, image_size: int) -> tuple[np.ndarray, Box]:
    with Image.open(io.BytesIO(data)) as image:
        size = image.size
        box = crop(*size)
        scale = _dct_scale(box, image_size)
        if scale > 1:  # JPEG only; PIL ignores the draft of other formats.
            image.draft("RGB", (size[0] // scale, size[1] // scale))
        pixels = np.asarray(_to_rgb(image))
    return pixels, _scaled(box, size, pixels)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB of any PIL mode; 16-bit grey keeps its top 8 bits (PIL would saturate it)."""
    if image.mode in _SIXTEEN_BIT_MODES:
        pixels = np.clip(np.asarray(image, np.int64) >> 8, 0, 255).astype(np.uint8)
        return Image.fromarray(pixels, "L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # What PIL asks for before dropping the alpha.
    return image.convert("RGB")
