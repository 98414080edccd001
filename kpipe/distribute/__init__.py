"""Data parallelism: cluster info, strategy choice, sharding, the large-minibatch recipe,
chief-only side effects, a local multi-worker launcher and the tf.data service.

Importing this package does not import TensorFlow: `cluster_info`, `default_shard`,
`launch` and the path helpers work in any process. Names that need TensorFlow
(`auto_strategy`, `MultiWorkerMirroredStrategy`, the data-service helpers) import it on
first use.

* `cluster_info()`, `default_shard()`, `TFConfigError` -- who am I, from `TF_CONFIG`.
* `auto_strategy()`, `MultiWorkerMirroredStrategy` -- the strategy for this process, with
  the repair Keras 3 `fit()` needs under multi-worker training; `DeviceNotFoundError` --
  `auto_strategy(devices=...)` names a device this process does not have.
* `is_presharded()`, `mark_presharded()`, `check_shuffle_seed()` -- input sharding rules.
* `scaled_learning_rate()` -- the linear scaling rule (see `kpipe.callbacks.Warmup`).
* `chief_only()`, `chief_path()`, `per_worker_path()` -- files written by the chief only.
* `launch()`, `LaunchResult`, `free_ports()`, `tf_configs()` -- local multi-worker jobs;
  `OpenPortsWarning` -- a server listens on every network interface (docs/security.md).
* `ps_fit()`, `ParameterServerError` -- parameter-server training on the chief
  (`auto_strategy()` serves on `worker` and `ps` tasks).
* `start_dispatcher()`, `start_worker()`, `via_data_service()` -- tf.data service.
* `pipeline_model()`, `PipelineModel` -- model parallelism: a model's layers as pipeline
  stages on several devices, trained by `fit()` with GPipe micro-batches;
  `PipelineGradientError` -- a loss the pipeline cannot back-propagate.

Example:

>>> import kpipe
>>> kpipe.distribute.cluster_info("").num_workers          # no TF_CONFIG: one worker
1
>>> kpipe.distribute.scaled_learning_rate(0.1, base_batch=256, global_batch=512)
0.2
"""

from kpipe import _lazy
from kpipe._devices import DeviceNotFoundError
from kpipe.distribute._chief import chief_only, chief_path, per_worker_path
from kpipe.distribute._cluster import ClusterInfo, TFConfigError, cluster_info, default_shard
from kpipe.distribute._launcher import LaunchResult, launch, tf_configs
from kpipe.distribute._ports import OpenPortsWarning, free_ports
from kpipe.distribute._lr import scaled_learning_rate
from kpipe.distribute._sharding import check_shuffle_seed, is_presharded, mark_presharded

# name -> private module that defines it and imports TensorFlow; resolved on first use.
_LAZY_ATTRS = {
    "auto_strategy": "kpipe.distribute._strategy",
    "MultiWorkerMirroredStrategy": "kpipe.distribute._strategy",
    "ps_fit": "kpipe.distribute._ps_fit",
    "ParameterServerError": "kpipe.distribute._ps_fit",
    "start_dispatcher": "kpipe.distribute._data_service",
    "start_worker": "kpipe.distribute._data_service",
    "via_data_service": "kpipe.distribute._data_service",
    "pipeline_model": "kpipe.distribute._pipeline",
    "PipelineModel": "kpipe.distribute._pipeline",
    "PipelineGradientError": "kpipe.distribute._pipeline_loss",
}

__all__ = sorted([
    "ClusterInfo", "DeviceNotFoundError", "LaunchResult", "OpenPortsWarning", "TFConfigError", "check_shuffle_seed", "chief_only",
    "chief_path", "cluster_info", "default_shard", "free_ports", "is_presharded", "launch",
    "mark_presharded", "per_worker_path", "scaled_learning_rate", "tf_configs",
    *_LAZY_ATTRS,
])

__getattr__, __dir__ = _lazy.attach(globals(), _LAZY_ATTRS)
_lazy_getattr = __getattr__


def __getattr__(name):  # noqa: F811 -- the lazy lookup, refused for tf.distribute names off TensorFlow
    from kpipe import _backends

    if name in _backends.INSTEAD:
        _backends.require_tensorflow(name)  # UnsupportedBackendError on JAX / PyTorch
    return _lazy_getattr(name)
