"""kpipe: keep accelerators busy when training Keras 3 / TensorFlow models.

Public API (everything else lives in private `_` modules):

* `kpipe.ProcessLoader` -- run any `keras.utils.PyDataset` / `Sequence` in worker
  processes that hand batches over through shared memory.
* `kpipe.fit_generator` -- the Keras 2 `fit_generator` signature on top of it.
* `kpipe.worker_info` / `kpipe.WorkerInfo` -- inside a worker: its id and seed.
* `kpipe.empty` -- a batch array allocated directly in the worker's shared memory.
* `kpipe.Padding` / `kpipe.Buckets` -- variable-length samples in `ProcessLoader.from_samples`.
* `kpipe.data` -- tf.data sources and pipelines.
* `kpipe.distribute` -- strategies, sharding, the large-minibatch recipe, launcher.
* `kpipe.callbacks` -- `InputProfiler`, `Warmup`.

Importing `kpipe` is cheap: TensorFlow and Keras are imported only when a name that needs
them is first used, so loader worker processes never import TensorFlow on kpipe's account.
Importing it checks, from package metadata and without importing them, that TensorFlow and
Keras are at least the oldest tested pair (README "Tested with"), and raises
`kpipe.IncompatibleVersionError` (an `ImportError`) naming both versions otherwise.
"""

from kpipe import _compat

_compat.check_versions()

from kpipe import _lazy  # noqa: E402
from kpipe._engine._alloc import empty  # noqa: E402
from kpipe._buckets import Buckets  # noqa: E402
from kpipe._padding import Padding  # noqa: E402
from kpipe._engine.worker_info import WorkerInfo, worker_info  # noqa: E402
from kpipe._compat import IncompatibleVersionError  # noqa: E402
from kpipe.errors import (  # noqa: E402
    BatchStructureError,
    BatchTimeoutError,
    DatasetPicklingError,
    LoaderClosedError,
    LoaderError,
    UnsupportedBackendError,
    WorkerDiedError,
)

__version__ = "0.1.0"

# name -> module that defines it; resolved on first access (PEP 562).
_LAZY_ATTRS = {
    "ProcessLoader": "kpipe.loader",
    "RayWorkers": "kpipe._engine._ray_cluster",
    "fit_generator": "kpipe.fit",
}
_LAZY_MODULES = ("data", "distribute", "callbacks")

__all__ = [
    "BatchStructureError",
    "BatchTimeoutError",
    "Buckets",
    "DatasetPicklingError",
    "IncompatibleVersionError",
    "LoaderClosedError",
    "LoaderError",
    "Padding",
    "ProcessLoader",
    "RayWorkers",
    "UnsupportedBackendError",
    "WorkerDiedError",
    "WorkerInfo",
    "callbacks",
    "data",
    "distribute",
    "empty",
    "fit_generator",
    "worker_info",
]

__getattr__, __dir__ = _lazy.attach(globals(), _LAZY_ATTRS, _LAZY_MODULES)
