"""ResNet-50 on ImageNet: synthetic input by default, the ImageNet recipe as `:imagenet`.

    --config=experiments/resnet50.py            224x224x3 synthetic data, 1000 classes:
                                                for GPU/TPU throughput; far too slow to
                                                train on a CPU.
    --config=experiments/resnet50.py:imagenet   the recipe for ILSVRC-2012 (ImageFolder
        --config.data.dir=/data/imagenet        or, with data.name=arrayrecord, its
                                                prepared shards).

The recipe is Goyal et al. (2017) as the Haiku and Flax ImageNet examples run
it: 90 epochs, SGD with Nesterov momentum 0.9, the linear scaling rule
(learning rate 0.1 per 256 examples of the global batch: 0.4 at the default
1024), 5 epochs of linear warmup then cosine decay (both follow an overridden
`batch_size`, unless given themselves), label smoothing 0.1, weight decay 1e-4
on the weights of convolutions and linear layers only (not BatchNorm, not
biases: `optim.haiku_weights`). It computes in bfloat16 (the library's mixed
precision). Training crops are Inception-style random-resized crops with
flips, made on the host; evaluation takes the centre 87.5%.
"""

import _base
import ml_collections

IMAGENET_TRAIN_EXAMPLES = 1_281_167


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    config = _base.get_config("resnet50")
    config.batch_size = 256
    config.log_every = 20
    config.check_every = 100
    config.checkpoint_every = 100
    config.max_to_keep = 2
    config.label_smoothing = 0.1
    # The linear scaling rule: 0.1 per 256 examples (Goyal et al., 2017).
    config.optimizer.learning_rate = 0.1
    config.optimizer.warmup_steps = 20
    config.data.image_size = 224
    config.data.max_shift = 0

    if variant == "imagenet":
        _imagenet_recipe(config)
    elif variant:
        raise ValueError(f"Unknown resnet50 variant {variant!r}; the variant is 'imagenet'.")
    else:
        _synthetic_input(config)
    return config


def _synthetic_input(config: ml_collections.ConfigDict) -> None:
    """A short run on synthetic ImageNet-shaped data (the keys the recipe does not read)."""
    config.steps = 200
    config.data.name = "synthetic"
    config.data.image_shape = (224, 224, 3)
    config.data.num_classes = 1000
    config.data.num_train = 512
    config.data.num_test = 256
    config.data.flip = True


def _imagenet_recipe(config: ml_collections.ConfigDict) -> None:
    config.batch_size = 1024
    config.eval_batch_size = 1024
    config.num_epochs = 90
    config.precision = "bfloat16"
    config.log_every = 100
    config.check_every = 1000
    config.checkpoint_every = 1000
    config.eval_every = 5000
    config.max_to_keep = 3
    # Both follow --config.batch_size (lazily: ml_collections references) unless set too.
    batch_size = config.get_ref("batch_size")
    del config.optimizer["learning_rate"], config.optimizer["warmup_steps"]
    config.optimizer.learning_rate = ml_collections.FieldReference(0.1 / 256) * batch_size
    steps_per_epoch = ml_collections.FieldReference(IMAGENET_TRAIN_EXAMPLES) // batch_size
    config.optimizer.warmup_steps = steps_per_epoch * 5
    config.optimizer.weight_decay = 1e-4
    config.data.name = "imagefolder"  # Or arrayrecord: the same data, prepared.
    config.data.max_shift = 0
    config.data.flip = False  # The host's crops are flipped already.
