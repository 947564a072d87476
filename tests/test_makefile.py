"""`make install` adds the JAX plugin of the accelerator that JAX_PLATFORMS names."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# The variables a caller may set, and those an outer `make test` passes down.
_CALLER_VARIABLES = ("JAX_PLATFORMS", "ACCELERATOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")


def _pinned_jax_version() -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.startswith("jax=="):
            return line.removeprefix("jax==")
    raise AssertionError("constraints.txt pins no jax version")


def _install_commands(**variables: str) -> list[str]:
    """The commands `make install` would run from scratch with `variables` set."""
    env = {k: v for k, v in os.environ.items() if k not in _CALLER_VARIABLES}
    result = subprocess.run(
        ["make", "--dry-run", "--always-make", "install"],
        cwd=REPO,
        env={**env, **variables},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


@pytest.mark.parametrize(
    ("variables", "accelerator"),
    [
        ({}, "cpu"),
        ({"JAX_PLATFORMS": "cpu"}, "cpu"),
        ({"JAX_PLATFORMS": "cuda"}, "cuda12"),
        ({"JAX_PLATFORMS": "cuda,cpu"}, "cuda12"),
        ({"JAX_PLATFORMS": "cuda", "ACCELERATOR": "cuda13"}, "cuda13"),
        ({"JAX_PLATFORMS": "tpu"}, "tpu"),
    ],
)
def test_install_adds_the_plugin_at_the_pinned_jax_version(variables, accelerator):
    commands = _install_commands(**variables)
    [install] = [c for c in commands if "-c constraints.txt" in c]
    plugins = [word.strip("'") for word in install.split() if word.strip("'").startswith("jax[")]
    if accelerator == "cpu":
        assert plugins == [], install
    else:
        assert plugins == [f"jax[{accelerator}]=={_pinned_jax_version()}"], install
    # One stamp per accelerator: installing for a GPU later is not skipped as done.
    assert f"touch .venv/.installed-{accelerator}" in commands, commands


def _dry_run(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in _CALLER_VARIABLES}
    result = subprocess.run(
        ["make", "--dry-run", *args], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


def test_train_takes_a_config_variant_and_prepare_a_path_with_spaces():
    [train] = [
        line for line in _dry_run("train", "EXP=resnet50:imagenet") if "haiku_state.train" in line
    ]
    assert "--config=experiments/resnet50.py:imagenet" in train
    assert "--workdir=runs/resnet50-imagenet" in train
    [plain] = [line for line in _dry_run("train", "EXP=mlp") if "haiku_state.train" in line]
    assert "--config=experiments/mlp.py " in plain
    [prepare] = [
        line
        for line in _dry_run("prepare", "FROM=imagefolder:/data/my photos", "TO=/out")
        if "haiku_state.prepare" in line
    ]
    assert '--from="imagefolder:/data/my photos" --to="/out"' in prepare
