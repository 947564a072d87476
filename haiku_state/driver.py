"""The training run in one function: `train_and_evaluate(config, workdir)`.

Read top to bottom it is the whole run: the set-up (every refusal before the workdir is
touched), the resume, the loop with its actions, the final evaluation. A rerun resumes exactly
where a stopped run saved; every process makes the same calls, and only process 0 logs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
from absl import logging

from haiku_state import checkpoint, compilation_cache, data, loop, sharding, summaries
from haiku_state.config import keep_best_mode
from haiku_state.data import device as device_batches
from haiku_state.evaluation import evaluate_test_split
from haiku_state.experiment import Experiment, abstract_batch, build_experiment, placeholder_batch
from haiku_state.guards import (
    config_checks,
    data_identity,
    divergence,
    processes,
    replicas,
    signals,
)
from haiku_state.guards import workdir as workdir_lib
from haiku_state.updater import LOGGED_ONLY, TrainState, step_of


def train_and_evaluate(
    config: Any,
    workdir: str,
    *,
    stop: signals.StopRequest | None = None,
    allow_config_change: bool = False,
) -> dict[str, float]:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final eval.

    `stop` is the process's signal handler (None: one for this call). A signal saves the step
    reached and raises `signals.Stopped`; call again to resume. `allow_config_change` resumes a
    run whose config changed its trajectory. `StartUp` logs where the start went.
    """
    with StartUp() as startup, ProgramsAhead() as programs:
        experiment, first, data_record = _set_up(config, workdir, startup, programs)
        config = experiment.config
        with (
            contextlib.nullcontext(stop) if stop is not None else signals.StopRequest() as stop,
            workdir_lib.owning(workdir),
            _checkpointer(config, workdir) as checkpointer,
        ):
            train_state, batches = _start(
                first, experiment, checkpointer, data_record, allow_config_change, startup, programs
            )
            end, evaluator, monitor = _train(
                experiment,
                workdir,
                train_state,
                batches,
                checkpointer,
                data_record,
                stop,
                startup,
                programs,
            )
            final = _final_evaluation(end, evaluator, checkpointer)
            saved, kept = checkpointer.latest_step(), checkpointer.all_steps()
    _report_end(config, workdir, end.step, final)
    if stop.should_stop_now():  # A signal during the final save, or since: said, not a success.
        raise stop.stopped(
            f"stopped at step {end.step}, the last, after its final evaluation; saved step "
            f"{saved}. Run again to end the run (it evaluates step {saved} again)."
        )
    monitor.check_recovered(end.step, final)  # A loss that exploded and stayed so fails the run.
    monitor.check_outcome(end.step, final, kept)  # So does one that ended far worse than it was.
    return final


def _report_end(config: Any, workdir: str, step: int, final: dict[str, float]) -> None:
    """Process 0's curves and the run's last line."""
    if jax.process_index() == 0:
        network = config.model.name or os.path.basename(config.model.network)
        summaries.plot_curves(workdir, f"{workdir}: {network} on {config.data.name}")
        print(
            f"Final eval at step {step}: {summaries.format_metrics(final)}. "
            + summaries.describe_outputs(workdir, "checkpoints/"),
            flush=True,
        )


def _set_up(
    config: Any, workdir: str, startup: StartUp, programs: ProgramsAhead
) -> tuple[Experiment, TrainState | None, dict[str, Any]]:
    """The run's experiment, its first train state (fresh, warm-started from `init_from`, or
    None for a resume) and the identity of its data: every refusal before the workdir is
    touched, a warm start that does not fit included. The `programs` begin to compile for the
    state's shapes and shardings once it is drawn, or beside a resume's restore."""
    config_checks.validate_config(config, jax.device_count(), jax.process_count())
    workdir_lib.check_same_config_on_every_process(config)
    workdir_lib.check_usable(workdir)
    saved = checkpoint.complete_steps(os.path.join(workdir, "checkpoints"))
    if saved:
        config = workdir_lib.recorded_config_of(workdir, config)  # Of a run older than some keys.
    compilation_cache.enable(config.compilation_cache_dir)
    experiment = build_experiment(config)
    config = experiment.config  # Its defaults that follow the data fitted to it.
    startup.ended("experiment")
    resuming = bool(saved)
    first_state = None if resuming else _train_state_at_0(experiment)
    if config.init_from and resuming:
        logging.warning(
            "config.init_from=%r is ignored: %s holds checkpoints, and the run resumes "
            "from its latest (init_from starts a new workdir only).",
            config.init_from,
            workdir,
        )
    elif config.init_from:
        axis = experiment.updater.axis_name
        first_state = checkpoint.warm_start(first_state, config.init_from, config.init_skip, axis)
    like = first_state if first_state is not None else _train_state_at_0(experiment, True)
    programs.start(experiment, like, training=not saved or saved[-1] < experiment.total_steps)
    startup.ended("init")
    verify_content = config.data.verify == "content"
    return experiment, first_state, data_identity.identity(experiment.dataset, verify_content)


def _train_state_at_0(experiment: Experiment, abstract: bool = False) -> TrainState:
    """A fresh train state, or (`abstract`) its shapes and shardings: what a restore reads into."""
    config, updater = experiment.config, experiment.updater
    batch = placeholder_batch(experiment.dataset, config.batch_size)
    return updater.abstract_init(batch) if abstract else updater.init(config.seed, batch)


def _checkpointer(config: Any, workdir: str) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.max_to_keep,
        keep_every_steps=config.keep_every_steps,
        keep_best_by=config.keep_best_by,
        keep_best_mode=keep_best_mode(config),
    )


def _start(
    first: TrainState | None,
    experiment: Experiment,
    checkpointer: checkpoint.Checkpointer,
    data_record: dict[str, Any],
    allow_config_change: bool,
    startup: StartUp,
    programs: ProgramsAhead,
) -> tuple[TrainState, Iterator[Any]]:
    """The run's first train state, once its config and data are checked against the workdir's:
    the latest complete checkpoint read into the shapes the programs compile for (nothing is
    initialised for it) while the first call's programs compile, else `first` (or a fresh one,
    every step being damaged); and its training batches, whose decoding starts before both
    (close them).
    The workdir's record is written once the restore succeeded; how the run starts is logged."""
    # The steps, listed once: the newest whose metadata reads, past damaged ones (the restore's).
    damaged: list[tuple[int, Exception]] = []
    latest = checkpointer.newest_readable(checkpointer.metadata, failures=damaged)
    record = workdir_lib.check_config_on_process_0(
        os.path.dirname(checkpointer.directory),
        experiment.config,
        allow_change=allow_config_change,
        data=data_record,
        has_checkpoint=latest is not None or bool(damaged),
        checkpoint_metadata=None if latest is None else latest[1],
    )
    expected_step = latest[0] if latest is not None else 0 if first is None else step_of(first)
    batches = _train_batches(experiment, expected_step)  # Decoding while the programs compile.
    summaries.import_tensorboard_ahead()  # So is the metrics writer's TensorBoard.
    try:
        how, train_state = _restored_or_first(first, experiment, checkpointer, programs.like)
        workdir_lib.write_record_on_process_0(record)
        startup.ended("restore")
        programs.wait_for_the_first()
        startup.ended("compile")  # What was left of it.
        start_step = step_of(train_state)
        _log_start(how, train_state, experiment, os.path.dirname(checkpointer.directory))
        replicas.check_savable(train_state, start_step)  # What a save checks, too.
        if start_step != expected_step:  # The newest step's arrays were damaged: an older one.
            batches.close()
            batches = _train_batches(experiment, start_step)
    except BaseException:
        batches.close()
        raise
    return train_state, batches


def _restored_or_first(
    first: TrainState | None,
    experiment: Experiment,
    checkpointer: checkpoint.Checkpointer,
    like: TrainState,
) -> tuple[str, TrainState]:
    """How the run starts and its state: the latest checkpoint read into `like`, else `first`,
    else (every step damaged) a fresh state."""
    train_state = checkpointer.restore(like)
    if train_state is not None:
        return "Resuming", train_state
    if first is None:  # A resume whose every step was damaged: `init_from` is not used.
        return "Starting", _train_state_at_0(experiment)
    init_from = experiment.config.init_from
    return (f"Starting from {init_from}" if init_from else "Starting"), first


def _train(
    experiment: Experiment,
    workdir: str,
    train_state: TrainState,
    batches: Iterator[Any],
    checkpointer: checkpoint.Checkpointer,
    data_record: dict[str, Any],
    stop: signals.StopRequest,
    startup: StartUp,
    programs: ProgramsAhead,
) -> tuple[loop.LoopEnd, Evaluator, divergence.Monitor]:
    """The loop and its actions over `_start`'s batches (closed here); a signal's step is saved."""
    config, start_step = experiment.config, step_of(train_state)
    with (
        contextlib.closing(batches),
        _metric_writer(workdir, experiment.total_steps, start_step) as writer,
        loop.Profiler(
            config.profile_steps, os.path.join(workdir, "profile"), start_step
        ) as profiler,
    ):
        monitor = divergence.Monitor(
            start_step,
            divergence.outcome_at(checkpointer, start_step),  # As the resumed step recorded it.
            examples_per_step=config.batch_size,
            eval_examples=data.num_examples(experiment.dataset.test),
            chance_loss=math.log(experiment.dataset.num_classes),
        )
        window = loop.MetricWindow(start_step, monitor)
        evaluator = Evaluator(experiment, writer, stop, monitor, programs)
        saver = Saver(checkpointer, window, monitor, evaluator, _run_metadata(config, data_record))
        actions = _actions(config, experiment.steps_per_call, window, writer, saver, profiler, stop)
        programs.begin_the_second_round()  # Beside the loop, not the set-up's host work.
        with divergence.setting_aside_diverged(monitor, checkpointer):
            end = loop.run(
                _step_fn(experiment, loop.Every(config.log_every), programs),  # As logged.
                train_state,
                batches,
                first_step=start_step,
                last_step=experiment.total_steps,
                window=window,
                actions=actions,
                stop=stop,
                steps_per_call=experiment.steps_per_call,
                first_call_done=functools.partial(startup.first_step_done, programs.seconds),
            )
            if end.stopped and end.step > start_step:
                saver(end.step, end.train_state)
    checkpointer.wait_until_finished()
    return end, evaluator, monitor


def _metric_writer(workdir: str, total_steps: int, start_step: int) -> summaries.MetricWriter:
    """Process 0's writer of metrics.jsonl and TensorBoard, whose training run is opened now,
    not at the loop's first log."""
    enabled = jax.process_index() == 0
    return summaries.MetricWriter(
        workdir, total_steps, enabled=enabled, resume_step=start_step, open_now=("train",)
    )


def _actions(
    config: Any,
    steps_per_call: int,
    window: loop.MetricWindow,
    writer: summaries.MetricWriter,
    save: Saver,
    profile: loop.Profiler,
    stop: signals.StopRequest,
) -> list[loop.PeriodicAction]:
    """The loop's actions in the order they run at a step: the metrics are logged before the
    evaluation, whose metrics rank the checkpoint saved after it (an evaluation that cannot read
    its data saves the step first). The processes vote on the save's timer and on a signal where
    the metrics are fetched (a lone one, on a signal at every step); the profile ends with the
    call that reaches its stop step."""
    stop.agreement = loop.Every(agree_every=config.log_every if jax.process_count() > 1 else 1)
    log = loop.MetricLogger(window, writer, None, config.batch_size)
    evaluate = _saving_on_data_error(save.evaluator, save)
    profile_at = [
        math.ceil(step / steps_per_call) * steps_per_call for step in config.profile_steps
    ]
    timer = {"secs": config.checkpoint_every_secs, "agree_every": config.log_every}
    return [
        loop.PeriodicAction(loop.Every(config.log_every), log),
        loop.PeriodicAction(loop.Every(config.check_every), replicas.check_invariants),
        loop.PeriodicAction(loop.Every(config.eval_every), evaluate),
        loop.PeriodicAction(loop.Every(config.checkpoint_every, **timer), save),
        loop.PeriodicAction(loop.Every(at=profile_at), profile),
    ]


def _final_evaluation(
    end: loop.LoopEnd, evaluator: Evaluator, checkpointer: checkpoint.Checkpointer
) -> dict[str, float]:
    """The last step's evaluation (the loop's, or one now); `Stopped`, saying what is saved, if
    a signal came first."""
    experiment, stop, latest = evaluator.experiment, evaluator.stop, checkpointer.latest_step()
    if end.stopped:
        if latest == end.step:
            saved = f"saved step {end.step}"
        elif latest is None:
            saved = "nothing saved (no checkpoint yet)"
        else:
            saved = f"nothing new to save (the latest checkpoint is step {latest})"
        raise stop.stopped(
            f"stopped at step {end.step} of {experiment.total_steps}; {saved}. Run again to resume."
        )
    final = evaluator.metrics_at(end.step)
    if final is None and not stop.should_stop_now():
        logging.info("Already trained to step %d; evaluating.", end.step)
        final = evaluator.test_metrics(end.train_state)
    if final is None:  # A signal came before or during it; the last step is saved.
        raise stop.stopped(
            f"stopped at step {end.step}, the last, before its final evaluation; "
            f"saved step {latest}. Run again to evaluate."
        )
    return final


def _log_start(how: str, train_state: TrainState, experiment: Experiment, workdir: str) -> None:
    config = experiment.config
    logging.info(
        "%s at step %d of %d%s on %d %s device(s) in %d process(es); workdir %s.",
        how,
        step_of(train_state),
        experiment.total_steps,
        _epochs_note(config, experiment),
        jax.device_count(),
        jax.default_backend(),
        jax.process_count(),
        workdir,
    )
    logging.info(
        "%s (backend=%s, param_sharding=%s, %d step(s) per call).",
        sharding.format_bytes_per_device(*sharding.bytes_per_device(train_state)),
        config.backend,
        config.param_sharding,
        experiment.steps_per_call,
    )
    logging.info("The step: %s.", _step_options(config.optimizer))
    params, state = train_state.params, train_state.state
    device_axis = not sharding.is_global(train_state)
    logging.info("%s", summaries.trees_table(params, state, device_axis=device_axis))


def _step_options(optimizer: Any) -> str:
    """The optimizer and what the step does besides: clipping, accumulation, moving averages."""
    options = [f"optax {optimizer.name}, learning rate {optimizer.learning_rate:g}"]
    if optimizer.clip_global_norm:
        options.append(f"gradients clipped to a global norm of {optimizer.clip_global_norm:g}")
    if optimizer.accumulation_steps > 1:
        options.append(f"gradients accumulated over {optimizer.accumulation_steps} micro-batches")
    if optimizer.ema_decay:
        options.append(
            f"moving averages of params and state (decay {optimizer.ema_decay:g}), which "
            "evaluation, predict and export use"
        )
    return "; ".join(options)


def _epochs_note(config: Any, experiment: Experiment) -> str:
    """` (90 epochs of 1251 steps)`: the run's length; warns of less than an epoch of images."""
    examples = data.num_examples(experiment.dataset.train)
    per_epoch = data.steps_per_epoch(examples, config.batch_size)  # >= 1: `fit_to_data`.
    epochs = experiment.total_steps / per_epoch
    encoded = experiment.dataset.name in data.ENCODED_DATASETS
    if config.get("num_epochs") is None and epochs < 1 and encoded:
        logging.warning(
            "config.steps=%d covers %.3g of an epoch of %s (%d examples); set "
            "--config.num_epochs to train on all of it (experiments/resnet50.py:imagenet "
            "is the ImageNet recipe).",
            experiment.total_steps,
            epochs,
            experiment.dataset.name,
            examples,
        )
    return f" ({epochs:.4g} epochs of {per_epoch} steps)"


def _run_metadata(config: Any, data_record: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (its config and data, too)."""
    return {
        "config": config.to_dict(),
        "data": data_record,
        "local_device_count": jax.local_device_count(),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "platform": jax.default_backend(),
    }


def _train_batches(experiment: Experiment, start_step: int) -> Iterator[Any]:
    """This process's device batches of the steps from `start_step` to the last, one per call
    of the loop (several steps', stacked)."""
    return data.train_batches(
        experiment.dataset.train,
        experiment.config.batch_size,
        seed=experiment.config.seed,
        start_step=start_step,
        num_steps=max(0, experiment.total_steps - start_step),
        process=data.ProcessSlice.current(),
        options=experiment.input_options,
        steps_per_call=experiment.steps_per_call,
    )


PLAIN_STEPS = "The steps without the global norms"
EVALUATION = "The evaluation"


class ProgramsAhead:
    """Compiles (or loads from the cache) every program the run calls, from the shapes and
    shardings of the train state alone, in two rounds. First, side by side once the state is
    drawn (a resume: while its checkpoint is read), what the first call needs: the logged
    steps' program (with the global norms), the replicas' check and the batches' gather. Then,
    once that is done and the loop begins, the steps' program without the norms and the
    evaluation: on a TPU v5e host two ResNet-50 step programs side by side took 1.6x one alone,
    so the first step waits for one. Until the second is ready on every process, every call
    runs the first (`with_norms`); the evaluation waits for its own (`wait_for`). A failure only
    logs: the call that needs the program compiles it and says what is wrong. A run that ends
    (or fails, or is stopped) waits for a compile under way, which cannot be stopped: a process
    that exits while XLA compiles in another thread may abort."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._first: list[tuple[str, concurrent.futures.Future]] = []
        self._later: dict[str, concurrent.futures.Future] = {}
        self._plain_steps, self._closed = False, False
        self._second_round = threading.Event()
        self.like: Any = None  # The train state's shapes and shardings (`start`'s).
        self.seconds: dict[str, float] = {}  # Each program's compile or load, once done.

    def __enter__(self) -> ProgramsAhead:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Waits for the compiles under way; the second round does not begin after the run."""
        self._closed = True
        self._second_round.set()
        if self._pool is not None:
            self._pool.shutdown()

    def start(self, experiment: Experiment, like: TrainState, training: bool) -> None:
        """Begins the first round; the second waits for it and `begin_the_second_round`.
        `training`: the steps' programs are compiled."""
        self.like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
        )
        first, later = _compiles(experiment, self.like, training)
        # A thread each: the second round's wait for the first takes none of the first's.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            len(first) + len(later), thread_name_prefix="compile"
        )
        self._first = [
            (what, self._pool.submit(self._timed, what, compile_program))
            for what, compile_program in first
        ]
        for what, compile_program in later:
            timed = functools.partial(self._timed, what, compile_program)
            future = self._pool.submit(self._after_the_first, timed)
            future.add_done_callback(functools.partial(_log_failure, what))
            self._later[what] = future

    def wait_for_the_first(self) -> None:
        """Waits for the first round (compiled or failed)."""
        for what, future in self._first:
            _log_failure(what, future)

    def begin_the_second_round(self) -> None:
        self._second_round.set()

    def wait_for(self, what: str) -> None:
        """Waits for the program `what` of the second round, if there is one (beginning it)."""
        self._second_round.set()
        if what in self._later:
            concurrent.futures.wait([self._later[what]])

    def with_norms(self, logged: bool) -> bool:
        """Whether a call runs the logged steps' program: a logged call does, and so does every
        call until the program without the norms is ready on every process (voted at the logged
        calls of a multi-process run: the processes switch at the same step)."""
        if not self._plain_steps and (logged or jax.process_count() == 1):
            plain = self._later.get(PLAIN_STEPS)
            ready = plain is None or plain.done()
            self._plain_steps = not processes.any_process(not ready)
        return logged or not self._plain_steps

    def _timed(self, what: str, compile_program: Callable[[], Any]) -> None:
        start = time.perf_counter()
        compile_program()
        self.seconds[what] = time.perf_counter() - start

    def _after_the_first(self, compile_program: Callable[[], Any]) -> None:
        concurrent.futures.wait([future for _, future in self._first])
        self._second_round.wait()
        if not self._closed:
            compile_program()


def _log_failure(what: str, future: concurrent.futures.Future) -> None:
    """Waits for `future`; logs why `what` was not compiled ahead, if it was not."""
    if future.exception() is not None:
        logging.info("%s was not compiled ahead: %s", what, future.exception())


def _compiles(
    experiment: Experiment, state: Any, training: bool
) -> tuple[list[tuple[str, Callable[[], Any]]], list[tuple[str, Callable[[], Any]]]]:
    """What `ProgramsAhead` compiles first and then, the longest of each round first: while
    `training`, the logged steps' program (with the global norms), the replicas' check and the
    batches' gather where `data.train_batches` gathers them on the devices, then the steps
    without the norms and the evaluation; else the evaluation and the check."""
    config, dataset = experiment.config, experiment.dataset
    compile_ahead = experiment.updater.compile_ahead
    eval_batch = abstract_batch(dataset, config.eval_batch_size, masked=True)
    # As `evaluate` asks for it: the Updater keys its programs by the norms, evaluate's too.
    evaluation = functools.partial(
        compile_ahead, "evaluate", state, eval_batch, with_global_norms=False
    )
    check = ("The replicas' check", functools.partial(replicas.compile_checks_ahead, state))
    if not training:
        return [(EVALUATION, evaluation), check], []
    method, batch = "update", abstract_batch(dataset, config.batch_size)
    if experiment.steps_per_call > 1:  # As the data stacks a call's batches.
        method = "update_steps"
        batch = abstract_batch(dataset, config.batch_size, steps=experiment.steps_per_call)
    steps = functools.partial(compile_ahead, method, state, batch)
    first = [("The logged steps", functools.partial(steps, with_global_norms=True)), check]
    train = dataset.train
    if isinstance(train, data.Split) and device_batches.fits_on_device(train):
        gather = functools.partial(
            device_batches.compile_gather_ahead,
            train,
            config.batch_size,
            process=data.ProcessSlice.current(),
            steps_per_call=experiment.steps_per_call,
        )
        first.append(("The batches' gather", gather))
    later = [(PLAIN_STEPS, functools.partial(steps, with_global_norms=False))]
    return first, [*later, (EVALUATION, evaluation)]


def _step_fn(experiment: Experiment, log: loop.Every, programs: ProgramsAhead) -> loop.StepFn:
    """The Updater's steps up to `step`, in one call, with the global norms where it is logged
    (other calls that run the logged program leave its norms out: `ProgramsAhead.with_norms`)."""
    last_step, updater = experiment.total_steps, experiment.updater
    update = updater.update if experiment.steps_per_call == 1 else updater.update_steps

    def step_fn(train_state: TrainState, batch: Any, step: int):
        logged = log.is_due(step, last_step)
        with_norms = programs.with_norms(logged)
        train_state, metrics = update(train_state, batch, with_global_norms=with_norms)
        if with_norms and not logged:
            metrics = {name: x for name, x in metrics.items() if name not in LOGGED_ONLY}
        return train_state, metrics

    return step_fn


class StartUp:
    """Where a run's start went: the phases from the process's start to the first step's end,
    timed where the run passes from one to the next, and the programs compiled or loaded from
    the compilation cache meanwhile (JAX's monitoring events); one line, logged once."""

    def __init__(self) -> None:
        before = _seconds_since_process_start()  # Imports, flags and the backend's start.
        self.phases: dict[str, float] = {} if before is None else {"backend": before}
        self.programs, self.cache_hits = 0, 0
        self._mark, self._listening = time.perf_counter(), False

    def __enter__(self) -> StartUp:
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        self._listening = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._listening:
            jax.monitoring.unregister_event_listener(self._on_event)
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            self._listening = False

    def _on_event(self, event: str, **kwargs: Any) -> None:
        self.cache_hits += event == "/jax/compilation_cache/cache_hits"

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        self.programs += event == "/jax/core/compile/backend_compile_duration"

    def ended(self, phase: str) -> None:
        """The phase since the previous one's end ends now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._mark
        self._mark = now

    def first_step_done(self, compiled_ahead: Mapping[str, float] | None = None) -> None:
        """Logs the line: `Start-up 23.4 s: backend 10.5 s, ..., first step 1.1 s (8 programs,
        5 from the cache; the logged steps 7.9 s, ...)`, with the programs compiled ahead by now
        (`ProgramsAhead.seconds`), the longest first; later programs are not counted."""
        self.ended("first step")
        self.__exit__()
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        # A copy first: the compile threads of the second round may still be adding to it.
        ahead = sorted(dict(compiled_ahead or {}).items(), key=lambda item: -item[1])
        each = ", ".join(f"{what[0].lower()}{what[1:]} {seconds:.1f} s" for what, seconds in ahead)
        logging.info(
            "Start-up %.1f s: %s (%d programs, %d from the cache%s).",
            sum(self.phases.values()),
            phases,
            self.programs,
            self.cache_hits,
            f"; {each}" if each else "",
        )


def _seconds_since_process_start() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return max(0.0, since_boot - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclasses.dataclass
class Evaluator:
    """The eval action: the test split's metrics, written and shown to the monitor."""

    experiment: Experiment
    writer: summaries.MetricWriter
    stop: signals.StopRequest
    monitor: divergence.Monitor
    programs: ProgramsAhead  # Its program, compiled while the first steps run.
    latest: tuple[int, dict[str, float]] | None = None  # (step, metrics)

    def __call__(self, step: int, train_state: TrainState) -> None:
        metrics = self.test_metrics(train_state)
        if metrics is not None:  # None: a signal interrupted it.
            self.latest = (step, metrics)
            self.writer.write(step, "eval", metrics)
            self.monitor.log_eval(step, metrics)

    def metrics_at(self, step: int) -> dict[str, float] | None:
        return self.latest[1] if self.latest is not None and self.latest[0] == step else None

    def test_metrics(self, train_state: TrainState) -> dict[str, float] | None:
        """The test split's metrics (None: a signal interrupted them), nothing written."""
        self.programs.wait_for(EVALUATION)
        batch_size = self.experiment.config.eval_batch_size
        return evaluate_test_split(self.experiment, train_state, batch_size, self.stop)


def _saving_on_data_error(evaluator: Evaluator, saver: Saver) -> Callable[[int, TrainState], None]:
    """`evaluator`, saving the step first if the evaluation data cannot be read (the steps
    since the last save are not lost with the run)."""

    def evaluate(step: int, train_state: TrainState) -> None:
        try:
            evaluator(step, train_state)
        except data.DataError as e:
            saver(step, train_state)  # On disk when the checkpointer closes.
            raise type(e)(f"{e} Step {step} was saved first.") from None

    return evaluate


class Saver(NamedTuple):
    """The save action: only a checked, whole train state, with the run's outcome so far."""

    checkpointer: checkpoint.Checkpointer
    window: loop.MetricWindow
    monitor: divergence.Monitor
    evaluator: Evaluator
    metadata: dict[str, Any]  # The run's (`_run_metadata`).

    def __call__(self, step: int, train_state: TrainState) -> None:
        if step in self.monitor.saved_steps:
            return  # Saved at its cadence right before a signal stopped the loop.
        self.window.check_finite()  # The losses since the last log.
        self.monitor.protect_last_good(self.checkpointer)
        replicas.check_savable(train_state, step)
        metrics = self.evaluator.metrics_at(step)
        metadata = {**self.metadata, divergence.OUTCOME_KEY: self.monitor.outcome.to_json()}
        self.checkpointer.save(train_state, metadata=metadata, metrics=metrics)
        self.monitor.record_save(step)
