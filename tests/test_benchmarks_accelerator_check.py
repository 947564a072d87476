"""The accelerator check's pieces at no cost: its budget, record, the start-up timing of a run.

The check itself runs on a GPU or TPU host (`make gpu-check VENV=`, `make tpu-check
VENV=`); `--quick` runs it on a
CPU in about two minutes, too long for the suite, so its parts are tested here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `benchmarks` is a top-level package of the repository, not installed.
    sys.path.insert(0, REPO)

from benchmarks import accelerator_check, startup  # noqa: E402

# A stand-in for a training run: logs step `argv[2] + 1` after `argv[3]` seconds, then
# waits for SIGTERM as a run would, or exits with 3 when asked to fail.
_FAKE_RUN = textwrap.dedent("""
    import json, os, signal, sys, time
    workdir, done, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if delay < 0:
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(delay)
    print("I 08:00:00 driver] Start-up 0.3 s: backend 0.1 s, compile 0.2 s.", flush=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": done + 1, "split": "train"}) + "\\n")
    time.sleep(60)
""")


def _fake_run(workdir, done: int, delay: float) -> list[str]:
    return [sys.executable, "-c", _FAKE_RUN, str(workdir), str(done), str(delay)]


def test_time_to_first_step_waits_for_a_new_step_then_stops_the_run(tmp_path):
    timed = startup.time_to_first_step(_fake_run(tmp_path, 0, 0.3), str(tmp_path), 30.0)
    assert timed["error"] is None and timed["step"] == 1
    assert 0.3 <= timed["seconds"] < 30
    assert 0 <= timed["cpu_seconds"] < timed["seconds"]  # It slept most of the time.
    assert timed["startup_line"] == "Start-up 0.3 s: backend 0.1 s, compile 0.2 s."
    # Resumed: the steps logged before do not count, the next one does.
    timed = startup.time_to_first_step(_fake_run(tmp_path, 1, 0.0), str(tmp_path), 30.0)
    assert timed["step"] == 2


def test_time_to_first_step_of_a_run_that_fails_or_hangs_says_why(tmp_path):
    failed = startup.time_to_first_step(_fake_run(tmp_path, 0, -1.0), str(tmp_path), 30.0)
    assert failed["seconds"] is None and failed["error"].startswith("exited with 3 before a step")
    assert failed["startup_line"] is None
    hung = startup.time_to_first_step(_fake_run(tmp_path, 0, 30.0), str(tmp_path), 0.5)
    assert hung["seconds"] is None and hung["error"].startswith("no step within 0 s")


def test_speedups_compare_cold_runs_with_cached_ones():
    runs = {
        "cold": {"seconds": 60.0},
        "cached": {"seconds": 20.0},
        "resumed_cold": {"seconds": 66.0},
        "resumed_cached": {"seconds": 15.0},
    }
    assert startup.speedups(runs) == {"rerun": 3.0, "resumed": 4.4}
    runs["cold"]["cpu_seconds"], runs["cached"]["cpu_seconds"] = 30.0, 6.0
    assert startup.speedups(runs, "cpu_seconds") == {"rerun": 5.0, "resumed": None}
    # Without a cold resumed run, the cold fresh run stands in for it.
    del runs["resumed_cold"]
    assert startup.speedups(runs)["resumed"] == 4.0
    assert startup.speedups({"cold": {"seconds": 60.0, "error": "x"}}) == {
        "rerun": None,
        "resumed": None,
    }


def test_the_runs_log_every_step_in_their_cache_on_small_synthetic_data(tmp_path):
    command = startup.train_command("resnet50", str(tmp_path / "run"), str(tmp_path / "c"), 8)
    assert command[1:3] == ["-m", "haiku_state.train"]
    assert "--config.log_every=1" in command
    assert f"--config.compilation_cache_dir={tmp_path / 'c'}" in command
    assert "--config.data.num_train=16" in command
    assert not any("data." in arg for arg in startup.train_command("mlp", "w", "c", 8))


def test_a_recipe_keeps_its_cadences_and_reads_the_data_it_is_given():
    command = startup.train_command(
        "resnet50:imagenet", "w", "c", 256, overrides={"data.dir": "/j", "log_every": 20}
    )
    assert command[3].endswith("experiments/resnet50.py:imagenet")
    assert {"--config.data.dir=/j", "--config.log_every=20", "--config.batch_size=256"} <= set(
        command
    )
    assert not any(arg.startswith(("--config.steps=", "--config.eval_every=")) for arg in command)


def test_a_phase_runs_if_its_estimate_fits_and_its_error_is_recorded(tmp_path):
    path = tmp_path / "gpu.json"
    check = accelerator_check.Check(
        str(path), budget_s=100.0, plan=accelerator_check.QUICK, argv=["--quick"]
    )
    assert json.loads(path.read_text())["status"] == "running"  # Written from the start.
    assert check.phase("first", 10.0, lambda: {"images_per_s": 5.0}) == {"images_per_s": 5.0}
    assert json.loads(path.read_text())["first"] == {"images_per_s": 5.0}  # At once.
    assert check.phase("too_long", 1000.0, lambda: pytest.fail("ran")) is None
    assert check.record["skipped"] == ["too_long: 100 s left, it needs about 1000 s"]

    def broken():
        raise RuntimeError("out of memory")

    assert check.phase("broken", 1.0, broken) == {"error": "RuntimeError: out of memory"}
    saved = json.loads(path.read_text())
    assert saved["broken"] == {"error": "RuntimeError: out of memory"}
    assert set(saved["phase_s"]) == {"first", "broken"}
    assert saved["plan"]["step_batch_sizes"] == [32, 64, 128]


@pytest.mark.parametrize("plan", [accelerator_check.Plan(), accelerator_check.TPU])
def test_a_plan_fits_the_eight_minutes_and_starts_the_imagenet_recipe(plan):
    assert plan.loop_experiment == plan.startup_experiment == "resnet50:imagenet"
    estimates = (
        plan.startup_s
        + len(plan.step_batch_sizes) * plan.step_s
        + plan.decoders_s
        + plan.pipeline_s
        + len(plan.decoders) * plan.loop_s
        + 15.0  # The peak matmul and the JPEGs.
    )
    assert estimates <= 480.0


def test_the_tpu_plan_has_no_gpu_decoder_and_records_it_as_not_applicable(tmp_path):
    assert accelerator_check.TPU.decoders == ("cpu",)
    check = accelerator_check.Check(
        str(tmp_path / "tpu.json"), budget_s=0.0, plan=accelerator_check.TPU, argv=[]
    )
    loops = accelerator_check.measure_loops(check, str(tmp_path), workers=1)
    assert loops["gpu"] == {"skipped": accelerator_check.NOT_APPLICABLE}


@pytest.mark.parametrize("target, plan", [("gpu-check", "gpu"), ("tpu-check", "tpu")])
def test_make_check_runs_the_hosts_python_as_it_is_and_writes_the_record(target, plan):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    commands = subprocess.run(
        ["make", "-n", "--no-print-directory", target, "VENV=", f"PYTHON={sys.executable}",
         f"RECORD=benchmarks/results/{plan}.json"],
        cwd=REPO, env=environment, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert [command.strip() for command in commands] == [
        f"{sys.executable} -m benchmarks.accelerator_check --out=benchmarks/results/{plan}.json"
        f" --plan={plan}"
    ]
