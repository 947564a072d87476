"""The loop benchmarks' pieces: the windows, the median run, the time limit, the input pipeline's
loop (its cache, pinning and decoder choice)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `benchmarks` is a top-level package of the repository, not installed.
    sys.path.insert(0, REPO)

from benchmarks import input_pipeline, loop, report, settings  # noqa: E402
from haiku_state import compilation_cache  # noqa: E402


def _loop_run(ratio):
    return {
        "ratio_vs_update": ratio,
        "ratio_vs_update_without_checkpoints": None if ratio is None else ratio + 0.05,
        "checkpoint_windows": {"cost_per_save_s": 0.07},
        "examples_per_s": None if ratio is None else 900.0 * ratio,
        "update_examples_per_s": 900.0,
    }


def test_median_loop_run_reports_the_middle_run_and_records_every_run():
    runs = [_loop_run(0.95), _loop_run(0.80), _loop_run(0.90)]
    median = loop.median_loop_run(runs)
    assert median["ratio_vs_update"] == 0.90
    assert [r["ratio_vs_update"] for r in median["runs"]] == [0.95, 0.80, 0.90]
    assert median["runs"][0]["cost_per_save_s"] == 0.07
    assert "runs" not in runs[2]  # The runs themselves are left as they were.
    # An even count reports the lower middle run: the figure is never flattered.
    assert loop.median_loop_run(runs[:2])["ratio_vs_update"] == 0.80


def test_a_run_stopped_before_its_steady_state_ranks_last_and_says_so():
    runs = [_loop_run(None), _loop_run(0.9), _loop_run(None)]
    median = loop.median_loop_run(runs)
    assert median["ratio_vs_update"] is None  # Two of three runs have no figure.
    assert loop.median_loop_run(runs[:2])["ratio_vs_update"] == 0.9
    median.update(stopped_by_time_limit=True, steps_logged=10)
    assert loop.summary_line(median).startswith("loop/update - (median of -, 0.900, -)")
    assert "stopped by the time limit at step 10" in loop.summary_line(median)


def test_quick_loop_config_runs_on_synthetic_data_in_this_processs_cache(tmp_path):
    quick = settings.Settings(loop_steps=30, loop_log_every=10, loop_synthetic_data=True)
    compilation_cache.enable(str(tmp_path / "cache"))
    try:
        config = loop.loop_config("mlp", quick, num_devices=4)
    finally:
        compilation_cache.enable("")
    assert config.data.name == "synthetic"
    assert tuple(config.data.image_shape) == settings.SYNTHETIC_SHAPES["mlp"][0]
    assert config.steps == 30 and config.log_every == 10
    assert config.checkpoint_every == 20 and config.eval_every == 30
    # The bare update's compiles are the loop's: never the user's cache.
    assert config.compilation_cache_dir == str(tmp_path / "cache")
    assert loop.loop_config("mlp", quick, num_devices=4).compilation_cache_dir == ""
    # --loop_checkpoint_every sets the saves' cadence (the issue's small-model figure: 100).
    every_15 = dataclasses.replace(quick, loop_checkpoint_every=15)
    assert loop.loop_config("mlp", every_15, num_devices=4).checkpoint_every == 15


def test_checkpoint_windows_separate_the_cost_of_each_save():
    # Batch 10, windows of 50 steps: 500 examples each. Steps 100 and 200 are saved
    # after their logs, so their cost lands in the windows (100, 150] and (200, 250].
    windows = [(50, 100, 1000.0), (100, 150, 500.0), (150, 200, 1000.0), (200, 250, 250.0)]
    saves = loop.checkpoint_windows(windows, batch_size=10, save_steps=range(100, 300, 100))
    assert saves["window_ends"] == [150, 250]
    assert saves["saves"] == 2
    assert saves["examples_per_s_without"] == pytest.approx(1000.0)
    # 0.5 s beyond the 0.5 s at 1,000/s in one save window, 1.5 s in the other.
    assert saves["cost_per_save_s"] == pytest.approx(1.0)


def test_checkpoint_windows_of_a_window_that_is_not_a_log_step():
    # A save between two logs lands in the window around it; two saves in one window
    # share its cost.
    windows = [(0, 40, 100.0), (40, 80, 50.0)]
    saves = loop.checkpoint_windows(windows, batch_size=1, save_steps=[50, 70])
    assert saves["window_ends"] == [80]
    assert saves["saves"] == 2
    assert saves["cost_per_save_s"] == pytest.approx((0.8 - 0.4) / 2)


def test_checkpoint_windows_without_a_window_to_compare_give_none():
    every_window_saves = loop.checkpoint_windows([(0, 10, 5.0)], batch_size=1, save_steps=[0])
    assert every_window_saves["examples_per_s_without"] is None
    assert every_window_saves["cost_per_save_s"] is None
    no_save = loop.checkpoint_windows([(0, 10, 5.0)], batch_size=1, save_steps=[])
    assert no_save["window_ends"] == [] and no_save["saves"] == 0
    assert no_save["examples_per_s_without"] == pytest.approx(5.0)
    assert no_save["cost_per_save_s"] is None


def test_a_deadline_stops_as_a_signal_would_once_it_has_passed():
    assert not loop.Deadline(None).should_stop_now()
    later = loop.Deadline(3600.0)
    assert not later.should_stop_now() and not later.expired
    passed = loop.Deadline(0.0)
    assert passed.should_stop_now() and passed.expired
    assert passed.signal_name == loop.Deadline.REASON


@jax.threefry_partitionable(False)
def test_a_loop_past_its_time_limit_ends_in_an_honest_partial_record(tmp_path):
    limited = settings.Settings(
        loop_steps=30, loop_log_every=10, loop_synthetic_data=True, loop_time_limit_s=0.0
    )
    result = loop.benchmark_training_loop("mlp", limited, lambda: 1000.0, tmp_path / "run")
    assert result["stopped_by_time_limit"] and result["time_limit_s"] == 0.0
    assert result["steps_logged"] == 0 and result["window_examples_per_s"] == []
    assert result["examples_per_s"] is None and result["ratio_vs_update"] is None
    assert result["final_eval"] == {}  # Stopped: no final evaluation.
    assert result["compiles"]["programs"] > 0


def test_the_update_is_pinned_on_a_cpu_only_unless_told():
    assert input_pipeline.pin_update_core("auto") is (jax.default_backend() == "cpu")
    assert input_pipeline.pin_update_core("True") and input_pipeline.pin_update_core("1")
    assert not input_pipeline.pin_update_core("false")


def test_the_loop_config_decodes_with_the_decoder_of_its_arguments(tmp_path):
    args = argparse.Namespace(
        loop_experiment="mlp", loop_steps=40, loop_batch_size=16, loop_log_every=10,
        loop_image_size=16, decoder="gpu",
    )  # fmt: skip
    config = input_pipeline.loop_config(args, str(tmp_path), workers=1)
    assert config.data.name == "imagefolder" and config.data.dir == str(tmp_path)
    assert config.data.decoder == "gpu"


def test_a_loop_stopped_before_a_steady_window_is_reported_as_such():
    record = {
        "machine": {"cores": 16},
        "decoders_one_core_images_per_s": {"libjpeg-turbo": 375.0},
        "pipeline": {"image_size": 224, "batch_size": 64, "images_per_s": {"1": 283.0},
                     "scaling": None},
        "loop": {"experiment": "resnet50:imagenet", "image_size": 224, "workers": 15,
                 "steps": 60, "steps_logged": 10, "loop_examples_per_s": None},
    }  # fmt: skip
    assert report.input_pipeline_lines(record)[1] == (
        "input pipeline loop (resnet50:imagenet, 224^2, 15 worker(s)): no steady window "
        "before the time limit (step 10 of 60)"
    )


def test_the_bare_update_compiles_its_two_step_programs_side_by_side(monkeypatch):
    """Each compile waits for the other at a barrier: compiled one after the other (or not
    ahead at all), the calls would compile. The timed calls run those programs, compiling none."""
    from configs import mlp_config

    from benchmarks.compiles import CompileEvents
    from haiku_state import updater

    both_compiling = threading.Barrier(2, timeout=60)
    compile_ahead, update = updater.Updater.compile_ahead, updater.Updater.update
    calls = CompileEvents()

    def meeting_the_other(self, *args, **kwargs):
        both_compiling.wait()
        return compile_ahead(self, *args, **kwargs)

    counting = []  # Entered at the first call: what the calls themselves compile.

    def counted(self, *args, **kwargs):
        if not counting:
            counting.append(calls.__enter__())
        return update(self, *args, **kwargs)

    monkeypatch.setattr(updater.Updater, "compile_ahead", meeting_the_other)
    monkeypatch.setattr(updater.Updater, "update", counted)
    try:
        assert input_pipeline.bare_update_rate(mlp_config(), steps=3) > 0
    finally:
        if counting:
            calls.__exit__(None, None, None)
    assert calls.figures()["programs"] == 0, calls.programs
