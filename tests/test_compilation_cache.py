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


@pytest.fixture
def cache_off_afterwards():
    """The process's cache as the tests before found it: off (each run enables its own)."""
    yield
    compilation_cache.enable("")


def _entries(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


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


def test_a_damaged_entry_is_one_line_and_replaced_by_the_program_compiled_instead(tmp_path):
    def compile_in_a_process():
        command = [sys.executable, "-c", _COMPILE_ONCE, str(tmp_path / "cache")]
        env = {**os.environ, "PYTHONPATH": REPO}
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.splitlines()[-1]), out.stderr

    first, _ = compile_in_a_process()
    entries = [tmp_path / "cache" / name for name in _entries(tmp_path / "cache")]
    for entry in entries:  # Truncated, as a full disk or a killed copy leaves them.
        entry.write_bytes(entry.read_bytes()[:100])
    damaged, said = compile_in_a_process()
    assert damaged == {"cache_hits": 0, "cache_misses": first["cache_misses"]}
    assert "Error reading persistent compilation cache entry" not in said
    lines = [line for line in said.splitlines() if "Compilation cache: the entry" in line]
    assert len(lines) == 1, said
    assert "cannot be read (error: Error -5 while decompressing data" in lines[0]
    assert "its program is compiled and written anew, as is any other damaged entry" in lines[0]
    assert all(entry.stat().st_size > 100 for entry in entries)  # Written anew.
    again, said = compile_in_a_process()
    assert again == {"cache_hits": first["cache_misses"], "cache_misses": 0}
    assert "Compilation cache: the entry" not in said


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
