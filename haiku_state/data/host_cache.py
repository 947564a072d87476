"""What this host keeps about data folders, outside them (they may be read-only): an
ImageFolder's index, the ArrayRecord shards found right. Anything there may be deleted."""

from __future__ import annotations

import hashlib
import os

CACHE_ENV = "HAIKU_STATE_CACHE"


def cache_dir(kind: str, root: str) -> str:
    """`$HAIKU_STATE_CACHE/<kind>/<hash of root>/`, by default under `~/.cache`."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "haiku_state"
    )
    key = hashlib.sha256(root.encode()).hexdigest()[:24]
    return os.path.join(base, kind, key)
