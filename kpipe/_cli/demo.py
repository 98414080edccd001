"""`kpipe demo`: train a small CNN on a built-in dataset, serial loading vs kpipe.

The first run generates an imbalanced image-classification dataset (HDF5, kept in the
user cache directory, see `kpipe._demo.cache_dir`). Then the same model trains twice for
`--epochs` epochs, each time under `kpipe.distribute.auto_strategy()`, with `class_weight`
computed from the labels and `kpipe.callbacks.InputProfiler` measuring the input wait:

1. fed by a plain `keras.utils.PyDataset` (what most training scripts do), then
2. fed by `kpipe.ProcessLoader(dataset, workers=N)` (the one-line change).

It ends with both runs' samples/s and input-wait share side by side; `--plot demo.png`
also draws both runs' per-step timelines (input wait stacked on compute) side by side.
`--devices 2` splits the CPU into two logical devices, so `auto_strategy` runs a local
`MirroredStrategy`.

    $ kpipe demo
    $ kpipe demo --plot demo.png
    $ kpipe demo --workers 4 --epochs 3 --samples 8192 --devices 2
"""

import os
import sys
import time

HELP = "train a small CNN on a built-in dataset, serial vs kpipe"
_BATCH = 64


def add_arguments(parser):
    parser.description = ("Train a small CNN on a built-in imbalanced image dataset twice -- fed by "
                          "a plain keras.utils.PyDataset, then by kpipe.ProcessLoader -- and compare "
                          "samples/s and input-wait share.")
    parser.add_argument("--workers", type=int, default=None, help="ProcessLoader workers. Defaults to min(4, CPU cores), at least 2.")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run. Defaults to 3.")
    parser.add_argument("--samples", type=int, default=8192, help="images in the generated dataset. Defaults to 8192.")
    parser.add_argument("--devices", type=int, default=1, help="logical CPU devices; > 1 trains with MirroredStrategy. Defaults to 1.")
    parser.add_argument("--plot", metavar="PNG", help="write both runs' per-step timelines side by side to PNG "
                        "(needs matplotlib: pip install 'kpipe[plot]')")


def _check(args):
    for name, minimum in (("epochs", 1), ("samples", 2 * _BATCH), ("devices", 1), ("workers", 0)):
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"`--{name}` must be >= {minimum}. Received: --{name}={value}.")
    if args.devices > 1 and _BATCH % args.devices:
        raise ValueError(f"`--devices` must divide the batch size {_BATCH}. Received: --devices={args.devices}.")


def run(args) -> int:
    try:
        _check(args)
        if getattr(args, "plot", None):
            from kpipe.callbacks import _plot

            _plot.require_matplotlib()  # before minutes of training, not after
    except (ValueError, ImportError) as exc:
        print(f"kpipe demo: error: {exc}", file=sys.stderr)
        return 2
    workers = args.workers if args.workers is not None else max(2, min(4, os.cpu_count() or 1))
    from kpipe._cli import _quiet

    _quiet.quiet_tensorflow(getattr(args, "verbose", False), level="2")
    from kpipe import _demo

    t0 = time.perf_counter()
    path, created = _demo.ensure_dataset(args.samples)
    what = f"generated in {time.perf_counter() - t0:.1f}s" if created else "cached"
    print(f"dataset: {args.samples} images {_demo.IMAGE_SIZE}x{_demo.IMAGE_SIZE}x3, "
          f"{len(_demo.CLASS_SHARES)} classes ({'/'.join(f'{s:.0%}' for s in _demo.CLASS_SHARES)}), {what}: {path}")

    try:
        strategy = _make_strategy(args.devices)  # before any other TensorFlow work
    except RuntimeError as exc:
        print(f"kpipe demo: error: --devices={args.devices} needs a fresh process: logical devices "
              f"must be set before TensorFlow initialises ({exc}).", file=sys.stderr)
        return 2
    import keras

    import kpipe

    weights = _demo.class_weights(path)
    print(f"strategy: {type(strategy).__name__.lstrip('_')}, {strategy.num_replicas_in_sync} replica(s); "
          f"class_weight: {{{', '.join(f'{c}: {w:.2f}' for c, w in weights.items())}}}")
    dataset = _demo.DemoImages(path, batch_size=_BATCH)

    runs = {}
    print("\n[1/2] serial: keras.utils.PyDataset, loading in the training process")
    runs["serial"] = _train(keras, kpipe, strategy, _demo.keras_view(dataset), args.epochs, weights)
    print(f"\n[2/2] kpipe: ProcessLoader(dataset, workers={workers})")
    with kpipe.ProcessLoader(dataset, workers=workers, shuffle=True, seed=0) as loader:
        runs["kpipe"] = _train(keras, kpipe, strategy, loader, args.epochs, weights)
    print()
    print(format_summary(runs, workers, args.epochs))
    if getattr(args, "plot", None):
        runs["kpipe"]["profiler"].plot(
            args.plot, before=runs["serial"]["profiler"],
            labels=["serial PyDataset", f"kpipe ProcessLoader(workers={workers})"],
            title="kpipe demo: input wait per training step, before and after",
        )
        print(f"timeline: {args.plot}")
    return 0


def _make_strategy(devices):
    import tensorflow as tf

    if devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    names = [f"/cpu:{i}" for i in range(devices)] if devices > 1 else None
    import kpipe.distribute

    return kpipe.distribute.auto_strategy(devices=names)


def build_model(keras, classes):
    """A small CNN: two strided convolutions, pooling, a linear classifier."""
    from kpipe._demo import IMAGE_SIZE

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3)),
            keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(classes),
        ]
    )


def _train(keras, kpipe, strategy, data, epochs, class_weight):
    from kpipe._demo import CLASS_SHARES

    with strategy.scope():
        model = build_model(keras, len(CLASS_SHARES))
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    profiler = kpipe.callbacks.InputProfiler(warn_above=None)  # the summary says it all
    t0 = time.perf_counter()
    history = model.fit(data, epochs=epochs, class_weight=class_weight, callbacks=[profiler], verbose=2)
    # Over all epochs (the profiler leaves out the first step: tracing, worker start-up).
    wall_s = sum(e["wall_s"] for e in profiler.epochs)
    return {
        "samples_per_sec": sum(e["samples"] for e in profiler.epochs) / wall_s,
        "input_wait_share": sum(e["input_wait_s"] for e in profiler.epochs) / wall_s,
        "accuracy": float(history.history["accuracy"][-1]),
        "seconds": time.perf_counter() - t0,
        "profiler": profiler,
    }


def _epochs_label(epochs):
    return "epoch 1" if epochs == 1 else f"epochs 1-{epochs}"


def format_summary(runs, workers, epochs):
    serial, fast = runs["serial"], runs["kpipe"]
    label = f"ProcessLoader(workers={workers})"
    width = max(len(label), 16)
    lines = [
        f"{_epochs_label(epochs):<22}{'serial PyDataset':>{width}}  {label:>{width}}",
        f"{'samples/s':<22}{serial['samples_per_sec']:>{width}.0f}  {fast['samples_per_sec']:>{width}.0f}"
        f"   {fast['samples_per_sec'] / serial['samples_per_sec']:.2f}x",
        f"{'input wait share':<22}{serial['input_wait_share']:>{width}.0%}  {fast['input_wait_share']:>{width}.0%}",
        f"{'accuracy (last)':<22}{serial['accuracy']:>{width}.3f}  {fast['accuracy']:>{width}.3f}",
        f"{'fit() seconds':<22}{serial['seconds']:>{width}.1f}  {fast['seconds']:>{width}.1f}",
    ]
    if fast["input_wait_share"] > 0.2:
        lines.append(f"Still waiting on input {fast['input_wait_share']:.0%} of the time: on more cores, raise "
                     "--workers; `kpipe bench module:factory` measures a loader alone.")
    return "\n".join(lines)
