"""`kpipe.data`: tf.data sources and pipelines that are fast by default.

* Sources, each a `tf.data.Dataset` of single samples, sharded where the data is
  addressed: `from_hdf5`, `from_numpy`, `from_files`, `from_tfrecord`, `from_packed`.
* `pack`: an image folder into sharded HDF5 files of JPEG bytes (`kpipe pack`);
  `PackedImages` reads them per sample with PIL, OpenCV or simplejpeg, for
  `ProcessLoader.from_samples`; `FolderImages` does the same over a folder's files.
* `pipeline`: shard -> cache -> shuffle -> map -> batch -> prefetch with AUTOTUNE and a
  private thread pool, plus `py_map_fn` for Python/NumPy steps in worker processes.
* `class_weights`: a `class_weight` dict for `fit()`.
* `ShardSpec`: which shard a pipeline reads.

Importing this module does not import TensorFlow; the functions do, when called.

Example:

>>> import numpy as np, kpipe
>>> ds = kpipe.data.pipeline(kpipe.data.from_numpy(np.zeros((8, 2), "float32")), batch_size=4)
>>> [b.shape for b in ds.as_numpy_iterator()]
[(4, 2), (4, 2)]
"""

from kpipe.data._files import from_files
from kpipe.data._folder_images import FolderImages
from kpipe.data._hdf5 import from_hdf5
from kpipe.data._numpy import from_numpy
from kpipe.data._pack import pack
from kpipe.data._packed import from_packed
from kpipe.data._packed_images import PackedImages
from kpipe.data._pipeline import pipeline
from kpipe.data._sharding import ShardSpec
from kpipe.data._tfrecord import from_tfrecord
from kpipe.data._weights import class_weights

__all__ = [
    "FolderImages",
    "PackedImages",
    "ShardSpec",
    "class_weights",
    "from_files",
    "from_hdf5",
    "from_numpy",
    "from_packed",
    "from_tfrecord",
    "pack",
    "pipeline",
]
