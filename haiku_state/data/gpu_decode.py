"""The GPU decoder (`config.data.decoder="gpu"`): nvJPEG through nvImageCodec, on the device.

The host still draws every crop box and flip, from `(seed, step, position)`
as the CPU decoder does (`preprocess.train_plan`); only the pixels move. A
decoding worker reads an example's bytes and header, draws its plan and hands
over a *request* (`train_request`, `eval_request`): the bytes, the box and the
flip. In the training process, `DeviceDecoder` decodes each JPEG's region of
interest on its device with nvJPEG (nvImageCodec's ROI decoding), and resizes
the exact box to `image_size` with antialiased bilinear weights
(`jax.image.scale_and_translate`, as PIL's bilinear resize), mirrors it, and
hands over uint8 device arrays. Batches are the same function of `(seed, step)`
as with the CPU decoder, whatever the worker or process count; the pixels
differ slightly (another IDCT, no DCT scaling, the exact box).

Where the device cannot or does not decode, the host does, with the CPU
decoder's code and results: PNGs, CMYK JPEGs and JPEGs without an end marker
(truncated files) are decoded in the worker (same box and flip), and an image
nvImageCodec refuses is loaded again on the host from its slot, which stops
with the file's name or replaces it (`skip_corrupt`) exactly as the CPU decoder
would. The request functions run in the workers and import nothing of
nvImageCodec; `DeviceDecoder` imports it when built.

The region each image decodes is its box rounded out to whole pixels, padded
to a square whose side is a multiple of `CANVAS_QUANTUM` (beyond the image,
filled with zeros); a device batch is resized in chunks of `CHUNK` such
canvases of one side (the images sorted by size). The resize then compiles
once per side, not per image, and launches once per chunk.
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
from haiku_state.replication import DEFAULT_AXIS_NAME, local_mesh

# Decoded regions are padded to a multiple of this many pixels along each side.
CANVAS_QUANTUM = 128
# Canvases resized by one launch.
CHUNK = 64
INSTALL_HINT = "pip install 'haiku_state[gpu-decode-cu13]' (or -cu12, as JAX's CUDA plugin)"
_JPEG_END = b"\xff\xd9"
# The fields of a request that `DeviceDecoder` consumes (with the host's "image").
REQUEST_FIELDS = ("encoded", "box", "flip", "slot")


def unavailable_reason() -> str | None:
    """Why `config.data.decoder="gpu"` cannot run here (no GPU, no nvImageCodec); None if it can."""
    platforms = sorted({device.platform for device in jax.local_devices()})
    if "gpu" not in platforms:
        return f"this machine has no GPU (JAX's devices: {', '.join(platforms)})"
    try:
        from nvidia import nvimgcodec  # noqa: F401 - only whether it imports.
    except ImportError:
        return f"the nvImageCodec package is missing: {INSTALL_HINT}"
    return None


def device_decodes(data: bytes) -> bool:
    """Whether the device decodes these bytes: an RGB or grey JPEG ending with its end marker."""
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
    """A training example's request: its plan drawn as the CPU decoder draws it.

    Raises:
      Whatever reading the header raises for bytes that are not an image.
    """
    return _request(data, preprocess.train_plan(*preprocess.encoded_size(data), rng), image_size)


def eval_request(data: bytes, image_size: int) -> Batch:
    """An evaluation example's request: the centre crop, not mirrored."""
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
    """The region decoded for `box`: `(top, left, height, width)`, the box rounded out, padded.

    The box lies at `box - (left, top)` in the decoded region; `height` and
    `width` are multiples of `quantum`.
    """
    left, top = math.floor(box[0]), math.floor(box[1])
    height = math.ceil(box[3]) - top
    width = math.ceil(box[2]) - left
    return top, left, -(-height // quantum) * quantum, -(-width // quantum) * quantum


@functools.partial(jax.jit, static_argnames="image_size")
def crop_resize(canvas: jax.Array, box: jax.Array, flip: jax.Array, image_size: int) -> jax.Array:
    """`box` (left, top, right, bottom, in pixels of `canvas`) resized to `image_size`, uint8.

    Antialiased bilinear weights over the exact box, as PIL's bilinear resize;
    mirrored left to right where `flip`.
    """
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


# `crop_resize` of a chunk of same-shaped canvases at once: one launch per chunk.
_crop_resize_chunk = jax.jit(
    jax.vmap(crop_resize.__wrapped__, in_axes=(0, 0, 0, None)), static_argnums=3
)


# `(encoded images, regions (top, left, height, width), device) -> one uint8 [height, width, 3]
# array per image on `device` (the region, zeros beyond the image), or None where it fails.
RegionDecoder = Callable[[list[bytes], list[tuple[int, int, int, int]], Any], list[Any]]


def nvimgcodec_regions() -> RegionDecoder:
    """nvImageCodec's ROI decoding on each local GPU: the device half of this decoder."""
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
    """Host batches of requests -> batches whose `"image"` was decoded on the local devices.

    Args:
      image_size: the side of the output.
      host_load: `slot -> example` of the CPU decoder (`pipeline.LoadTrainExample`
        or `LoadEvalExample` with the CPU decoder): what an image the device
        refuses becomes, exactly as with the CPU decoder.
      regions: the region decoder; None: nvImageCodec's (`nvimgcodec_regions`).
      axis_name: the device axis the batches are sharded along.
    """

    def __init__(
        self,
        image_size: int,
        host_load: Callable[[tuple[int, ...]], Batch],
        regions: RegionDecoder | None = None,
        axis_name: str = DEFAULT_AXIS_NAME,
    ):
        self._image_size, self._host_load = image_size, host_load
        self._regions = nvimgcodec_regions() if regions is None else regions
        self._sharding = jax.sharding.NamedSharding(
            local_mesh(axis_name), jax.sharding.PartitionSpec(axis_name)
        )

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
        """`[len(rows), S, S, 3]` on `device`: the requests' images, decoded there if they can be.

        The regions are decoded in one call, then resized in chunks of `CHUNK`
        canvases of one shape (the examples sorted by size, so a chunk's canvas
        is about its images' size).
        """
        todo = sorted((i for i in rows if batch["encoded"][i]), key=lambda i: _side(batch, i))
        chunks = [todo[start : start + CHUNK] for start in range(0, len(todo), CHUNK)]
        regions = {}
        for chunk in chunks:
            side = _side(batch, chunk[-1])  # The chunk's largest.
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
        """Example `i` as the CPU decoder loads it from its slot; its fields replace the batch's."""
        example = self._host_load(tuple(int(v) for v in batch["slot"][i]))
        for name, value in example.items():
            if name != "image":
                batch[name][i] = value
        return example["image"]


def _side(batch: Batch, i: int) -> int:
    """The side of the square canvas the box of example `i` fits in."""
    return max(region(batch["box"][i])[2:])


def decoded_batches(host_batches: Iterator[Batch], decoder: DeviceDecoder) -> Iterator[Batch]:
    """`decoder` applied to each host batch; closing it closes `host_batches` (its workers)."""
    try:
        for batch in host_batches:
            yield decoder(batch)
    finally:
        if hasattr(host_batches, "close"):
            host_batches.close()
