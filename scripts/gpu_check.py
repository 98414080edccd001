"""Is the GPU busy? A ResNet-style model fed by Keras multiprocessing vs `kpipe.ProcessLoader`.

Trains the same ResNet-style network for a fixed number of steps twice, each arm in its
own Python process (a fresh TensorFlow, and a hang in one arm cannot stall the other):

  (a) `keras`: the dataset as a `keras.utils.PyDataset(workers=W, use_multiprocessing=True)`;
  (b) `kpipe`: the same dataset in `kpipe.ProcessLoader(dataset, workers=W)`, given to
      `fit()` (kpipe's feed: batches converted, and copied to the GPU, ahead of the step);
  (c) `kpipe-dataset`: the loader's `as_dataset()`, batches left on the host;
  (d) `kpipe-dataset-device`: `as_dataset(device=<first GPU>)`, copied to the GPU ahead
      (`prefetch_to_device`). (c) against (d) is the accelerator path without and with
      the device prefetch; `--arms` picks a subset.

The dataset makes batches the way image pipelines do: uint8 "decoded" images, then per
image a random crop, flip, colour jitter and conversion to float32 in NumPy. While each arm
runs, `nvidia-smi` is sampled at 10 Hz; only samples inside the arm's timed steps count
(the first epoch, with graph compilation and worker start-up, is a warm-up). Printed per
arm: GPU busy % (mean utilisation), samples/s and input-wait share (InputProfiler).
`--plot` (default `gpu_check.png`, needs matplotlib) draws both arms side by side over
the timed epoch: GPU utilisation over time above, each step's input wait (InputProfiler's
per-step record) below, on the same time axis -- the swing between 0% and 90% and the
waits that cause it, then its cure.

Then, on a machine with 2 or more GPUs, the pipeline case (`kpipe.distribute.pipeline_model`,
model parallelism): an MLP trained on one GPU, then cut into stages over the GPUs with
micro-batches, from the same weights; it prints whether the losses match (the correctness
check) and each GPU's peak memory in both runs (`tf.config.experimental.get_memory_info`).
With fewer than 2 GPUs it says so and skips that case. `--only pipeline` runs just it.

Run it through `scripts/gpu_check.sh`, which installs what is needed and exits 0 on a
machine without an NVIDIA GPU. `--cpu-ok` runs it without a GPU (GPU columns say n/a; with
`--only pipeline`, the pipeline case on 2 logical CPU devices): for trying the script itself.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

_SMI_PERIOD_MS = 100
_ARMS = ("keras", "kpipe", "kpipe-dataset", "kpipe-dataset-device")


class Images:
    """Synthetic image batches with NumPy augmentation. No TensorFlow: sent to workers."""

    def __init__(self, steps, batch_size, size, classes=10, seed=0):
        self.steps, self.batch_size, self.size, self.classes, self.seed = steps, batch_size, size, classes, seed
        self.epoch = 0

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, self.epoch, i))
        pad = self.size // 8
        raw = rng.integers(0, 256, size=(self.batch_size, self.size + 2 * pad, self.size + 2 * pad, 3), dtype=np.uint8)
        labels = rng.integers(0, self.classes, size=self.batch_size)
        out = np.empty((self.batch_size, self.size, self.size, 3), dtype=np.float32)
        for k in range(self.batch_size):
            r, c = rng.integers(0, 2 * pad + 1, size=2)
            img = raw[k, r : r + self.size, c : c + self.size].astype(np.float32) / 255.0
            if rng.random() < 0.5:
                img = img[:, ::-1]
            img = (img - img.mean()) * rng.uniform(0.8, 1.2) + img.mean() + rng.uniform(-0.1, 0.1)
            out[k] = np.clip(img, 0.0, 1.0)
        return out, labels

    def on_epoch_end(self):
        self.epoch += 1


def build_resnet(keras, size, classes, widths=(64, 128, 256, 512), blocks=2):
    """A ResNet-18-style network: stem, 4 stages of `blocks` basic residual blocks."""
    L = keras.layers
    inputs = keras.Input((size, size, 3))
    x = L.Conv2D(widths[0], 3, padding="same", use_bias=False)(inputs)
    x = L.Activation("relu")(L.BatchNormalization()(x))
    for stage, width in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = L.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
            y = L.Activation("relu")(L.BatchNormalization()(y))
            y = L.BatchNormalization()(L.Conv2D(width, 3, padding="same", use_bias=False)(y))
            if stride != 1 or shortcut.shape[-1] != width:
                shortcut = L.BatchNormalization()(L.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut))
            x = L.Activation("relu")(L.Add()([y, shortcut]))
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, L.Dense(classes)(x))


def run_arm(args):
    """One arm, in this process: trains 2 epochs of `--steps`; prints a JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import kpipe
    from kpipe import _demo

    keras.mixed_precision.set_global_policy("mixed_float16" if tf.config.list_physical_devices("GPU") else "float32")
    dataset = Images(args.steps, args.batch, args.size)
    model = build_resnet(keras, args.size, dataset.classes)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    profiler = kpipe.callbacks.InputProfiler(warn_above=None)

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.start = time.time()

        def on_epoch_end(self, epoch, logs=None):
            self.end = time.time()

    clock = Clock()
    if args.arm == "keras":

        keras_images = _demo.keras_view(dataset, workers=args.workers, use_multiprocessing=True, max_queue_size=2 * args.workers)
        model.fit(keras_images, epochs=2, verbose=0, callbacks=[profiler, clock])
    else:
        with kpipe.ProcessLoader(dataset, workers=args.workers, max_queue_size=2 * args.workers) as loader:
            data = loader
            if args.arm == "kpipe-dataset":
                data = loader.as_dataset()
            elif args.arm == "kpipe-dataset-device":
                gpus = tf.config.list_logical_devices("GPU")
                data = loader.as_dataset(device=gpus[0].name if gpus else "/cpu:0")
            model.fit(data, epochs=2, verbose=0, callbacks=[profiler, clock])
    timed = profiler.epochs[-1]
    steps = profiler.steps
    rows = (steps.epoch == timed["epoch"]) & steps.counted
    t0 = float(steps.start_s[rows][0]) if rows.any() else 0.0
    print("ARM_RESULT " + json.dumps({
        "arm": args.arm, "start": clock.start, "end": clock.end,
        "samples_per_sec": timed["samples_per_sec"], "input_wait_share": timed["input_wait_share"],
        "steps": timed["steps"],
        # per step of the timed epoch: start (s since its first step), input wait and step time (ms)
        "step_start_s": [round(float(t) - t0, 5) for t in steps.start_s[rows]],
        "step_wait_ms": [round(1e3 * float(w) / n, 3) for w, n in zip(steps.wait_s[rows], steps.steps[rows])],
        "step_ms": [round(1e3 * float(w) / n, 3) for w, n in zip(steps.step_s[rows], steps.steps[rows])],
    }), flush=True)
    return 0


def run_pipeline_arm(args):
    """The pipeline case, in this process: one GPU vs stages over the GPUs; prints a JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import gc

    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= 2:
        devices = [f"/gpu:{i}" for i in range(min(len(gpus), args.pipeline_stages))]
        tf.config.experimental.enable_tensor_float_32_execution(False)  # float32 on both sides
    elif args.cpu_ok:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        devices = ["/cpu:0", "/cpu:1"]
    else:
        print("ARM_RESULT " + json.dumps({"arm": "pipeline", "skipped": f"TensorFlow sees {len(gpus)} GPU(s); "
                                          "the pipeline case needs 2 or more"}), flush=True)
        return 0
    import keras

    import kpipe.distribute

    on_gpu = devices[0].startswith("/gpu")
    width, depth, batch, m = args.pipeline_width, args.pipeline_depth, args.batch, args.pipeline_microbatches
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * batch, width)).astype("float32")
    y = rng.integers(0, 10, len(x))

    def build():  # on the host: the model need not fit on one device
        keras.utils.set_random_seed(0)
        with tf.device("/cpu:0"):
            return keras.Sequential([keras.Input((width,)), *[keras.layers.Dense(width, activation="relu")
                                                              for _ in range(depth)], keras.layers.Dense(10)])

    def train(model):
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        names = [d.upper().lstrip("/") for d in devices]
        if on_gpu:
            for name in names:
                tf.config.experimental.reset_memory_stats(name)
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0).history["loss"]
        seconds = time.perf_counter() - start
        peaks = [round(tf.config.experimental.get_memory_info(n)["peak"] / 2**20, 1) for n in names] if on_gpu else None
        return history, peaks, seconds

    host = build()
    with tf.device(devices[0]):
        one = keras.models.clone_model(host)
        one.set_weights(host.get_weights())
    loss_one, peak_one, seconds_one = train(one)
    del one
    gc.collect()
    keras.backend.clear_session()
    piped = kpipe.distribute.pipeline_model(build(), devices, num_microbatches=m)
    loss_pipe, peak_pipe, seconds_pipe = train(piped)
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(loss_one, loss_pipe))
    print("ARM_RESULT " + json.dumps({
        "arm": "pipeline", "devices": devices, "microbatches": m, "params": piped.count_params(),
        "split": [list(s.layer_names) for s in piped.stages], "loss_one": loss_one, "loss_pipeline": loss_pipe,
        "max_rel_diff": diff, "match": diff < 1e-4, "peak_mb_one": peak_one, "peak_mb_pipeline": peak_pipe,
        "seconds_one": seconds_one, "seconds_pipeline": seconds_pipe,
    }), flush=True)
    return 0


def print_pipeline(r):
    """The pipeline case's lines of the report."""
    if "skipped" in r or "error" in r:
        print(f"gpu_check: pipeline case {'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['error'][-300:]}")
        return
    k = len(r["devices"])
    print(f"\npipeline: {r['params']:,}-weight MLP in {k} stages over {', '.join(r['devices'])}, "
          f"{r['microbatches']} micro-batches (bubble {(k - 1) / (r['microbatches'] + k - 1):.0%})")
    print(f"  losses {'match' if r['match'] else 'DIFFER FROM'} one device: largest relative difference "
          f"{r['max_rel_diff']:.1e} over {len(r['loss_one'])} epochs; time {r['seconds_one']:.1f} s on one device, "
          f"{r['seconds_pipeline']:.1f} s in stages")
    if r["peak_mb_one"] is not None:
        print(f"  {'device':<10}{'peak MB, one device':>21}{'peak MB, stages':>17}")
        for i, device in enumerate(r["devices"]):
            print(f"  {device:<10}{r['peak_mb_one'][i]:>21,.0f}{r['peak_mb_pipeline'][i]:>17,.0f}")


def pipeline_skip_reason(gpus, cpu_ok, only):
    """Why the pipeline case does not run (a message), or None when it runs."""
    if gpus >= 2 or (cpu_ok and only == "pipeline"):
        return None
    return (f"nvidia-smi lists {gpus} GPU(s); model parallelism needs 2 or more "
            "(--cpu-ok --only pipeline tries it on 2 logical CPU devices)")


def _gpu_count(have_smi):
    if not have_smi:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


class _SmiSampler:
    """Streams `nvidia-smi` utilisation every 100 ms into (time, mean % over GPUs) pairs."""

    def __init__(self):
        self.samples = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={_SMI_PERIOD_MS}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self._gpus = max(1, len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.splitlines()))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        batch = []
        for line in self._proc.stdout:
            try:
                batch.append(float(line.strip()))
            except ValueError:
                continue
            if len(batch) == self._gpus:
                self.samples.append((time.time(), sum(batch) / len(batch)))
                batch = []

    def busy(self, start, end):
        window = [u for t, u in self.samples if start <= t <= end]
        return (sum(window) / len(window), len(window)) if window else (None, 0)

    def series(self, start, end):
        """`[(seconds since start, utilisation %)]` of the samples in [start, end]."""
        return [(round(t - start, 3), u) for t, u in self.samples if start <= t <= end]

    def close(self):
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)


def _launch_arm(arm, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--steps", str(args.steps), "--batch", str(args.batch),
           "--size", str(args.size), "--workers", str(args.workers), "--pipeline-width", str(args.pipeline_width),
           "--pipeline-depth", str(args.pipeline_depth), "--pipeline-stages", str(args.pipeline_stages),
           "--pipeline-microbatches", str(args.pipeline_microbatches), *(["--cpu-ok"] if args.cpu_ok else [])]
    with tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=args.arm_timeout)
        except subprocess.TimeoutExpired:
            return {"arm": arm, "error": f"did not finish within {args.arm_timeout}s (a hung input pipeline?)"}
        err.seek(0)
        tail = err.read()[-2000:]
    line = next((l for l in proc.stdout.splitlines() if l.startswith("ARM_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"arm": arm, "error": f"exit code {proc.returncode}: {tail}"}
    return json.loads(line[len("ARM_RESULT "):])


def plot_utilisation(results, names, path):
    """Both arms side by side, shared axes: GPU utilisation (%) over the timed epoch above,
    each step's input wait (ms) at the time it began below."""
    from matplotlib.figure import Figure

    arms = [r for r in results if "error" not in r]
    fig = Figure(figsize=(5.4 * len(arms), 5.2), dpi=100, layout="constrained")
    axes = fig.subplots(2, len(arms), sharex=True, sharey="row", squeeze=False)
    for col, r in enumerate(arms):
        top, bottom = axes[0][col], axes[1][col]
        series = r.get("gpu_series") or []
        busy = f"GPU busy {r['gpu_busy_pct']:.0f}%" if r.get("gpu_busy_pct") is not None else "no GPU samples"
        top.set_title(f"{names[r['arm']]}\n{busy}, {r['samples_per_sec']:,.0f} samples/s, input wait {r['input_wait_share']:.0%}",
                      fontsize="medium")
        if series:
            t, u = zip(*series)
            top.fill_between(t, u, step="post", color="#5b8db8", alpha=0.8, linewidth=0)
        else:
            top.text(0.5, 0.5, "no GPU samples (run with a GPU)", transform=top.transAxes, ha="center", color="0.3")
        top.set_ylim(0, 105)
        top.grid(axis="y", alpha=0.3)
        start, wait = r.get("step_start_s", []), r.get("step_wait_ms", [])
        bottom.bar(start, wait, width=[max(1e-3, s / 1e3) for s in r.get("step_ms", [])], align="edge",
                   color="#d1495b", linewidth=0)
        bottom.set_xlabel("seconds into the timed epoch")
        bottom.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GPU utilisation (%)")
    axes[1][0].set_ylabel("input wait per step (ms)")
    fig.suptitle("Is the GPU kept busy? Utilisation and input wait over time", fontweight="bold")
    fig.savefig(path)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="training steps per epoch (2 epochs per arm; the 2nd is timed). Defaults to 60.")
    parser.add_argument("--batch", type=int, default=128, help="batch size. Defaults to 128.")
    parser.add_argument("--size", type=int, default=96, help="image side in pixels. Defaults to 96.")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="loader workers in both arms. Defaults to min(8, CPU cores).")
    parser.add_argument("--arm-timeout", type=float, default=120.0, help="seconds one arm may take. Defaults to 120.")
    parser.add_argument("--cpu-ok", action="store_true", help="run without a GPU (no utilisation figures)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--plot", metavar="PNG", default="gpu_check.png",
                        help="draw GPU utilisation and input wait over time for both arms (needs matplotlib). "
                             "Defaults to gpu_check.png; '' draws nothing.")
    parser.add_argument("--arms", default=",".join(_ARMS), help=f"comma-separated subset of {','.join(_ARMS)}. Defaults to all.")
    parser.add_argument("--only", choices=("loaders", "pipeline"), help="run only the loader arms or only the pipeline case")
    parser.add_argument("--pipeline-width", type=int, default=4096, help="pipeline case: units per Dense layer. Defaults to 4096.")
    parser.add_argument("--pipeline-depth", type=int, default=8, help="pipeline case: Dense layers. Defaults to 8 (134M weights).")
    parser.add_argument("--pipeline-stages", type=int, default=2, help="pipeline case: stages, at most the GPUs. Defaults to 2.")
    parser.add_argument("--pipeline-microbatches", type=int, default=4, help="pipeline case: micro-batches. Defaults to 4.")
    parser.add_argument("--arm", choices=_ARMS + ("pipeline",), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm == "pipeline":
        return run_pipeline_arm(args)
    if args.arm:
        return run_arm(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in _ARMS for a in arms):
        parser.error(f"--arms takes a comma-separated subset of {','.join(_ARMS)}. Received: {args.arms}")
    have_smi = subprocess.run(["sh", "-c", "command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null"]).returncode == 0
    if not have_smi and not args.cpu_ok:
        print("gpu_check: no NVIDIA GPU (nvidia-smi missing or failing); nothing to check.")
        return 0
    pipeline = None
    if args.only != "loaders":
        skip = pipeline_skip_reason(_gpu_count(have_smi), args.cpu_ok, args.only)
        if skip:
            pipeline = {"arm": "pipeline", "skipped": skip}
        else:
            print(f"gpu_check: running the pipeline case ({args.pipeline_stages} stages, {args.pipeline_microbatches} micro-batches)...", flush=True)
            pipeline = _launch_arm("pipeline", args)
        if args.only == "pipeline":
            print_pipeline(pipeline)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": {k: v for k, v in vars(args).items() if k != "arm"}, "pipeline": pipeline}, f, indent=2)
            return 0 if "error" not in pipeline and pipeline.get("match", True) else 1
    sampler = _SmiSampler() if have_smi else None
    results = []
    try:
        for arm in arms:
            print(f"gpu_check: running arm {arm} ({args.steps} steps x 2 epochs, batch {args.batch}, {args.size}px, {args.workers} workers)...", flush=True)
            result = _launch_arm(arm, args)
            if sampler and "error" not in result:
                result["gpu_busy_pct"], result["gpu_samples"] = sampler.busy(result["start"], result["end"])
                result["gpu_series"] = sampler.series(result["start"], result["end"])
            results.append(result)
    finally:
        if sampler:
            sampler.close()
    names = {"keras": f"keras PyDataset (multiprocessing, {args.workers} workers)", "kpipe": f"kpipe ProcessLoader ({args.workers} workers)",
             "kpipe-dataset": "kpipe as_dataset(), batches on the host", "kpipe-dataset-device": "kpipe as_dataset(device=GPU)"}
    print(f"\n{'input fed by':<46}{'GPU busy':>9}{'samples/s':>11}{'input wait':>12}")
    for r in results:
        if "error" in r:
            print(f"{names[r['arm']]:<46}  failed: {r['error'][-300:]}")
            continue
        busy = f"{r['gpu_busy_pct']:.0f}%" if r.get("gpu_busy_pct") is not None else "n/a"
        print(f"{names[r['arm']]:<46}{busy:>9}{r['samples_per_sec']:>11.0f}{r['input_wait_share']:>12.0%}")
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["arm"] == "keras"), None)
    for r in ok:
        if base is not None and r is not base:
            print(f"{r['arm']} / keras samples/s: {r['samples_per_sec'] / base['samples_per_sec']:.2f}x")
    if args.plot and ok:
        try:
            plot_utilisation(results, names, args.plot)
            print(f"gpu_check: wrote {args.plot}")
        except ImportError:
            print("gpu_check: --plot needs matplotlib (pip install 'kpipe[plot]'); no figure drawn.")
    if pipeline is not None:
        print_pipeline(pipeline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "arm"}, "results": results,
                       "pipeline": pipeline}, f, indent=2)
    pipeline_ok = pipeline is None or ("error" not in pipeline and pipeline.get("match", True))
    return 0 if pipeline_ok and any(r["arm"].startswith("kpipe") and "error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
