"""Converts a dataset to ArrayRecord shards: `python -m haiku_state.prepare --from=... --to=OUT`.

    python -m haiku_state.prepare --from=imagefolder:/data/imagenet --to=/data/imagenet-ar
    python -m haiku_state.prepare --from=cifar10:/data/cifar-10-batches-py --to=/data/c10-ar
    python -m haiku_state.prepare --from=digits --to=/tmp/digits-ar
    python -m haiku_state.prepare --from=imagefolder:/data/imagenet --to=/data/256 --short_side=256

Train on the result with `--config.data.name=arrayrecord --config.data.dir=OUT`: the
same examples in the same order as the source (so an ImageFolder tree and its
shards give identical batches), in a few large files, which is what a network
filesystem reads fast. Images are stored as the source encodes them (the JPEG
bytes of an ImageFolder; CIFAR-10 and the digits as lossless PNG), or, with
`--short_side=N`, re-encoded with their short side at most N pixels (JPEG at
quality `SHORT_SIDE_QUALITY`, PNG stays PNG): decoding costs follow the pixel
count, so every epoch decodes faster, for crops drawn from fewer pixels. Images
already that small, and files that cannot be decoded, are stored as they are
(training then treats them as it would have). `dataset.json` records N, and a
training run started on the shards of one `short_side` refuses to resume on
another's.

The conversion is resumable: each shard is written to a temporary name and
renamed when complete, a rerun skips the shards already there, and
`dataset.json`, written last, marks the folder complete. `OUT/prepare.json`
records what the conversion is of, so a rerun with another source is refused
instead of mixing the two.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from PIL import Image

from haiku_state.data import arrayrecord, imagefolder, in_memory, preprocess
from haiku_state.data.splits import IMAGENET_MEAN, IMAGENET_STD, DataError, Split

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer")
CIFAR10_CLASSES += ("dog", "frog", "horse", "ship", "truck")
PLAN_FILE = "prepare.json"
SHORT_SIDE_QUALITY = 95


class SourceSplit(NamedTuple):
    """One split to convert: its size, and `read(i) -> (encoded image, label, name)`."""

    num_examples: int
    read: Callable[[int], tuple[bytes, int, str]]


class Source(NamedTuple):
    """What a conversion reads: the splits (`train`, `val`) and what `dataset.json` records."""

    splits: dict[str, SourceSplit]
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def open_source(spec: str) -> Source:
    """`imagefolder:DIR`, `cifar10:DIR` or `digits` as a `Source`."""
    kind, _, path = spec.partition(":")
    if kind == "imagefolder":
        classes, records = imagefolder.index_tree(path)
        splits = {
            split: SourceSplit(len(r), lambda i, r=r: (*r[i], r.name(i)))
            for split, r in records.items()
        }
        return Source(splits, classes, IMAGENET_MEAN, IMAGENET_STD)
    if kind in ("cifar10", "digits"):
        if kind == "cifar10":
            dataset, classes = in_memory.load_cifar10(path), list(CIFAR10_CLASSES)
        else:
            dataset, classes = in_memory.load_digits(), [str(d) for d in range(10)]
        splits = {
            "train": _png_split(dataset.train, "train"),
            "val": _png_split(dataset.test, "val"),
        }
        return Source(splits, classes, dataset.mean, dataset.std)
    raise ValueError(f"--from={spec!r}: expected imagefolder:DIR, cifar10:DIR or digits.")


def _png_split(split: Split, name: str) -> SourceSplit:
    def read(index: int) -> tuple[bytes, int, str]:
        pixels = split.images[index]
        buffer = io.BytesIO()
        Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buffer, "PNG")
        return buffer.getvalue(), int(split.labels[index]), f"{name}/{index:06d}"

    return SourceSplit(len(split.labels), read)


def shorten(image: bytes, short_side: int) -> bytes:
    """The image re-encoded with its short side at most `short_side`; as it is if it already is.

    Resized with antialiasing (PIL's bicubic, after a DCT-scaled decode of a JPEG);
    a JPEG (or anything but a PNG) becomes an RGB JPEG, a PNG an RGB PNG. Bytes
    PIL cannot decode are returned as they are.
    """
    try:
        with Image.open(io.BytesIO(image)) as decoded:
            width, height = decoded.size
            if min(width, height) <= short_side:
                return image
            scale = short_side / min(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            png = decoded.format == "PNG"
            decoded.draft("RGB", size)
            rgb = preprocess._to_rgb(decoded).resize(size, Image.Resampling.BICUBIC)
    except (OSError, ValueError, Image.DecompressionBombError):  # What training will meet.
        return image
    buffer = io.BytesIO()
    rgb.save(buffer, "PNG" if png else "JPEG", **({} if png else {"quality": SHORT_SIDE_QUALITY}))
    return buffer.getvalue()


def _shortened(split: SourceSplit, short_side: int | None) -> SourceSplit:
    if short_side is None:
        return split

    def read(index: int) -> tuple[bytes, int, str]:
        image, label, name = split.read(index)
        return shorten(image, short_side), label, name

    return SourceSplit(split.num_examples, read)


def _plan(
    spec: str, source: Source, examples_per_shard: int, short_side: int | None
) -> dict[str, Any]:
    """What the output folder will hold; a rerun must make the same plan to resume."""
    kind, _, path = spec.partition(":")
    return {
        "source": f"{kind}:{os.path.realpath(path)}" if path else kind,
        "examples_per_shard": examples_per_shard,
        "classes": source.classes,
        "num_examples": {split: s.num_examples for split, s in source.splits.items()},
        "short_side": short_side,
    }


def _check_plan(out_dir: str, plan: dict[str, Any]) -> None:
    """Records the plan, or refuses to resume a conversion made with another one."""
    path = os.path.join(out_dir, PLAN_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            previous = json.load(f)
        if previous != plan:
            differ = sorted(key for key in plan if previous.get(key) != plan[key])
            raise DataError(
                f"{out_dir} holds a conversion of another source or layout ({', '.join(differ)} "
                f"differ from {path}); choose another --to, or remove it."
            )
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)


def _read_ahead(read: Callable[[int], Any], indices: range, pool, window: int) -> Iterator[Any]:
    """`read(i)` for each index in order, at most `window` reads running ahead."""
    pending = [pool.submit(read, i) for i in indices[:window]]
    for position in range(len(indices)):
        if position + window < len(indices):
            pending.append(pool.submit(read, indices[position + window]))
        yield pending[position].result()
        pending[position] = None  # Frees the bytes once written.


def convert_split(
    out_dir: str, split: str, source: SourceSplit, examples_per_shard: int, threads: int
) -> list[dict[str, Any]]:
    """Writes the shards of one split that are not there yet; returns every shard's entry."""
    from tqdm import tqdm

    num_shards = max(1, -(-source.num_examples // examples_per_shard))
    bounds = [
        range(s * examples_per_shard, min((s + 1) * examples_per_shard, source.num_examples))
        for s in range(num_shards)
    ]
    names = [arrayrecord.shard_name(split, s, num_shards) for s in range(num_shards)]
    done = sum(len(b) for b, n in zip(bounds, names, strict=True) if _exists(out_dir, n))
    with (
        tqdm(total=source.num_examples, initial=done, desc=split, unit="img") as progress,
        concurrent.futures.ThreadPoolExecutor(threads) as pool,
    ):
        for indices, name in zip(bounds, names, strict=True):
            if _exists(out_dir, name):
                continue

            def records(indices=indices) -> Iterator[bytes]:
                for image, label, example_name in _read_ahead(
                    source.read, indices, pool, 4 * threads
                ):
                    progress.update()
                    yield arrayrecord.encode_example(image, label, example_name)

            arrayrecord.write_shard(os.path.join(out_dir, name), records())
    return [{"file": n, "num_examples": len(b)} for b, n in zip(bounds, names, strict=True)]


def _exists(out_dir: str, name: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, name))


def convert(
    spec: str,
    out_dir: str,
    *,
    examples_per_shard: int = 10_000,
    threads: int = 16,
    short_side: int | None = None,
):
    """Converts the source `spec` into `out_dir`, resuming where an earlier run stopped.

    `short_side`: re-encode the images with their short side at most this many
    pixels (`shorten`); None stores them as the source has them.

    Returns:
      The `dataset.json` written.
    """
    if examples_per_shard < 1:
        raise ValueError(f"--examples_per_shard={examples_per_shard} must be positive.")
    if short_side is not None and short_side < 1:
        raise ValueError(f"--short_side={short_side} must be positive (or left out).")
    if threads < 1:
        raise ValueError(f"--threads={threads} must be positive: the files read at once.")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--to={out_dir} is a file; expected a folder (made if missing).")
    source = open_source(spec)
    _check_plan(out_dir, _plan(spec, source, examples_per_shard, short_side))
    splits = {}
    for split in arrayrecord.SPLITS:
        read = _shortened(source.splits[split], short_side)
        shards = convert_split(out_dir, split, read, examples_per_shard, threads)
        splits[split] = {"num_examples": source.splits[split].num_examples, "shards": shards}
    metadata = {
        "format": arrayrecord.FORMAT,
        "source": spec,
        "classes": source.classes,
        "num_classes": len(source.classes),
        "mean": list(source.mean),
        "std": list(source.std),
        "short_side": short_side,
        "splits": splits,
    }
    path = os.path.join(out_dir, arrayrecord.DATASET_FILE)
    with open(f"{path}.incomplete", "w") as f:
        json.dump(metadata, f, indent=1)
    os.replace(f"{path}.incomplete", path)
    return metadata


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m haiku_state.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--from", dest="source", required=True, help="imagefolder:DIR, ...")
    parser.add_argument("--to", dest="out_dir", required=True, help="the output folder")
    parser.add_argument("--examples_per_shard", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=16, help="files read at once")
    parser.add_argument(
        "--short_side", type=int, default=None, help="re-encode images to this short side"
    )
    args = parser.parse_args(argv)
    try:
        metadata = convert(
            args.source,
            args.out_dir,
            examples_per_shard=args.examples_per_shard,
            threads=args.threads,
            short_side=args.short_side,
        )
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # The shard being written is dropped whole (`write_shard`).
        print(
            f"\nInterrupted: the complete shards in {args.out_dir} are kept; run the same "
            "command again to write the rest.",
            file=sys.stderr,
        )
        sys.exit(128 + signal.SIGINT)
    sizes = {split: s["num_examples"] for split, s in metadata["splits"].items()}
    print(f"Wrote {args.out_dir}: {sizes} examples, {metadata['num_classes']} classes.")


if __name__ == "__main__":
    main()
