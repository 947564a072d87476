"""A ResNet-18-shaped network of width 16 on the 8x8 digits: `make train EXP=resnet`.

Cross-replica BatchNorm, warmup-cosine SGD with Nesterov momentum, random
shifts drawn on device from the per-device keys, label smoothing.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.steps = 400
    config.batch_size = 128  # Global, split over the local devices.
    config.eval_batch_size = 360
    config.log_every = 50
    config.eval_every = 200
    config.check_every = 200
    config.checkpoint_every = 200
    config.max_to_keep = 3
    config.backend = "pmap"  # Or "shard_map": the same step on jax.shard_map.
    config.precision = "float32"  # Or bfloat16 / float16 (mixed precision).
    config.label_smoothing = 0.1

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.2
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 40
    config.optimizer.weight_decay = 5e-4
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True

    config.data = ml_collections.ConfigDict()
    config.data.name = "digits"
    config.data.dir = ""
    config.data.max_shift = 1
    config.data.flip = False

    config.model = ml_collections.ConfigDict()
    config.model.name = "resnet"
    config.model.width = 16
    config.model.blocks_per_stage = (2, 2, 2, 2)
    return config
