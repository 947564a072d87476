"""Draws the benchmark results: scaling, throughput and ratio charts as PNG files.

    python -m benchmarks.plot [--results_dir=benchmarks/results] [--output_dir=DIR]

Reads every `*.json` run record in `results_dir` (written by `benchmarks.run`:
the curated `<platform>.json` records, and the timestamped runs of this
machine), or the one record `results_dir` names, and writes, next to them
unless `--output_dir` says otherwise:

* `scaling.png`: Updater examples/s against the device count, one panel per
  experiment, one line per platform/device kind and precision (the latest run
  of each wins where runs overlap);
* `throughput.png`: examples/s of the Updater (pmap and shard_map backends), the
  hand-written pmap step and the Flax peer, per experiment and device count, of
  the latest run;
* `ratios.png`: Updater / hand-written, Updater / Flax, shard_map Updater / pmap
  Updater, input pipeline / pre-sharded and training loop / bare update, with
  the targets drawn in.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"

SCALING_FILE = "scaling.png"
THROUGHPUT_FILE = "throughput.png"
RATIOS_FILE = "ratios.png"


def load_runs(results: str | Path) -> list[dict[str, Any]]:
    """Every run record in the directory `results` (or the record it names), oldest first.

    Unreadable files are skipped.
    """
    results = Path(results)
    paths = [results] if results.is_file() else sorted(results.glob("*.json"))
    runs = []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
            continue
        if isinstance(record, dict) and "results" in record:
            record["_path"] = str(path)
            runs.append(record)
    runs.sort(key=lambda r: r.get("created_utc") or "")
    return runs


def _series_label(run: dict[str, Any], result: dict[str, Any]) -> str:
    label = f"{result.get('platform', '?')}:{result.get('device_kind', '?')}"
    if (run.get("settings") or {}).get("quick"):
        label += " --quick"
    if result.get("precision", "float32") != "float32":
        label += f" {result['precision']}"
    if result.get("model_overrides"):
        label += " (reduced model)"
    return label


def _latest_results(runs: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(label, experiment, devices) -> the newest result with that key."""
    latest = {}
    for run in runs:
        for result in run["results"]:
            key = (_series_label(run, result), result["experiment"], result["num_devices"])
            latest[key] = result
    return latest


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    latest = _latest_results(runs)
    experiments = sorted({key[1] for key in latest})
    figure, axes = plt.subplots(
        1, max(len(experiments), 1), figsize=(4.5 * max(len(experiments), 1), 3.8), squeeze=False
    )
    for axis, experiment in zip(axes[0], experiments, strict=False):
        labels = sorted({key[0] for key in latest if key[1] == experiment})
        for label in labels:
            points = sorted(
                (key[2], r["throughput"]["updater"]["examples_per_s"])
                for key, r in latest.items()
                if key[0] == label and key[1] == experiment
            )
            devices, rates = zip(*points, strict=True)
            axis.plot(devices, rates, "o-", label=label)
            # Ideal linear scaling from the smallest device count measured.
            axis.plot(
                devices,
                [rates[0] * d / devices[0] for d in devices],
                ":",
                color=axis.lines[-1].get_color(),
                alpha=0.5,
            )
        axis.set_title(f"{experiment}: Updater examples/s")
        axis.set_xlabel("devices")
        axis.set_ylabel("examples/s")
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle("Scaling (dotted: linear from the first point; CPU devices are simulated)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _bar_groups(results: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{r['experiment']}\n{r['num_devices']} dev" for r in results]


def plot_throughput(run: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    results = run["results"]
    variants = (
        ("updater", "Updater"),
        ("updater_shard_map", "Updater, shard_map backend"),
        ("hand_written", "hand-written pmap"),
        ("flax", "Flax"),
    )
    figure, axis = plt.subplots(figsize=(max(6.0, 1.4 * len(results) + 2), 4))
    width = 0.8 / len(variants)
    for index, (variant, label) in enumerate(variants):
        xs, heights = [], []
        for position, result in enumerate(results):
            figures = result["throughput"].get(variant)
            if figures and figures.get("examples_per_s"):
                xs.append(position + (index - (len(variants) - 1) / 2) * width)
                heights.append(figures["examples_per_s"])
        if xs:
            axis.bar(xs, heights, width=width, label=label)
    axis.set_xticks(range(len(results)), _bar_groups(results), fontsize=8)
    axis.set_yscale("log")
    axis.set_ylabel("examples/s")
    axis.set_title(f"Step throughput, {run.get('platform')} ({run.get('created_utc')})")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_ratios(run: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    results = run["results"]
    series = (
        ("Updater / hand-written", lambda r: r["ratios"].get("updater_vs_hand_written")),
        ("Updater / Flax", lambda r: r["ratios"].get("updater_vs_flax")),
        ("Updater shard_map / pmap", lambda r: r["ratios"].get("updater_shard_map_vs_pmap")),
        ("input pipeline / pre-sharded", lambda r: r["ratios"].get("input_pipeline_vs_presharded")),
        ("loop / bare update", lambda r: (r.get("loop") or {}).get("ratio_vs_update")),
    )
    figure, axis = plt.subplots(figsize=(max(6.0, 1.6 * len(results) + 2), 4))
    width = 0.8 / len(series)
    for index, (label, value) in enumerate(series):
        xs, heights = [], []
        for position, result in enumerate(results):
            ratio = value(result)
            if ratio is not None:
                xs.append(position + (index - (len(series) - 1) / 2) * width)
                heights.append(ratio)
        if xs:
            axis.bar(xs, heights, width=width, label=label)
    loop_targets = set()
    for position, result in enumerate(results):
        targets = result.get("targets", {})
        if targets.get("updater_vs_hand_written"):
            axis.hlines(
                targets["updater_vs_hand_written"],
                position - 0.4,
                position + 0.4,
                colors="k",
                linestyles="--",
            )
        if targets.get("loop_vs_update"):
            loop_targets.add(targets["loop_vs_update"])
    for target in sorted(loop_targets):
        axis.axhline(target, color="gray", linestyle=":", label=f"loop target {target}")
    axis.axhline(1.0, color="k", linewidth=0.5)
    axis.set_xticks(range(len(results)), _bar_groups(results), fontsize=8)
    axis.set_ylabel("throughput ratio")
    axis.set_title("Ratios (dashed: Updater / hand-written target)")
    axis.legend(fontsize=7, loc="lower left")
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_all(results_dir: str | Path, output_dir: str | Path | None = None) -> list[Path]:
    """Draws every chart from the records in `results_dir` (or the one it names).

    Returns:
      The PNG paths.

    Raises:
      FileNotFoundError: when `results_dir` holds no run record.
    """
    runs = load_runs(results_dir)
    measured = [run for run in runs if run["results"]]
    if not measured:
        raise FileNotFoundError(
            f"No benchmark results in {results_dir}; run `make bench` (or bench-quick) first."
        )
    results_dir = Path(results_dir)
    output_dir = Path(output_dir or (results_dir.parent if results_dir.is_file() else results_dir))
    output_dir.mkdir(parents=True, exist_ok=True)
    latest = measured[-1]
    return [
        plot_scaling(measured, output_dir / SCALING_FILE),
        plot_throughput(latest, output_dir / THROUGHPUT_FILE),
        plot_ratios(latest, output_dir / RATIOS_FILE),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__)
    parser.add_argument(
        "--results_dir", default=str(DEFAULT_RESULTS_DIR), help="Records, or one record."
    )
    parser.add_argument("--output_dir", default=None, help="Default: the results directory.")
    args = parser.parse_args(argv)
    try:
        paths = plot_all(args.results_dir, args.output_dir)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
