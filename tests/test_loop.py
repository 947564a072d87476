"""Tests of haiku_state.loop: cadences (`Every`), periodic actions, the metric window, logging,
profiling, the loop."""

from __future__ import annotations

import glob
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from haiku_state import loop, summaries
from haiku_state.guards import divergence


def test_every_is_due_at_multiples_of_its_steps_at_its_steps_and_at_the_last_step():
    assert [step for step in range(1, 26) if loop.Every(10).is_due(step, 25)] == [10, 20, 25]
    every = loop.Every(10, at=(4, 13))
    assert [step for step in range(1, 26) if every.is_due(step, 25)] == [4, 10, 13, 20, 25]
    assert not any(loop.Every().is_due(step, 25) for step in range(1, 25))


def test_every_is_due_on_its_timer_read_where_processes_agree_only(monkeypatch):
    now = [159.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    every = loop.Every(1000, secs=60, agree_every=5, since=100.0)
    assert not every.is_due(5, 100)  # 59 s.
    now[0] = 160.0
    assert not every.is_due(6, 100)  # 60 s, read at multiples of 5 only.
    assert every.is_due(10, 100)
    acted = []
    action = loop.PeriodicAction(every, lambda step, state: acted.append(step))
    action.run(10, None)
    assert acted == [10] and every.since == 160.0  # The seconds count from the end of a run.
    assert not action.is_due(15, 100) and action.is_due(100, 100)
    assert not loop.Every(1000, agree_every=5).is_due(10, 100)  # No timer: steps only.


def test_every_votes_with_every_process_on_a_flag(monkeypatch):
    votes = []
    monkeypatch.setattr(loop.processes, "any_process", lambda flag: votes.append(flag) or True)
    every = loop.Every(agree_every=5)
    assert not every.agreed(4, False) and votes == []  # Not a step where processes vote.
    assert every.agreed(5, False) and votes == [False]  # Another process's flag counts.


def test_periodic_action_is_due_on_multiples_and_at_the_last_step():
    action = loop.PeriodicAction(10, lambda step, state: None)
    due = [step for step in range(1, 26) if action.is_due(step, last_step=25)]
    assert due == [10, 20, 25]


def test_metric_window_averages_what_it_holds_and_restarts_at_the_fetch():
    window = loop.MetricWindow(start_step=4)
    for step, loss in [(5, 1.0), (6, 2.0), (7, 6.0)]:
        window.append(step, {"loss": jnp.float32(loss), "accuracy": jnp.float32(step / 10)})
    summary = window.fetch(7)
    assert summary.steps == 3 and summary.seconds > 0
    assert summary.metrics == pytest.approx({"loss": 3.0, "accuracy": 0.6})
    assert window.start_step == 7
    # A metric some steps report only (the norms of the logged step) is averaged over those.
    window.append(8, {"loss": jnp.float32(1.0)})
    window.append(9, {"loss": jnp.float32(3.0), "l2_grads": jnp.float32(5.0)})
    assert window.fetch(9).metrics == pytest.approx({"loss": 2.0, "l2_grads": 5.0})
    window.append(8, {"loss": jnp.float32(jnp.nan)})
    with pytest.raises(FloatingPointError, match="at step 8"):
        window.check_finite()
    with pytest.raises(FloatingPointError, match="at step 8"):
        window.fetch(8)


def test_metric_window_shows_every_loss_it_fetches_or_checks_to_the_divergence_monitor():
    monitor = divergence.Monitor(resumed_step=0)
    window = loop.MetricWindow(start_step=0, monitor=monitor)
    window.append(1, {"loss": jnp.float32(2.0)})
    window.append(2, {"loss": jnp.float32(300.0)})  # Over 100 x the first loss.
    window.check_finite()
    assert monitor.first_exploding_step == 2
    window.fetch(2)
    window.append(3, {"loss": jnp.float32(jnp.inf)})
    with pytest.raises(FloatingPointError, match="at step 3"):
        window.fetch(3)
    assert monitor.first_exploding_step == 2


def test_metric_logger_writes_the_window_means_throughput_and_the_learning_rate_of_the_step(
    tmp_path,
):
    window = loop.MetricWindow(start_step=0)
    with summaries.MetricWriter(str(tmp_path), 10, enabled=True) as writer:
        logger = loop.MetricLogger(window, writer, lambda step: 0.5 * step, batch_size=32)
        for step, loss in [(1, 1.0), (2, 3.0)]:
            window.append(step, {"loss": jnp.float32(loss)})
        logger(2, train_state=None)
    [record] = summaries.read_metrics(str(tmp_path))
    assert (record["step"], record["split"], record["loss"]) == (2, "train", 2.0)
    assert record["learning_rate"] == 0.5  # The rate step 2 was computed with: step 1's.
    assert record["examples_per_s"] > 0


def test_metric_logger_without_a_schedule_writes_the_learning_rate_the_step_reported(tmp_path):
    window = loop.MetricWindow(start_step=0)
    with summaries.MetricWriter(str(tmp_path), 10, enabled=True) as writer:
        logger = loop.MetricLogger(window, writer, None, batch_size=32)
        window.append(1, {"loss": jnp.float32(1.0)})
        window.append(2, {"loss": jnp.float32(3.0), "learning_rate": jnp.float32(0.25)})
        logger(2, train_state=None)
    [record] = summaries.read_metrics(str(tmp_path))
    assert (record["loss"], record["learning_rate"]) == (2.0, 0.25)
    assert list(record).index("learning_rate") > list(record).index("examples_per_s")


def test_profiler_traces_its_steps_and_resumes_a_trace_inside_them(tmp_path):
    with loop.Profiler((), str(tmp_path / "none"), start_step=0) as never:
        never(20, jnp.zeros(()))  # Its cadence's last step: nothing to end.
        assert not never.tracing
    with loop.Profiler((5, 8), str(tmp_path / "fresh"), start_step=0) as fresh:
        fresh(5, jnp.zeros(()))
        assert fresh.tracing
        fresh(8, jnp.zeros(()))
        assert not fresh.tracing
        fresh(20, jnp.zeros(()))  # The last step, after the trace: not a new one.
        assert not fresh.tracing
    # Resumed at step 6, inside (5, 8]: tracing from the start, ended by the block at the latest.
    with loop.Profiler((5, 8), str(tmp_path / "resumed"), start_step=6) as resumed:
        assert resumed.tracing
    assert not resumed.tracing
    for run in ("fresh", "resumed"):
        assert glob.glob(str(tmp_path / run / "**" / "*.xplane.pb"), recursive=True), run


class _NoStop:
    signal_name = None

    def should_stop(self, step):
        return False


def test_run_steps_from_the_first_to_the_last_and_runs_the_due_actions():
    calls = []

    def step_fn(state, batch, step):
        return state + batch, {"loss": jnp.float32(batch)}

    actions = [
        loop.PeriodicAction(2, lambda step, state: calls.append(("even", step, int(state)))),
        loop.PeriodicAction(5, lambda step, state: calls.append(("five", step, int(state)))),
    ]
    end = loop.run(
        step_fn,
        jnp.int32(0),
        itertools.repeat(jnp.int32(1)),
        first_step=3,
        last_step=7,
        window=loop.MetricWindow(3),
        actions=actions,
        stop=_NoStop(),
    )
    assert (int(end.train_state), end.step, end.stopped) == (4, 7, False)
    assert calls == [("even", 4, 1), ("five", 5, 2), ("even", 6, 3), ("even", 7, 4), ("five", 7, 4)]


def test_run_ends_before_the_step_a_stop_is_requested_at():
    class StopAt5(_NoStop):
        def should_stop(self, step):
            return step == 5

    end = loop.run(
        lambda state, batch, step: (state + 1, {"loss": np.float32(0)}),
        0,
        itertools.repeat(None),
        first_step=0,
        last_step=100,
        window=loop.MetricWindow(0),
        actions=[],
        stop=StopAt5(),
    )
    assert (end.train_state, end.step, end.stopped) == (5, 5, True)


def test_nothing_runs_when_the_run_is_already_at_its_last_step():
    end = loop.run(
        lambda state, batch, step: pytest.fail("stepped"),
        "state",
        iter(()),
        first_step=30,
        last_step=30,
        window=loop.MetricWindow(30),
        actions=[loop.PeriodicAction(1, lambda step, state: pytest.fail("acted"))],
        stop=_NoStop(),
    )
    assert end == loop.LoopEnd("state", 30, False)


@pytest.mark.parametrize(
    "stop_at, last_step, expected",
    [
        (None, 3, 1),  # Several calls: once the second is dispatched.
        (None, 1, 1),  # A run of one call.
        (1, 3, 1),  # A signal after the first call.
        (0, 3, 0),  # A signal before it: no step was done.
    ],
)
def test_the_first_call_is_reported_done_once_if_it_ran(stop_at, last_step, expected):
    class StopAt(_NoStop):
        def should_stop(self, step):
            return step == stop_at

    done = []
    loop.run(
        lambda state, batch, step: (state + 1, {"loss": np.float32(0)}),
        0,
        itertools.repeat(None),
        first_step=0,
        last_step=last_step,
        window=loop.MetricWindow(0),
        actions=[],
        stop=StopAt(),
        first_call_done=lambda: done.append(True),
    )
    assert len(done) == expected
