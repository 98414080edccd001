"""MirroredStrategy over 2 logical CPU devices vs one device: `python mirrored_cpu.py OUT.json`.

Must run in a fresh process: the logical devices are configured before TensorFlow
initialises. Trains the same model from the same weights twice -- under
`kpipe.distribute.auto_strategy(devices=[cpu:0, cpu:1])` and without a strategy -- on
`kpipe.ProcessLoader` input with `class_weight`, and writes both loss histories, the final
weights' largest difference and the replica count to OUT.json. Then, under the same
strategy, 35 samples in batches of 6 (the last, of 5 rows, split 3 + 2 over the
replicas): the losses of a ProcessLoader against the same batches from tf.data, and where
the loader's last batch is placed (device and rows of each replica's part). Last, under
`OneDeviceStrategy("/cpu:1")`: the losses, and the device of the batches the feed and
`as_dataset(device="/cpu:1")` give.
"""

import json
import os
import sys

import numpy as np

from mw_train import ContiguousBatches  # TF-free; workers import it from this folder

N_SAMPLES, BATCH = 64, 16


class WithLastPartial(ContiguousBatches):
    """ContiguousBatches plus the last, smaller batch."""

    def __len__(self):
        return -(-len(self.x) // self.batch_size)


def main(argv=None):
    out = (sys.argv[1:] if argv is None else argv)[0]
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    import keras
    import kpipe
    import kpipe.distribute

    rng = np.random.RandomState(0)
    x = rng.rand(N_SAMPLES, 4).astype("float32")
    y = (x[:, 0] + x[:, 2] > 1.0).astype("int32")

    from keras.src.trainers import data_adapters

    def feed_of(loader):
        """kpipe's feed factory for `loader` (None where Keras < 3.7 reads tf.data)."""
        if not kpipe._compat.keras_at_least(kpipe._compat.KERAS_ITERABLE_TRAIN_FUNCTION):
            return None
        return data_adapters.get_data_adapter(loader)._kpipe_feed

    def run(strategy, workers=2, after=None):
        """Losses and weights of the 3-epoch fit under `strategy`, and `after(loader)`."""
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with kpipe.ProcessLoader(ContiguousBatches(x, y, BATCH), workers=workers) as loader:
            history = model.fit(loader, epochs=3, verbose=0, shuffle=False,
                                class_weight={0: 3.0, 1: 1.0})
            extra = after(loader) if after is not None else None
        return history.history["loss"], model.get_weights(), extra

    mirrored = kpipe.distribute.auto_strategy(devices=["/cpu:0", "/cpu:1"])
    loss_2, weights_2, _ = run(mirrored)
    loss_1, weights_1, _ = run(tf.distribute.get_strategy())
    diff = max(float(np.abs(a - b).max()) for a, b in zip(weights_1, weights_2))

    def odd_batches(data):
        with mirrored.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(data, epochs=2, verbose=0, shuffle=False).history["loss"]

    xo, yo = x[:35], y[:35]
    with kpipe.ProcessLoader(WithLastPartial(xo, yo, 6), workers=1) as loader:
        loss_loader_odd = odd_batches(loader)
        placement = []
        feed = feed_of(loader)
        if feed is not None:
            *_, batch = feed(mirrored)
            for part_x, part_y in zip(mirrored.experimental_local_results(batch[0]),
                                      mirrored.experimental_local_results(batch[1])):
                placement.append({"device": part_x.device, "x": part_x.numpy().tolist(),
                                  "y_device": part_y.device})
            del batch
    loss_tfdata_odd = odd_batches(tf.data.Dataset.from_tensor_slices((xo, yo)).batch(6))

    # One replica on the second device: batches are copied there ahead of the step.
    one = tf.distribute.OneDeviceStrategy("/cpu:1")

    def devices_fed(loader):
        feed = feed_of(loader)
        fed_on = None if feed is None else [t.device for t in next(feed(one))]
        return fed_on, [t.device for t in next(iter(loader.as_dataset(device="/cpu:1")))]

    loss_one_device, _, (fed_on, as_dataset_on) = run(one, workers=1, after=devices_fed)
    with open(out, "w") as f:
        json.dump({"replicas": mirrored.num_replicas_in_sync,
                   "strategy": type(mirrored).__name__, "loss_2_devices": loss_2,
                   "loss_1_device": loss_1, "max_weight_diff": diff,
                   "loss_loader_odd": loss_loader_odd, "loss_tfdata_odd": loss_tfdata_odd,
                   "placement": placement, "x_last_batch": xo[30:].tolist(),
                   "loss_one_device_cpu1": loss_one_device, "fed_on": fed_on, "as_dataset_on": as_dataset_on}, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
