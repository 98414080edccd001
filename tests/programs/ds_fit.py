"""Trainer program of the tf.data service test: `python ds_fit.py DISPATCHER OUT.json`.

Builds a `kpipe.data.pipeline`, sends it through the tf.data service at DISPATCHER
(`host:port`, started by `kpipe data-service dispatcher` with workers registered), checks
that one epoch read through the service holds every sample exactly once, then trains a
small model with `fit()` on it and writes the sample ids and the losses to OUT.json.
"""

import json
import os
import sys

import numpy as np

N_SAMPLES = 64


def make_pipeline(tf, kpipe):
    rng = np.random.RandomState(0)
    x = rng.rand(N_SAMPLES, 4).astype("float32")
    y = (x[:, 0] > 0.5).astype("int32")
    ids = np.arange(N_SAMPLES, dtype="int64")
    source = tf.data.Dataset.from_tensor_slices((x, y, ids))
    return kpipe.data.pipeline(source, batch_size=8, map_fn=lambda a, b, i: (a * 2.0, b, i))


def main(argv=None):
    dispatcher, out = (sys.argv[1:] if argv is None else argv)[:2]
    import kpipe
    import kpipe.distribute
    import tensorflow as tf
    import keras

    ds = kpipe.distribute.via_data_service(make_pipeline(tf, kpipe), dispatcher,
                                           processing_mode="distributed_epoch")
    seen = sorted(int(i) for _, _, ids in ds.as_numpy_iterator() for i in ids)
    train = ds.map(lambda a, b, i: (a, b))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(train, epochs=2, verbose=0)
    with open(out, "w") as f:
        json.dump({"ids": seen, "loss": history.history["loss"]}, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
