"""The hand-over of a ProcessLoader's batches into Keras's PyTorch trainer, without a copy.

NOTE [ Torch tensors over the loader's slots ]
----------------------------------------------
Keras's torch trainer reads a `PyDataset` through `get_torch_dataloader()`: a torch
`DataLoader` over the adapter's batches whose every leaf goes through Keras's
`convert_to_tensor`, which copies a NumPy array (`np.array(x)`) before `torch.as_tensor`
shares that copy: a second copy of every batch, after the worker's into the slot. A torch
tensor is taken as it is (moved only when its device is not Keras's).

So for a ProcessLoader kpipe's adapter yields each batch with its NumPy leaves wrapped by
`torch.from_numpy` -- tensors over the slot's memory, no copy. torch keeps the NumPy array
it wraps alive for as long as the tensor's storage lives, and that array holds the slot's
lease (`kpipe/_engine/_shm.py`): a slot is not reused while a tensor made from it lives,
whoever holds it (the trainer, a callback, the user, a view of the tensor). Leaves torch
cannot wrap (read-only arrays, dtypes torch lacks, such as uint32 or bfloat16 from
ml_dtypes) go through Keras's conversion, as before. On a CUDA device Keras then copies
each tensor to the device (`x.to(device)`) from the slot's pageable memory -- unless
kpipe's ahead copy runs: on a CUDA device (and `KPIPE_TORCH_PIN` is not 0) a thread copies
each batch into pinned host memory and on to the device ahead of the step, and the trainer
gets tensors already on its device (NOTE in `kpipe/_torch_pin.py`).

Example:

>>> from kpipe import _torch_feed
>>> _torch_feed.wrappable(__import__("numpy").zeros(3, "float32"))
True
"""

import numpy as np

from kpipe import _torch_pin

# NumPy dtypes torch.from_numpy takes and Keras's conversion would keep as they are.
_KINDS = frozenset("biuf")


def wrappable(array):
    """Whether `array` becomes a torch tensor over its own memory (`torch.from_numpy`)."""
    return (
        isinstance(array, np.ndarray)
        and array.dtype.kind in _KINDS
        and array.dtype != np.uint32  # Keras widens uint32 to int64 (torch lacks it)
        and array.dtype.isnative
        and array.flags.writeable
    )


def _tensors(batch):
    import torch
    from keras.src import tree

    return tree.map_structure(lambda x: torch.from_numpy(x) if wrappable(x) else x, batch)


def _copier():
    from keras.src.backend.torch.core import get_device

    return _torch_pin.copier_for(get_device())


def install():
    """Makes kpipe's `PyDatasetAdapter` answer `get_torch_dataloader()` for a ProcessLoader
    with batches of torch tensors over the slots (idempotent; other datasets keep Keras's
    path). Called by `kpipe._keras_hook.install()` on the torch backend."""
    try:
        from keras.src.trainers import data_adapters
        from keras.src.trainers.data_adapters import data_adapter_utils
    except ImportError:
        return
    adapter = data_adapters.PyDatasetAdapter
    if not getattr(adapter, "_kpipe_hooked", False) or getattr(adapter, "_kpipe_torch_feed", False):
        return
    original = adapter.get_torch_dataloader

    def get_torch_dataloader(self):
        if getattr(self, "_kpipe_loader", None) is None:
            return original(self)
        copier = None if self._source().probing() else _copier()
        if copier is not None:  # pinned memory, copied to the device ahead by a feed thread (kpipe/_torch_pin.py)
            feed = _torch_pin.AheadCopy(None, copier, wrap=wrappable, loader_ref=self._kpipe_loader,
                                        standardize=self._standardize_batch, consumer=self._kpipe_consumer)
            return data_adapter_utils.get_torch_dataloader(feed)
        return data_adapter_utils.get_torch_dataloader(_tensors(b) for b in self._get_iterator())

    adapter.get_torch_dataloader = get_torch_dataloader
    adapter._kpipe_torch_feed = True
    adapter._kpipe_plain_torch_dataloader = original  # (scripts/bench_feed.py's "before" row)
