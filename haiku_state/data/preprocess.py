"""Host preprocessing of encoded images: decode by content, crop, resize, flip; uint8 out.

Training takes an Inception-style random crop (area 8-100% of the image, aspect
ratio 3/4-4/3, as `torchvision.transforms.RandomResizedCrop` draws it) resized
to `image_size` squared, mirrored with probability 1/2. Evaluation takes the
centred square of side `0.875 x` the short side, resized to `image_size`: the
usual "resize the short side to `image_size / 0.875`, centre-crop `image_size`"
with one resampling instead of two.

The crop is chosen from the image's size alone (read from its header), before
the pixels are decoded, so a JPEG can be decoded at 1/2, 1/4 or 1/8 scale in the
DCT domain when the crop stays at least `image_size` wide: large photos then
cost a fraction of a full decode. The random draws come from the generator the
caller passes, seeded by the example's place in the global batch (see
`order.example_seed`), never from a worker's state.

Decoding goes by content, not by file name: JPEGs in RGB or grayscale go through
libjpeg-turbo (`simplejpeg`); everything else (PNG, CMYK JPEGs, a PNG named
`.JPEG`, files libjpeg-turbo refuses) through PIL. All come out RGB.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np
import simplejpeg
from PIL import Image

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


def random_crop_box(width: int, height: int, rng: np.random.Generator) -> Box:
    """A random box of 8-100% of the area and aspect 3/4-4/3; the centre if 10 draws miss.

    As `RandomResizedCrop.get_params` in torchvision (and Inception's
    `distorted_bounding_box_crop`): the area fraction is uniform, the log of the
    aspect ratio is uniform, and a box that does not fit is drawn again.
    """
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
    # The whole image, trimmed to the nearest allowed aspect ratio.
    crop_width, crop_height = width, height
    if width / height < ASPECT_RANGE[0]:
        crop_height = round(width / ASPECT_RANGE[0])
    elif width / height > ASPECT_RANGE[1]:
        crop_width = round(height * ASPECT_RANGE[1])
    left, top = (width - crop_width) // 2, (height - crop_height) // 2
    return (left, top, left + crop_width, top + crop_height)


def center_crop_box(width: int, height: int) -> Box:
    """The centred square of side `EVAL_CROP_FRACTION` times the short side."""
    side = EVAL_CROP_FRACTION * min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    return (left, top, left + side, top + side)


def decode_crop(data: bytes, crop: CropFn, image_size: int) -> np.ndarray:
    """Decodes an encoded image and resizes the box `crop` picks to `image_size` squared.

    Args:
      data: the file's bytes: JPEG, PNG, or anything else PIL reads.
      crop: `(width, height) -> box`, called once with the image's full size.
      image_size: the side of the output.

    Returns:
      uint8 `[image_size, image_size, 3]`, RGB.

    Raises:
      Whatever PIL raises for bytes it cannot read (`PIL.UnidentifiedImageError`,
      `OSError` for a truncated file, ...).
    """
    return np.asarray(_decode_crop_image(data, crop, image_size))


def _decode_crop_image(data: bytes, crop: CropFn, image_size: int) -> Image.Image:
    size = _turbo_size(data)
    if size is None:
        return _decode_crop_pil(data, crop, image_size)
    box = crop(*size)
    try:
        return _decode_crop_turbo(data, size, box, image_size)
    except ValueError:  # A defect libjpeg-turbo refuses (strictly): PIL decides, same box.
        return _decode_crop_pil(data, lambda width, height: box, image_size)


def _turbo_size(data: bytes) -> tuple[int, int] | None:
    """`(width, height)` of a JPEG that libjpeg-turbo can decode to RGB; None for the rest."""
    if data[:3] != _JPEG_MAGIC:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (width, height) if colorspace in _TURBO_COLORSPACES else None


def _dct_scale(box: Box, image_size: int) -> int:
    """The largest JPEG DCT scale (8, 4, 2 or 1) that keeps `box` at least `image_size` wide."""
    shortest = min(box[2] - box[0], box[3] - box[1])
    return next((s for s in _DCT_SCALES if shortest / s >= image_size), 1)


def _resized(
    image: Image.Image, box: Box, scale: tuple[float, float], image_size: int
) -> Image.Image:
    """`box` (in pixels of the undecoded image) of `image` (decoded at `scale`), resized."""
    sx, sy = scale
    scaled_box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    return image.resize((image_size, image_size), Image.Resampling.BILINEAR, box=scaled_box)


def _decode_crop_turbo(data: bytes, size: tuple[int, int], box: Box, image_size: int) -> np.ndarray:
    width, height = size
    scale = _dct_scale(box, image_size)
    pixels = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_height=-(-height // scale), min_width=-(-width // scale)
    )
    decoded = (pixels.shape[1] / width, pixels.shape[0] / height)
    return _resized(Image.fromarray(pixels), box, decoded, image_size)


def _decode_crop_pil(data: bytes, crop: CropFn, image_size: int) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        box = crop(width, height)
        scale = _dct_scale(box, image_size)
        if scale > 1:  # JPEG only; PIL ignores the draft of other formats.
            image.draft("RGB", (width // scale, height // scale))
        rgb = _to_rgb(image)
        decoded = (rgb.width / width, rgb.height / height)
        return _resized(rgb, box, decoded, image_size)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB of any PIL mode; 16-bit grey keeps its top 8 bits (PIL would saturate it)."""
    if image.mode in _SIXTEEN_BIT_MODES:
        pixels = np.clip(np.asarray(image, np.int64) >> 8, 0, 255).astype(np.uint8)
        return Image.fromarray(pixels, "L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # What PIL asks for before dropping the alpha.
    return image.convert("RGB")


def train_image(data: bytes, rng: np.random.Generator, image_size: int) -> np.ndarray:
    """A random crop of the encoded image, resized to `image_size`, mirrored half the time."""
    pixels = decode_crop(
        data, lambda width, height: random_crop_box(width, height, rng), image_size
    )
    if rng.uniform() < 0.5:
        pixels = pixels[:, ::-1]
    return np.ascontiguousarray(pixels)


def eval_image(data: bytes, image_size: int) -> np.ndarray:
    """The centre crop of the encoded image, resized to `image_size`."""
    return np.ascontiguousarray(decode_crop(data, center_crop_box, image_size))
