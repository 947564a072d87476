"""Your own network: a Haiku function beside get_config(), trained as a built-in model is.

README.md's "Your own network" shows this file and says what the trainer gives `network` and
what the run records of the file (its path and SHA-256, to build the network again).
"""

import haiku as hk
import jax

from haiku_state import config as config_lib
from haiku_state import models


def network(config, num_classes):
    def forward(batch, is_training):  # batch["image"]: [N, H, W, C] float32, standardised.
        x = hk.Conv2D(16, 3)(batch["image"])
        x = models.BatchNorm()(x, is_training)
        return hk.Linear(num_classes)(hk.Flatten()(jax.nn.relu(x)))

    return forward


def get_config():
    config = config_lib.default_config()  # Every key at its default, and no model.name.
    config.steps = 300
    return config
