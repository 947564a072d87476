"""`benchmarks.run`'s command line and the peers the Updater is timed against: the settings a
flag gives, the subprocess environments, the Flax network's and the hand-written step's
equivalence to the library's."""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `benchmarks` is a top-level package of the repository, not installed.
    sys.path.insert(0, REPO)

from benchmarks import baselines, flax_models, run, settings, variants  # noqa: E402
from haiku_state import models, optim, replication  # noqa: E402
from haiku_state.experiment import build_experiment  # noqa: E402


def test_loop_runs_default_to_three_for_the_mlp_and_zero_is_refused():
    args = run._parse_args([])
    assert run.settings_for("mlp", args, "cpu", 1)[0].loop_runs == 3
    assert run.settings_for("resnet", args, "cpu", 1)[0].loop_runs == 1
    quick = run._parse_args(["--quick"])
    assert run.settings_for("mlp", quick, "cpu", 2)[0].loop_runs == 1
    assert run.settings_for("mlp", run._parse_args(["--loop_runs=2"]), "cpu", 1)[0].loop_runs == 2
    with pytest.raises(SystemExit):
        run._parse_args(["--loop_runs=0"])
    every = run._parse_args(["--loop_checkpoint_every=100"])
    assert run.settings_for("resnet", every, "cpu", 1)[0].loop_checkpoint_every == 100
    with pytest.raises(SystemExit):
        run._parse_args(["--loop_checkpoint_every=0"])


def test_the_training_loops_final_eval_line_naming_its_deleted_workdir_is_not_shown(capsys):
    with run.without_stray_lines():
        print("  3.0s mlp: loop done", file=sys.stderr)
        print("Final eval at step 30: accuracy 10.55%. In /tmp/haiku_state_bench_x/loop_0: ...")
        sys.stderr.write("Final eval at step 30: accuracy 10.55%")  # In two writes, as print.
        sys.stderr.write(", loss 2.3\nlast line, no newline")
    assert capsys.readouterr().err == "  3.0s mlp: loop done\nlast line, no newline\n"


def test_quick_says_it_is_a_smoke_run_whose_figures_are_not_measurements():
    notes = run._notes(run._parse_args(["--quick"]), [])
    assert notes[0] == run.QUICK_NOTE
    assert "not measurements" in run.QUICK_NOTE and "smoke run" in run.QUICK_NOTE
    assert run.QUICK_NOTE not in run._notes(run._parse_args([]), [])


def test_precisions_are_the_librarys_and_others_are_refused_with_the_reason():
    assert set(settings.SUPPORTED_PRECISIONS) == set(models.PRECISIONS)
    for precision in models.PRECISIONS:
        settings.check_precision(precision)
    with pytest.raises(ValueError, match="config.precision"):
        settings.check_precision("float8")
    with pytest.raises(SystemExit):
        run._parse_args(["--precisions=float32,float8"])


def test_subprocess_env_gives_the_device_count_on_cpu_and_gpu(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_foo=1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    env = run.subprocess_env(2)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert REPO in env["PYTHONPATH"].split(os.pathsep)


def test_quick_runs_the_mlp_in_every_precision_and_the_others_in_float32():
    quick = run._parse_args(["--quick"])
    planned = run.measurements(quick)
    assert {p for name, p, _, _ in planned if name == "mlp"} == set(models.PRECISIONS)
    assert {p for name, p, _, _ in planned if name != "mlp"} == {"float32"}
    for precision in ("bfloat16", "float16"):
        half, skip_loop = run.settings_for("mlp", quick, "cpu", 2, precision)
        assert half.precision == precision
        assert half.hand_written  # The step each precision compiles, next to the Updater's.
        assert half.loop_steps == 0 and "float32" in skip_loop
    # --precisions is what runs, on every experiment.
    named = run._parse_args(["--quick", "--precisions=float16"])
    assert run.measurements(named) == [
        ("mlp", "float16", None, ()),
        ("resnet", "float16", None, ()),
    ]
    assert run.measurements(run._parse_args([])) == [
        (n, "float32", None, ()) for n in settings.EXPERIMENTS
    ]


def test_batch_sizes_are_measured_in_turn_each_in_its_settings():
    args = run._parse_args(["--experiments=resnet50", "--batch_sizes=256,512,1024", "--full"])
    planned = run.measurements(args)
    assert planned == [("resnet50", "float32", b, ()) for b in (256, 512, 1024)]
    for name, precision, batch_size, _ in planned:
        assert run.settings_for(name, args, "gpu", 1, precision, batch_size)[0].batch_size == (
            batch_size
        )
    # ResNet-50 on a CPU keeps its batch of 8 at most, without --full.
    cpu = run._parse_args(["--experiments=resnet50", "--batch_sizes=4,64"])
    assert [run.settings_for("resnet50", cpu, "cpu", 1, "float32", b)[0].batch_size
            for b in (4, 64)] == [4, 8]  # fmt: skip
    assert run._parse_args(["--batch_size=64"]).batch_sizes == [64]
    for bad in (["--batch_size=64", "--batch_sizes=32"], ["--batch_sizes=0,8"]):
        with pytest.raises(SystemExit):
            run._parse_args(bad)


def test_on_an_accelerator_nothing_named_measures_resnet50_in_bfloat16_beside_its_peers():
    args = run._parse_args([])
    run.apply_platform_defaults(args, "tpu", 8)
    assert (args.devices, args.plan, args.no_input_pipeline) == ([8], "accelerator", True)
    planned = run.measurements(args, "TPU v5 lite", 8)
    assert [(name, precision, batch) for name, precision, batch, _ in planned] == [
        ("resnet50", "bfloat16", 1024),  # The v5e's best batch, 128 a chip, every peer.
        ("resnet", "float32", 128),
        ("resnet50", "bfloat16", 2048),  # 256 a chip, beside Flax and the hand-written step.
    ]
    second = dict(planned[2][3])
    assert second["updater_jit"] is False and second["checkpoint_saves"] == 0
    assert run.measurements(args, "NVIDIA H200", 1)[0][2] == 256  # No figure: 256 a device.
    # What is named stays: devices, experiments, the input pipeline.
    named = run._parse_args(["--devices=1", "--experiments=mlp", "--input_pipeline"])
    run.apply_platform_defaults(named, "gpu", 4)
    assert (named.devices, named.plan, named.no_input_pipeline) == ([1], "named", False)
    on_cpu = run._parse_args([])
    run.apply_platform_defaults(on_cpu, "cpu", 1)
    assert (on_cpu.devices, on_cpu.plan) == ([1, 2, 4], "named")


def test_a_measurement_that_runs_out_of_device_memory_is_sized_down(monkeypatch):
    tried = []

    def benchmark(name, settings_, **_):
        tried.append(settings_.batch_size)
        if settings_.batch_size > 64:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return {"experiment": name}

    monkeypatch.setattr(run, "benchmark_experiment", benchmark)
    device_run = {"skipped": []}
    result = run._measure_within_memory(
        "resnet50", settings.Settings(batch_size=256), {}, "/tmp", None, device_run
    )
    assert tried == [256, 128, 64]
    assert [line.split(":")[0] for line in result["sized_down"]] == ["batch 256", "batch 128"]
    assert device_run["skipped"] == []

    def broken(name, settings_, **_):
        raise ValueError("another failure")

    monkeypatch.setattr(run, "benchmark_experiment", broken)
    assert (
        run._measure_within_memory("mlp", settings.Settings(), {}, "/tmp", None, device_run) is None
    )
    assert device_run["skipped"] == [
        "mlp (float32, batch default): failed: ValueError: another failure"
    ]


def test_targets_and_the_datasheet_peaks_of_the_chips():
    assert settings.targets_for("resnet50", "tpu") == {
        "updater_vs_hand_written": 0.98,
        "updater_vs_flax": 1.02,
        "mfu_datasheet": 0.34,
        "loop_vs_update": 0.95,
    }
    assert settings.targets_for("resnet", "cpu")["loop_vs_update"] == 0.90
    assert "updater_vs_flax" not in settings.targets_for("mlp", "gpu")
    from benchmarks import costs

    assert costs.datasheet_tflops("TPU v5 lite", "bfloat16") == 197.0
    assert costs.datasheet_tflops("NVIDIA H100 80GB HBM3", "float32") == 494.7
    assert costs.datasheet_tflops("cpu", "bfloat16") is None
    use = costs.utilisation(2e12, 10.0, None, "bfloat16", "TPU v5 lite", 2)
    assert use["mfu_datasheet"] == pytest.approx(20.0 / 394.0) and use["mfu"] is None


def test_the_loop_time_limit_reaches_every_measurements_settings():
    args = run._parse_args(["--loop_time_limit_s=90"])
    assert run.settings_for("mlp", args, "cpu", 1)[0].loop_time_limit_s == 90.0
    assert run.settings_for("resnet", run._parse_args([]), "cpu", 1)[0].loop_time_limit_s is None


@pytest.mark.parametrize("name", settings.FLAX_PEERS)
def test_flax_peer_has_the_haiku_networks_parameters_and_weight_decay(name):
    config = settings.experiment_config(name, settings.Settings(), num_devices=4)
    image_shape, num_classes = settings.SYNTHETIC_SHAPES[name]
    options = {k: v for k, v in config.model.items() if k not in ("name", "network")}
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


@jax.threefry_partitionable(False)
def test_hand_written_float16_step_keeps_the_updaters_loss_scale_bookkeeping():
    config = settings.synthetic_config(
        "mlp", settings.Settings(batch_size=32, num_batches=1, precision="float16"), 4
    )
    built = build_experiment(config)
    updater = built.updater
    [host_batch] = variants.host_batches(built.dataset, config.batch_size, 1)
    batch = replication.shard(host_batch)
    hand_written = baselines.make_hand_written_step(
        variants.hand_written_per_device(built), updater.axis_name
    )

    def finite_then_overflowing_step(step):
        train_state, finite = step(updater.init(config.seed, batch), batch)
        huge = replication.replicate(jnp.float32(2.0**100))  # float16 gradients overflow.
        train_state = train_state._replace(
            opt_state=train_state.opt_state._replace(loss_scale=huge)
        )
        params_before = jax.device_get(train_state.params)
        train_state, overflowing = step(train_state, batch)
        return jax.device_get((train_state, finite, overflowing)), params_before

    (library, *library_metrics), _ = finite_then_overflowing_step(updater.update)
    (baseline, *baseline_metrics), params_before = finite_then_overflowing_step(hand_written)
    for metrics in (library_metrics, baseline_metrics):  # Hand-written: one per device.
        assert [set(np.ravel(m["loss_scale"])) for m in metrics] == [{2.0**15}, {2.0**100}]
    # The overflowing step is skipped alike: the scale halves, the count of good steps resets.
    for state in (library, baseline):
        assert list(state.opt_state.loss_scale) == [2.0**99] * 4
        assert list(state.opt_state.good_steps) == [0] * 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), baseline.params, params_before)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        baseline.params,
        library.params,
    )
