"""The input pipeline: `load_dataset` (a source by name), then `train_batches` and
`eval_batches`, which yield batches of a pure function of `(seed, step)` laid out on the
devices; `make_augment_fn`'s shifts and flips run inside the step. ARCHITECTURE.md maps
the modules."""

# ruff: noqa: F401 - the imports below are this package's API.
from haiku_state.data.augment import make_augment_fn, random_flip, random_shift
from haiku_state.data.batches import DEFAULT_OPTIONS, PipelineOptions, eval_batches, train_batches
from haiku_state.data.gpu_decode import unavailable_reason as gpu_decoder_unavailable
from haiku_state.data.in_memory import CIFAR10_MEAN, CIFAR10_STD
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice, steps_per_epoch
from haiku_state.data.pipeline import DECODER_NAMES, default_workers
from haiku_state.data.sources import (
    DATASETS,
    ENCODED_DATASETS,
    SOURCES,
    Source,
    SourceArgs,
    image_from_file,
    image_shape_of,
    load_dataset,
)
from haiku_state.data.splits import (
    CorruptImageError,
    DataError,
    Dataset,
    EncodedSplit,
    MissingDataError,
    Split,
    num_examples,
)
