"""The input pipeline: sources, batch order, host decoding, batches onto the devices, augmentation.

Nothing here touches the network. A run uses it in three calls: `load_dataset`
(a source by name), then `train_batches` and `eval_batches` (module `batches`),
which take the split, the global batch size and this process's `ProcessSlice`,
pick the cheapest pipeline, and yield batches laid out on the devices. On the
device, `make_augment_fn`'s shifts and flips run inside the step.

The modules, in the order data flows:

- `sources`: the datasets by name (`SOURCES`) and `load_dataset`; `in_memory`
  (digits, CIFAR-10, synthetic: arrays), `imagefolder` (`DIR/train/<class>/*`
  trees, their index cached, `host_cache`), `arrayrecord` (the shards `prepare`
  writes).
- `order`: which examples each step sees, a pure function of `(seed, step)`;
  `ProcessSlice`: which slice of every global batch a process loads.
- `batches`: the entry point, and the host batches of a split in memory;
  `device`: a small split kept and batched on the devices, and the thread that
  shards host batches onto them; `pipeline`: grain's workers decoding encoded
  splits with `preprocess`'s crops and flips (or for `gpu_decode`'s device decoder).
- `augment`: on-device random shifts and flips inside the step.

Images travel as stored (uint8, or float32 for synthetic data) and are
standardised on the device with the dataset's `mean` and `std`. Because the
batches are a pure function of `(seed, step)`, a checkpoint holds nothing about
the input: resuming at step `k` rebuilds the pipeline at step `k`. What
identifies the data a run reads is guarded apart (`haiku_state.guards.data_identity`).
"""

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
