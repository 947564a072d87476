"""The settings every experiment shares; an experiment file overrides what differs.

Not an experiment itself (its name starts with `_`): `mlp.py`, `resnet.py` and
`resnet50.py` start from `get_config(model)` here. Every key, its default and
what it sets are in `haiku_state/config.py`'s `SCHEMA`.
"""

import ml_collections

from haiku_state import config as config_lib


def get_config(model: str | None = None) -> ml_collections.ConfigDict:
    """Every key at its default, with `model.name = model` and that network's options."""
    return config_lib.default_config(model)
