"""GPU check, PyTorch arm: kpipe's pinned-memory ahead copy (kpipe/_torch_pin.py) on a CUDA device.

Under `KERAS_BACKEND=torch` the same small convolutional model is trained from the same
initial weights on the same batches (batch i depends on i only) by each arm, in one process:

  plain       `fit(PyDataset)`: Keras's own input (the reference weights and losses);
  kpipe-pin   `fit(kpipe.ProcessLoader(ds, workers=W))`, `KPIPE_TORCH_PIN=1` (the default):
              batches copied into pinned host buffers and on to the GPU by a side stream,
              ahead of the step;
  kpipe-nopin the same loader with `KPIPE_TORCH_PIN=0`: tensors over the loader's slots,
              copied to the GPU by Keras in the step (pageable memory);
  torch-dl    `fit(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=W,
              pin_memory=True))`: PyTorch's usual input.

Arms are interleaved over `--rounds` rounds; each trains `--epochs` epochs and the epochs
after the first are timed (steps/s of the best timed epoch over all rounds is printed, with
the median). Checked: each arm's final weights and per-epoch losses equal the plain arm's
(max relative difference printed; cuDNN set deterministic), and in the kpipe-pin arm the
batches reach the train step as tensors already on the GPU (Keras then copies nothing).
Exit status 1 if a check fails.

Where torch has no CUDA it prints "gpu_check_torch: skipped: no CUDA torch (...)" and exits
0; `--cpu-ok` runs it on the CPU anyway (`KPIPE_TORCH_PIN=cpu` for the pin arm: the ahead
copy's thread with the CPU as the device), for trying the script itself. Called by
scripts/gpu_check.sh when the chosen Python has torch with CUDA.

    python scripts/gpu_check_torch.py --steps 40 --batch 256 --size 64 --workers 8
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ARMS = ("plain", "kpipe-pin", "kpipe-nopin", "torch-dl")


def cuda_skip_reason():
    """None when torch with CUDA is importable, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


class Batches:
    """Float32 image batches and int labels; batch i depends on i only (no TensorFlow, no torch:
    sent to the loader's workers)."""

    def __init__(self, steps, batch_size, size, classes=10):
        self.steps, self.batch_size, self.size, self.classes = steps, batch_size, size, classes
        self._base = None

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        if self._base is None:
            rng = np.random.default_rng(0)
            self._base = rng.random((4, self.batch_size, self.size, self.size, 3), dtype=np.float32)
        x = self._base[i % 4] * np.float32(1.0 + (i % 7) / 10)
        y = (np.arange(self.batch_size) * 7 + i) % self.classes
        return x, y.astype("int64")


def build(keras, size, classes):
    L, init = keras.layers, keras.initializers.GlorotUniform
    model = keras.Sequential([
        keras.Input((size, size, 3)),
        L.Conv2D(32, 3, strides=2, activation="relu", kernel_initializer=init(seed=1)),
        L.Conv2D(64, 3, strides=2, activation="relu", kernel_initializer=init(seed=2)),
        L.GlobalAveragePooling2D(),
        L.Dense(classes, kernel_initializer=init(seed=3)),
    ])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run_arm(arm, args, cuda):
    """Trains one arm: {"arm", "epoch_s": [timed epochs], "losses", "weights", "on_device"}."""
    import keras
    import torch

    import kpipe

    dataset = Batches(args.steps, args.batch, args.size)
    model = build(keras, args.size, dataset.classes)
    times, seen = [], []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if cuda:
                torch.cuda.synchronize()
            if epoch > 0:
                times.append(time.perf_counter() - self.start)

    model.make_train_function()
    step = model.train_function

    def recording(data):
        if len(seen) < 3:
            seen.append(str(data[0][0].device))
        return step(data)

    model.train_function = recording
    fit = dict(epochs=args.epochs, shuffle=False, verbose=0, callbacks=[Clock()])
    if arm == "plain":
        class KerasView(keras.utils.PyDataset):
            def __len__(self):
                return len(dataset)

            def __getitem__(self, i):
                return dataset[i]

        history = model.fit(KerasView(), **fit)
    elif arm == "torch-dl":
        class View(torch.utils.data.Dataset):
            def __len__(self):
                return len(dataset)

            def __getitem__(self, i):
                return dataset[i]

        loader = torch.utils.data.DataLoader(View(), batch_size=None, shuffle=False, num_workers=args.workers,
                                             pin_memory=cuda, persistent_workers=args.workers > 0)
        history = model.fit(loader, **fit)
    else:
        os.environ["KPIPE_TORCH_PIN"] = ("1" if cuda else "cpu") if arm == "kpipe-pin" else "0"
        with kpipe.ProcessLoader(dataset, workers=args.workers) as loader:
            history = model.fit(loader, **fit)
    return {"arm": arm, "epoch_s": times, "losses": [float(v) for v in history.history["loss"]],
            "weights": [np.asarray(w) for w in model.get_weights()], "on_device": seen}


def max_rel_diff(a, b):
    """Largest |a - b| of each array over that array's largest |b|, over the arrays."""
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) if x.size else 0.0 for x, y in zip(a, b))


def report(results, args):
    """Prints the table; returns the checks' failures (a list of strings)."""
    failures, reference = [], results["plain"][0]
    print(f"{'arm':<12} {'steps/s best':>12} {'median':>8} {'vs torch-dl':>11} {'max rel diff':>12}  batches on")
    best = {arm: args.steps / min(t for r in runs for t in r["epoch_s"]) for arm, runs in results.items()}
    for arm, runs in results.items():
        rates = [args.steps / t for r in runs for t in r["epoch_s"]]
        diff = max(max(max_rel_diff(r["weights"], reference["weights"]),
                       max_rel_diff([np.array(r["losses"])], [np.array(reference["losses"])])) for r in runs)
        ratio = f"{best[arm] / best['torch-dl']:.2f}x" if "torch-dl" in best else "n/a"
        print(f"{arm:<12} {best[arm]:>12.1f} {statistics.median(rates):>8.1f} {ratio:>11} {diff:>12.2e}  "
              f"{','.join(sorted(set(runs[0]['on_device'])))}")
        if diff > args.tolerance:
            failures.append(f"{arm}: weights/losses differ from plain Keras's by {diff:.2e} (> {args.tolerance})")
    pinned = results.get("kpipe-pin")
    if pinned and args.cuda and not all(d.startswith("cuda") for d in pinned[0]["on_device"]):
        failures.append(f"kpipe-pin: batches reached the step on {pinned[0]['on_device']}, not the GPU")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch. Defaults to 40.")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per arm and round (the first is not timed). Defaults to 3.")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all arms, interleaved. Defaults to 2.")
    parser.add_argument("--batch", type=int, default=256, help="batch size. Defaults to 256.")
    parser.add_argument("--size", type=int, default=64, help="image side. Defaults to 64 (a batch of 256: 12.6 MB).")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="loader workers. Defaults to min(8, CPU cores).")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)} (plain is always run).")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max relative difference to plain Keras. Defaults to 1e-5.")
    parser.add_argument("--cpu-ok", action="store_true", help="run without CUDA (the pin arm with KPIPE_TORCH_PIN=cpu)")
    parser.add_argument("--json", metavar="PATH", help="also write steps/s and differences as JSON to PATH")
    args = parser.parse_args(argv)
    arms = ["plain"] + [a.strip() for a in args.arms.split(",") if a.strip() and a.strip() != "plain"]
    if any(a not in ARMS for a in arms):
        parser.error(f"--arms takes a comma-separated subset of {','.join(ARMS)}. Received: {args.arms}")
    skip = cuda_skip_reason()
    if skip and not args.cpu_ok:
        print(f"gpu_check_torch: skipped: no CUDA torch ({skip}); nothing to check.")
        return 0
    args.cuda = skip is None
    os.environ["KERAS_BACKEND"] = "torch"
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "torch":
        parser.error("keras was imported with another backend; run this script in its own process")
    import torch

    if args.cuda:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        print(f"gpu_check_torch: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    results = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in arms:
            print(f"gpu_check_torch: round {round_ + 1}/{args.rounds}: {arm}...", flush=True)
            results[arm].append(run_arm(arm, args, args.cuda))
    os.environ.pop("KPIPE_TORCH_PIN", None)
    failures = report(results, args)
    print(f"method: best (and median) steps/s over the timed epochs (epochs 2..{args.epochs} of {args.rounds} "
          f"interleaved rounds); {args.steps} steps of {args.batch} x {args.size}x{args.size}x3 float32, "
          f"{args.workers} workers")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({arm: {"steps_per_s": [args.steps / t for r in runs for t in r["epoch_s"]],
                             "losses": runs[0]["losses"], "on_device": runs[0]["on_device"]}
                       for arm, runs in results.items()} | {"failures": failures, "cuda": args.cuda}, f, indent=1)
    for failure in failures:
        print(f"gpu_check_torch: FAILED: {failure}")
    if not failures:
        print("gpu_check_torch: every arm ends with plain Keras's weights and losses")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
