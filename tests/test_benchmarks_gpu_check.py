"""The GPU check's pieces at no cost: its budget, its record, the start-up timing around a run.

The check itself runs on a GPU host (`make gpu-check VENV=`); `--quick` runs it on a
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

from benchmarks import gpu_check, startup  # noqa: E402

# A stand-in for a training run: logs step `argv[2] + 1` after `argv[3]` seconds, then
# waits for SIGTERM as a run would, or exits with 3 when asked to fail.
_FAKE_RUN = textwrap.dedent("""
    import json, os, signal, sys, time
    workdir, done, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if delay < 0:
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(delay)
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
    # Resumed: the steps logged before do not count, the next one does.
    timed = startup.time_to_first_step(_fake_run(tmp_path, 1, 0.0), str(tmp_path), 30.0)
    assert timed["step"] == 2


def test_time_to_first_step_of_a_run_that_fails_or_hangs_says_why(tmp_path):
    failed = startup.time_to_first_step(_fake_run(tmp_path, 0, -1.0), str(tmp_path), 30.0)
    assert failed["seconds"] is None and failed["error"].startswith("exited with 3 before a step")
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


def test_a_phase_runs_if_its_estimate_fits_and_its_error_is_recorded(tmp_path):
    path = tmp_path / "gpu.json"
    check = gpu_check.Check(str(path), budget_s=100.0, plan=gpu_check.QUICK, argv=["--quick"])
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


def test_the_plan_on_a_gpu_is_the_issues():
    plan = gpu_check.Plan()
    assert plan.step_batch_sizes == (256, 512, 1024)
    assert plan.loop_experiment == "resnet50:imagenet" and plan.loop_batch_size == 1024
    assert gpu_check.DECODERS == ("cpu", "gpu")
    # Every estimate together fits the eight minutes of the check.
    estimates = (
        plan.startup_s
        + len(plan.step_batch_sizes) * plan.step_s
        + plan.decoders_s
        + plan.pipeline_s
        + len(gpu_check.DECODERS) * plan.loop_s
        + 15.0  # The peak matmul and the JPEGs.
    )
    assert estimates <= 480.0


def test_make_gpu_check_runs_the_hosts_python_as_it_is_and_writes_the_record():
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    commands = subprocess.run(
        ["make", "-n", "--no-print-directory", "gpu-check", "VENV=", f"PYTHON={sys.executable}",
         "RECORD=benchmarks/results/gpu.json"],
        cwd=REPO, env=environment, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert [command.strip() for command in commands] == [
        f"{sys.executable} -m benchmarks.gpu_check --out=benchmarks/results/gpu.json"
    ]
