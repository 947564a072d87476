"""The input pipeline: sources, batch order, host decoding, batches onto the devices, augmentation.

Nothing here touches the network. A run uses it in three calls: `load_dataset`
(a source by name), then `sharded_train_batches` and `sharded_eval_batches`
(module `sharded`, the entry point), which take the split, the global batch
size and this process's `ProcessSlice`, and yield batches laid out on the
devices. On the device, `make_augment_fn`'s shifts and flips run inside the step.

The modules, in the order data flows:

- `sources`: the registry of datasets by name (`SOURCES`) and `load_dataset`.
  `in_memory`: the embedded digits, CIFAR-10's python release and synthetic
  data, held as arrays. `imagefolder`: `DIR/train/<class>/*` trees, their file
  index cached. `arrayrecord`: the same examples in the shards
  `python -m haiku_state.prepare` writes.
- `order`: which examples each step sees, a pure function of `(seed, step)`;
  `ProcessSlice`: which contiguous slice of every global batch a process loads.
- `sharded`: the entry point; picks the cheapest of the three pipelines below
  for a split.
  - `device`: a small split in memory kept on the devices and batched there
    (`device_train_batches`); and `prefetch_to_device`, the thread that shards
    the host batches of the other two onto the devices.
  - `batches`: host batches of a split in memory (numpy gathers).
  - `pipeline`: grain's workers reading and decoding the batches of encoded
    splits, with `preprocess`'s decoding and random crops and flips, seeded by
    each example's place in the global batch.
  - `gpu_decode`: the optional GPU decoder: the workers' bytes, boxes and
    flips decoded on the device (`config.data.decoder="gpu"`).
- `augment`: on-device random shifts and flips inside the step.
- `identity`: what identifies the data a run read (sizes, class names, statistics,
  digests of the file index or shards and of their content), recorded so that a
  resume on other data is refused.
- `host_cache`: where this host keeps what it learnt about a data folder.

Images travel as stored: uint8 pixels (float32 for synthetic data), never
standardised on the host. The network standardises them on the device with
the dataset's `mean` and `std`.

Because the batches (and every host-side random choice) are a pure function of
`(seed, step)`, a checkpoint needs to hold nothing about the input: resuming at
step `k` rebuilds the pipeline at step `k`.
"""

from haiku_state.data.augment import make_augment_fn, random_flip, random_shift
from haiku_state.data.batches import eval_batches, train_batches
from haiku_state.data.device import (
    DEVICE_RESIDENT_MAX_BYTES,
    device_train_batches,
    fits_on_device,
    prefetch_to_device,
)
from haiku_state.data.gpu_decode import unavailable_reason as gpu_decoder_unavailable
from haiku_state.data.identity import (
    identity,
    identity_changes,
    split_digest,
    unchecked_keys,
)
from haiku_state.data.in_memory import CIFAR10_MEAN, CIFAR10_STD, DIGITS_NUM_TEST
from haiku_state.data.order import SINGLE_PROCESS, ProcessSlice, steps_per_epoch
from haiku_state.data.pipeline import (
    DECODER_NAMES,
    default_workers,
    encoded_eval_batches,
    encoded_train_batches,
)
from haiku_state.data.sharded import (
    DEFAULT_OPTIONS,
    PipelineOptions,
    sharded_eval_batches,
    sharded_train_batches,
)
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
    "DEVICE_RESIDENT_MAX_BYTES",
    "DIGITS_NUM_TEST",
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
    "device_train_batches",
    "encoded_eval_batches",
    "encoded_train_batches",
    "eval_batches",
    "fits_on_device",
    "gpu_decoder_unavailable",
    "identity",
    "identity_changes",
    "load_dataset",
    "make_augment_fn",
    "num_examples",
    "prefetch_to_device",
    "random_flip",
    "random_shift",
    "sharded_eval_batches",
    "sharded_train_batches",
    "split_digest",
    "steps_per_epoch",
    "train_batches",
    "unchecked_keys",
]
