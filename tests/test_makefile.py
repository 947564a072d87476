"""What `make` installs, and with which Python: dry runs of the Makefile, no install.

Each stack is a Python version with a lock file, requirements/py<X.Y>.txt. `make` picks
the newest stack's Python that runs, builds .venv (newest stack) or .venv-X.Y, installs
each target's extras pinned by the lock, and adds the JAX plugin that JAX_PLATFORMS or
ACCELERATOR names at the lock's jax version; VENV= installs nothing.
"""

from __future__ import annotations

import configparser
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCKS = {path.stem.removeprefix("py"): path for path in REPO.glob("requirements/py*.txt")}
# Newest first, as the Makefile orders them.
STACKS = sorted(LOCKS, key=lambda stack: tuple(map(int, stack.split("."))), reverse=True)
# The variables a caller may set, and those an outer `make test PYTHON=... VENV=` passes down.
_CALLER_VARIABLES = (
    "JAX_PLATFORMS",
    "ACCELERATOR",
    "PYTHON",
    "VENV",
    "STACKS",
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
)
# The extras each target installs: training draws curves.png, nothing more.
_TARGET_EXTRAS = {
    "install": "test,bench,plots",
    "test": "test,bench,plots",
    "train": "plots",
    "train-multiprocess": "plots",
    "eval": "plots",
    "prepare": "plots",
    "bench": "bench,plots",
    "bench-quick": "bench,plots",
    "bench-plot": "bench,plots",
    "lint": "test",
    "format": "test",
}
# Extras for accelerators (JAX's plugins, the GPU decoder): not locked, they cannot run here.
_PLUGIN_EXTRAS = ("cuda12", "cuda13", "tpu", "gpu-decode-cu12", "gpu-decode-cu13")


def _make(*args: str, env: dict[str, str] | None = None, cwd=REPO) -> list[str]:
    """The lines `make args` prints, with none of the caller's make variables set."""
    clean = {k: v for k, v in os.environ.items() if k not in _CALLER_VARIABLES}
    result = subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


def _dry_run(target: str, *variables: str, env: dict[str, str] | None = None) -> list[str]:
    """The commands `make target` would run from scratch."""
    return _make("--dry-run", "--always-make", target, *variables, env=env)


def _pins(stack: str) -> dict[str, str]:
    pins = {}
    for line in LOCKS[stack].read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_normalized(name)] = version
    return pins


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _stack_python(stack: str) -> str:
    try:
        [python] = _make("-s", "which-python", f"STACKS={stack}")
    except subprocess.CalledProcessError:
        pytest.skip(f"no Python {stack} here")
    return python


def _venv(stack: str) -> str:
    return ".venv" if stack == STACKS[0] else f".venv-{stack}"


def test_the_default_python_is_the_newest_stacks_that_is_here():
    assert {"3.11", "3.12"} <= set(STACKS)
    # The lock's jax version is the stack's: 0.10.2 is the last release for Python 3.11.
    assert _pins("3.11")["jax"] == "0.10.2"
    [default] = _make("-s", "which-python")
    for stack in STACKS:
        try:
            [python] = _make("-s", "which-python", f"STACKS={stack}")
        except subprocess.CalledProcessError:
            continue  # This stack's Python is not here: the next one's is the default.
        assert default == python, (stack, default)
        return
    raise AssertionError(f"make picked {default}, which is no stack's Python")


@pytest.mark.parametrize("stack", STACKS)
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
def test_install_adds_the_plugin_at_the_locked_jax_version(stack, variables, accelerator):
    python = _stack_python(stack)
    commands = _dry_run("install", f"PYTHON={python}", env=variables)
    [install] = [c for c in commands if "pip install" in c and "-e " in c]
    assert f" -c requirements/py{stack}.txt " in install, install
    plugins = [word.strip("'") for word in install.split() if word.strip("'").startswith("jax[")]
    if accelerator == "cpu":
        assert plugins == [], install
    else:
        assert plugins == [f"jax[{accelerator}]=={_pins(stack)['jax']}"], install
    # The stack's own virtualenv, made by its Python (and remade if it holds another).
    venv = _venv(stack)
    assert install.startswith(f"{venv}/bin/python -m pip install "), install
    assert any(f"{python} -m venv --clear {venv}" in c for c in commands), commands
    # One stamp per stack and accelerator: installing for a GPU later is not skipped as done.
    assert f"touch {venv}/.installed-py{stack}-{accelerator}-test+bench+plots" in commands


@pytest.mark.parametrize(("target", "extras"), _TARGET_EXTRAS.items())
def test_each_target_installs_only_its_extras(target, extras):
    commands = _dry_run(target)
    [install] = [c for c in commands if "pip install" in c and "-e " in c]
    assert f"-e '.[{extras}]'" in install, install
    stamps = [c for c in commands if c.startswith("touch ")]
    assert stamps and stamps[0].endswith(f"-cpu-{extras.replace(',', '+')}"), stamps


def test_a_changed_lock_or_setup_cfg_redoes_the_install(tmp_path):
    stack = STACKS[0]
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / f".installed-py{stack}-cpu-plots").touch()  # Newer than every prerequisite.
    variables = (f"PYTHON={_stack_python(stack)}", f"VENV={venv}")
    up_to_date = _make("--dry-run", "train", *variables)
    assert not any("pip install" in c for c in up_to_date), up_to_date
    for changed in (f"requirements/py{stack}.txt", "setup.cfg", "pyproject.toml"):
        commands = _make("--dry-run", f"--what-if={changed}", "train", *variables)
        assert any("pip install" in c for c in commands), (changed, commands)


@pytest.mark.parametrize("target", _TARGET_EXTRAS)
def test_empty_venv_runs_the_given_python_as_it_is(target):
    """VENV= is for an environment that already has JAX: no virtualenv, no pip."""
    commands = _dry_run(target, "VENV=", f"PYTHON={sys.executable}")
    installs = [c for c in commands if re.search(r"-m (pip|venv)\b|^touch ", c)]
    assert installs == [], commands
    if target != "install":
        assert commands[0].lstrip("@").split()[0] in (sys.executable, "status=0;"), commands
        assert all(f"{sys.executable} -m " in c for c in commands if " -m " in c), commands


def _fake_python(path: pathlib.Path, version: str, runs: bool = True) -> None:
    """An interpreter that exits 0 for `-c ''` and prints `version` for the version query,
    or, with runs=False, a pyenv shim of an inactive version (exit 127)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f'[ -z "$2" ] && exit 0\necho {version}\n' if runs else "exit 127\n"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.fixture
def fake_machine(tmp_path):
    """A PATH with no real Python of the fake stacks 3.99 and 3.98, and a fake pyenv."""
    bin_dir, pyenv_root = tmp_path / "bin", tmp_path / "pyenv"
    bin_dir.mkdir()
    (bin_dir / "pyenv").write_text(f"#!/bin/sh\necho {pyenv_root}\n")
    (bin_dir / "pyenv").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return bin_dir, pyenv_root, env


def _picked(env, *variables: str) -> str:
    [python] = _make("-s", "which-python", "STACKS=3.99 3.98", *variables, env=env)
    return python


def test_make_picks_the_newest_stack_whose_python_runs(fake_machine):
    bin_dir, pyenv_root, env = fake_machine
    _fake_python(bin_dir / "python3.98", "3.98")
    assert _picked(env) == "python3.98"
    # A pyenv shim of an inactive version exits 127: pyenv's own 3.99 interpreters are
    # next, the newest first.
    _fake_python(bin_dir / "python3.99", "3.99", runs=False)
    assert _picked(env) == "python3.98"
    for patch in ("3.99.2", "3.99.10"):
        _fake_python(pyenv_root / f"versions/{patch}/bin/python3.99", "3.99")
    assert _picked(env) == f"{pyenv_root}/versions/3.99.10/bin/python3.99"
    _fake_python(bin_dir / "python3.99", "3.99")
    assert _picked(env) == "python3.99"
    # PYTHON overrides the choice, and a named VENV brings its stack's Python.
    assert _picked(env, "PYTHON=python3.98") == "python3.98"
    assert _picked(env, "VENV=.venv-3.98") == "python3.98"
    # VENV= alone uses the Python of the environment one is in.
    _fake_python(bin_dir / "python3", "3.97")
    assert _picked(env, "VENV=") == "python3"


def test_pyenv_versions_are_found_without_the_pyenv_command(fake_machine):
    bin_dir, pyenv_root, env = fake_machine
    (bin_dir / "pyenv").unlink()
    _fake_python(pyenv_root / "versions/3.99.1/bin/python3.99", "3.99")
    assert _picked({**env, "PYENV_ROOT": str(pyenv_root)}) == (
        f"{pyenv_root}/versions/3.99.1/bin/python3.99"
    )


def _requirement_names(lines: str) -> set[str]:
    names = set()
    for line in lines.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(_normalized(re.match(r"[A-Za-z0-9._-]+", line).group()))
    return names


def test_every_lock_pins_every_requirement_of_setup_cfg():
    """Adding a dependency to setup.cfg needs `make lock`: this fails until it ran."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    required = _requirement_names(setup["options"]["install_requires"])
    for extra, requirements in setup["options.extras_require"].items():
        if extra not in _PLUGIN_EXTRAS:
            required |= _requirement_names(requirements)
    for stack in STACKS:
        pins = _pins(stack)
        assert required <= set(pins), (stack, sorted(required - set(pins)))
        assert pins["jaxlib"] == pins["jax"], stack
    # One ruff, so `make lint` says the same on every stack.
    assert len({_pins(stack)["ruff"] for stack in STACKS}) == 1


def test_train_takes_a_config_variant_and_prepare_a_path_with_spaces():
    def command(module, *variables):
        [line] = [c for c in _dry_run(*variables) if f"-m {module}" in c]
        return line

    train = command("haiku_state.train", "train", "EXP=resnet50:imagenet")
    assert "--config=experiments/resnet50.py:imagenet" in train
    assert "--workdir=runs/resnet50-imagenet" in train
    assert "--config=experiments/mlp.py " in command("haiku_state.train", "train", "EXP=mlp")
    prepare = command(
        "haiku_state.prepare", "prepare", "FROM=imagefolder:/data/my photos", "TO=/out"
    )
    assert '--from="imagefolder:/data/my photos" --to="/out"' in prepare


def test_the_readmes_own_photos_recipe_trains_in_a_workdir_of_its_own():
    # In `make train EXP=mlp`'s workdir it would be refused: that run is on the digits.
    readme = (REPO / "README.md").read_text()
    [recipe] = [
        block for block in re.findall(r"```sh\n(.*?)```", readme, re.S)
        if "make train" in block and "data.name=imagefolder" in block
    ]  # fmt: skip
    make, target, *variables = shlex.split(recipe.replace("\\\n", " "))
    assert (make, target) == ("make", "train")

    def workdir(*variables: str) -> str:
        [line] = [c for c in _dry_run("train", *variables) if "-m haiku_state.train" in c]
        return re.search(r"--workdir=(\S+)", line).group(1)

    assert workdir(*variables) != workdir("EXP=mlp") == "runs/mlp"


def _phony_targets() -> list[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    [phony] = re.findall(r"^\.PHONY:(.*)$", text, re.M)
    return phony.split()


def test_make_alone_lists_every_target_and_the_main_variables_and_installs_nothing():
    # Dry runs: were the default another target, this test would not install it.
    assert _make("--dry-run") == _make("--dry-run", "help")
    listing = _make("help")
    described = {line.split()[0]: line for line in listing if line.startswith("  ")}
    for target in _phony_targets():
        assert target in described and len(described[target].split()) > 2, target
    for variable in ("EXP", "WORKDIR", "DEVICES", "ARGS", "PYTHON", "VENV"):
        assert variable in described, variable
    assert described["WORKDIR"].endswith("(now runs/resnet)")
    assert any(line.endswith("(now runs/mlp)") for line in _make("EXP=mlp"))


def test_help_needs_no_python_and_the_other_targets_say_which_is_missing(fake_machine):
    _, _, env = fake_machine
    assert _make("--dry-run", "STACKS=3.99 3.98", env=env) == _make(
        "--dry-run", "help", "STACKS=3.99 3.98", env=env
    )
    listing = _make("help", "STACKS=3.99 3.98", env=env)
    assert any("none found: set PYTHON=" in line for line in listing), listing
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _make("--dry-run", "train", "STACKS=3.99 3.98", env=env)
    assert "No Python of the stacks 3.99 3.98 runs here" in refused.value.stderr


def test_the_tensorboard_viewer_the_readme_names_comes_with_make_train():
    assert "tensorboard --logdir runs" in (REPO / "README.md").read_text()
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    extras = setup["options.extras_require"]
    train_installs = set().union(
        *(_requirement_names(extras[extra]) for extra in _TARGET_EXTRAS["train"].split(","))
    )
    assert "tensorboard" in train_installs
