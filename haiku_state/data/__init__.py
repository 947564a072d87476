"""The input pipeline: `load_dataset` (a source by name), then `train_batches` and
`eval_batches`, which yield batches of a pure function of `(seed, step)` laid out on the
devices; `make_augment_fn`'s shifts and flips run inside the step. ARCHITECTURE.md maps
the modules."""

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

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATASETS",
    "DECODER_NAMES",
    "DEFAULT_OPTIONS",
    "ENCODED_DATASETS",
    "SINGLE_PROCESS",
    "SOURCES",
    "CorruptImageError",
    "DataError",
    "Dataset",
    "EncodedSplit",
    "MissingDataError",
    "PipelineOptions",
    "ProcessSlice",
    "Source",
    "SourceArgs",
    "Split",
    "default_workers",
    "eval_batches",
    "gpu_decoder_unavailable",
    "load_dataset",
    "make_augment_fn",
    "num_examples",
    "random_flip",
    "random_shift",
    "steps_per_epoch",
    "train_batches",
]
