"""What this host keeps about data folders, outside them, so that they may be read-only.

`$HAIKU_STATE_CACHE/<kind>/<hash of the folder's real path>/` (default under
`$XDG_CACHE_HOME` or `~/.cache`): an ImageFolder's file index and statistics, the
ArrayRecord shards found to match their record. Anything there may be deleted.
"""

from __future__ import annotations

import hashlib
import os

CACHE_ENV = "HAIKU_STATE_CACHE"


def cache_dir(kind: str, root: str) -> str:
    """Where this host caches what it learnt about the `kind` folder at `root` (a real path)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "haiku_state"
    )
    key = hashlib.sha256(root.encode()).hexdigest()[:24]
    return os.path.join(base, kind, key)
