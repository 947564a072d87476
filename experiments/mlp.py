"""A small MLP with BatchNorm and dropout on the 8x8 digits: the fast experiment.

Trains in well under a minute on two CPU cores; tests and resume checks use it.
"""

import _base
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    # The defaults: hidden_sizes (256, 256), dropout_rate 0.1, digits, 600 steps of SGD.
    return _base.get_config("mlp")
