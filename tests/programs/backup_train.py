"""Worker program of the `kpipe.callbacks.BackupAndRestore` tests: run it under `kpipe launch`.

Each copy trains the small model of `mw_train.py` under `kpipe.distribute.auto_strategy()`
on a shuffled, seeded `kpipe.ProcessLoader` (sharded by TF_CONFIG) with
`kpipe.callbacks.BackupAndRestore(--backup, loaders=[loader])`, and writes
`--out/worker<i>.json` (epoch resumed from, epochs run, backups left) and
`--out/worker<i>.npz` (final weights).

`--tear-at N` makes the save of epoch N torn: worker 1 writes its state file, waits until
worker 0 has committed epoch N, and SIGKILLs itself before committing its own metadata.
Worker 0 is then stopped by the launcher. The backups are left one epoch apart.

`--reference`: the chief also trains the same model in one process, without a strategy
and without interruption, on the concatenation of both shards' batches (the same global
batches), and saves those weights as `reference/w<i>`.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np

import _outputs
from mw_train import GLOBAL_BATCH, ContiguousBatches, build_model, compile_model, make_data

SEED = 7
_WAIT_FOR_PEER_S = 120


def make_loader(kpipe, x, y, num_workers, shard_index=None):
    batches = ContiguousBatches(x, y, GLOBAL_BATCH // num_workers)
    if shard_index is None:  # sharded by TF_CONFIG (kpipe.distribute.default_shard)
        return kpipe.ProcessLoader(batches, workers=0, shuffle=True, seed=SEED)
    return kpipe.ProcessLoader(batches, workers=0, shuffle=True, seed=SEED,
                               num_shards=num_workers, shard_index=shard_index)


def global_batches(keras, loaders):
    """One PyDataset whose batch k concatenates batch k of every shard's loader (each
    loader moves to its next pass when its last batch is read, as under fit())."""

    class _Global(keras.utils.PyDataset):
        def __len__(self):
            return len(loaders[0])

        def __getitem__(self, k):
            parts = [loader[k] for loader in loaders]
            return tuple(np.concatenate(p) for p in zip(*parts))


    return _Global()


def tearing_backup(kpipe, args, info):
    class TearingBackup(kpipe.callbacks.BackupAndRestore):
        def _commit(self, epoch_dir, metadata):
            if metadata["epoch"] == args.tear_at and info.worker_index == 1:
                peer = os.path.join(args.backup, "worker-0", os.path.basename(epoch_dir),
                                    "metadata.json")
                deadline = time.monotonic() + _WAIT_FOR_PEER_S
                while not os.path.exists(peer) and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
            super()._commit(epoch_dir, metadata)

    return TearingBackup


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--tear-at", type=int)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args(argv)

    import kpipe
    import kpipe.distribute

    info = kpipe.distribute.cluster_info()
    strategy = kpipe.distribute.auto_strategy(communication="ring")
    import keras
    import kpipe.callbacks

    keras.utils.set_random_seed(0)
    x, y = make_data()
    initial = build_model(keras).get_weights()
    loader = make_loader(kpipe, x, y, info.num_workers)
    backup = tearing_backup(kpipe, args, info)(args.backup, loaders=[loader])
    epochs_run = []

    class Progress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

    with strategy.scope():
        model = build_model(keras, initial)
        compile_model(keras, model)
    with loader:
        model.fit(loader, epochs=args.epochs, verbose=0, callbacks=[backup, Progress()])
    record = {"restored_epoch": backup.restored_epoch, "epochs_run": epochs_run,
              "worker_dir": backup.worker_dir,
              "worker_dir_left": os.path.exists(backup.worker_dir),
              "iterations": int(model.optimizer.iterations.numpy())}
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}

    if args.reference and info.is_chief:
        shards = [make_loader(kpipe, x, y, info.num_workers, i) for i in range(info.num_workers)]
        reference = build_model(keras, initial)
        compile_model(keras, reference)
        # shuffle=False: Keras would reorder the batches of a plain PyDataset.
        reference.fit(global_batches(keras, shards), epochs=args.epochs, verbose=0,
                      shuffle=False)
        for shard in shards:
            shard.close()
        arrays.update({f"reference/w{i}": w for i, w in enumerate(reference.get_weights())})

    _outputs.write(args.out, info.worker_index, record, arrays)
    print(f"worker {info.worker_index}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
