"""The names a config key may take, in a module that imports nothing.

`config` reads them here, so that loading an experiment file does not import the modules
that implement them (Haiku, optax, the data pipeline: seconds); `train` imports those while
the accelerator's runtime starts. Each implementing module re-exports its names from here,
and `tests/test_config.py` checks that its registry holds exactly these.
"""

BACKENDS = ("pmap", "shard_map", "jit")  # replication: how the step is replicated.
PARAM_SHARDINGS = ("replicated", "fsdp")  # sharding: how the params are laid out.
MODELS = ("mlp", "resnet", "resnet50")  # models: the built-in networks.
PRECISIONS = ("float32", "bfloat16", "float16")  # models: compute dtypes.
BATCH_NORMS = ("lean", "haiku")  # batch_norm: the implementations.
OPTIMIZERS = ("sgd", "adam", "adamw")  # optim.
SCHEDULES = ("constant", "warmup_cosine")  # optim: learning-rate schedules.
EVAL_METRICS = {"accuracy": "max", "loss": "min"}  # losses: by metric, which is better.
DATASETS = ("digits", "cifar10", "synthetic", "imagefolder", "arrayrecord")  # data.SOURCES.
ENCODED_DATASETS = ("imagefolder", "arrayrecord")  # Decoded by workers while training.
DECODERS = ("cpu", "gpu")  # data.pipeline.DECODERS.
