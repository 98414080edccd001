"""The README's before/after figure: a per-step timeline of input wait vs compute.

Trains the same small model twice on the same `keras.utils.PyDataset`, whose batches
each take `--delay-ms` of storage latency (a `time.sleep`, as a network file system or an
object store would add) plus a little NumPy decoding:

  (a) before: the dataset fed to `fit()` as it is (Keras loads in the training process);
  (b) after:  the same dataset in `kpipe.ProcessLoader(dataset, workers=W)`.

`kpipe.callbacks.InputProfiler` records every step of both runs, and `profiler.plot()`
draws them side by side with shared axes. The script prints the numbers behind the
figure (input-wait share and steps/s per run) and can write them as JSON.

Regenerate the committed figure (about a minute on a CPU):

    python scripts/plot_input_wait.py --out docs/input_wait.png
"""

import argparse
import json
import os
import sys
import time

# Run from a checkout without installing: the repository root goes first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


class SlowStorage:
    """Batches of `features`-wide rows, each batch `delay_s` late (I/O) plus NumPy work.

    No Keras or TensorFlow here: `ProcessLoader` sends it to worker processes.
    """

    def __init__(self, batches, batch_size=64, features=256, delay_s=0.02, seed=0):
        self.batches, self.batch_size, self.features, self.delay_s, self.seed = batches, batch_size, features, delay_s, seed

    def __len__(self):
        return self.batches

    def __getitem__(self, i):
        time.sleep(self.delay_s)  # storage latency: the worker waits, the CPU is free
        rng = np.random.default_rng((self.seed, i))
        raw = rng.integers(0, 256, size=(self.batch_size, self.features), dtype=np.uint8)
        x = (raw.astype(np.float32) - 127.5) / 127.5  # "decode"
        y = (x[:, :8].sum(axis=1, keepdims=True) > 0).astype(np.float32)
        return x, y


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="input_wait.png", help="PNG to write. Defaults to input_wait.png.")
    parser.add_argument("--steps", type=int, default=60, help="batches per epoch. Defaults to 60.")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run. Defaults to 3.")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="storage latency per batch in ms. Defaults to 20.")
    parser.add_argument("--workers", type=int, default=4, help="ProcessLoader workers in the 'after' run. Defaults to 4.")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers behind the figure as JSON to PATH.")
    args = parser.parse_args(argv)
    for name, minimum in (("steps", 2), ("epochs", 1), ("workers", 1)):
        if getattr(args, name) < minimum:
            parser.error(f"--{name} must be >= {minimum}. Received: {getattr(args, name)}.")
    if args.delay_ms < 0:
        parser.error(f"--delay-ms must be >= 0. Received: {args.delay_ms}.")
    return args


def _train(keras, kpipe, data, epochs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    profiler = kpipe.callbacks.InputProfiler(warn_above=None)
    model.fit(data, epochs=epochs, verbose=0, callbacks=[profiler])
    return profiler


def summarize(profiler):
    """Input-wait share and steps/s over all epochs of a profiler (warm-up step left out)."""
    wall = sum(e["wall_s"] for e in profiler.epochs)
    return {
        "input_wait_share": sum(e["input_wait_s"] for e in profiler.epochs) / wall,
        "steps_per_sec": sum(e["steps"] for e in profiler.epochs) / wall,
        "per_epoch_share": [e["input_wait_share"] for e in profiler.epochs],
        "wait_patterns": [e["wait_pattern"] for e in profiler.epochs],
    }


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import kpipe
    from kpipe.callbacks import _plot

    _plot.require_matplotlib()  # fail before training, not after
    dataset = SlowStorage(args.steps, delay_s=args.delay_ms / 1e3)

    class AsPyDataset(keras.utils.PyDataset):  # what a training script has today
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            return dataset[i]

    print(f"before: PyDataset, {args.steps} batches x {args.epochs} epochs, {args.delay_ms:g} ms latency per batch", flush=True)
    before = _train(keras, kpipe, AsPyDataset(), args.epochs)
    print(f"after:  ProcessLoader(workers={args.workers})", flush=True)
    with kpipe.ProcessLoader(dataset, workers=args.workers) as loader:
        after = _train(keras, kpipe, loader, args.epochs)
    label = f"after: ProcessLoader(workers={args.workers})"
    after.plot(args.out, before=before, labels=["before: PyDataset", label],
               title=f"Input wait per training step, {args.delay_ms:g} ms storage latency per batch")
    numbers = {"before": summarize(before), "after": summarize(after)}
    for name, n in numbers.items():
        print(f"{name:<7} input-wait share {n['input_wait_share']:6.1%}   {n['steps_per_sec']:7.1f} steps/s   "
              f"per epoch: {', '.join(f'{s:.0%}' for s in n['per_epoch_share'])}")
    print(f"speed-up: {numbers['after']['steps_per_sec'] / numbers['before']['steps_per_sec']:.2f}x; wrote {args.out} "
          f"({os.path.getsize(args.out) / 1024:.0f} KB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **numbers}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
