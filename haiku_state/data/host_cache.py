"""What this host keeps about data folders, outside them, so that they may be read-only.

`$HAIKU_STATE_CACHE/<kind>/<key>/` (default `~/.cache/haiku_state`, or under
`$XDG_CACHE_HOME`), where `<key>` is a hash of the folder's absolute real path:
an ImageFolder tree's file index and pixel statistics (`imagefolder`), the
shards of an ArrayRecord folder whose content was read and found to match its
`dataset.json` (`arrayrecord`). Anything there may be deleted; it is rebuilt.
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
