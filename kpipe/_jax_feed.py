"""The hand-over of a ProcessLoader's batches into Keras's JAX trainer.

NOTE [ The JAX feed: batches on the device before the step asks ]
------------------------------------------------------------------
Keras's JAX trainer pulls each batch in Python, inside `train_function(state, iterator)`:
`next()` on the iterator its `JAXEpochIterator` made from the adapter's
`get_jax_iterator()`, then the jitted step (which puts NumPy arguments on the device).
Through the plain adapter that `next()` ran the loader in the trainer's own thread -- the
submit of the next task, the wait for the worker's message, building the batch's arrays
over its shared slot, Keras's batch standardization -- one batch at a time: fit() took
1.5 MB batches at 0.29-0.66x the rate of NumPy arrays given to fit() (one epoch profiled:
~1 ms per batch in the loader's `stream_next`, of it most in `poll` and `sendmsg`, the
worker and the trainer taking turns on the cores; the copy out of the slot and
`device_put` cost nothing: see below).

So kpipe's adapter answers `get_jax_iterator()` for a ProcessLoader with a `JaxFeed`: the
TensorFlow backend's feed (`kpipe._feed.Feed`: a thread per stream, a bounded queue of
batches in plan order, the consumer counting only what Keras took, the read limit lifted
when Keras asks past it, errors re-raised in Keras's thread), whose thread here
standardizes each batch and puts every NumPy leaf on JAX's default device
(`jax.device_put`) ahead of the step, so the trainer's share of a batch is a queue `get`.

Zero copy, and slots: on the CPU, JAX aliases a 64-byte aligned NumPy buffer instead of
copying it (its CPU client's zero-copy hand-over), and the engine's slots and leaves are
64-byte aligned: the JAX array *is* the slot's memory. JAX then keeps the NumPy array --
which holds the slot's lease (`kpipe/_engine/_shm.py`) -- alive for as long as the JAX
array (or a computation reading it) lives, so a slot is not reused while a JAX array
aliases it, whoever holds that array (the trainer, a callback, the user). On an
accelerator `device_put` copies, and JAX drops the NumPy array (and so the lease) once the
transfer is done: the slot goes back to the loader as soon as the device holds its copy.
Unaligned leaves (a `_standardize_batch` result, a user's array) are copied by
`device_put`, as the jitted step would copy them.

Under a `keras.distribution` (DataParallel, ModelParallel) the thread gives the
standardized NumPy batch only: Keras's distributed iterator lays each batch out over the
mesh (`distribute_data_input`) itself, in its thread. A feed made while the loader is in a
probe reads in the calling thread (as `Feed` does).

Example:

>>> from kpipe import _jax_feed
>>> _jax_feed.DEPTH >= 1
True
"""

from kpipe import _feed

DEPTH = 2  # batches converted ahead of the step (beyond the one the thread works on)


class _JaxPlacement:
    """A standardized batch as JAX takes it: every NumPy leaf put on JAX's default device
    (`device_put`), or, under a `keras.distribution`, left to Keras's layout."""

    def __init__(self, put):
        self.put = put

    def __call__(self, data, whole=False):
        import jax
        import numpy as np
        from keras.src import tree
        from keras.src.trainers.data_adapters import data_adapter_utils

        data = next(data_adapter_utils.get_jax_iterator([data]))  # Keras's leaf conversion
        if not self.put:
            return data
        return tree.map_structure(
            lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, data
        )


class JaxFeed(_feed.Feed):
    """An iterator of one stream's batches, standardized and put on the device ahead in a
    thread (see NOTE). The arguments are `kpipe._feed.Feed`'s, but for `put`: whether to
    `device_put` the leaves (False under a `keras.distribution`)."""

    def __init__(self, loader_ref, standardize, put=True, depth=DEPTH, consumer=None):
        # (Feed's own placement puts batches with TensorFlow: JAX's is given instead)
        super().__init__(loader_ref, standardize, None, depth=depth, consumer=consumer, place=_JaxPlacement(put))


def install():
    """Makes kpipe's `PyDatasetAdapter` answer `get_jax_iterator()` for a ProcessLoader with
    a `JaxFeed` (idempotent; other datasets keep Keras's iterator). Called by
    `kpipe._keras_hook.install()` on the JAX backend, after it installed the adapter."""
    try:
        from keras.src.trainers import data_adapters
    except ImportError:
        return
    adapter = data_adapters.PyDatasetAdapter
    if not getattr(adapter, "_kpipe_hooked", False) or getattr(adapter, "_kpipe_jax_feed", False):
        return
    original = adapter.get_jax_iterator

    def get_jax_iterator(self):
        if getattr(self, "_kpipe_loader", None) is None:
            return original(self)
        import jax
        from keras.src.distribution import distribution_lib

        self._loader()  # a clear error when the loader is gone
        put = distribution_lib.distribution() is None and jax.default_backend() != "cpu"
        return JaxFeed(self._kpipe_loader, self._standardize_batch, put=put, consumer=self._kpipe_consumer)

    adapter.get_jax_iterator = get_jax_iterator
    adapter._kpipe_plain_jax_iterator = original  # (scripts/bench_feed.py's "before" row)
    adapter._kpipe_jax_feed = True
