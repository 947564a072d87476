r"""A run record as tables: the text table `benchmarks.run` prints, and the README's table.

    python -m benchmarks.report [--record=benchmarks/results/cpu.json] [--update_readme]

Prints the Markdown table of a record; with `--update_readme` writes it into
`benchmarks/README.md` between the lines `<!-- table -->` and `<!-- /table -->`,
replacing what was there. `python -m benchmarks.run --record=PATH
--update_readme` does the same at the end of a run (`make bench
RECORD=benchmarks/results/cpu.json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.record import REPO_ROOT, curated_record_path

README = REPO_ROOT / "benchmarks" / "README.md"
TABLE_START, TABLE_END = "<!-- table -->", "<!-- /table -->"


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _label(result: dict[str, Any]) -> str:
    precision = result.get("precision", "float32")
    return result["experiment"] + ("" if precision == "float32" else f" {precision}")


def _examples_per_s(result: dict[str, Any], variant: str) -> float | None:
    return (result["throughput"].get(variant) or {}).get("examples_per_s")


def _blocked(result: dict[str, Any], scale: float, spec: str, separator: str) -> str:
    """How long a save blocked, async then sync (times `scale`); a dash if not measured."""
    checkpoint = result.get("checkpoint") or {}
    if "async" not in checkpoint:
        return "-"
    return separator.join(
        format(checkpoint[mode]["blocked_s"] * scale, spec) for mode in ("async", "sync")
    )


def _write_rate(result: dict[str, Any]) -> str:
    checkpoint = result.get("checkpoint") or {}
    return f"{checkpoint['async']['write_mb_per_s']:.0f}" if "async" in checkpoint else "-"


Row = tuple[str, str, str, str]  # (what was measured, value, target, met / MISSED / "")


def _verdict(value: float | None, target: float | None, spec: str = "g") -> tuple[str, str]:
    if target is None:
        return "", ""
    floor = f">= {format(target, spec)}"
    if value is None:
        return floor, "not measured"
    return floor, "met" if value >= target else "MISSED"


def _ratio_row(label: str, value: float | None, target: float | None = None) -> Row:
    return (label, _fmt(value, ".3f"), *_verdict(value, target))


def _per_call(result: dict[str, Any]) -> int:
    return (result["throughput"].get("updater_steps") or {}).get("steps_per_call") or 0


def result_rows(result: dict[str, Any]) -> list[Row]:
    """Each figure of one measurement, labelled with what was measured, against its target."""
    targets, ratios, throughput = result.get("targets", {}), result["ratios"], result["throughput"]
    updater = throughput["updater"]
    rows: list[Row] = [
        (
            "Updater, one step a call",
            f"{updater['examples_per_s']:,.0f} examples/s ({updater['step_ms']:.2f} ms a step)",
            "",
            "",
        )
    ]
    per_call = _per_call(result)
    if per_call:
        several = throughput["updater_steps"]
        rows.append(
            (
                f"Updater, {per_call} steps a call",
                f"{several['examples_per_s']:,.0f} examples/s ({several['step_ms']:.2f} ms a step)",
                "",
                "",
            )
        )
    rows.append(
        _ratio_row(
            "Updater / hand-written step", ratios.get("updater_vs_hand_written"),
            targets.get("updater_vs_hand_written"),
        )
    )  # fmt: skip
    flax_target = targets.get("updater_vs_flax")
    if per_call and "flax" in throughput:
        rows.append(
            _ratio_row("Updater, one step a call / Flax peer", ratios.get("updater_vs_flax"))
        )
        rows.append(
            _ratio_row(
                f"Updater, {per_call} steps a call / Flax peer",
                ratios.get("updater_steps_vs_flax"),
                flax_target,
            )
        )
    elif "flax" in throughput:
        rows.append(_ratio_row("Updater / Flax peer", ratios.get("updater_vs_flax"), flax_target))
    for label, ratio in (
        ("Updater with the norms (logged steps) / without", "updater_with_norms_vs_updater"),
        ("Updater fed by its input pipeline / pre-sharded", "input_pipeline_vs_presharded"),
        ("Updater backend shard_map / pmap", "updater_shard_map_vs_pmap"),
        ("Updater backend jit / pmap", "updater_jit_vs_pmap"),
        ("Updater backend jit fsdp / pmap", "updater_fsdp_vs_pmap"),
    ):
        if ratios.get(ratio) is not None:
            rows.append(_ratio_row(label, ratios[ratio]))
    rows += _utilisation_rows(result, targets) + _loop_rows(result, targets)
    checkpoint = result.get("checkpoint") or {}
    if "async" in checkpoint:
        rows.append(("a save blocks training: async / sync", _blocked(result, 1e3, ".0f", " / ")
                     + " ms", "", ""))  # fmt: skip
    beside = " (side by side with the others)" if updater.get("compiled_side_by_side") else ""
    rows.append((f"compile of the Updater's step{beside}",
                 _fmt(updater.get("compile_s"), ".1f") + " s", "", ""))  # fmt: skip
    return rows


def _utilisation_rows(result: dict[str, Any], targets: dict[str, float]) -> list[Row]:
    use = result.get("utilisation") or {}
    rows = []
    if use.get("datasheet_tflop_per_s"):
        value = use.get("mfu_datasheet")
        rows.append(
            (
                f"MFU of the datasheet's {use['datasheet_tflop_per_s']:.4g} TFLOP/s",
                _fmt(value, ".2%"),
                *_verdict(value, targets.get("mfu_datasheet"), ".0%"),
            )
        )
    if use.get("peak_tflop_per_s"):
        rows.append(
            (
                f"MFU of the measured {use.get('peak_precision') or ''} matmul, "
                f"{use['peak_tflop_per_s']:.3g} TFLOP/s",
                _fmt(use.get("mfu"), ".1%"),
                "",
                "",
            )
        )
    return rows


def _loop_rows(result: dict[str, Any], targets: dict[str, float]) -> list[Row]:
    loop = result.get("loop") or {}
    if "ratio_vs_update" not in loop:
        return [("training loop", "skipped: " + str(loop.get("skipped", "-")), "", "")]
    without = loop.get("ratio_vs_update_without_checkpoints")
    cost = loop["checkpoint_windows"]["cost_per_save_s"]
    return [
        _ratio_row("loop / bare update, windows without a save", without,
                   targets.get("loop_vs_update")),
        _ratio_row("loop / bare update, every steady window", loop["ratio_vs_update"],
                   targets.get("loop_whole_vs_update")),
        ("a save costs the loop", _fmt(cost, ".0f", 1e3) + " ms", "", ""),
    ]  # fmt: skip


def result_heading(result: dict[str, Any]) -> str:
    sized = " (sized down to fit the device)" if result.get("sized_down") else ""
    overrides = ", ".join(f"{k}={v}" for k, v in (result.get("model_overrides") or {}).items())
    reduced = f" (a reduced model: {overrides})" if overrides else ""
    return (
        f"{_label(result)}: batch {result['batch_size']} on {result['num_devices']} x "
        f"{result.get('device_kind', '?')}{sized}{reduced}"
    )


def peak_line(run: dict[str, Any]) -> str:
    """The f32 and bf16 (and f16, if measured) matmul peaks of one device count, on one
    device and on all."""
    peak = run["peak_matmul"]
    f16 = peak.get("float16")
    return (
        f"peak matmul on {run['num_devices']} {run['device_kind']} device(s), "
        f"{peak['size']}^2: f32 {peak['float32']['single_device_tflop_per_s']:.3f} "
        f"TFLOP/s one device, {peak['float32']['all_devices_tflop_per_s']:.3f} all; "
        f"bf16 {peak['bfloat16']['single_device_tflop_per_s']:.3f} / "
        f"{peak['bfloat16']['all_devices_tflop_per_s']:.3f}"
        + (
            f"; f16 {f16['single_device_tflop_per_s']:.3f} / {f16['all_devices_tflop_per_s']:.3f}"
            if f16
            else ""
        )
    )


def _run_notes(record: dict[str, Any]) -> list[str]:
    """Each device count's peak matmul, what was skipped (at which counts), the run's notes."""
    peaks = [peak_line(run) for run in record["runs"] if run.get("peak_matmul")]
    skipped: dict[str, list[str]] = {}
    for run in record["runs"]:
        for note in run.get("skipped", []):
            skipped.setdefault(note, []).append(str(run["num_devices"]))
    skips = [f"skipped ({', '.join(counts)} dev): {note}" for note, counts in skipped.items()]
    notes = [f"note: {note}" for note in record.get("notes", [])]
    return peaks + input_pipeline_lines(record.get("input_pipeline")) + skips + notes


def input_pipeline_lines(result: dict[str, Any] | None) -> list[str]:
    """`benchmarks.input_pipeline`'s figures: decoders, workers, and the loop they feed."""
    if not result:
        return []
    if "skipped" in result:
        return [f"input pipeline skipped: {result['skipped']}"]
    rates = result["decoders_one_core_images_per_s"]
    decoders = ", ".join(
        f"{name} {rate:,.0f}" for name, rate in rates.items() if not name.endswith("_vs_baseline")
    )
    if "cpu_vs_baseline" in rates:  # A ratio, not a rate.
        decoders += f" (cpu / cpu_baseline {rates['cpu_vs_baseline']:.2f})"
    pipeline = result["pipeline"]
    rates = ", ".join(
        f"{workers} worker(s) {rate:,.0f}" for workers, rate in pipeline["images_per_s"].items()
    )
    lines = [
        f"input pipeline ({pipeline['image_size']}^2 uint8 batches of {pipeline['batch_size']}, "
        f"{result['machine']['cores']} cores): one core decodes+crops {decoders} images/s; "
        f"pipeline {rates} images/s"
        + ("" if pipeline["scaling"] is None else f", scaling {pipeline['scaling']:.2f}")
    ]
    loop = result.get("loop")
    if loop and loop.get("loop_examples_per_s") is None:
        lines.append(
            f"input pipeline loop ({loop['experiment']}, {loop['image_size']}^2, "
            f"{loop['workers']} worker(s)): no steady window before the time limit "
            f"(step {loop.get('steps_logged', 0)} of {loop['steps']})"
        )
    elif loop:
        stopped = loop.get("stopped_by_time_limit")
        lines.append(
            f"input pipeline loop ({loop['experiment']}, {loop['image_size']}^2, "
            f"{loop['workers']} worker(s)): {loop['loop_examples_per_s']:,.0f} examples/s, "
            f"{loop['ratio_vs_min']:.2f} of min(pipeline alone "
            f"{loop['pipeline_alone_images_per_s']:,.0f}, bare update "
            f"{loop['bare_update_examples_per_s']:,.0f})"
            + (f"; stopped by the time limit at step {loop['steps_logged']}" if stopped else "")
        )
    return lines


RATIOS_READ = (
    "ratios: a row 'A / B' is A's examples/s over B's (for the loop, its steady examples/s over "
    "the bare update's): above 1, A is faster; a target is a floor."
)
QUICK_VERDICT = (
    "a smoke run: it checks that the benchmarks run; its figures are not measurements, so no "
    "target is judged (`make bench` measures)"
)


def _failures(record: dict[str, Any]) -> list[str]:
    """What failed to run: a measurement, a device count's subprocess, the input pipeline."""
    notes = [note for run in record["runs"] for note in run.get("skipped", [])]
    notes.append(str((record.get("input_pipeline") or {}).get("skipped", "")))
    return [note for note in notes if "failed:" in note or "exited with" in note]


def verdict_line(record: dict[str, Any]) -> str:
    """One line: a quick run's smoke verdict (no target judged), else the targets met."""
    failures = _failures(record)
    if (record.get("settings") or {}).get("quick"):
        if failures or not record["results"]:
            failed = f"{len(failures)} thing(s) did not run (above)"
            return f"verdict: --quick FAILED, {failed}; {QUICK_VERDICT}."
        return f"verdict: --quick passed, every benchmark ran; {QUICK_VERDICT}."
    verdicts = [
        (f"{_label(result)} at {result['num_devices']} device(s): {label}", verdict)
        for result in record["results"]
        for label, _, target, verdict in result_rows(result)
        if target
    ]
    unmet = [f"{what} ({verdict})" for what, verdict in verdicts if verdict != "met"]
    line = f"verdict: {len(verdicts) - len(unmet)} of {len(verdicts)} targets met"
    line += f"; {'; '.join(unmet)}" if unmet else ""
    return line + (f"; {len(failures)} thing(s) failed to run (above)" if failures else "")


def format_table(record: dict[str, Any]) -> str:
    """The run's figures, a short table per measurement, each figure against its target (none
    in a quick run: a smoke run), then the peaks, skips and notes, how ratios read and one
    verdict line (every figure is in the record's JSON)."""
    quick = (record.get("settings") or {}).get("quick")
    lines = []
    for result in record["results"]:
        lines.append(result_heading(result))
        for label, value, target, verdict in result_rows(result):
            if quick:  # A smoke run's figures are not measurements: nothing to judge.
                target = verdict = ""
            lines.append(f"  {label:<62} {value:<38} {target:<8} {verdict}".rstrip())
    return "\n".join(lines + _run_notes(record) + [RATIOS_READ, verdict_line(record)])


def _display_path(path: str | Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _caption(record: dict[str, Any], record_path: str | Path) -> str:
    created = datetime.datetime.fromisoformat(record["created_utc"])
    machine, versions = record["machine"], record["versions"]
    load = machine.get("load_average") or [None]
    return (
        f"Generated by `python -m benchmarks.report` from `{_display_path(record_path)}`: "
        f"`python {' '.join(record['command'][1:])}` of {created:%Y-%m-%d %H:%M} UTC, "
        f"{record['wall_s']:.0f} s; {machine['cpu_count']} {machine['processor']} cores, "
        f"load average {_fmt(load[0], '.1f')} at the start; {record['device_kind']} devices, "
        f"jax {versions['jax']}, dm-haiku {versions['dm-haiku']}, flax {versions['flax']}."
    )


def _loop_runs_lines(record: dict[str, Any]) -> list[str]:
    lines = []
    for result in record["results"]:
        runs = (result.get("loop") or {}).get("runs", [])
        if len(runs) > 1:
            ratios = ", ".join(f"{run['ratio_vs_update']:.3f}" for run in runs)
            lines.append(
                f"{_label(result)} at {result['num_devices']} device(s): the loop ran "
                f"{len(runs)} times (loop / update {ratios}); the row holds the median run."
            )
        if result.get("model_overrides"):
            overrides = ", ".join(f"{k}={v}" for k, v in result["model_overrides"].items())
            lines.append(f"{_label(result)}: a reduced model ({overrides}).")
    return lines


def markdown_table(record: dict[str, Any], record_path: str | Path) -> str:
    """The README's tables of a record: a caption naming it, a table per measurement (each
    figure against its target), then its notes."""
    lines = [_caption(record, record_path)]
    for result in record["results"]:
        lines += ["", f"**{result_heading(result)}**", ""]
        lines += ["| figure | value | target | |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(row)} |" for row in result_rows(result)]
    notes = _loop_runs_lines(record) + _run_notes(record)
    return "\n".join(lines + ([""] + [f"* {note}" for note in notes] if notes else []))


def update_readme(readme: str | Path, table: str) -> None:
    """Replaces the lines between the marker lines of `readme` with `table`.

    A marker is a line of its own (`TABLE_START`, then `TABLE_END`), so the prose
    can name them.

    Raises:
      ValueError: when `readme` lacks a marker line, or has them out of order.
    """
    readme = Path(readme)
    lines = readme.read_text().splitlines(keepends=True)
    marks = [line.strip() for line in lines]
    if marks.count(TABLE_START) != 1 or marks.count(TABLE_END) != 1:
        raise ValueError(f"{readme} needs one {TABLE_START} line and one {TABLE_END} line.")
    start, end = marks.index(TABLE_START), marks.index(TABLE_END)
    if end < start:
        raise ValueError(f"{readme}: {TABLE_END} comes before {TABLE_START}.")
    readme.write_text("".join(lines[: start + 1]) + table + "\n" + "".join(lines[end:]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument("--record", default=str(curated_record_path("cpu")))
    parser.add_argument("--readme", default=str(README))
    parser.add_argument("--update_readme", action="store_true", help="Write it into --readme.")
    args = parser.parse_args(argv)
    table = markdown_table(json.loads(Path(args.record).read_text()), args.record)
    if args.update_readme:
        update_readme(args.readme, table)
        print(f"wrote the table of {args.record} into {args.readme}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
