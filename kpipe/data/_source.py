"""What a kpipe source remembers about itself, so `pipeline()` can rebuild it.

A source function (`from_hdf5`, ...) returns a plain `tf.data.Dataset`. It also records,
on that dataset object, the `Source` that built it and the shard it reads. `pipeline()`
looks for that record: when it finds one it rebuilds the source with the requested shard
and a seeded order of blocks/files, so sharding and shuffling happen where the data is
addressed instead of after every sample was read.
"""

import abc
from typing import Optional, Tuple

import numpy as np

from kpipe.data._sharding import ShardSpec

_ATTR = "_kpipe_source"


class Source(abc.ABC):
    """A recipe for a dataset of single samples that can be sharded and shuffled at the source."""

    #: Short description used in error messages, e.g. "from_hdf5('train.h5')".
    what: str = "source"
    #: Whether `build(shuffle=True)` permutes every sample (not blocks of them): its order is
    #: then uniformly random each epoch, and `pipeline(shuffle=True)` adds no shuffle buffer.
    shuffles_samples: bool = False

    @abc.abstractmethod
    def build(self, shard: ShardSpec, shuffle: bool = False, seed: Optional[int] = None):
        """Returns a `tf.data.Dataset` of the samples of `shard`.

        Args:
            shard: Which part to read.
            shuffle: Read the blocks/files in a shuffled order, reshuffled on each
                iteration. Defaults to False (storage order).
            seed: Seed of that order. Defaults to None (random).
        """

    def labels(self) -> Optional[np.ndarray]:
        """Returns all labels of the source as an integer array, or None if unknown.

        Sources that can read labels without reading the inputs (HDF5, NumPy, image
        folders) override this, so `class_weights` stays cheap.
        """
        return None


def attach(ds, source: Source, shard: ShardSpec):
    """Records on `ds` that `source` built it for `shard`; returns `ds`."""
    setattr(ds, _ATTR, (source, shard))
    return ds


def source_of(ds) -> Optional[Tuple[Source, ShardSpec]]:
    """Returns `(source, shard)` if `ds` is a dataset a kpipe source returned, else None."""
    return getattr(ds, _ATTR, None)
