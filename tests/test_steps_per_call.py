"""Several training steps in one device call (`Updater.update_steps`, `steps_per_call`).

On 4 simulated CPU devices: the same keys and (within float rounding) the same updates as
one step per call on every backend; the loop's calls and actions; an exact resume; the
config's refusals and the automatic choice.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import optax
import pytest
from configs import mlp_config
from updater_helpers import NUM_CLASSES, assert_trees_bit_equal, bn_mlp, host_batch, to_host

import haiku_state as hs
from haiku_state import config as config_lib
from haiku_state import driver, experiment, loop, replication
from haiku_state.guards import config_checks, signals

NUM_STEPS = 5


def _updater(backend: str) -> hs.Updater:
    axis = None if backend == "jit" else replication.DEFAULT_AXIS_NAME
    return hs.Updater(
        bn_mlp(axis, dropout_rate=0.2, batch_norm="lean"),  # Dropout: the keys matter.
        optax.sgd(0.1, momentum=0.9),
        hs.losses.classification_loss(NUM_CLASSES),
        backend=backend,
    )


@pytest.fixture(scope="module", params=["pmap", "shard_map", "jit"])
def one_and_several(request):
    """The same 5 steps one call each, and as calls of 2 and 3 steps (norms on the last)."""
    updater = _updater(request.param)
    batches = [hs.shard(host_batch(seed)) for seed in range(NUM_STEPS)]
    one = updater.init(0, batches[0])
    one_metrics = []
    for index, batch in enumerate(batches):
        one, metrics = updater.update(one, batch, with_global_norms=index == NUM_STEPS - 1)
        one_metrics.append(jax.device_get(metrics))
    several = updater.init(0, batches[0])
    several, first = updater.update_steps(
        several, replication.stack_steps(batches[:2]), with_global_norms=False
    )
    several, second = updater.update_steps(several, replication.stack_steps(batches[2:]))
    return to_host(one), one_metrics, to_host(several), jax.device_get((first, second))


def test_several_steps_a_call_draw_the_same_keys_and_count_the_same_steps(one_and_several):
    one, _, several, _ = one_and_several
    assert_trees_bit_equal(several.rng, one.rng)
    assert_trees_bit_equal(several.step, one.step)
    assert np.all(several.step == NUM_STEPS)


def test_several_steps_a_call_give_the_updates_of_one_step_a_call(one_and_several):
    """Within float rounding: XLA compiles a loop's body apart from a lone step."""
    one, _, several, _ = one_and_several
    for tree in ("params", "state", "opt_state"):
        pairs = zip(
            jax.tree.leaves(getattr(several, tree)),
            jax.tree.leaves(getattr(one, tree)),
            strict=True,
        )
        for a, b in pairs:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=tree)


def test_metrics_come_per_step_and_the_norms_of_the_last_step_alone(one_and_several):
    _, one_metrics, _, (first, second) = one_and_several
    assert set(first) == {"loss", "accuracy"} and first["loss"].shape == (2,)
    assert set(second) == {"loss", "accuracy", *hs.updater.NORMS}
    assert second["loss"].shape == (3,) and second["l2_grads"].shape == ()
    losses = np.concatenate([first["loss"], second["loss"]])
    np.testing.assert_allclose(losses, [m["loss"] for m in one_metrics], rtol=1e-5)
    for name in hs.updater.NORMS:
        np.testing.assert_allclose(second[name], one_metrics[-1][name], rtol=1e-5)


@pytest.mark.parametrize("backend", ["pmap", "jit"])
def test_a_list_of_batches_is_stacked_in_the_step_as_stack_steps_stacks_them(backend):
    updater = _updater(backend)
    batches = [hs.shard(host_batch(seed)) for seed in range(3)]
    stacked = updater.update_steps(updater.init(0, batches[0]), replication.stack_steps(batches))
    listed = updater.update_steps(updater.init(0, batches[0]), batches)
    assert_trees_bit_equal(to_host(listed), to_host(stacked))


def test_the_logged_steps_report_the_learning_rate_of_the_updaters_schedule():
    updater = _updater("pmap")
    updater.learning_rate = optax.linear_schedule(0.5, 0.0, 10)  # 0.5 - 0.05 * step.
    batches = [hs.shard(host_batch(seed)) for seed in range(3)]
    train_state, metrics = updater.update(updater.init(0, batches[0]), batches[0])
    assert float(metrics["learning_rate"]) == pytest.approx(0.5)  # Step 0's: the one it used.
    train_state, unlogged = updater.update(train_state, batches[1], with_global_norms=False)
    assert "learning_rate" not in unlogged
    _, metrics = updater.update_steps(train_state, batches[1:])
    assert metrics["learning_rate"].shape == () and metrics["loss"].shape == (2,)
    assert float(metrics["learning_rate"]) == pytest.approx(0.35)  # Step 3's, the last.


def test_update_steps_refuses_batches_without_a_steps_axis():
    updater = _updater("pmap")
    batch = hs.shard(host_batch(0))
    train_state = updater.init(0, batch)
    with pytest.raises(ValueError, match=r"update_steps: expected batches stacked as \[local_"):
        updater.update_steps(train_state, batch)  # One step's batch: no steps axis.
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(train_state))


def test_check_finite_names_the_first_non_finite_step_of_a_call_as_one_a_call_does():
    """Steps counted from 1 as the loop logs them: one step, then a call of steps 2-4."""
    updater = hs.Updater(
        bn_mlp(replication.DEFAULT_AXIS_NAME, batch_norm="lean"),
        optax.sgd(0.1),
        hs.losses.classification_loss(NUM_CLASSES),
        check_finite=True,
    )
    good = hs.shard(host_batch(0))
    nan = hs.shard({**host_batch(1), "image": np.full_like(host_batch(1)["image"], np.nan)})
    train_state, _ = updater.update(updater.init(0, good), good)
    with pytest.raises(FloatingPointError, match=r"Non-finite loss nan at step 3\."):
        updater.update_steps(train_state, replication.stack_steps([good, nan, good]))


def test_a_program_compiled_ahead_is_the_one_the_call_runs():
    from benchmarks.compiles import CompileEvents

    updater = _updater("pmap")
    batches = [hs.shard(host_batch(seed)) for seed in range(2)]
    train_state = updater.init(0, batches[0])
    stacked = replication.stack_steps(batches)
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        (train_state, stacked),
    )
    updater.compile_ahead("update_steps", *shapes, with_global_norms=True)
    with CompileEvents() as events:
        train_state, metrics = updater.update_steps(train_state, stacked)
    assert events.figures()["programs"] == 0
    assert set(hs.updater.NORMS) <= set(metrics) and metrics["loss"].shape == (2,)


@pytest.mark.parametrize("backend", ["pmap", "jit"])
def test_a_logged_call_holds_the_step_once(backend):
    # Its steps all compute the norms: one scan body, not a scan and a last step apart, so
    # half the program to compile and to load (the small ResNet's: 18.6 MB on a TPU).
    updater = _updater(backend)
    batch = hs.shard(host_batch(0))
    train_state = updater.abstract_init(batch)
    for norms in (False, True):
        lowered = updater.lower("update_steps", train_state, [batch] * 3, with_global_norms=norms)
        assert lowered.as_text().count("call @loss_gradients") == 1


def test_the_evaluation_compiled_ahead_by_default_is_the_one_evaluate_runs():
    # The evaluation has no global norms: its program is one whatever `with_global_norms` says.
    from benchmarks.compiles import CompileEvents

    updater = _updater("shard_map")
    batch = hs.shard(host_batch(0))
    train_state = updater.init(0, batch)
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (train_state, batch)
    )
    updater.compile_ahead("evaluate", *shapes)
    with CompileEvents() as events:
        jax.block_until_ready(updater.evaluate(train_state, batch))
    assert events.figures()["programs"] == 0, events.programs


# The loop's calls.


class _NoStop:
    def should_stop(self, step):
        return False


def test_loop_ends_calls_at_multiples_of_steps_per_call_and_at_the_last_step():
    calls, acted = [], []

    def step_fn(state, batch, step):  # `state` is the step reached; a call's batch, its number.
        calls.append((step, step - state, batch))
        losses = np.arange(state + 1, step + 1, dtype=np.float32)
        return step, {"loss": losses, "l2_grads": np.float32(step)}

    window = loop.MetricWindow(3)
    end = loop.run(
        step_fn,
        3,
        iter(range(100)),
        first_step=3,
        last_step=14,
        window=window,
        actions=[loop.PeriodicAction(4, lambda step, state: acted.append((step, state)))],
        stop=_NoStop(),
        steps_per_call=4,
    )
    # A resume at 3 catches up to 4; one batch per call.
    assert calls == [(4, 1, 0), (8, 4, 1), (12, 4, 2), (14, 2, 3)]
    assert acted == [(4, 4), (8, 8), (12, 12), (14, 14)]
    assert end == loop.LoopEnd(14, 14, False)
    summary = window.fetch(14)
    assert summary.steps == 11
    assert summary.metrics["loss"] == pytest.approx(np.mean(np.arange(4, 15)))
    # The norms are of the steps that end a call, averaged over those.
    assert summary.metrics["l2_grads"] == pytest.approx(np.mean([4, 8, 12, 14]))


# A run of several steps a call: exact resume, and the results of one step a call.


def _config(**overrides):
    settings = dict(steps=20, log_every=5, eval_every=10, check_every=10, checkpoint_every=10,
                    steps_per_call=5)  # fmt: skip
    return mlp_config(**{**settings, **overrides})


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("steps_per_call_whole"))
    final = driver.train_and_evaluate(_config(), workdir)
    return workdir, final


def _latest(workdir):
    with hs.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as reader:
        experiment_ = experiment.build_experiment(_config())
        like = experiment_.updater.abstract_init(
            experiment.placeholder_batch(experiment_.dataset, 64)
        )
        return to_host(reader.restore(like))


class _StopAfter(signals.StopRequest):
    """A signal that arrives once step `step` is done."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def should_stop(self, step: int) -> bool:
        return step >= self.step


def test_a_run_of_several_steps_a_call_resumes_bit_for_bit(whole_run, tmp_path):
    workdir, final = whole_run
    resumed = str(tmp_path / "resumed")
    with pytest.raises(signals.Stopped, match="stopped at step 10 of 20; saved step 10"):
        driver.train_and_evaluate(_config(), resumed, stop=_StopAfter(10))
    again = driver.train_and_evaluate(_config(), resumed)
    assert again == final
    assert_trees_bit_equal(_latest(resumed), _latest(workdir))


def test_a_run_of_several_steps_a_call_logs_every_step_and_matches_one_a_call(whole_run, tmp_path):
    workdir, final = whole_run
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all("l2_grads" in r for r in train)
    one_a_call = driver.train_and_evaluate(_config(steps_per_call=1), str(tmp_path / "one"))
    assert one_a_call["loss"] == pytest.approx(final["loss"], rel=1e-4)


# The config.


def test_cadences_that_are_not_multiples_of_steps_per_call_are_refused_together():
    config = _config(log_every=6, eval_every=12)
    with pytest.raises(
        ValueError,
        match=r"config.steps_per_call=5 runs 5 steps in each call, .* but log_every=6, "
        r"eval_every=12 are not a multiple of 5: use multiples of it, or steps_per_call=0",
    ):
        config_checks.validate_config(config, num_devices=4)


@pytest.mark.parametrize(
    "platform, image_shape, batch_size, expected",
    [
        ("cpu", (8, 8, 1), 64, 1),  # XLA:CPU runs a loop's convolutions slower.
        ("tpu", (8, 8, 1), 64, 5),  # The largest divisor of the cadences (5, 10) up to 8.
        ("gpu", (224, 224, 3), 64, 1),  # A long step: its dispatch does not show.
    ],
)
def test_steps_per_call_zero_chooses_for_the_platform_and_the_input(
    platform, image_shape, batch_size, expected
):
    config = _config(steps_per_call=0, batch_size=batch_size)
    assert experiment.steps_per_call(config, image_shape, platform) == expected
    config_checks.validate_config(config, num_devices=4)  # The choice fits the cadences.


def test_steps_per_call_is_free_to_change_on_resume():
    assert config_lib.KEYS["steps_per_call"].free
