"""MirroredStrategy over 2 logical CPU devices vs one device: `python mirrored_cpu.py OUT.json`.

Must run in a fresh process: the logical devices are configured before TensorFlow
initialises. Trains the same model from the same weights twice -- under
`kpipe.distribute.auto_strategy(devices=[cpu:0, cpu:1])` and without a strategy -- on
`kpipe.ProcessLoader` input with `class_weight`, and writes both loss histories, the final
weights' largest difference and the replica count to OUT.json.
"""

import json
import os
import sys

import numpy as np

from mw_train import ContiguousBatches  # TF-free; workers import it from this folder

N_SAMPLES, BATCH = 64, 16


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

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with kpipe.ProcessLoader(ContiguousBatches(x, y, BATCH), workers=2) as loader:
            history = model.fit(loader, epochs=3, verbose=0, shuffle=False,
                                class_weight={0: 3.0, 1: 1.0})
        return history.history["loss"], model.get_weights()

    mirrored = kpipe.distribute.auto_strategy(devices=["/cpu:0", "/cpu:1"])
    loss_2, weights_2 = run(mirrored)
    loss_1, weights_1 = run(tf.distribute.get_strategy())
    diff = max(float(np.abs(a - b).max()) for a, b in zip(weights_1, weights_2))
    with open(out, "w") as f:
        json.dump({"replicas": mirrored.num_replicas_in_sync,
                   "strategy": type(mirrored).__name__, "loss_2_devices": loss_2,
                   "loss_1_device": loss_1, "max_weight_diff": diff}, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
