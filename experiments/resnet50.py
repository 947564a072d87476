"""ResNet-50 on ImageNet-shaped (224x224x3, 1000 classes) synthetic input.

For GPU/TPU throughput benchmarks, and the template for a real ImageNet run:
swap `data` for a real loader and raise `steps` (90 epochs of 1.28M images at
batch 1024 is about 112,590 steps). Far too slow to train on a CPU.
"""

import _base
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = _base.get_config()
    config.steps = 200
    config.batch_size = 256
    config.log_every = 20
    config.check_every = 100
    config.checkpoint_every = 100
    config.max_to_keep = 2
    config.label_smoothing = 0.1
    # The linear scaling rule: 0.1 per 256 examples (Goyal et al., 2017).
    config.optimizer.learning_rate = 0.1
    config.optimizer.warmup_steps = 20

    config.data.name = "synthetic"
    config.data.image_shape = (224, 224, 3)
    config.data.num_classes = 1000
    config.data.num_train = 512
    config.data.num_test = 256
    config.data.max_shift = 0
    config.data.flip = True

    config.model.name = "resnet50"
    return config
