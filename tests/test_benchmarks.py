"""Smoke tests of `benchmarks/`: one experiment measured in process, the run record, the tables
and the plots.

The process has 4 simulated CPU devices (conftest.py), so the measured step is the
real multi-device one; step counts are tiny, so no figure here is a measurement.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `benchmarks` is a top-level package of the repository, not installed.
    sys.path.insert(0, REPO)

from benchmarks import costs, experiment, plot, record, report, run, settings  # noqa: E402

TINY = settings.Settings(
    batch_size=32,
    steps_per_window=2,
    windows=2,
    warmup_steps=1,
    num_batches=2,
    # Two short loop runs: a save at step 20 lands in the window (20, 30], (10, 20] has none.
    loop_steps=30,
    loop_log_every=10,
    loop_runs=2,
    loop_synthetic_data=True,
    checkpoint_saves=1,
)


def _is_positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    peak = costs.measure_peak_matmul(size=128, repeats=2, calls_per_repeat=2)
    with jax.threefry_partitionable(False):  # As `benchmarks.run` measures on CPU.
        result = experiment.benchmark_experiment(
            "mlp", TINY, peak=peak, workdir=tmp_path_factory.mktemp("bench"), log=lambda line: None
        )
    device_run = {
        "num_devices": jax.local_device_count(),
        **costs.device_info(),
        "peak_matmul": peak,
        "experiments": [result],
        "skipped": ["resnet: not measured in this test"],
    }
    return device_run, result


def test_benchmark_experiment_reports_positive_finite_throughputs_and_ratios(mlp_run):
    _, result = mlp_run
    assert result["experiment"] == "mlp"
    assert result["num_devices"] == jax.local_device_count() == 4
    assert result["per_device_batch"] == 8
    for variant in ("updater", "hand_written", "updater_with_input", "updater_shard_map"):
        figures = result["throughput"][variant]
        for name in ("examples_per_s", "steps_per_s", "first_call_s"):
            assert _is_positive_finite(figures[name]), (variant, name, figures[name])
        assert len(figures["window_steps_per_s"]) == TINY.windows
    for name in (
        "updater_vs_hand_written",
        "input_pipeline_vs_presharded",
        "updater_shard_map_vs_pmap",
    ):
        assert _is_positive_finite(result["ratios"][name]), (name, result["ratios"])
    assert result["ratios"]["updater_vs_flax"] is None  # No Flax peer for the MLP.
    assert result["input_pipeline"] == "device_train_batches"  # The digits-sized split fits.
    # The MLP's matmuls counted from the step's jaxpr, over the 4 devices: three forwards'
    # work (forward, weight and input gradients), less the images' gradient.
    forward = 2 * TINY.batch_size * (64 * 256 + 256 * 256 + 256 * 10)
    flops = result["flops"]
    assert flops["per_step"] == flops["by_primitive"]["dot_general"]
    assert flops["per_step"] == 3 * forward - 2 * TINY.batch_size * 64 * 256
    assert flops["per_device_per_step"] == flops["per_step"] / 4
    assert flops["source"] == costs.JAXPR_SOURCE and flops["analytic_per_example"] is None
    # XLA's figure beside it (per device: the partitioned program), from Updater.lower.
    assert flops["xla_per_step"] == pytest.approx(4 * flops["xla_per_device_per_step"])
    assert flops["xla_source"] == costs.UPDATER_COST_SOURCE
    assert flops["updater_matches_hand_written"] is True
    assert result["utilisation"]["peak_precision"] == "float32"
    assert _is_positive_finite(result["utilisation"]["mfu"])
    assert result["memory"]["compiled_update_per_device"]["total_bytes"] > 0
    assert result["memory"]["device_peak_bytes_in_use"] is None  # CPU reports none.
    checkpoint = result["checkpoint"]
    assert _is_positive_finite(checkpoint["size_mb"])
    for mode in ("async", "sync"):
        assert _is_positive_finite(checkpoint[mode]["blocked_s"])
        assert _is_positive_finite(checkpoint[mode]["write_mb_per_s"])
    loop = result["loop"]
    assert len(loop["runs"]) == TINY.loop_runs
    assert loop["ratio_vs_update"] == min(run["ratio_vs_update"] for run in loop["runs"])
    for run_figures in loop["runs"]:
        assert _is_positive_finite(run_figures["ratio_vs_update"])
        assert _is_positive_finite(run_figures["ratio_vs_update_without_checkpoints"])
        assert math.isfinite(run_figures["cost_per_save_s"])  # Noise can make it negative.
    assert loop["checkpoint_windows"]["window_ends"] == [30]
    assert loop["checkpoint_windows"]["saves"] == 1
    after_loops = result["throughput"]["updater"]["window_steps_per_s_after_loop"]
    assert [len(windows) for windows in after_loops] == [TINY.windows] * TINY.loop_runs


def test_the_jit_updaters_are_timed_beside_pmap_and_fsdp_holds_a_quarter_per_device(mlp_run):
    _, result = mlp_run
    for variant in ("updater_jit", "updater_fsdp"):
        assert _is_positive_finite(result["throughput"][variant]["examples_per_s"]), variant
    for ratio in ("updater_jit_vs_pmap", "updater_fsdp_vs_pmap"):
        assert _is_positive_finite(result["ratios"][ratio]), ratio
    # The MLP's weights (64 x 256 and 256 x 256 float32) and their momentum are split.
    memory = result["memory"]["params_and_opt_state_per_device"]
    assert memory["updater"] == memory["updater_jit"] == memory["whole"]
    assert memory["updater_fsdp"] == memory["fsdp_bound"] < memory["whole"] / 3
    assert memory["fsdp_vs_replicated"] == memory["updater_fsdp"] / memory["updater_jit"]
    # XLA's analysis of the compiled steps: the train state is most of the arguments.
    compiled = result["memory"]["compiled_update_per_device_by_backend"]
    saved = memory["whole"] - memory["updater_fsdp"]
    assert compiled["jit"]["argument_size_in_bytes"] == compiled["pmap"]["argument_size_in_bytes"]
    assert (
        compiled["jit"]["argument_size_in_bytes"] - compiled["fsdp"]["argument_size_in_bytes"]
        == saved
    )


def test_run_record_is_written_as_json_with_machine_versions_and_figures(mlp_run, tmp_path):
    device_run, result = mlp_run
    run_record = record.make_run_record(
        [device_run],
        settings={"quick": True},
        command=["python", "-m", "benchmarks.run"],
        wall_s=1.5,
    )
    path = record.write_run_record(run_record, tmp_path)
    assert path.parent == tmp_path and path.name.endswith("_cpu.json")
    loaded = json.loads(path.read_text())
    assert {"node", "processor", "cpu_count"} <= set(loaded["machine"])
    assert {"jax", "jaxlib", "dm-haiku", "optax", "flax", "python"} <= set(loaded["versions"])
    assert loaded["platform"] == "cpu" and loaded["device_kind"]
    assert loaded["device_counts"] == [4]
    [saved] = loaded["results"]
    assert saved["throughput"]["updater"]["examples_per_s"] == pytest.approx(
        result["throughput"]["updater"]["examples_per_s"]
    )
    assert loaded["runs"][0]["peak_matmul"]["float32"]["all_devices_tflop_per_s"] > 0
    table = report.format_table(loaded)
    assert "mlp" in table and "skipped (4 dev): resnet" in table
    # The curated copy (--record) is the same record.
    curated = record.write_json(tmp_path / "curated" / "cpu.json", run_record)
    assert json.loads(curated.read_text()) == loaded


def _synthetic_result(experiment: str, num_devices: int, examples_per_s: float) -> dict:
    return {
        "experiment": experiment,
        "num_devices": num_devices,
        "platform": "cpu",
        "device_kind": "cpu",
        "precision": "float32",
        "throughput": {
            "updater": {"examples_per_s": examples_per_s},
            "hand_written": {"examples_per_s": examples_per_s * 1.01},
            "flax": {"examples_per_s": examples_per_s * 0.98} if experiment != "mlp" else None,
        },
        "ratios": {
            "updater_vs_hand_written": 0.99,
            "updater_vs_flax": 1.02 if experiment != "mlp" else None,
            "input_pipeline_vs_presharded": 0.9,
        },
        "targets": {"updater_vs_hand_written": 0.97, "loop_vs_update": 0.9},
        "loop": {"ratio_vs_update": 0.93} if num_devices == 1 else {"skipped": "x"},
    }


def test_table_marks_each_figure_against_its_target_and_says_what_was_measured():
    result = _synthetic_result("resnet", 2, 1000.0)
    result["throughput"]["updater"].update(step_ms=128.0, compile_s=1.0)
    result["throughput"]["updater_steps"] = {
        "examples_per_s": 1300.0, "step_ms": 98.5, "steps_per_call": 5
    }  # fmt: skip
    result["throughput"]["updater_shard_map"] = {"examples_per_s": 990.0}
    result["ratios"].update(
        updater_shard_map_vs_pmap=0.99, updater_steps_vs_flax=1.3, updater_vs_hand_written=None
    )
    result["targets"] = {"updater_vs_hand_written": 0.98, "updater_vs_flax": 1.0}
    result.update(batch_size=128, utilisation={"achieved_tflop_per_s": None, "mfu": None})
    lines = report.format_table({"results": [result], "runs": []}).splitlines()
    assert lines[0] == "resnet: batch 128 on 2 x cpu"
    rows = {line[2:64].strip(): line[64:].split() for line in lines[1:]}
    assert rows["Updater, one step a call"][:2] == ["1,000", "examples/s"]
    assert rows["Updater, 5 steps a call"][:2] == ["1,300", "examples/s"]
    assert rows["Updater / hand-written step"] == ["-", ">=", "0.98", "not", "measured"]
    assert rows["Updater, one step a call / Flax peer"] == ["1.020"]  # No target of its own.
    assert rows["Updater, 5 steps a call / Flax peer"] == ["1.300", ">=", "1", "met"]
    assert rows["Updater backend shard_map / pmap"] == ["0.990"]
    result["ratios"]["updater_steps_vs_flax"] = 0.9
    assert "1.300" not in report.format_table({"results": [result], "runs": []})
    missed = report.format_table({"results": [result], "runs": []}).splitlines()[5]
    assert missed.split()[-4:] == ["0.900", ">=", "1", "MISSED"]


def test_a_quick_run_judges_no_target_and_ends_with_one_verdict_line():
    full = _full_record([_synthetic_result("mlp", 2, 1000.0), _synthetic_result("resnet", 2, 1.0)])
    for result in full["results"]:
        result["batch_size"] = 32
        result["throughput"]["updater"].update(step_ms=32.0, compile_s=1.0)
    full["settings"] = {"quick": False}
    full["results"][1]["ratios"]["updater_vs_hand_written"] = 0.5
    table = report.format_table(full).splitlines()
    assert table[-2] == report.RATIOS_READ  # Which way a ratio reads.
    assert table[-1] == (
        "verdict: 1 of 2 targets met; resnet at 2 device(s): Updater / hand-written step (MISSED)"
    )

    quick = dict(full, settings={"quick": True})
    quick["results"][1]["model_overrides"] = {"width": 8, "blocks_per_stage": [1, 1]}
    skipped = "--quick: the loop runs for mlp at the first device count only"
    quick["results"][1]["loop"] = {"skipped": skipped}
    text = report.format_table(quick)
    assert "MISSED" not in text and " met" not in text and ">= " not in text
    assert "resnet: batch 32 on 2 x cpu (a reduced model: width=8, blocks_per_stage=[1, 1])" in text
    assert f"skipped: {skipped}" in text  # Whole, not cut mid-word.
    assert text.splitlines()[-1].startswith("verdict: --quick passed, every benchmark ran; a smoke")
    assert sum(line.startswith("verdict:") for line in text.splitlines()) == 1
    quick["runs"] = [{"num_devices": 2, "skipped": ["resnet (float32, batch 32): failed: boom"]}]
    assert (
        report.format_table(quick)
        .splitlines()[-1]
        .startswith("verdict: --quick FAILED, 1 thing(s) did not run (above)")
    )


def test_plot_draws_scaling_throughput_and_ratio_charts(tmp_path):
    record = {
        "created_utc": "2026-01-01T00:00:00+00:00",
        "platform": "cpu",
        "settings": {},
        "results": [
            _synthetic_result(experiment, devices, 1000.0 * devices)
            for experiment in ("mlp", "resnet")
            for devices in (1, 2, 4)
        ],
    }
    (tmp_path / "20260101T000000Z_cpu.json").write_text(json.dumps(record))
    (tmp_path / "not_a_record.json").write_text("[1, 2]")
    paths = plot.plot_all(tmp_path)
    assert [p.name for p in paths] == [plot.SCALING_FILE, plot.THROUGHPUT_FILE, plot.RATIOS_FILE]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_results_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="make bench"):
        plot.plot_all(tmp_path)


def _full_record(results: list[dict]) -> dict:
    return {
        "created_utc": "2026-01-01T12:30:00+00:00",
        "command": ["/venv/bin/python", "-m", "benchmarks.run", "--quick"],
        "machine": {"cpu_count": 2, "processor": "x86_64", "load_average": [1.25, 1.0, 1.0]},
        "versions": {"jax": "0.10.2", "dm-haiku": "0.0.17", "flax": "0.12.8"},
        "platform": "cpu",
        "device_kind": "cpu",
        "wall_s": 61.0,
        "runs": [{"num_devices": 2, "skipped": ["resnet50: not asked for"]}],
        "results": results,
        "notes": ["CPU device counts are simulated"],
    }


def test_readme_table_is_written_between_the_markers_from_a_record(tmp_path):
    result = _synthetic_result("mlp", 1, 1000.0)
    utilisation = {"achieved_tflop_per_s": 0.1, "mfu": 0.25, "peak_tflop_per_s": 0.4,
                   "peak_precision": "float32"}  # fmt: skip
    result.update(batch_size=128, utilisation=utilisation)
    result["throughput"]["updater"].update(compile_s=2.0, step_ms=128.0)
    result["loop"] = {
        "ratio_vs_update": 0.93,
        "ratio_vs_update_without_checkpoints": 0.97,
        "checkpoint_windows": {"cost_per_save_s": 0.058},
        "runs": [{"ratio_vs_update": r} for r in (0.93, 0.91, 0.95)],
    }
    result["checkpoint"] = {
        "async": {"blocked_s": 0.003, "write_mb_per_s": 7.0},
        "sync": {"blocked_s": 0.108},
    }
    table = report.markdown_table(_full_record([result]), tmp_path / "cpu.json")
    assert "from `" + str(tmp_path / "cpu.json") + "`" in table
    assert "`python -m benchmarks.run --quick` of 2026-01-01 12:30 UTC, 61 s" in table
    assert "**mlp: batch 128 on 1 x cpu**" in table
    assert "| Updater, one step a call | 1,000 examples/s (128.00 ms a step) |  |  |" in table
    assert "| Updater / hand-written step | 0.990 | >= 0.97 | met |" in table
    assert "| MFU of the measured float32 matmul, 0.4 TFLOP/s | 25.0% |  |  |" in table
    assert "| loop / bare update, windows without a save | 0.970 | >= 0.9 | met |" in table
    assert "| a save costs the loop | 58 ms |  |  |" in table
    assert "| a save blocks training: async / sync | 3 / 108 ms |  |  |" in table
    assert "loop / update 0.930, 0.910, 0.950" in table
    assert "skipped (2 dev): resnet50: not asked for" in table

    readme = tmp_path / "README.md"
    before = f"# Bench\n\nThe table between `{report.TABLE_START}` and its end marker.\n\n"
    readme.write_text(f"{before}{report.TABLE_START}\nold\n{report.TABLE_END}\n\nAfter.\n")
    for _ in range(2):  # Writing it again replaces it; markers named in the prose stay.
        report.update_readme(readme, table)
        assert readme.read_text() == (
            f"{before}{report.TABLE_START}\n{table}\n{report.TABLE_END}\n\nAfter.\n"
        )
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="one <!-- table --> line"):
        report.update_readme(readme, table)


def test_readme_shows_the_table_of_the_curated_cpu_record():
    path = record.curated_record_path("cpu")
    table = report.markdown_table(json.loads(path.read_text()), path)
    readme = report.README.read_text()
    assert f"{report.TABLE_START}\n{table}\n{report.TABLE_END}" in readme


def test_plot_draws_the_curated_record(tmp_path):
    paths = plot.plot_all(record.curated_record_path("cpu"), tmp_path)
    assert [p.parent for p in paths] == [tmp_path] * 3


def test_the_input_pipeline_figures_are_reported_beside_the_table():
    result = {
        "machine": {"cores": 2},
        "decoders_one_core_images_per_s": {"simplejpeg": 520.0, "pil": 440.0},
        "pipeline": {
            "image_size": 224,
            "batch_size": 64,
            "images_per_s": {"1": 300.0, "2": 560.0},
            "scaling": 1.87,
        },
        "loop": {
            "experiment": "mlp",
            "image_size": 64,
            "workers": 1,
            "loop_examples_per_s": 950.0,
            "ratio_vs_min": 0.95,
            "pipeline_alone_images_per_s": 1000.0,
            "bare_update_examples_per_s": 2000.0,
        },
    }
    first, second = report.input_pipeline_lines(result)
    assert "simplejpeg 520, pil 440 images/s" in first and "2 worker(s) 560" in first
    assert "scaling 1.87" in first and "0.95 of min(pipeline alone 1,000" in second
    assert report.input_pipeline_lines({"skipped": "--no_input_pipeline"}) == [
        "input pipeline skipped: --no_input_pipeline"
    ]
    assert run.QUICK_INPUT_PIPELINE and "--no_loop" in run.QUICK_INPUT_PIPELINE
