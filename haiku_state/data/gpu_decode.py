"""The GPU decoder (`config.data.decoder="gpu"`): nvJPEG through nvImageCodec, on the device.

The host draws every crop box and flip; a worker hands over a request (bytes, box, flip) and
`DeviceDecoder` decodes each JPEG's region on its device, resizes the box (antialiased
bilinear, as PIL) and mirrors it: the CPU decoder's crops, slightly different pixels. Other
images are decoded in the worker; one nvImageCodec refuses is loaded again on the host.
Regions are padded to squares of a multiple of `CANVAS_QUANTUM`, resized `CHUNK` at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from haiku_state.data import preprocess
from haiku_state.data.splits import Batch
from haiku_state.replication import device_axis_sharding

CANVAS_QUANTUM = 128
CHUNK = 64
INSTALL_HINT = "pip install 'haiku_state[gpu-decode-cu13]' (or -cu12, as JAX's CUDA plugin)"
_JPEG_END = b"\xff\xd9"
REQUEST_FIELDS = ("encoded", "box", "flip", "slot")  # Those `DeviceDecoder` consumes.


def unavailable_reason() -> str | None:
    """Why `config.data.decoder="gpu"` cannot run here; None if it can."""
    platforms = sorted({device.platform for device in jax.local_devices()})
    if "gpu" not in platforms:
        return f"this machine has no GPU (JAX's devices: {', '.join(platforms)})"
    try:
        from nvidia import nvimgcodec  # noqa: F401 - only whether it imports.
    except ImportError:
        return f"the nvImageCodec package is missing: {INSTALL_HINT}"
    return None


def device_decodes(data: bytes) -> bool:
    """Whether the device decodes these bytes: an RGB or grey JPEG with its end marker."""
    return preprocess._turbo_size(data) is not None and data.endswith(_JPEG_END)


def _request(data: bytes, plan: preprocess.Plan, image_size: int) -> Batch:
    """The bytes, box and flip for the device; or, if it does not decode them, the pixels."""
    on_device = device_decodes(data)
    if on_device:
        image = np.zeros((image_size, image_size, 3), np.uint8)
    else:  # Decoded here exactly as the CPU decoder does; raises as it does.
        image = preprocess.decode_crop(data, lambda w, h: plan.box, image_size, plan.flip)
    return {
        "encoded": np.array(data if on_device else b"", dtype=object),
        "box": np.array(plan.box, np.float32),
        "flip": np.bool_(plan.flip),
        "image": image,
    }


def train_request(data: bytes, rng: np.random.Generator, image_size: int) -> Batch:
    return _request(data, preprocess.train_plan(*preprocess.encoded_size(data), rng), image_size)


def eval_request(data: bytes, image_size: int) -> Batch:
    box = preprocess.center_crop_box(*preprocess.encoded_size(data))
    return _request(data, preprocess.Plan(box, False), image_size)


def blank_request(image_size: int) -> Batch:
    """The request of an evaluation example left out: nothing to decode, zero pixels."""
    return {
        "encoded": np.array(b"", dtype=object),
        "box": np.zeros(4, np.float32),
        "flip": np.bool_(False),
        "image": np.zeros((image_size, image_size, 3), np.uint8),
    }


def region(box: Sequence[float], quantum: int = CANVAS_QUANTUM) -> tuple[int, int, int, int]:
    """The region decoded for `box`: `(top, left, height, width)`, rounded out and padded."""
    left, top = math.floor(box[0]), math.floor(box[1])
    height = math.ceil(box[3]) - top
    width = math.ceil(box[2]) - left
    return top, left, -(-height // quantum) * quantum, -(-width // quantum) * quantum


@functools.partial(jax.jit, static_argnames="image_size")
def crop_resize(canvas: jax.Array, box: jax.Array, flip: jax.Array, image_size: int) -> jax.Array:
    """`box` of `canvas` resized to `image_size` (antialiased bilinear, as PIL), maybe mirrored."""
    left, top, right, bottom = box[0], box[1], box[2], box[3]
    scale = jnp.stack([image_size / (bottom - top), image_size / (right - left)])
    translation = -jnp.stack([top, left]) * scale
    out = jax.image.scale_and_translate(
        canvas.astype(jnp.float32),
        (image_size, image_size, canvas.shape[2]),
        (0, 1),
        scale,
        translation,
        method="linear",
        antialias=True,
    )
    out = jnp.where(flip, out[:, ::-1], out)
    return jnp.clip(jnp.round(out), 0, 255).astype(jnp.uint8)


_crop_resize_chunk = jax.jit(
    jax.vmap(crop_resize.__wrapped__, in_axes=(0, 0, 0, None)), static_argnums=3
)


# `(encoded images, regions (top, left, height, width), device) -> a uint8 [height, width, 3]
# array per image on `device` (zeros beyond the image), or None where it fails.
RegionDecoder = Callable[[list[bytes], list[tuple[int, int, int, int]], Any], list[Any]]


def nvimgcodec_regions() -> RegionDecoder:
    """nvImageCodec's ROI decoding on each local GPU."""
    from nvidia import nvimgcodec

    decoders: dict[int, Any] = {}

    def decode(encoded: list[bytes], regions: list[tuple[int, int, int, int]], device: Any):
        if device.id not in decoders:
            decoders[device.id] = nvimgcodec.Decoder(device_id=device.local_hardware_id)
        streams = [
            nvimgcodec.CodeStream(data).get_sub_code_stream(
                region=nvimgcodec.Region(top, left, top + height, left + width)
            )
            for data, (top, left, height, width) in zip(encoded, regions, strict=True)
        ]
        images = decoders[device.id].decode(streams)
        return [None if image is None else jax.dlpack.from_dlpack(image) for image in images]

    return decode


class DeviceDecoder:
    """Host batches of requests -> batches whose `"image"` was decoded on the local devices;
    `host_load`, the CPU decoder's `slot -> example`, loads an image the device refuses."""

    def __init__(
        self,
        image_size: int,
        host_load: Callable[[tuple[int, ...]], Batch],
        regions: RegionDecoder | None = None,
    ):
        self._image_size, self._host_load = image_size, host_load
        self._regions = nvimgcodec_regions() if regions is None else regions
        self._sharding = device_axis_sharding()

    def __call__(self, batch: Batch) -> Batch:
        """The batch with `"image"` a uint8 `[B, S, S, 3]` array sharded over the devices."""
        batch = {name: np.array(leaf) for name, leaf in batch.items()}
        devices = self._sharding.mesh.devices.ravel()
        per_device = len(batch["label"]) // len(devices)
        images = [
            self._device_images(batch, range(k * per_device, (k + 1) * per_device), device)
            for k, device in enumerate(devices)
        ]
        shape = (len(batch["label"]), self._image_size, self._image_size, 3)
        batch["image"] = jax.make_array_from_single_device_arrays(shape, self._sharding, images)
        return {name: leaf for name, leaf in batch.items() if name not in REQUEST_FIELDS}

    def _device_images(self, batch: Batch, rows: range, device: Any) -> jax.Array:
        """`[len(rows), S, S, 3]` on `device`: the regions decoded in one call, resized in
        chunks of one side (sorted by size); the rest decoded on the host."""
        todo = sorted((i for i in rows if batch["encoded"][i]), key=lambda i: _side(batch, i))
        chunks = [todo[start : start + CHUNK] for start in range(0, len(todo), CHUNK)]
        regions = {}  # Each chunk's regions are squares of its largest side.
        for chunk in chunks:
            side = _side(batch, chunk[-1])
            regions.update({i: (*region(batch["box"][i])[:2], side, side) for i in chunk})
        encoded = [batch["encoded"][i] for i in todo]
        decoded = self._regions(encoded, [regions[i] for i in todo], device)
        decoded = dict(zip(todo, decoded, strict=True))
        parts, order = [], {}  # The resized chunks, and where each row lies in them.
        for chunk in chunks:
            kept = [i for i in chunk if decoded[i] is not None]
            if not kept:
                continue
            padded = kept + kept[:1] * (CHUNK - len(kept))  # One shape for every chunk.
            offsets = np.array([(regions[i][1], regions[i][0]) * 2 for i in padded], np.float32)
            boxes = np.stack([batch["box"][i] for i in padded]) - offsets
            flips = np.array([batch["flip"][i] for i in padded])
            canvases = jnp.stack([decoded[i] for i in padded])
            order.update({i: CHUNK * len(parts) + j for j, i in enumerate(kept)})
            parts.append(_crop_resize_chunk(canvases, boxes, flips, self._image_size))
        host = [i for i in rows if i not in order]  # Decoded in the worker, or refused here.
        if host:
            pixels = [
                self._redo_on_host(batch, i) if batch["encoded"][i] else batch["image"][i]
                for i in host
            ]
            order.update({i: CHUNK * len(parts) + j for j, i in enumerate(host)})
            parts.append(jax.device_put(np.stack(pixels), device))
        rows_in_parts = np.array([order[i] for i in rows])
        return jnp.concatenate(parts)[rows_in_parts] if len(parts) > 1 else parts[0][rows_in_parts]

    def _redo_on_host(self, batch: Batch, i: int) -> np.ndarray:
        """Example `i`'s pixels as the CPU decoder loads it; its fields replace the batch's."""
        example = self._host_load(tuple(int(v) for v in batch["slot"][i]))
        for name, value in example.items():
            if name != "image":
                batch[name][i] = value
        return example["image"]


def _side(batch: Batch, i: int) -> int:
    return max(region(batch["box"][i])[2:])


def decoded_batches(host_batches: Iterator[Batch], decoder: DeviceDecoder) -> Iterator[Batch]:
    """`decoder` applied to each host batch; closing it closes `host_batches` (its workers)."""
    try:
        for batch in host_batches:
            yield decoder(batch)
    finally:
        if hasattr(host_batches, "close"):
            host_batches.close()
