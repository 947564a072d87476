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
