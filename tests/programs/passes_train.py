"""Worker program of the exactly-once tests: run it under `kpipe launch` (one copy per worker).

Each copy trains a small model under `kpipe.distribute.auto_strategy()` on a shuffled,
seeded `kpipe.ProcessLoader` (sharded by TF_CONFIG) whose batch i holds the id i, records
the id of every batch its compiled train step consumes and how often each worker loaded
a batch, and writes `--out/worker<i>.json` (ids, loads, steps, restored step) and
`--out/worker<i>.npz` (final weights).

  --steps-per-epoch S      fit(steps_per_epoch=S)
  --validation             also validate on a 4-batch ProcessLoader (2 per worker)
  --save-freq N            kpipe.callbacks.BackupAndRestore(--backup, save_freq=N)
  --kill-at-step K         worker 1 SIGKILLs itself after its K-th training step
  --loader-workers W       ProcessLoader(workers=W)
  --ray-address A          ... W Ray actors of the cluster at A, on nodes with a "preprocess" resource
"""

import argparse
import json
import os
import signal
import sys

import numpy as np

import _outputs

N_BATCHES = 16
SEED = 11


class Ids:
    """Batch i: 4 samples whose features all hold i; appends i to `log` at each load."""

    def __init__(self, n, log):
        self.n, self.log = n, log

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        x = np.full((4, 3), i, "float32")
        return x, (x.sum(axis=1, keepdims=True) * 0.01).astype("float32")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int)
    parser.add_argument("--validation", action="store_true")
    parser.add_argument("--backup")
    parser.add_argument("--save-freq", type=int)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--ray-address")
    args = parser.parse_args(argv)

    import kpipe
    import kpipe.distribute

    info = kpipe.distribute.cluster_info()
    strategy = kpipe.distribute.auto_strategy(communication="ring")
    import keras
    import tensorflow as tf

    import kpipe.callbacks

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"worker{info.worker_index}")
    seen = []

    def record(ids):
        seen.extend(int(v) for v in ids.numpy())
        return np.int32(0)

    class Recording(keras.Sequential):
        def train_step(self, data):
            tf.py_function(record, [data[0][0, 0:1]], tf.int32)
            return super().train_step(data)

    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = Recording([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")

    train_log, val_log = stem + ".train-loads", stem + ".val-loads"
    workers = args.loader_workers
    if args.ray_address:
        workers = kpipe.RayWorkers(workers, address=args.ray_address, resources={"preprocess": 1})
    loader = kpipe.ProcessLoader(Ids(N_BATCHES, train_log), workers=workers, shuffle=True, seed=SEED)
    val = kpipe.ProcessLoader(Ids(4, val_log), workers=1) if args.validation else None
    callbacks = []
    backup = None
    if args.save_freq:
        backup = kpipe.callbacks.BackupAndRestore(args.backup, save_freq=args.save_freq, loaders=loader)
        callbacks.append(backup)
    if args.kill_at_step and info.worker_index == 1:
        class Kill(keras.callbacks.Callback):
            done = 0

            def on_train_batch_end(self, batch, logs=None):
                Kill.done += 1
                if Kill.done == args.kill_at_step:
                    with open(stem + ".killed.json", "w") as f:
                        json.dump({"ids": seen}, f)
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(Kill())
    with loader:
        model.fit(loader, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=0,
                  validation_data=val, callbacks=callbacks)
        stats = loader.stats()
        actor_nodes = kpipe._stream.source_of(loader).backend.nodes() if args.ray_address else []
    if val is not None:
        val.close()

    def count(path):
        try:
            with open(path) as f:
                return len(f.read().split())
        except FileNotFoundError:
            return 0

    record_out = {
        "ids": seen,
        "shard": [loader.num_shards, loader.shard_index],
        "num_batches": len(loader),
        "train_loads": count(train_log),
        "val_loads": count(val_log),
        "passes": stats["passes"],
        "restored_step": backup.restored_step if backup is not None else None,
        "iterations": int(model.optimizer.iterations.numpy()),
        "loader_pids": stats["pids"],
        "actor_nodes": actor_nodes,
    }
    _outputs.write(args.out, info.worker_index, record_out, {f"w{i}": w for i, w in enumerate(model.get_weights())})
    print(f"worker {info.worker_index}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
