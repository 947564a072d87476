r"""The input pipeline's throughput: decoding alone, and the training loop it feeds.

    python -m benchmarks.input_pipeline [--images=2048] [--image_size=224] [--decoder=cpu] \
        [--loop_experiment=mlp --loop_image_size=64 --loop_batch_size=64 --loop_steps=120]

1. Writes ImageNet-like JPEGs (500x375, about 100 KB: smooth noise at several
   scales plus grain, so they compress as photos do) into a temporary ImageFolder.
2. One core, one image at a time: decode + random crop + resize to
   `image_size` squared, by libjpeg-turbo (simplejpeg) and by PIL; the whole
   training example of the CPU decoder (`cpu`), and of the CPU decoder before
   OpenCV resized (`cpu_baseline`, `benchmarks/baseline_decode.py`).
3. The pipeline alone (`pipeline.encoded_train_batches`): images/s into
   `image_size` squared uint8 batches, for 1 worker and for as many workers as
   this process may use cores; per worker, and the scaling between the two.
   Each worker count runs `--repeats` times with the decoder of `--decoder` and
   as many with the baseline decoder through the same pipeline, interleaved
   (which goes first alternates): the figures are the medians, and
   `ratio_vs_baseline` the median of the per-repeat ratios, with its spread.
   With `--decoder=gpu` the batches are decoded on the device too.
4. The training loop (`driver.train_and_evaluate`) fed by the pipeline, against
   the smaller of the pipeline alone and the bare update at the same settings
   (a model and image size a CPU trains). The bare update runs first and
   compiles the programs the loop runs into this process's compilation cache,
   so the loop loads them instead of compiling them again. On a CPU the update
   is timed on the first core and the workers on the others
   (`--pin_update_core`, after the compiles, which use every core), as on an
   accelerator host, where the update does not take the decoders' cores; on an
   accelerator nothing is pinned by default. `--loop_time_limit_s` bounds the
   loop: past it the run stops and saves, and the record holds the windows it
   logged (`stopped_by_time_limit`).

Prints one JSON record (also written to `--out` if given). The figures are the
machine's: on a shared machine, other processes' load moves them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import jax
import numpy as np
from PIL import Image

from benchmarks import baseline_decode, report
from benchmarks.compiles import CompileEvents
from benchmarks.loop import Deadline
from haiku_state import compilation_cache, data, driver, summaries
from haiku_state import config as config_lib
from haiku_state.data import gpu_decode, host_cache, pipeline, preprocess
from haiku_state.experiment import build_experiment, placeholder_batch
from haiku_state.guards import config_checks, signals

EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments")
WIDTH, HEIGHT = 500, 375
JPEG_QUALITY = 90
NUM_CLASSES = 10


def photo_like(rng: np.random.Generator) -> np.ndarray:
    """An RGB image with structure at every scale, as photos have: its JPEG is photo-sized."""
    image = np.zeros((HEIGHT, WIDTH, 3), np.float32)
    for cells, amplitude in ((6, 70.0), (25, 40.0), (100, 30.0), (250, 25.0)):
        coarse = rng.integers(0, 256, (max(2, HEIGHT * cells // WIDTH), cells, 3), dtype=np.uint8)
        smooth = Image.fromarray(coarse).resize((WIDTH, HEIGHT), Image.Resampling.BICUBIC)
        image += (np.asarray(smooth, np.float32) / 127.5 - 1.0) * amplitude
    image += rng.normal(0.0, 7.0, (HEIGHT, WIDTH, 1))
    return np.clip(image + 128.0, 0, 255).astype(np.uint8)


def write_tree(root: str, num_images: int, num_distinct: int, seed: int = 0) -> dict[str, Any]:
    """An ImageFolder of `num_images` training JPEGs (cycling `num_distinct` contents)."""
    rng = np.random.default_rng(seed)
    encoded = []
    for _ in range(num_distinct):
        buffer = io.BytesIO()
        Image.fromarray(photo_like(rng)).save(buffer, "JPEG", quality=JPEG_QUALITY)
        encoded.append(buffer.getvalue())
    for split, count in (("train", num_images), ("val", 4 * NUM_CLASSES)):
        for i in range(count):
            folder = os.path.join(root, split, f"class_{i % NUM_CLASSES:02d}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{i:07d}.JPEG"), "wb") as f:
                f.write(encoded[i % num_distinct])
    sizes = [len(e) for e in encoded]
    return {"images": num_images, "distinct": num_distinct, "mean_kb": statistics.mean(sizes) / 1e3}


def decoder_rates(root: str, image_size: int, seconds: float) -> dict[str, float]:
    """Images/s on one core (this thread) of decode + random crop + resize, per decoder.

    `libjpeg-turbo` and `pil`: the CPU decoder's two libraries on a fixed box;
    `cpu` and `cpu_baseline`: a whole training example (box and flip drawn) by
    today's CPU decoder and by the baseline's. The decoders take turns in short
    rounds, and each keeps its median round, so a change in the machine's load
    meanwhile touches all alike.
    """
    split = data.load_dataset("imagefolder", data_dir=root, image_size=image_size).train
    images = [split.records[i][0] for i in range(min(64, len(split.records)))]
    boxes = [preprocess.random_crop_box(WIDTH, HEIGHT, np.random.default_rng(i)) for i in range(64)]
    decoders = {
        "libjpeg-turbo": lambda jpeg, i: preprocess.decode_crop(
            jpeg, lambda w, h: boxes[i], image_size
        ),
        "pil": lambda jpeg, i: preprocess.resize_crop(
            *preprocess._decode_pil(jpeg, lambda w, h: boxes[i], image_size), image_size, False
        ),
        "cpu": lambda jpeg, i: preprocess.train_image(jpeg, np.random.default_rng(i), image_size),
        "cpu_baseline": lambda jpeg, i: baseline_decode.train_image(
            jpeg, np.random.default_rng(i), image_size
        ),
    }
    rounds = {name: [] for name in decoders}
    for _ in range(max(1, int(seconds / 0.25))):
        for name, decode in decoders.items():
            start = time.perf_counter()
            for i, image in enumerate(images):
                decode(image, i)
            rounds[name].append(len(images) / (time.perf_counter() - start))
    rates = {name: statistics.median(rates) for name, rates in rounds.items()}
    rates["cpu_vs_baseline"] = statistics.median(
        new / old for new, old in zip(rounds["cpu"], rounds["cpu_baseline"], strict=True)
    )
    return rates


def _children() -> list[str]:
    """The pids of this process's live child processes (the workers), Linux."""
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    children.append(pid)
        except OSError:
            continue  # Gone meanwhile.
    return children


def _children_cpu_seconds() -> float:
    """User + system CPU time of this process's child processes."""
    total = 0.0
    for pid in _children():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _resident_mb(pids: list[str]) -> float:
    """The summed resident memory of `pids` (shared pages counted in each)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
            total += int(line.split()[1]) / 1024
    return total


def _decoded_on_device(
    batches: Any, split: data.EncodedSplit, decoder: str | pipeline.Decoder
) -> Any:
    """The GPU decoder's device half after its workers; other decoders' batches as they are."""
    if decoder != "gpu":
        return batches
    host_load = pipeline.LoadTrainExample(split, 0, False)
    return gpu_decode.decoded_batches(
        batches, gpu_decode.DeviceDecoder(split.image_size, host_load)
    )


def pipeline_rate(
    split: data.EncodedSplit,
    batch_size: int,
    workers: int,
    steps: int,
    decoder: str | pipeline.Decoder = "cpu",
) -> dict[str, float]:
    """The host pipeline alone, once its workers are up (their first batches excluded).

    Returns images/s of wall time, and images per CPU-second of the decoding
    processes (the workers, or this one for 0 workers): the second does not
    count the time other processes of a shared machine take from them.
    """
    warmup = max(workers, 1)
    batches = _decoded_on_device(
        pipeline.encoded_train_batches(
            split, batch_size, seed=0, num_steps=steps + warmup, workers=workers, decoder=decoder
        ),
        split,
        decoder,
    )
    for _ in range(warmup):
        jax.block_until_ready(next(batches)["image"])
    cpu = time.process_time if workers == 0 else _children_cpu_seconds
    start, start_cpu = time.perf_counter(), cpu()
    count = 0
    for _ in range(steps):
        batch = next(batches)
        jax.block_until_ready(batch["image"])
        count += len(batch["label"])
    seconds, cpu_seconds = time.perf_counter() - start, cpu() - start_cpu
    resident_mb = _resident_mb(["self", *_children()])
    batches.close()
    return {
        "images_per_s": count / seconds,
        "images_per_cpu_s": count / cpu_seconds,
        "resident_mb": resident_mb,
    }


def loop_config(args: argparse.Namespace, root: str, workers: int) -> Any:
    """The experiment (`mlp`, `resnet50:imagenet`, ...) on the generated tree, for `loop_steps`."""
    name, _, variant = args.loop_experiment.partition(":")
    path = os.path.join(EXPERIMENTS_DIR, f"{name}.py" + (f":{variant}" if variant else ""))
    config = config_lib.load_config_file(path)
    config.update(
        num_epochs=None,
        steps=args.loop_steps,
        batch_size=args.loop_batch_size,
        eval_batch_size=args.loop_batch_size,
        log_every=args.loop_log_every,
        check_every=args.loop_steps,
        eval_every=args.loop_steps,
        checkpoint_every=args.loop_steps,
    )
    config.optimizer.warmup_steps = args.loop_steps // 4
    config.data.update(
        name="imagefolder",
        dir=root,
        image_size=args.loop_image_size,
        workers=workers,
        decoder=args.decoder,
        max_shift=0,
        flip=False,
    )
    # This process's compilation cache (`main` makes a private one), not the user's.
    config.compilation_cache_dir = jax.config.jax_compilation_cache_dir or ""
    return config


def bare_update_rate(config: Any, steps: int, pin_update_core: bool = False) -> float:
    """Examples/s of `Updater.update` on one device batch, at most two steps in flight.

    Compiles the programs the training loop of `config` runs (init, the step with
    and without the norms, those two side by side: each of ResNet-50's takes about
    45 s on a TPU v5e) on every core, into the compilation cache the loop shares;
    then times the step the loop runs between its logs, on the first core alone if
    `pin_update_core`.
    """
    experiment = build_experiment(config)
    batch = placeholder_batch(experiment.dataset, config.batch_size)
    state = experiment.updater.init(config.seed, batch)
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="compile") as pool:
        compiles = [
            pool.submit(
                experiment.updater.compile_ahead, "update", state, batch, with_global_norms=norms
            )
            for norms in (True, False)
        ]
    for compiled in compiles:
        compiled.result()  # The calls below run these programs.
    for with_norms in (True, False, False):
        state, metrics = experiment.updater.update(state, batch, with_global_norms=with_norms)
    jax.block_until_ready(metrics)
    update = functools.partial(experiment.updater.update, with_global_norms=False)
    with update_core_apart(pin_update_core):
        start, previous = time.perf_counter(), None
        for _ in range(steps):
            state, metrics = update(state, batch)
            if previous is not None:
                jax.block_until_ready(previous)
            previous = metrics
        jax.block_until_ready(previous)
        return steps * config.batch_size / (time.perf_counter() - start)


def loop_rate(config: Any, workdir: str, time_limit_s: float | None = None) -> dict[str, Any]:
    """The training loop's steady examples/s: every logged window but the first (compiles).

    Past `time_limit_s` the run stops as a signal would stop it; the windows it
    logged until then are its figure (None without a steady window).
    """
    deadline = Deadline(time_limit_s)
    with contextlib.redirect_stdout(sys.stderr), CompileEvents() as compiles:
        with contextlib.suppress(signals.Stopped):  # The time limit.
            driver.train_and_evaluate(config, workdir, stop=deadline)
    logged = os.path.exists(os.path.join(workdir, summaries.METRICS_FILE))  # Not if stopped.
    records = sorted(
        (r for r in (summaries.read_metrics(workdir) if logged else []) if r["split"] == "train"),
        key=lambda r: r["step"],
    )
    steps_logged = records[-1]["step"] if records else 0
    steady = records[1:]
    seconds = sum(config.log_every * config.batch_size / r["examples_per_s"] for r in steady)
    return {
        "examples_per_s": (
            len(steady) * config.log_every * config.batch_size / seconds if steady else None
        ),
        "steps_logged": steps_logged,
        # Past the limit before the last step (not after it, during the final evaluation).
        "stopped_by_time_limit": deadline.expired and steps_logged < config.steps,
        "compiles": compiles.figures(),
    }


def measure_pipeline(
    split: data.EncodedSplit,
    batch_size: int,
    worker_counts: list[int],
    steps: int,
    decoder: str = "cpu",
    repeats: int = 1,
) -> dict[str, Any]:
    """The pipeline alone for each worker count with `decoder` and with the baseline's.

    Every repeat runs each worker count with both decoders, the first of the two
    alternating; the figures are medians over the repeats.
    """
    runs: dict[int, list[dict[str, float]]] = {w: [] for w in worker_counts}
    baseline: dict[int, list[dict[str, float]]] = {w: [] for w in worker_counts}
    for repeat in range(repeats):
        for w in worker_counts:
            pair = [(runs[w], decoder), (baseline[w], baseline_decode.DECODER)]
            for results, run_decoder in pair[:: 1 if repeat % 2 == 0 else -1]:
                results.append(pipeline_rate(split, batch_size, w, steps, run_decoder))

    def median(results: dict[int, list[dict[str, float]]], key: str) -> dict[str, float]:
        return {str(w): statistics.median(r[key] for r in results[w]) for w in worker_counts}

    def each(results: dict[int, list[dict[str, float]]]) -> dict[str, list[float]]:
        return {str(w): [r["images_per_s"] for r in results[w]] for w in worker_counts}

    rates = median(runs, "images_per_s")
    ratios = {
        str(w): [
            new["images_per_s"] / old["images_per_s"]
            for new, old in zip(runs[w], baseline[w], strict=True)
        ]
        for w in worker_counts
    }
    first, last = str(worker_counts[0]), str(worker_counts[-1])
    scales = first != last and worker_counts[0] > 0
    return {
        "image_size": split.image_size,
        "batch_size": batch_size,
        "decoder": decoder,
        "repeats": repeats,
        "images_per_s": rates,
        "images_per_s_per_worker": {str(w): rates[str(w)] / max(w, 1) for w in worker_counts},
        "images_per_worker_cpu_s": median(runs, "images_per_cpu_s"),
        "resident_mb_with_workers": median(runs, "resident_mb"),
        "scaling": rates[last] / rates[first] if scales else None,
        "scaling_target": 0.8 * worker_counts[-1] / worker_counts[0] if scales else None,
        "images_per_s_runs": each(runs),
        "baseline": "benchmarks/baseline_decode.py: the CPU decoder of 6e7fcfe, same pipeline",
        "baseline_images_per_s": median(baseline, "images_per_s"),
        "baseline_images_per_s_runs": each(baseline),
        "baseline_images_per_worker_cpu_s": median(baseline, "images_per_cpu_s"),
        "ratio_vs_baseline": {w: statistics.median(r) for w, r in ratios.items()},
        "ratio_vs_baseline_runs": ratios,
        "ratio_vs_baseline_1_worker": (statistics.median(ratios["1"]) if "1" in ratios else None),
    }


@contextlib.contextmanager
def update_core_apart(enabled: bool) -> Iterator[None]:
    """This process (the loop, XLA:CPU's pool) on the first core, its workers on the others.

    On a CPU the update and the decoding compete for the same cores; on an
    accelerator host they do not. Pinning them apart makes the CPU loop figure
    answer the question it is for: does feeding the loop cost it throughput.
    """
    if not enabled:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    for thread_id in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(thread_id), {cores[0]})
    stop = threading.Event()

    def move_workers() -> None:  # Workers start on the first core, where they are spawned.
        while not stop.wait(0.1):
            for pid in _children():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(pid), set(cores[1:]))

    mover = threading.Thread(target=move_workers, daemon=True)
    mover.start()
    try:
        yield
    finally:
        stop.set()
        mover.join()
        for thread_id in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(thread_id), set(cores))


def measure_loop(args: argparse.Namespace, root: str, workers: int) -> dict[str, Any]:
    """The loop fed by `workers` decoding processes against the bare update and the pipeline.

    `args.decoder` is the decoder of both (`config.data.decoder`).
    """
    config = loop_config(args, root, workers)
    config_checks.validate_config(config, jax.device_count())  # A decoder refused here, at once.
    split = data.load_dataset("imagefolder", data_dir=root, image_size=args.loop_image_size).train
    # The pipeline alone on both sides of the loop: a shared machine's load drifts.
    steps = args.loop_steps // 2
    pinned = pin_update_core(args.pin_update_core) and len(os.sched_getaffinity(0)) > workers > 0
    update = bare_update_rate(config, args.loop_steps, pinned)  # Compiles the loop's programs.
    with update_core_apart(pinned):
        before = pipeline_rate(split, config.batch_size, workers, steps, args.decoder)[
            "images_per_s"
        ]
        with tempfile.TemporaryDirectory(prefix="bench_loop_") as workdir:
            loop = loop_rate(config, workdir, args.loop_time_limit_s)
        after = pipeline_rate(split, config.batch_size, workers, steps, args.decoder)[
            "images_per_s"
        ]
    alone = (before + after) / 2
    bound = min(alone, update)
    examples_per_s = loop["examples_per_s"]
    return {
        "experiment": args.loop_experiment,
        "decoder": config.data.decoder,
        "image_size": args.loop_image_size,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "steps_logged": loop["steps_logged"],
        "stopped_by_time_limit": loop["stopped_by_time_limit"],
        # The loop's programs, loaded from the cache the bare update wrote (`cache_hits`).
        "loop_compiles": loop["compiles"],
        "workers": workers,
        "update_core_apart": pinned,
        "pipeline_alone_images_per_s": alone,
        "pipeline_alone_before_after": [before, after],
        "bare_update_examples_per_s": update,
        "loop_examples_per_s": examples_per_s,
        "ratio_vs_min": examples_per_s / bound if examples_per_s else None,
        "ratio_vs_update": examples_per_s / update if examples_per_s else None,
        "bound": "pipeline" if alone <= update else "update",
    }


def pin_update_core(value: str) -> bool:
    """`--pin_update_core`: true, false, or auto (true on a CPU, where the update and the
    decoders share the cores; false on an accelerator, where the update needs none)."""
    value = value.lower()
    if value == "auto":
        return jax.default_backend() == "cpu"
    return value in ("1", "true", "yes")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.input_pipeline")
    parser.add_argument("--images", type=int, default=2048, help="training JPEGs written")
    parser.add_argument("--distinct", type=int, default=256, help="distinct contents among them")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24, help="batches timed per worker count")
    parser.add_argument("--workers", default="", help="worker counts, e.g. 1,15 (1 and cores)")
    parser.add_argument(
        "--decoder", default="cpu", choices=tuple(pipeline.DECODERS), help="config.data.decoder"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per worker count, each beside the baseline"
    )
    parser.add_argument("--decoder_seconds", type=float, default=4.0, help="rounds x 0.25 s")
    parser.add_argument("--loop_experiment", default="mlp", help="or resnet50:imagenet, ...")
    parser.add_argument("--loop_workers", type=int, default=None, help="default: cores - 1")
    parser.add_argument("--loop_image_size", type=int, default=64)
    parser.add_argument("--loop_batch_size", type=int, default=64)
    parser.add_argument("--loop_steps", type=int, default=120)
    parser.add_argument("--loop_log_every", type=int, default=20)
    parser.add_argument("--no_loop", action="store_true", help="skip the training loop")
    parser.add_argument(
        "--pin_update_core",
        default="auto",
        help="loop: time the update on the first core, the workers on the others: true, "
        "false, or auto (true on a CPU, false on an accelerator)",
    )
    parser.add_argument(
        "--loop_time_limit_s",
        type=float,
        default=600.0,
        help="loop: stop the run past this many seconds; its logged windows are the figure",
    )
    parser.add_argument("--out", default="", help="also write the JSON record here")
    args = parser.parse_args(argv)
    if args.decoder == "gpu" and (reason := gpu_decode.unavailable_reason()):
        parser.error(f"--decoder=gpu decodes on the GPU: {reason}.")
    cores = len(os.sched_getaffinity(0))
    worker_counts = [int(w) for w in args.workers.split(",")] if args.workers else [1, cores]
    record: dict[str, Any] = {
        "machine": {
            "cores": cores,
            "load_average": os.getloadavg(),
            "python": platform.python_version(),
        }
    }
    with (
        tempfile.TemporaryDirectory(prefix="bench_imagefolder_") as root,
        tempfile.TemporaryDirectory(prefix="bench_index_cache_") as cache,
        mock.patch.dict(os.environ, {host_cache.CACHE_ENV: cache}),  # Not the user's.
    ):
        # The loop shares the bare update's compiles through a cache of this run's own.
        compilation_cache.enable(os.path.join(cache, "jax_compilation_cache"))
        record["data"] = write_tree(root, args.images, args.distinct)
        record["decoders_one_core_images_per_s"] = decoder_rates(
            root, args.image_size, args.decoder_seconds
        )
        split = data.load_dataset("imagefolder", data_dir=root, image_size=args.image_size).train
        record["pipeline"] = measure_pipeline(
            split, args.batch_size, worker_counts, args.steps, args.decoder, args.repeats
        )
        if not args.no_loop:
            workers = data.default_workers() if args.loop_workers is None else args.loop_workers
            record["loop"] = measure_loop(args, root, workers)
    record["machine"]["load_average_after"] = os.getloadavg()
    text = json.dumps(record, indent=1)
    if args.out:  # The figures in the file; a few lines of them on the screen.
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print("\n".join(report.input_pipeline_lines(record)) + f"\nwrote {args.out}")
    else:
        print(text)
    return record


if __name__ == "__main__":
    main()
