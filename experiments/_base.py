"""The settings every experiment shares; an experiment file overrides what differs.

Not an experiment itself (its name starts with `_`): `mlp.py`, `resnet.py` and
`resnet50.py` start from `get_config()` here.
"""

import ml_collections

from haiku_state import compilation_cache


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.steps = 600
    # Instead of `steps` when set: this many epochs of the training split (the log says both).
    config.num_epochs = ml_collections.config_dict.placeholder(int)
    config.batch_size = 128  # Global, split over every device of every process.
    config.eval_batch_size = 256
    config.log_every = 50
    config.eval_every = 200
    config.check_every = 200  # Replicas identical, keys distinct.
    config.checkpoint_every = 200
    config.checkpoint_every_secs = 300.0  # Also save on a timer (jaxline's default); 0: off.
    config.max_to_keep = 3  # The newest complete checkpoints kept.
    config.keep_every_steps = 0  # Milestones kept forever: steps divisible by this; 0: none.
    config.keep_best_by = ""  # An eval metric ("accuracy", "loss") to keep the best step by.
    config.keep_best_mode = "max"  # Or "min" (for a loss).
    config.init_from = ""  # Warm start: params and state of a checkpoint (dir or step dir).
    config.init_skip = ""  # Regex of param/state paths that keep their fresh initialisation.
    config.profile_steps = ()  # (start, stop): a jax.profiler trace into WORKDIR/profile.
    config.backend = "pmap"  # Or "shard_map": the same step on jax.shard_map.
    config.precision = "float32"  # Or bfloat16 / float16 (mixed precision).
    config.label_smoothing = 0.0
    # Compiled programs kept on disk, so a rerun or a resume does not compile again; "": off.
    config.compilation_cache_dir = compilation_cache.default_directory()

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.1
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 50
    config.optimizer.weight_decay = 1e-4
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True

    config.data = ml_collections.ConfigDict()
    config.data.name = "digits"  # Or cifar10, synthetic, imagefolder, arrayrecord.
    config.data.dir = ""
    # The side of the square crops of imagefolder / arrayrecord images (224 for ImageNet);
    # the sources held in memory keep their own size.
    config.data.image_size = ml_collections.config_dict.placeholder(int)
    # Decoding processes (None: the cores this process may use, less one, at most 16;
    # 0: decode in the training process) and batches kept ready on the devices.
    config.data.workers = ml_collections.config_dict.placeholder(int)
    config.data.prefetch = 2
    # False: an unreadable image stops the run naming the file and the step. True: it is
    # replaced deterministically and counted in the train metrics (corrupt_fraction).
    config.data.skip_corrupt = False
    config.data.max_shift = 1  # On-device random shifts of up to this many pixels.
    config.data.flip = False  # Digits must not be mirrored.

    config.model = ml_collections.ConfigDict()
    return config
