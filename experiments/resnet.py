"""A ResNet-18-shaped network of width 16 on the 8x8 digits: `make train EXP=resnet`.

Cross-replica BatchNorm, warmup-cosine SGD with Nesterov momentum, random
shifts drawn on device from the per-device keys, label smoothing.
"""

import _base
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = _base.get_config("resnet")  # width 16, blocks_per_stage (2, 2, 2, 2).
    config.steps = 400
    config.eval_batch_size = 360
    config.label_smoothing = 0.1
    config.optimizer.learning_rate = 0.2
    config.optimizer.warmup_steps = 40
    config.optimizer.weight_decay = 5e-4
    return config
