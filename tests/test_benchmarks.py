"""Smoke tests of `benchmarks/`: one experiment measured in process, the run record, the plots.

The process has 4 simulated CPU devices (conftest.py), so the measured step is the
real multi-device one; step counts are tiny, so no figure here is a measurement.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `benchmarks` is a top-level package of the repository, not installed.
    sys.path.insert(0, REPO)

from benchmarks import core, flax_models, plot, run  # noqa: E402
from haiku_state import models, optim  # noqa: E402

TINY = core.Settings(
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
    peak = core.measure_peak_matmul(size=128, repeats=2, calls_per_repeat=2)
    result = core.benchmark_experiment(
        "mlp", TINY, peak=peak, workdir=tmp_path_factory.mktemp("bench"), log=lambda line: None
    )
    device_run = {
        "num_devices": jax.local_device_count(),
        **core.device_info(),
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
    assert _is_positive_finite(result["flops"]["per_device_per_step"])
    assert result["flops"]["per_step"] == pytest.approx(4 * result["flops"]["per_device_per_step"])
    assert result["flops"]["updater_matches_hand_written"] is True
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


def test_median_loop_run_reports_the_middle_run_and_records_every_run():
    def loop_run(ratio):
        return {
            "ratio_vs_update": ratio,
            "ratio_vs_update_without_checkpoints": ratio + 0.05,
            "checkpoint_windows": {"cost_per_save_s": 0.07},
            "examples_per_s": 900.0 * ratio,
            "update_examples_per_s": 900.0,
        }

    runs = [loop_run(0.95), loop_run(0.80), loop_run(0.90)]
    median = core._median_loop_run(runs)
    assert median["ratio_vs_update"] == 0.90
    assert [r["ratio_vs_update"] for r in median["runs"]] == [0.95, 0.80, 0.90]
    assert median["runs"][0]["cost_per_save_s"] == 0.07
    assert "runs" not in runs[2]  # The runs themselves are left as they were.
    # An even count reports the lower middle run: the figure is never flattered.
    assert core._median_loop_run(runs[:2])["ratio_vs_update"] == 0.80


def test_loop_runs_default_to_three_for_the_mlp_and_zero_is_refused():
    args = run._parse_args([])
    assert run.settings_for("mlp", args, "cpu", 1)[0].loop_runs == 3
    assert run.settings_for("resnet", args, "cpu", 1)[0].loop_runs == 1
    quick = run._parse_args(["--quick"])
    assert run.settings_for("mlp", quick, "cpu", 2)[0].loop_runs == 1
    assert run.settings_for("mlp", run._parse_args(["--loop_runs=2"]), "cpu", 1)[0].loop_runs == 2
    with pytest.raises(SystemExit):
        run._parse_args(["--loop_runs=0"])


def test_run_record_is_written_as_json_with_machine_versions_and_figures(mlp_run, tmp_path):
    device_run, result = mlp_run
    record = core.make_run_record(
        [device_run],
        settings={"quick": True},
        command=["python", "-m", "benchmarks.run"],
        wall_s=1.5,
    )
    path = core.write_run_record(record, tmp_path)
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
    table = run.format_table(loaded)
    assert "mlp" in table and "skipped (4 dev): resnet" in table


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


def test_table_shows_the_shard_map_updater_and_a_dash_for_variants_not_timed():
    result = _synthetic_result("resnet", 2, 1000.0)
    del result["throughput"]["hand_written"]  # As --quick times the ResNet.
    result["ratios"]["updater_vs_hand_written"] = None
    result["throughput"]["updater_shard_map"] = {"examples_per_s": 990.0}
    result["ratios"]["updater_shard_map_vs_pmap"] = 0.99
    result["throughput"]["updater"].update(steps_per_s=7.8, compile_s=1.0)
    result.update(batch_size=128, utilisation={"achieved_tflop_per_s": None, "mfu": None})
    header, row = run.format_table({"results": [result], "runs": []}).splitlines()
    titles = ["updater ex/s", "hand ex/s", "upd/hand", "shmap ex/s", "shmap/pmap"]
    assert all(title in header for title in titles)
    cells = row.split()
    assert cells[:5] == ["resnet", "2", "128", "1,000", "7.80"]
    assert cells[5:7] == ["-", "-"]  # Hand-written examples/s and Updater / hand-written.
    assert cells[10:12] == ["990", "0.990"]  # shard_map Updater examples/s and / pmap.


def test_quick_loop_config_runs_on_synthetic_data_of_the_timed_shape():
    settings = core.Settings(loop_steps=30, loop_log_every=10, loop_synthetic_data=True)
    config = core.loop_config("mlp", settings, num_devices=4)
    assert config.data.name == "synthetic"
    assert tuple(config.data.image_shape) == core.SYNTHETIC_SHAPES["mlp"][0]
    assert config.steps == 30 and config.log_every == 10
    assert config.checkpoint_every == 20 and config.eval_every == 30


def test_checkpoint_windows_separate_the_cost_of_each_save():
    # Batch 10, windows of 50 steps: 500 examples each. Steps 100 and 200 are saved
    # after their logs, so their cost lands in the windows (100, 150] and (200, 250].
    windows = [(50, 100, 1000.0), (100, 150, 500.0), (150, 200, 1000.0), (200, 250, 250.0)]
    saves = core.checkpoint_windows(windows, batch_size=10, save_steps=range(100, 300, 100))
    assert saves["window_ends"] == [150, 250]
    assert saves["saves"] == 2
    assert saves["examples_per_s_without"] == pytest.approx(1000.0)
    # 0.5 s beyond the 0.5 s at 1,000/s in one save window, 1.5 s in the other.
    assert saves["cost_per_save_s"] == pytest.approx(1.0)


def test_checkpoint_windows_of_a_window_that_is_not_a_log_step():
    # A save between two logs lands in the window around it; two saves in one window
    # share its cost.
    windows = [(0, 40, 100.0), (40, 80, 50.0)]
    saves = core.checkpoint_windows(windows, batch_size=1, save_steps=[50, 70])
    assert saves["window_ends"] == [80]
    assert saves["saves"] == 2
    assert saves["cost_per_save_s"] == pytest.approx((0.8 - 0.4) / 2)


def test_checkpoint_windows_without_a_window_to_compare_give_none():
    every_window_saves = core.checkpoint_windows([(0, 10, 5.0)], batch_size=1, save_steps=[0])
    assert every_window_saves["examples_per_s_without"] is None
    assert every_window_saves["cost_per_save_s"] is None
    no_save = core.checkpoint_windows([(0, 10, 5.0)], batch_size=1, save_steps=[])
    assert no_save["window_ends"] == [] and no_save["saves"] == 0
    assert no_save["examples_per_s_without"] == pytest.approx(5.0)
    assert no_save["cost_per_save_s"] is None


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


def test_precisions_are_the_librarys_and_others_are_refused_with_the_reason():
    assert set(core.SUPPORTED_PRECISIONS) == set(models.PRECISIONS)
    for precision in models.PRECISIONS:
        core.check_precision(precision)
    with pytest.raises(ValueError, match="config.precision"):
        core.check_precision("float8")
    with pytest.raises(SystemExit):
        run._parse_args(["--precisions=float32,float8"])


def test_subprocess_env_gives_the_device_count_on_cpu_and_gpu(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_foo=1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    env = run.subprocess_env(2)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert REPO in env["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize("name", core.FLAX_PEERS)
def test_flax_peer_has_the_haiku_networks_parameters_and_weight_decay(name):
    config = core.load_experiment_config(name)
    image_shape, num_classes = core.SYNTHETIC_SHAPES[name]
    options = {k: v for k, v in config.model.items() if k != "name"}
    network = models.make_network(name, num_classes, **options)
    batch = {"image": jnp.zeros((2, *image_shape)), "label": jnp.zeros((2,), jnp.int32)}
    params, _ = jax.eval_shape(
        lambda key: network.init(key, batch, is_training=True), jax.random.key(0)
    )
    model = flax_models.make_model(config, num_classes)
    variables = jax.eval_shape(
        lambda key: model.init({"params": key}, jnp.zeros((1, *image_shape))), jax.random.key(0)
    )

    def count(tree):
        return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))

    assert count(variables["params"]) == count(params)
    assert len(jax.tree.leaves(variables["params"])) == len(jax.tree.leaves(params))

    # The same optimizer work: weight decay on the same weights, under each one's names.
    def decayed(tree, mask):
        leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(mask(tree)), strict=True)
        return count([x for x, is_decayed in leaves if is_decayed])

    haiku_decayed = decayed(params, optim.haiku_weights)
    assert haiku_decayed == decayed(variables["params"], flax_models.kernels)
    assert 0 < haiku_decayed < count(params)
