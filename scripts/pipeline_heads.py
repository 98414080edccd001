"""Per-epoch losses of a model cut into pipeline stages vs the unsplit model, by head and loss.

Trains a 3-layer Dense classifier (8 features -> 16 relu -> 16 relu -> head) with SGD,
`shuffle=False`, from the same initial weights, twice for each row: unsplit, and as
`kpipe.distribute.pipeline_model(model, devices, num_microbatches=M)` on K logical CPU
devices. Rows are the heads and losses users write: a softmax head with
`"sparse_categorical_crossentropy"` and with `SparseCategoricalCrossentropy()`, logits with
`from_logits=True`, a linear head with `"mse"` on one-hot targets, and a 1-unit sigmoid head
with `"binary_crossentropy"`. It prints each row's per-epoch losses, how far the weights
moved (largest change of any weight) and the largest difference between the two models'
final weights. Exit status 1 when a row's losses or weights differ by more than
`--tolerance`.

    python scripts/pipeline_heads.py                          # K=2, M=1, 512 samples, 3 epochs
    python scripts/pipeline_heads.py --microbatches 4 --stages 3 --json heads.json
"""

import argparse
import json
import os
import sys

HEADS = (
    # name, head activation, units, loss, targets
    ("softmax, \"sparse_categorical_crossentropy\"", "softmax", 3, "sparse_categorical_crossentropy", "labels"),
    ("softmax, SparseCategoricalCrossentropy()", "softmax", 3, "SparseCategoricalCrossentropy", "labels"),
    ("logits, SparseCategoricalCrossentropy(from_logits=True)", None, 3, "from_logits", "labels"),
    ("linear, \"mse\" on one-hot", None, 3, "mse", "onehot"),
    ("sigmoid (1 unit), \"binary_crossentropy\"", "sigmoid", 1, "binary_crossentropy", "binary"),
)


def run(args):
    """Trains every row; returns the rows (a list of dicts)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.stages)
    import keras
    import numpy as np

    import kpipe.distribute

    devices = [f"/cpu:{k}" for k in range(args.stages)]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 8)).astype("float32")
    labels = ((x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5)).astype("int32")
    targets = {"labels": labels, "onehot": np.eye(3, dtype="float32")[labels],
               "binary": (x[:, 0] > 0).astype("float32")[:, None]}

    def build(activation, units):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Dense(16, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(units, activation=activation)(h))

    def loss_of(name):
        if name == "SparseCategoricalCrossentropy":
            return keras.losses.SparseCategoricalCrossentropy()
        if name == "from_logits":
            return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return name

    def train(model, loss, y):
        start = [w.copy() for w in model.get_weights()]
        model.compile(keras.optimizers.SGD(args.lr), loss_of(loss))
        hist = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0, shuffle=False)
        moved = max(float(np.abs(a - b).max()) for a, b in zip(start, model.get_weights()))
        return [float(v) for v in hist.history["loss"]], moved

    rows = []
    for name, activation, units, loss, kind in HEADS:
        unsplit = build(activation, units)
        unsplit_loss, unsplit_moved = train(unsplit, loss, targets[kind])
        piped = kpipe.distribute.pipeline_model(build(activation, units), devices,
                                                num_microbatches=args.microbatches)
        piped_loss, piped_moved = train(piped, loss, targets[kind])
        rows.append({
            "head": name, "unsplit_loss": unsplit_loss, "pipeline_loss": piped_loss,
            "unsplit_moved": unsplit_moved, "pipeline_moved": piped_moved,
            "max_loss_diff": max(abs(a - b) for a, b in zip(unsplit_loss, piped_loss)),
            "max_weight_diff": max(float(np.abs(a - b).max())
                                   for a, b in zip(unsplit.get_weights(), piped.get_weights())),
        })
    return rows


def table(rows, args):
    """The rows as a Markdown table (a string)."""
    lines = [f"{args.samples} samples, batch {args.batch_size}, SGD({args.lr}), {args.epochs} epochs; pipeline: "
             f"{args.stages} stages on logical CPU devices, num_microbatches={args.microbatches}", "",
             "| head, loss | unsplit per-epoch loss | pipeline per-epoch loss | weights moved (unsplit / pipeline) "
             "| max weight diff |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head']} | {', '.join(f'{v:.4f}' for v in r['unsplit_loss'])} | "
                     f"{', '.join(f'{v:.4f}' for v in r['pipeline_loss'])} | "
                     f"{r['unsplit_moved']:.3f} / {r['pipeline_moved']:.3f} | {r['max_weight_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (logical CPU devices). Default 2.")
    parser.add_argument("--microbatches", type=int, default=1, help="num_microbatches. Default 1.")
    parser.add_argument("--samples", type=int, default=512, help="training samples. Default 512.")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size. Default 32.")
    parser.add_argument("--epochs", type=int, default=3, help="epochs. Default 3.")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate. Default 0.05.")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest loss or weight difference accepted. Default 1e-4.")
    parser.add_argument("--json", help="also write the rows to this JSON file.")
    args = parser.parse_args(argv)
    for flag, value, low in (("--stages", args.stages, 2), ("--microbatches", args.microbatches, 1),
                             ("--samples", args.samples, 1), ("--batch-size", args.batch_size, 1),
                             ("--epochs", args.epochs, 1)):
        if value < low:
            parser.error(f"{flag} must be >= {low}. Received: {flag} {value}.")
    rows = run(args)
    print(table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    bad = [r["head"] for r in rows if max(r["max_loss_diff"], r["max_weight_diff"]) > args.tolerance]
    if bad:
        print(f"pipeline_heads: differs from the unsplit model by more than {args.tolerance}: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
