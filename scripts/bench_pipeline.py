"""Step time of a model cut into K pipeline stages vs the same model on one device, by micro-batches.

Trains one MLP with `train_on_batch` three ways, side by side in one process, for each
micro-batch count M (every arm warmed up, then timed in rounds over all arms; the median
round counts):

  unsplit     the Keras model on one device (the same for every M);
  1 stage     `kpipe.distribute.pipeline_model(model, [dev0], num_microbatches=M)`: the cost of
              cutting the batch into M micro-batches alone;
  K stages    `pipeline_model(model, [dev0 .. devK-1], num_microbatches=M)` (cuts balanced by
              weight count);

and prints each step time with GPipe's bubble, the idle share of each device during a step,
(K-1)/(M+K-1), beside it. Without `--gpu` the devices are logical CPU devices, which share
one process's CPU threads: the figures then show the pipeline's overhead, not its speed-up
(the point on CPUs is correctness, tested in tests/test_distribute_pipeline.py). With
`--gpu` (K >= 2 GPUs) the stages are GPUs.

    python scripts/bench_pipeline.py                       # K=2 logical CPUs, M = 1 2 4 8
    python scripts/bench_pipeline.py --gpu --stages 4 --width 4096 --json pipe.json
"""

import argparse
import json
import os
import sys
import time


def bubble(stages, microbatches):
    """GPipe's idle share of each device per step: (K-1)/(M+K-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def run(args):
    """Measures every arm; returns the rows of the table (a list of dicts)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if args.gpu:
        devices = [d.name for d in tf.config.list_logical_devices("GPU")]
        if len(devices) < args.stages:
            raise SystemExit(f"bench_pipeline: --gpu --stages {args.stages} needs {args.stages} GPUs; "
                             f"TensorFlow sees {len(devices)}.")
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.stages)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    import keras
    import numpy as np

    import kpipe.distribute

    devices = devices[: args.stages]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, args.width)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, args.batch).astype("int32"))

    def build():
        keras.utils.set_random_seed(0)
        with tf.device(devices[0]):
            layers = [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
            return keras.Sequential([keras.Input((args.width,)), *layers, keras.layers.Dense(10)])

    def compiled(model):
        model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        for _ in range(args.warmup):
            model.train_on_batch(x, y)
        return model

    def step_ms(model):
        start = time.perf_counter()
        for _ in range(args.steps):
            model.train_on_batch(x, y)  # returns the loss as a number: the step has finished
        return 1e3 * (time.perf_counter() - start) / args.steps

    arms = {"unsplit": compiled(build())}
    for m in args.microbatches:
        arms[("one", m)] = compiled(kpipe.distribute.pipeline_model(build(), devices[:1], num_microbatches=m))
        arms[("many", m)] = compiled(kpipe.distribute.pipeline_model(build(), devices, num_microbatches=m))
    # Rounds over all arms in turn, the median per arm: a change in the machine's load
    # during the run then touches every arm alike.
    times = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, model in arms.items():
            times[name].append(step_ms(model))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    ms = {name: float(np.median(t)) for name, t in times.items()}
    rows = [{"microbatches": m, "unsplit_ms": ms["unsplit"], "one_stage_ms": ms[("one", m)],
             "stages_ms": ms[("many", m)], "stages_vs_unsplit": ms[("many", m)] / ms["unsplit"],
             "bubble": bubble(len(devices), m)} for m in args.microbatches]
    return devices, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages K (devices). Defaults to 2.")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="micro-batch counts M to measure. Defaults to 1 2 4 8.")
    parser.add_argument("--batch", type=int, default=256, help="batch size. Defaults to 256.")
    parser.add_argument("--width", type=int, default=512, help="units per Dense layer. Defaults to 512.")
    parser.add_argument("--depth", type=int, default=8, help="hidden Dense layers. Defaults to 8.")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm and round. Defaults to 10.")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all arms; the median counts. Defaults to 3.")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (tracing). Defaults to 3.")
    parser.add_argument("--gpu", action="store_true", help="stages on GPUs instead of logical CPU devices")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.stages < 2 or min(args.microbatches) < 1 or min(args.steps, args.warmup, args.rounds) < 1:
        parser.error("--stages must be >= 2; --microbatches, --steps, --warmup and --rounds >= 1")
    print(f"bench_pipeline: MLP {args.depth}x{args.width}, batch {args.batch}, {args.rounds} rounds of "
          f"{args.steps} timed steps per arm",
          flush=True)
    devices, rows = run(args)
    k = len(devices)
    print(f"\nstages on {', '.join(devices)}")
    print(f"{'M':>3}{'unsplit ms':>12}{'1 stage ms':>12}{f'{k} stages ms':>14}{f'{k} stages/unsplit':>19}"
          f"{'bubble (K-1)/(M+K-1)':>23}")
    for r in rows:
        print(f"{r['microbatches']:>3}{r['unsplit_ms']:>12.1f}{r['one_stage_ms']:>12.1f}{r['stages_ms']:>14.1f}"
              f"{r['stages_vs_unsplit']:>18.2f}x{r['bubble']:>23.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "devices": devices, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
