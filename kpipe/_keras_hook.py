"""kpipe's one hook into Keras's data adapters (`keras.src.trainers.data_adapters`).

Keras turns every `PyDataset` given to `fit`/`evaluate`/`predict` into a
`PyDatasetAdapter`. kpipe swaps in a subclass that differs in two places only:

* A `ProcessLoader` orders its own batches (seeded shuffle, in-order prefetch), so the
  adapter is built with `shuffle=False` for it: Keras's `fit(shuffle=True)` default would
  otherwise request batches in a random order of its own and defeat prefetching.
* A `PyDataset` that loads only this worker's shard (`num_shards > 1`, e.g. a sharded
  `ProcessLoader`) yields a `tf.data.Dataset` marked presharded, so kpipe's
  `MultiWorkerMirroredStrategy` neither auto-shards it nor splits its batch again.

Other datasets are untouched. With a Keras lacking this module layout the hook is not
installed; a ProcessLoader then still works (random access), only slower under
`fit(shuffle=True)`.
"""


def install():
    """Installs the adapter subclass (idempotent)."""
    try:
        from keras.src.trainers import data_adapters
    except ImportError:
        return
    base = data_adapters.PyDatasetAdapter
    if getattr(base, "_kpipe_hooked", False):
        return

    from kpipe.distribute._sharding import is_presharded, mark_presharded

    class PyDatasetAdapter(base):
        _kpipe_hooked = True

        def __init__(self, x, class_weight=None, shuffle=False):
            if getattr(type(x), "_kpipe_orders_batches", False):
                shuffle = False
            super().__init__(x, class_weight=class_weight, shuffle=shuffle)

        def get_tf_dataset(self):
            ds = super().get_tf_dataset()
            return mark_presharded(ds) if is_presharded(self.py_dataset) else ds

    data_adapters.PyDatasetAdapter = PyDatasetAdapter
