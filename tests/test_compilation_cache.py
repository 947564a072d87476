"""The persistent compilation cache: where it goes, on and off, and a second process's hits."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from configs import REPO, mlp_config

from haiku_state import compilation_cache, evaluation, train
from haiku_state import config as config_lib
from haiku_state.guards import config_checks

# Compiles one program with the cache of argv[1] and prints the cache's hits and misses.
_COMPILE_ONCE = """
import json, sys
import jax, jax.numpy as jnp
from haiku_state import compilation_cache
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
compilation_cache.enable(sys.argv[1])
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)))
print(json.dumps({name: events.count("/jax/compilation_cache/" + name)
                  for name in ("cache_hits", "cache_misses")}))
"""

# Compiles two programs, jit_first and jit_second, and prints the cache's hits and misses.
_COMPILE_TWO = """
import json, sys
import jax, jax.numpy as jnp
from haiku_state import compilation_cache
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
compilation_cache.enable(sys.argv[1])
def first(x):
    return jnp.sin(x) * 3 + 1
def second(x):
    return jnp.cos(x) * 2 - 1
for program in (first, second):
    jax.block_until_ready(jax.jit(program)(jnp.arange(7.0)))
print(json.dumps({name: events.count("/jax/compilation_cache/" + name)
                  for name in ("cache_hits", "cache_misses")}))
"""


@pytest.fixture
def cache_off_afterwards():
    """The process's cache as the tests before found it: off (each run enables its own)."""
    yield
    compilation_cache.enable("")


def _entries(directory) -> list[str]:
    """The cache's entries (beside them: the record of what they held, `MANIFEST`)."""
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory) if name.endswith("-cache"))


def _compile_new_program(scale: float) -> None:
    jax.block_until_ready(jax.jit(lambda x: jnp.cos(x) * scale)(jnp.ones(5)))


def test_default_directory_follows_the_cache_variables(monkeypatch, tmp_path):
    monkeypatch.setenv(compilation_cache.CACHE_ENV, str(tmp_path / "hs"))
    assert compilation_cache.default_directory() == str(tmp_path / "hs/jax_compilation_cache")
    monkeypatch.delenv(compilation_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    expected = tmp_path / "xdg/haiku_state/jax_compilation_cache"
    assert compilation_cache.default_directory() == str(expected)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home/.cache/haiku_state/jax_compilation_cache"
    assert compilation_cache.default_directory() == str(expected)


def test_the_experiments_cache_by_default_and_the_tests_out_of_the_users_home():
    config = mlp_config()
    assert config.compilation_cache_dir == compilation_cache.default_directory()
    assert config.compilation_cache_dir.startswith(os.environ[compilation_cache.CACHE_ENV])


def test_enable_writes_every_program_logs_once_and_empty_turns_it_off(
    tmp_path, caplog, cache_off_afterwards
):
    caplog.set_level(logging.INFO)
    compilation_cache.enable(str(tmp_path / "cache"))
    compilation_cache.enable(str(tmp_path / "cache"))  # Idempotent.
    _compile_new_program(2.0)  # Compiles in milliseconds, and is cached all the same.
    written = _entries(tmp_path / "cache")
    assert written
    lines = [r.getMessage() for r in caplog.records if "Compilation cache" in r.getMessage()]
    assert lines == [f"Compilation cache: {tmp_path / 'cache'} (config.compilation_cache_dir)."]
    compilation_cache.enable(str(tmp_path / "other"))  # Another directory takes over.
    _compile_new_program(3.0)
    written_other = _entries(tmp_path / "other")
    assert written_other and _entries(tmp_path / "cache") == written
    compilation_cache.enable("")
    assert jax.config.jax_compilation_cache_dir is None
    _compile_new_program(4.0)
    assert _entries(tmp_path / "other") == written_other
    assert _entries(tmp_path / "cache") == written


def _read_only_directory(path) -> str:
    """A directory this process cannot write to; skips where it can (root writes anywhere)."""
    os.makedirs(path)
    os.chmod(path, 0o555)
    try:
        open(os.path.join(path, "probe"), "w").close()
    except PermissionError:
        return str(path)
    pytest.skip("this user writes into read-only directories (root)")


@pytest.mark.parametrize("where", ["under_a_file", "read_only"])
def test_an_unusable_directory_turns_the_cache_off_in_one_line_and_compiles_on(
    tmp_path, caplog, cache_off_afterwards, where
):
    (tmp_path / "afile").write_text("")
    if where == "under_a_file":
        directory, why = str(tmp_path / "afile" / "cache"), "Not a directory"
    else:
        directory, why = _read_only_directory(tmp_path / "read_only"), "Permission denied"
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        compilation_cache.enable(directory)
        _compile_new_program(5.0)
    assert jax.config.jax_compilation_cache_dir is None
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        f"Compilation cache off: config.compilation_cache_dir={directory} cannot be used ("
    )
    assert why in line and line.endswith("or set it to '' to turn the cache off.")
    assert [str(w.message) for w in raw if "compilation cache" in str(w.message)] == []


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    def compile_in_a_process() -> dict[str, int]:
        command = [sys.executable, "-c", _COMPILE_ONCE, str(tmp_path / "cache")]
        env = {**os.environ, "PYTHONPATH": REPO}
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.splitlines()[-1])

    first = compile_in_a_process()
    assert first["cache_hits"] == 0 and first["cache_misses"] >= 1
    assert len(_entries(tmp_path / "cache")) == first["cache_misses"]
    assert compile_in_a_process() == {"cache_hits": first["cache_misses"], "cache_misses": 0}


def _compile_in_a_process(script: str, directory) -> tuple[dict[str, int], str]:
    command = [sys.executable, "-c", script, str(directory)]
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def _one_damage_line(said: str, count: int) -> str:
    assert "Error reading persistent compilation cache entry" not in said  # JAX's, per entry.
    lines = [line for line in said.splitlines() if "Compilation cache: " in line and "entr" in line]
    assert len(lines) == 1, said
    entries = "entry" if count == 1 else "entries"
    assert f"Compilation cache: {count} {entries} of " in lines[0]
    assert lines[0].endswith(
        "did not hold what JAX wrote there (truncated, overwritten or swapped); removed, so "
        "their programs are compiled and written anew."
    )
    return lines[0]


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
def test_a_damaged_entry_is_one_line_and_replaced_by_the_program_compiled_instead(
    tmp_path, recorded
):
    cache = tmp_path / "cache"
    first, _ = _compile_in_a_process(_COMPILE_ONCE, cache)
    if not recorded:  # Written by a run that was killed, or before the entries were recorded.
        (cache / compilation_cache.MANIFEST).unlink()
    entries = [cache / name for name in _entries(cache)]
    assert len(entries) == first["cache_misses"]
    for entry in entries:  # Truncated, as a full disk or a killed copy leaves them.
        entry.write_bytes(entry.read_bytes()[:100])
    damaged, said = _compile_in_a_process(_COMPILE_ONCE, cache)
    assert damaged == {"cache_hits": 0, "cache_misses": first["cache_misses"]}
    _one_damage_line(said, len(entries))
    assert all(entry.stat().st_size > 100 for entry in entries)  # Written anew.
    again, said = _compile_in_a_process(_COMPILE_ONCE, cache)
    assert again == {"cache_hits": first["cache_misses"], "cache_misses": 0}
    assert "did not hold" not in said


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
def test_two_valid_entries_swapped_are_damaged_entries_replaced_not_a_crash(tmp_path, recorded):
    cache = tmp_path / "cache"
    first, _ = _compile_in_a_process(_COMPILE_TWO, cache)
    others = first["cache_misses"] - 2  # What jnp.arange compiles besides.
    if not recorded:
        (cache / compilation_cache.MANIFEST).unlink()
    [one] = cache.glob("jit_first-*-cache")
    [other] = cache.glob("jit_second-*-cache")
    contents = one.read_bytes(), other.read_bytes()
    one.rename(cache / "swap")
    other.rename(one)
    (cache / "swap").rename(other)
    swapped, said = _compile_in_a_process(_COMPILE_TWO, cache)
    assert swapped == {"cache_hits": others, "cache_misses": 2}
    line = _one_damage_line(said, 2)
    assert f"Compilation cache: 2 entries of {cache} (jit_first-" in line
    assert (one.read_bytes(), other.read_bytes()) != contents[::-1]  # Written anew.
    again, said = _compile_in_a_process(_COMPILE_TWO, cache)
    assert again == {"cache_hits": first["cache_misses"], "cache_misses": 0}
    assert "did not hold" not in said


def test_an_entry_written_again_with_its_own_bytes_is_kept(tmp_path):
    cache = tmp_path / "cache"
    first, _ = _compile_in_a_process(_COMPILE_TWO, cache)
    for name in _entries(cache):  # A copy back and forth: new times, the same bytes.
        (cache / name).write_bytes((cache / name).read_bytes())
    again, said = _compile_in_a_process(_COMPILE_TWO, cache)
    assert again == {"cache_hits": first["cache_misses"], "cache_misses": 0}
    assert "did not hold" not in said


def test_enable_leaves_jaxs_own_modules_as_they_are(tmp_path, cache_off_afterwards):
    from jax._src import compilation_cache as jax_internal_cache
    from jax._src import compiler as jax_compiler

    before = {module.__name__: dict(vars(module)) for module in (jax_internal_cache, jax_compiler)}
    compilation_cache.enable(str(tmp_path / "cache"))
    _compile_new_program(6.0)
    compilation_cache.enable("")
    for module in (jax_internal_cache, jax_compiler):
        changed = [
            name
            for name, value in vars(module).items()
            if callable(value) and before[module.__name__].get(name) is not value
        ]
        assert changed == [], module.__name__
    read = jax_internal_cache.get_executable_and_time
    assert read.__module__ == "jax._src.compilation_cache" and not hasattr(read, "__wrapped__")


def test_training_and_evaluation_compile_into_the_configs_cache(tmp_path, cache_off_afterwards):
    config = mlp_config(compilation_cache_dir=str(tmp_path / "train_cache"), steps=10)
    config.update(log_every=5, eval_every=10, check_every=5, checkpoint_every=5)
    train.train_and_evaluate(config, str(tmp_path / "run"))
    assert _entries(tmp_path / "train_cache")
    config.compilation_cache_dir = str(tmp_path / "eval_cache")  # A free key: no refusal.
    evaluation.evaluate_checkpoint(config, str(tmp_path / "run"))
    assert _entries(tmp_path / "eval_cache")


def test_a_cache_path_that_is_a_file_or_not_a_string_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="config.compilation_cache_dir=.* or '' for no"):
        config_checks.validate_config(mlp_config(compilation_cache_dir=str(tmp_path / "file")), 4)
    not_a_string = mlp_config()
    del not_a_string["compilation_cache_dir"]
    not_a_string.compilation_cache_dir = 3
    with pytest.raises(ValueError, match="config.compilation_cache_dir=3"):
        config_checks.validate_config(not_a_string, 4)
    for good in ("", str(tmp_path / "not_yet_made")):
        config_checks.validate_config(mlp_config(compilation_cache_dir=good), 4)
    assert config_lib.KEYS["compilation_cache_dir"].free  # It changes no step of a run.
