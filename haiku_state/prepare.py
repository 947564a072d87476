"""Converts a dataset to ArrayRecord shards: `python -m haiku_state.prepare --from=... --to=OUT`.

    python -m haiku_state.prepare --from=imagefolder:/data/imagenet --to=/data/imagenet-ar
    python -m haiku_state.prepare --from=cifar10:/data/cifar-10-batches-py --to=/data/c10-ar
    python -m haiku_state.prepare --from=digits --to=/tmp/digits-ar
    python -m haiku_state.prepare --from=imagefolder:/data/imagenet --to=/data/256 --short_side=256

The sources (--from):
  imagefolder:DIR  DIR/train/<class>/* and DIR/val/<class>/* (JPEG or PNG files; class i
                   is the i-th class folder in sorted order), as ILSVRC-2012 is extracted
  cifar10:DIR      the cifar-10-batches-py folder of CIFAR-10's python release
  digits           scikit-learn's 8x8 handwritten digits, embedded in the package

Train on OUT with `--config.data.name=arrayrecord --config.data.dir=OUT`: the source's
examples in its order, in a few large files a network filesystem reads fast. Images keep the
source's encoding (CIFAR-10 and the digits as PNG) or, with --short_side=N, are re-encoded
with their short side at most N pixels (JPEG quality 95, PNG stays PNG); smaller images and
undecodable files are stored as they are.

OUT/dataset.json, written last, marks the conversion complete: the classes, each shard's
record count, size, modification time and SHA-256, and the per-channel mean and
std the network standardises with (over the centre crops of at most 1,000 training images,
or the exact ones of the digits and CIFAR-10). A rerun keeps the complete shards;
OUT/prepare.json refuses a rerun with another source or layout.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from absl import app, flags, logging
from PIL import Image

from haiku_state import errors
from haiku_state.data import arrayrecord, imagefolder, in_memory, preprocess
from haiku_state.data.splits import DataError, Split

CIFAR10_CLASSES = tuple("airplane automobile bird cat deer dog frog horse ship truck".split())
PLAN_FILE = "prepare.json"
SHORT_SIDE_QUALITY = 95


class SourceSplit(NamedTuple):
    """One split to convert: its size, and `read(i) -> (encoded image, label, name)`."""

    num_examples: int
    read: Callable[[int], tuple[bytes, int, str]]


class Source(NamedTuple):
    """What a conversion reads: the splits, the classes, the images' mean and std."""

    splits: dict[str, SourceSplit]
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def open_source(spec: str) -> Source:
    """The source `--from` names: imagefolder:DIR, cifar10:DIR or digits."""
    kind, _, path = spec.partition(":")
    if kind == "imagefolder":
        tree = imagefolder.index_tree(path)
        splits = {
            split: SourceSplit(len(r), lambda i, r=r: (*r[i], r.name(i)))
            for split, r in tree.records.items()
        }
        return Source(splits, tree.classes, tree.mean, tree.std)
    if kind == "cifar10":
        dataset, classes = in_memory.load_cifar10(path), list(CIFAR10_CLASSES)
    elif kind == "digits":
        dataset, classes = in_memory.load_digits(), [str(d) for d in range(10)]
    else:
        raise errors.InvalidValue(
            f"--from={spec!r}: expected imagefolder:DIR, cifar10:DIR or digits."
        )
    splits = {"train": _png_split(dataset.train, "train"), "val": _png_split(dataset.test, "val")}
    return Source(splits, classes, dataset.mean, dataset.std)


def _png_split(split: Split, name: str) -> SourceSplit:
    def read(index: int) -> tuple[bytes, int, str]:
        pixels = split.images[index]
        buffer = io.BytesIO()
        Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buffer, "PNG")
        return buffer.getvalue(), int(split.labels[index]), f"{name}/{index:06d}"

    return SourceSplit(len(split.labels), read)


def shorten(image: bytes, short_side: int) -> bytes:
    """The image re-encoded (bicubic; PNG stays PNG, the rest JPEG) with its short side at most
    `short_side`; as it is if it already is, or if PIL cannot decode it."""
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


def statistics(
    source: Source, short_side: int | None, pool: concurrent.futures.Executor
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std `dataset.json` records: the source's, or with `short_side` those of
    a sample of the re-encoded training images."""
    if short_side is None:
        return source.mean, source.std
    train = _shortened(source.splits["train"], short_side)
    sample = preprocess.statistics_sample(train.num_examples)
    try:
        return preprocess.pixel_statistics(image for image, _, _ in pool.map(train.read, sample))
    except ValueError as e:
        raise DataError(f"--short_side={short_side}: {e}.") from None


def _record_plan(out_dir: str, plan: dict[str, Any]) -> None:
    """Records what the output folder will hold, or refuses to resume another plan there."""
    path = os.path.join(out_dir, PLAN_FILE)
    if not os.path.isfile(path):
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(plan, f, indent=1)
        return
    with open(path) as f:
        previous = json.load(f)
    if previous != plan:
        differ = sorted(key for key in plan if previous.get(key) != plan[key])
        raise DataError(
            f"{out_dir} holds a conversion of another source or layout ({', '.join(differ)} "
            f"differ from {path}); choose another --to, or remove it."
        )


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
    shards = [
        (
            arrayrecord.shard_name(split, s, num_shards),
            range(s * examples_per_shard, min((s + 1) * examples_per_shard, source.num_examples)),
        )
        for s in range(num_shards)
    ]
    missing = [(n, b) for n, b in shards if not os.path.isfile(os.path.join(out_dir, n))]
    done = source.num_examples - sum(len(b) for _, b in missing)
    with (
        tqdm(total=source.num_examples, initial=done, desc=split, unit="img") as progress,
        concurrent.futures.ThreadPoolExecutor(threads) as pool,
    ):
        for name, indices in missing:

            def records(indices=indices) -> Iterator[bytes]:
                for example in _read_ahead(source.read, indices, pool, 4 * threads):
                    progress.update()
                    yield arrayrecord.encode_example(*example)

            arrayrecord.write_shard(os.path.join(out_dir, name), records())
    return [arrayrecord.shard_entry(out_dir, n, len(b)) for n, b in shards]


def _check_options(
    out_dir: str, examples_per_shard: int, threads: int, short_side: int | None
) -> None:
    """Refuses, before anything is read or written, options `convert` cannot use."""
    if examples_per_shard < 1:
        raise errors.InvalidValue(f"--examples_per_shard={examples_per_shard} must be positive.")
    if short_side is not None and short_side < 1:
        raise errors.InvalidValue(f"--short_side={short_side} must be positive (or left out).")
    if threads < 1:
        raise errors.InvalidValue(f"--threads={threads} must be positive: the files read at once.")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise errors.InvalidValue(f"--to={out_dir} is a file; expected a folder (made if missing).")


def convert(
    spec: str,
    out_dir: str,
    *,
    examples_per_shard: int = 10_000,
    threads: int = 16,
    short_side: int | None = None,
) -> dict[str, Any]:
    """Converts the source `spec` into `out_dir`, resuming where an earlier run stopped;
    returns the `dataset.json` written."""
    _check_options(out_dir, examples_per_shard, threads, short_side)
    source = open_source(spec)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        mean, std = statistics(source, short_side, pool)
    logging.info("Pixel mean %s, std %s (RGB, 0..255).", mean, std)
    kind, _, path = spec.partition(":")
    sizes = {split: s.num_examples for split, s in source.splits.items()}
    plan = {
        "source": f"{kind}:{os.path.realpath(path)}" if path else kind,
        "examples_per_shard": examples_per_shard,
        "classes": source.classes,
        "num_examples": sizes,
        "short_side": short_side,
    }
    _record_plan(out_dir, plan)  # A rerun must make the same plan to resume.
    splits = {}
    for split in arrayrecord.SPLITS:
        read = _shortened(source.splits[split], short_side)
        shards = convert_split(out_dir, split, read, examples_per_shard, threads)
        splits[split] = {"num_examples": sizes[split], "shards": shards}
    metadata = {
        "format": arrayrecord.FORMAT,
        "source": spec,
        "classes": source.classes,
        "num_classes": len(source.classes),
        "mean": list(mean),
        "std": list(std),
        "short_side": short_side,
        "splits": splits,
    }
    path = os.path.join(out_dir, arrayrecord.DATASET_FILE)
    with open(f"{path}.incomplete", "w") as f:
        json.dump(metadata, f, indent=1)
    os.replace(f"{path}.incomplete", path)
    return metadata


def run(spec: str, out_dir: str, **options: Any) -> None:
    """`convert` as the command line runs it: a one-line error, or exit 130 on Ctrl-C."""
    try:
        metadata = convert(spec, out_dir, **options)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # The shard being written is dropped whole (`write_shard`).
        print(
            f"\nInterrupted: the complete shards in {out_dir} are kept; run the same "
            "command again to write the rest.",
            file=sys.stderr,
        )
        sys.exit(128 + signal.SIGINT)
    sizes = {split: s["num_examples"] for split, s in metadata["splits"].items()}
    print(f"Wrote {out_dir}: {sizes} examples, {metadata['num_classes']} classes.")


def main(argv: Sequence[str] | None = None) -> None:
    source = flags.DEFINE_string(
        "from", None, "What to convert: imagefolder:DIR, cifar10:DIR or digits (above)."
    )
    out_dir = flags.DEFINE_string(
        "to", None, "The output folder, made if missing. Run the same command again to complete "
        "an interrupted conversion; another source or layout there is refused.")  # fmt: skip
    examples_per_shard = flags.DEFINE_integer(
        "examples_per_shard", 10_000, "Examples per shard file (10,000 makes ImageNet's "
        "1.28 M training images 129 shards of about 1.1 GB).")  # fmt: skip
    threads = flags.DEFINE_integer(
        "threads", 16, "Files read (and re-encoded, with --short_side) at once; more than "
        "the cores helps on a network filesystem.")  # fmt: skip
    short_side = flags.DEFINE_integer(
        "short_side", None, "Re-encode every image to this short side, if its own "
        "is longer (above). Unset: every image is stored as the source has it.")  # fmt: skip
    flags.mark_flags_as_required(["from", "to"])

    def convert_flags(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments {argv[1:]}: everything is given in flags.")
        options = {"examples_per_shard": examples_per_shard.value, "threads": threads.value}
        run(source.value, out_dir.value, short_side=short_side.value, **options)

    app.run(convert_flags, argv=argv)


if __name__ == "__main__":
    from haiku_state.guards import processes

    processes.run_then_exit_at_once(main)
