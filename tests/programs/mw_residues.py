"""Worker program of the every-sample tests: run it under `kpipe launch` (one copy per
worker), or alone (no TF_CONFIG) for the one-process reference.

For each sample count `n` of `--counts`, each copy trains the same small model from the
same weights under `kpipe.distribute.auto_strategy()` for `--epochs` epochs, then
evaluates (with and without sample weights) and predicts, on three inputs:

  loader    kpipe.ProcessLoader over contiguous batches of `--batch` samples (sharded by
            TF_CONFIG: this worker's share), its own worker process
  samples   kpipe.ProcessLoader.from_samples(..., `--batch`) over the same samples
  tfdata    tf.data batches of the global batch (`--batch` x workers), auto-sharded

Alone, it runs plain Keras in one process on NumPy arrays with `--batch` as the global
batch (`reference`). It writes `--out/worker<i>.json` (per input and `n`: epoch losses,
evaluate results, rows predicted) and `--out/worker<i>.npz` (`<input>/<n>/w<k>` final
weights, `<input>/<n>/predict`).
"""

import argparse
import os
import sys

import numpy as np

import _outputs

FEATURES = 4
EPOCHS = 2


def make_data(n):
    rng = np.random.RandomState(n)
    x = rng.rand(n, FEATURES).astype("float32")
    y = (x[:, 0] + x[:, 1] > 1.0).astype("int32")
    w = (0.5 + rng.rand(n)).astype("float32")
    return x, y, w


class Contiguous:
    """Batch i: samples `[i * batch, (i + 1) * batch)` of the arrays given (the last short)."""

    def __init__(self, arrays, batch):
        self.arrays, self.batch = arrays, batch

    def __len__(self):
        return -(-len(self.arrays[0]) // self.batch)

    def __getitem__(self, i):
        return tuple(a[i * self.batch:(i + 1) * self.batch] for a in self.arrays)


class Samples:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, j):
        return self.x[j], self.y[j]


def build(keras):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def run(model, initial, fit_input, eval_input, weighted_input, predict_input):
    """Trains from `initial`, then evaluates and predicts: (record, arrays)."""
    model.set_weights(initial)
    history = model.fit(fit_input(), epochs=EPOCHS, verbose=0, shuffle=False)
    record = {"loss": history.history["loss"],
              "evaluate": model.evaluate(eval_input(), verbose=0),
              "evaluate_weighted": model.evaluate(weighted_input(), verbose=0)}
    predictions = model.predict(predict_input(), verbose=0)
    record["rows"] = int(predictions.shape[0])
    arrays = {f"w{k}": w for k, w in enumerate(model.get_weights())}
    arrays["predict"] = predictions
    return record, arrays


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--counts", required=True, help="sample counts, e.g. 12,13,14")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]

    import kpipe
    import kpipe.distribute

    info = kpipe.distribute.cluster_info()
    strategy = kpipe.distribute.auto_strategy(communication="ring")
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = build(keras)
    initial = model.get_weights()
    record, arrays = {}, {}

    def keep(name, n, result):
        record[f"{name}/{n}"], got = result
        arrays.update({f"{name}/{n}/{k}": v for k, v in got.items()})

    def batched(batch, *arrays):
        return lambda: tf.data.Dataset.from_tensor_slices(arrays).batch(batch)

    for n in counts:
        x, y, w = make_data(n)
        if not info.is_multi_worker:  # plain Keras in one process: --batch is the global batch
            keep("reference", n, run(model, initial, batched(args.batch, x, y), batched(args.batch, x, y),
                                     batched(args.batch, x, y, w), batched(args.batch, x)))
            continue
        loaders = [kpipe.ProcessLoader(Contiguous((x, y), args.batch), workers=1, shuffle=False),
                   kpipe.ProcessLoader(Contiguous((x, y, w), args.batch), workers=0, shuffle=False),
                   kpipe.ProcessLoader.from_samples(Samples(x, y), args.batch, workers=0)]
        xy, xyw, samples = loaders
        keep("loader", n, run(model, initial, lambda: xy, lambda: xy, lambda: xyw, lambda: xy))
        keep("samples", n, run(model, initial, lambda: samples, lambda: samples, lambda: xyw,
                               lambda: samples))
        record[f"shards/{n}"] = [xy.num_shards, xy.shard_index, len(xy), len(samples)]
        for loader in loaders:
            loader.close()
        g = args.batch * info.num_workers  # the global batch
        keep("tfdata", n, run(model, initial, batched(g, x, y), batched(g, x, y), batched(g, x, y, w),
                              batched(g, x)))
    _outputs.write(args.out, info.worker_index or 0, record, arrays)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    status = main()
    _outputs.leave(status)
