"""The batch orders `fit()` trains on, through plain Keras and through a
`kpipe.ProcessLoader` (its default `shuffle=None`), on whatever backend `KERAS_BACKEND`
names; used by tests/test_fit_shuffle.py in fresh processes.

Writes `worker0.json` in `--out` (`_outputs.write`): `{"backend", "plain", "kpipe",
"plain_in_order", "kpipe_in_order", "kpipe_evaluate", "plain_evaluate"}` -- each a list of
epochs, each the list of batch ids the model's first layer saw -- and `worker0.npz`:
the weights after the kpipe default run. With `--kpipe-only --then-seed S`, the same process
then runs it again seeded by S: `kpipe_seeded` in the JSON, `seeded/w<i>` in the npz."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N_BATCHES = 8


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="folder for worker0.json / worker0.npz")
    parser.add_argument("--seed", type=int, default=None, help="keras.utils.set_random_seed before each fit()")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kpipe-only", action="store_true", help="only the kpipe default run")
    parser.add_argument("--then-seed", type=int, default=None,
                        help="with --kpipe-only: after that run (seeded by --seed, if given), a second "
                             "kpipe default run on a new loader with keras.utils.set_random_seed(this) "
                             "before its fit(): `kpipe_seeded` and `seeded/w<i>`")
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    import _outputs
    import kpipe

    seen = []

    class Ids(keras.utils.PyDataset):
        def __len__(self):
            return N_BATCHES

        def __getitem__(self, i):
            return np.full((2, 1), i, "float32"), np.full((2, 1), i % 2, "float32")

    class Record(keras.layers.Layer):
        def call(self, x):
            try:
                seen.append(int(keras.ops.convert_to_numpy(x)[0, 0]))
            except Exception:  # noqa: BLE001 -- a symbolic build (KerasTensor, JAX tracer): no batch
                pass
            return x

    def model(seed=args.seed):
        if seed is not None:
            keras.utils.set_random_seed(seed)
        m = keras.Sequential([keras.Input((1,)), Record(), keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=True)
        return m

    def epochs(ids):
        return [ids[i:i + N_BATCHES] for i in range(0, len(ids), N_BATCHES)]

    def run(data, call="fit", seed=args.seed, **kwargs):
        m = model(seed)
        del seen[:]
        if call == "fit":
            m.fit(data, epochs=args.epochs, verbose=0, **kwargs)
        else:
            m.evaluate(data, verbose=0)
        return epochs(list(seen)), m

    record = {"backend": keras.backend.backend()}
    with kpipe.ProcessLoader(Ids(), workers=2) as loader:
        record["kpipe"], trained = run(loader)
        weights = {f"w{i}": np.asarray(w) for i, w in enumerate(trained.get_weights())}
        if not args.kpipe_only:
            record["kpipe_in_order"] = run(loader, shuffle=False)[0]
            record["kpipe_evaluate"] = run(loader, call="evaluate")[0]
    if args.kpipe_only and args.then_seed is not None:
        with kpipe.ProcessLoader(Ids(), workers=2) as loader:
            record["kpipe_seeded"], trained = run(loader, seed=args.then_seed)
            weights.update({f"seeded/w{i}": np.asarray(w) for i, w in enumerate(trained.get_weights())})
    if not args.kpipe_only:
        record["plain"] = run(Ids())[0]
        record["plain_in_order"] = run(Ids(), shuffle=False)[0]
        record["plain_evaluate"] = run(Ids(), call="evaluate")[0]
    _outputs.write(args.out, 0, record, weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
