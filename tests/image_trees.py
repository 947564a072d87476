"""Small image datasets in their real on-disk formats, for the input pipeline's tests.

`write_imagefolder` writes `train/<class>/*` and `val/<class>/*` with real JPEG
and PNG files of varied sizes, and the oddities ImageNet has: a PNG named
`.JPEG`, a CMYK JPEG, a grayscale JPEG, upper-case extensions, and files in a
class folder that are not images (a README, a hidden `._x.JPEG` of macOS).
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
from PIL import Image

CLASSES = ("cat", "dog", "eel")


def image_bytes(rng: np.random.Generator, width: int, height: int, fmt: str, mode="RGB") -> bytes:
    """A smooth random image (so JPEG sizes are realistic) encoded as `fmt` in `mode`."""
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def write_imagefolder(root, per_class=(6, 2), seed: int = 0) -> str:
    """Writes a tree of `per_class` (train, val) images per class of `CLASSES`; returns root."""
    rng = np.random.default_rng(seed)
    for split, count in zip(("train", "val"), per_class, strict=True):
        for label, name in enumerate(CLASSES):
            folder = os.path.join(root, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                width, height = int(rng.integers(24, 90)), int(rng.integers(24, 90))
                kind = (i + label) % 5
                if kind == 0:  # A PNG named .JPEG, as ImageNet has one.
                    file, data = f"{name}_{i}.JPEG", image_bytes(rng, width, height, "PNG")
                elif kind == 1:
                    file, data = f"{name}_{i}.jpeg", image_bytes(rng, width, height, "JPEG", "CMYK")
                elif kind == 2:
                    file, data = f"{name}_{i}.JPG", image_bytes(rng, width, height, "JPEG", "L")
                elif kind == 3:
                    file, data = f"{name}_{i}.png", image_bytes(rng, width, height, "PNG", "RGBA")
                else:
                    file, data = f"{name}_{i}.JPEG", image_bytes(rng, width, height, "JPEG")
                _write(os.path.join(folder, file), data)
    _write(os.path.join(root, "train", CLASSES[0], "README.txt"), b"not an image\n")
    # What macOS leaves beside a copied file: hidden, and not an image despite its name.
    _write(os.path.join(root, "train", CLASSES[1], f"._{CLASSES[1]}_0.JPEG"), b"\x00\x05\x16\x07")
    return str(root)


def swap_keeping_times(first: str, second: str) -> None:
    """Swaps two files' bytes and restores their modification times: sizes (equal) and times
    are those recorded, the blind spot of the stat identity."""
    times = [os.stat(path).st_mtime_ns for path in (first, second)]
    contents = [open(path, "rb").read() for path in (first, second)]
    for path, content, mtime in zip((first, second), contents[::-1], times, strict=True):
        with open(path, "wb") as f:
            f.write(content)
        os.utime(path, ns=(mtime, mtime))


def write_cifar10_batch(path, images_chw: np.ndarray, labels: list[int], batch_label: bytes):
    """Writes one batch file exactly as the python release of CIFAR-10 lays it out."""
    batch = {
        b"batch_label": batch_label,
        b"labels": labels,
        b"data": images_chw.reshape(len(labels), 3072).astype(np.uint8),
        b"filenames": [f"image_{i}.png".encode() for i in range(len(labels))],
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f)


CORRUPTIONS = {
    "truncated": lambda rng: image_bytes(rng, 64, 48, "JPEG")[:400],
    "zero-bytes": lambda rng: b"",
    "random-bytes": lambda rng: rng.bytes(2000),
}


def add_corrupt_file(root, kind: str, split: str = "train", name: str = "dog") -> str:
    """Writes an unreadable `.jpg` of `kind` into a class folder; returns its path."""
    path = os.path.join(root, split, name, f"{name}_corrupt_{kind}.jpg")
    _write(path, CORRUPTIONS[kind](np.random.default_rng(7)))
    return path
