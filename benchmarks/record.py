"""The run record: one JSON file per `benchmarks.run`, with the machine, versions and figures.

Every run writes `<output_dir>/<UTC timestamp>_<platform>.json` (ignored by
git: the runs of one machine). `--record=PATH` also writes it to PATH: the
curated record of a platform, `benchmarks/results/<platform>.json`, the one
file per platform that is committed and that the README's table is made from.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1
_VERSIONED_PACKAGES = ("jax", "jaxlib", "dm-haiku", "optax", "flax", "chex", "orbax-checkpoint")


def curated_record_path(platform_name: str) -> Path:
    """Where the committed record of a platform lives (`cpu`, `gpu`, `tpu`)."""
    return DEFAULT_OUTPUT_DIR / f"{platform_name}.json"


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in _VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def machine_info() -> dict[str, Any]:
    return {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "system": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def json_ready(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither); numpy scalars become Python."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """Writes `value` as strict JSON (see `json_ready`) at `path`, creating its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_ready(value), indent=2, allow_nan=False) + "\n")
    return path


def write_run_record(record: dict[str, Any], output_dir: str | os.PathLike) -> Path:
    """Writes one run's record as `<output_dir>/<UTC timestamp>_<platform>.json`."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}_{record.get('platform') or 'unknown'}"
    path, suffix = Path(output_dir) / f"{name}.json", 1
    while path.exists():
        path, suffix = Path(output_dir) / f"{name}_{suffix}.json", suffix + 1
    return write_json(path, record)


def make_run_record(
    device_runs: list[dict[str, Any]],
    *,
    settings: dict[str, Any],
    command: list[str],
    wall_s: float,
    notes: list[str] = (),
) -> dict[str, Any]:
    """Assembles the run's JSON: machine, versions, and every device count's figures.

    Args:
      device_runs: one dict per device count: `costs.device_info()` fields,
        `num_devices`, `peak_matmul`, `experiments` (results of
        `experiment.benchmark_experiment`) and `skipped` notes.
    """
    measured = [run for run in device_runs if run.get("experiments")]
    first = measured[0] if measured else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(command),
        "settings": settings,
        "machine": machine_info(),
        "versions": package_versions(),
        "platform": first.get("platform"),
        "device_kind": first.get("device_kind"),
        "device_counts": [run["num_devices"] for run in measured],
        "runs": device_runs,
        "results": [result for run in measured for result in run["experiments"]],
        "wall_s": wall_s,
        "notes": list(notes),
    }
