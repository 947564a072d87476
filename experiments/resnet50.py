"""ResNet-50 on ImageNet-shaped (224x224x3, 1000 classes) synthetic input.

For GPU/TPU throughput benchmarks, and the template for a real ImageNet run:
swap `data` for a real loader and raise `steps` (90 epochs of 1.28M images at
batch 1024 is about 112,590 steps). Far too slow to train on a CPU.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.steps = 200
    config.batch_size = 256  # Global, split over the local devices.
    config.eval_batch_size = 256
    config.log_every = 20
    config.eval_every = 200
    config.check_every = 100
    config.checkpoint_every = 100
    config.max_to_keep = 2
    config.backend = "pmap"  # Or "shard_map": the same step on jax.shard_map.
    config.precision = "float32"  # Or bfloat16 / float16 (mixed precision).
    config.label_smoothing = 0.1

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "sgd"
    # The linear scaling rule: 0.1 per 256 examples (Goyal et al., 2017).
    config.optimizer.learning_rate = 0.1
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 20
    config.optimizer.weight_decay = 1e-4
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True

    config.data = ml_collections.ConfigDict()
    config.data.name = "synthetic"
    config.data.dir = ""
    config.data.image_shape = (224, 224, 3)
    config.data.num_classes = 1000
    config.data.num_train = 512
    config.data.num_test = 256
    config.data.max_shift = 0
    config.data.flip = True

    config.model = ml_collections.ConfigDict()
    config.model.name = "resnet50"
    return config
