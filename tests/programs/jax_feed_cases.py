"""The JAX feed's hand-over (kpipe/_jax_feed.py), run by tests/test_backend_jax.py in a fresh
process with KERAS_BACKEND=jax (and the torch hand-over, kpipe/_torch_feed.py, by
tests/test_backend_torch.py with KERAS_BACKEND=torch).

    python jax_feed_cases.py --out D --phase handover   # every batch Keras's JAX trainer took
    python jax_feed_cases.py --out D --phase fork       # start_method="fork" in a JAX process
    python jax_feed_cases.py --out D --phase torch_handover   # the same as handover, on torch

`handover`: a ProcessLoader with a small ring (`max_queue_size=2`, 2 workers) trains a model
while a recorder between Keras's trainer and its jitted step keeps every batch the trainer
took -- even steps as the NumPy arrays handed over (viewing the loader's slots), odd steps
as JAX arrays made from them with the NumPy arrays dropped (on the CPU the JAX array
aliases the slot) -- until the end of `fit()`. The record compares each kept batch, byte
for byte, with the dataset called serially in this process, and the final weights with
plain Keras's on the same `PyDataset`; and counts the slots held while the batches were
kept and after they were dropped.

`fork`: what `ProcessLoader(..., start_method="fork")` does once JAX's runtime runs here.

Each phase writes `_outputs.write(D/<phase>, 0, record, arrays)`.
"""

import argparse
import gc
import os
import sys

import keras  # KERAS_BACKEND=jax, set by the test
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _outputs  # noqa: E402

BATCHES, ROWS, EPOCHS = 12, 8, 2


class Distinct(keras.utils.PyDataset):
    """Batch i: (x, y, sample weights) drawn from a generator seeded with i: every batch
    differs, and the same index gives the same bytes in any process."""

    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        rng = np.random.default_rng(1000 + i)
        x = rng.random((ROWS, 4, 4, 3), dtype=np.float32)
        y = rng.integers(0, 5, size=(ROWS,)).astype("int64")
        w = rng.random(ROWS).astype("float32") + 0.5
        return x, y, w


def build():
    # (seeded initializers, not keras.utils.set_random_seed: that imports TensorFlow)
    dense = keras.layers.Dense(5, kernel_initializer=keras.initializers.GlorotUniform(seed=0))
    model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Flatten(), dense])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Recorder:
    """Keras's trainer calls `train_function(state, iterator)`, whose step takes
    `next(iterator)`: this keeps each batch taken (see the module's docstring)."""

    def __init__(self, model):
        import jax

        model.make_train_function()
        self._step = model.train_function
        self._jax = jax
        self.kept, self.iterators = [], set()
        model.train_function = self

    def __call__(self, state, iterator):
        self.iterators.add(type(iterator).__name__)
        return self._step(state, _Taking(iterator, self))

    def keep(self, batch):
        if len(self.kept) % 2:  # the trainer (or a user) keeps a JAX array, not the NumPy one
            self.kept.append(tuple(self._jax.device_put(a) for a in batch))
        else:
            self.kept.append(batch)


class _Taking:
    def __init__(self, iterator, recorder):
        self._iterator, self._recorder = iterator, recorder

    def __next__(self):
        batch = next(self._iterator)
        self._recorder.keep(batch)
        return batch


def _same(kept, expected):
    """Byte equality; a JAX array holds int64 as int32 unless x64 is on (JAX's canonical dtype)."""
    import jax

    dtype = jax.dtypes.canonicalize_dtype(expected.dtype) if isinstance(kept, jax.Array) else expected.dtype
    kept = np.asarray(kept)
    if kept.dtype != dtype:
        return False
    return kept.shape == expected.shape and kept.tobytes() == expected.astype(kept.dtype).tobytes()


def handover(record, arrays):
    import jax

    import kpipe
    from kpipe import _stream
    from kpipe._engine._shm import _LeasedBuffer

    plain = build()
    plain.fit(Distinct(), epochs=EPOCHS, shuffle=False, verbose=0)
    for i, w in enumerate(plain.get_weights()):
        arrays[f"plain/{i}"] = w

    model = build()
    recorder = Recorder(model)
    with kpipe.ProcessLoader(Distinct(), workers=2, max_queue_size=2) as loader:
        model.fit(loader, epochs=EPOCHS, shuffle=False, verbose=0)
        backend = _stream.source_of(loader).backend
        record["slots_held_while_kept"] = backend.slots_held()
        kept = recorder.kept
        record["iterators"] = sorted(recorder.iterators)
        record["taken"] = len(kept)
        first = kept[0][0]
        record["numpy_views_slot"] = isinstance(first, np.ndarray) and isinstance(first.base, _LeasedBuffer)
        odd = kept[1][0]
        record["jax_aliases_slot"] = bool(jax.default_backend() == "cpu" and isinstance(odd, jax.Array)
                                          and odd.unsafe_buffer_pointer() % 64 == 0)
        serial = Distinct()
        record["equal"] = [
            all(_same(a, b) for a, b in zip(batch, serial[step % BATCHES])) for step, batch in enumerate(kept)
        ]
        record["kinds"] = [type(batch[0]).__name__ for batch in kept[:2]]
        del kept, first, odd, recorder.kept
        gc.collect()
        record["slots_held_after_drop"] = backend.slots_held()
    record["tensorflow_imported"] = "tensorflow" in sys.modules
    for i, w in enumerate(model.get_weights()):
        arrays[f"kpipe/{i}"] = w


def torch_handover(record, arrays):
    """On KERAS_BACKEND=torch: the batches the torch trainer took (its train function gets
    `[batch]`), kept until fit() returns, against the dataset called serially; tensors over
    the slots (kpipe/_torch_feed.py)."""
    import torch

    import kpipe
    from kpipe import _stream

    plain = build()
    plain.fit(Distinct(), epochs=EPOCHS, shuffle=False, verbose=0)
    for i, w in enumerate(plain.get_weights()):
        arrays[f"plain/{i}"] = w
    model = build()
    model.make_train_function()
    step, kept = model.train_function, []

    def recording(data):
        kept.append(data[0])
        return step(data)

    model.train_function = recording
    with kpipe.ProcessLoader(Distinct(), workers=2, max_queue_size=2) as loader:
        model.fit(loader, epochs=EPOCHS, shuffle=False, verbose=0)
        backend = _stream.source_of(loader).backend
        record["slots_held_while_kept"] = backend.slots_held()
        record["taken"] = len(kept)
        record["kinds"] = sorted({type(leaf).__name__ for batch in kept for leaf in batch})
        serial = Distinct()
        record["equal"] = [
            all(t.dtype == torch.from_numpy(b).dtype and t.numpy().tobytes() == b.tobytes()
                for t, b in zip(batch, serial[step_i % BATCHES]))
            for step_i, batch in enumerate(kept)
        ]
        del kept[:]
        gc.collect()
        record["slots_held_after_drop"] = backend.slots_held()
    for i, w in enumerate(model.get_weights()):
        arrays[f"kpipe/{i}"] = w
    record["tensorflow_imported"] = "tensorflow" in sys.modules


def fork(record, arrays):
    import jax.numpy as jnp

    import kpipe
    from kpipe._engine._worker import jax_runtime_started

    record["runtime_before"] = jax_runtime_started()
    jnp.ones(3).block_until_ready()  # JAX's runtime (its XLA backends) now runs here
    record["runtime_after"] = jax_runtime_started()
    try:
        with kpipe.ProcessLoader(Distinct(), workers=1, start_method="fork", timeout=30) as loader:
            record["fork_batch0"] = bool(np.array_equal(loader[0][0], Distinct()[0][0]))
        record["fork_error"] = None
    except (ValueError, kpipe.LoaderError) as exc:
        record["fork_error"] = [type(exc).__name__, str(exc)]
    for method in ("forkserver", "spawn"):  # what the error says to use instead
        with kpipe.ProcessLoader(Distinct(), workers=1, start_method=method, timeout=60) as loader:
            record[f"{method}_batch0"] = bool(np.array_equal(loader[0][0], Distinct()[0][0]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=("handover", "fork", "torch_handover"), required=True)
    args = parser.parse_args()
    record, arrays = {"backend": keras.backend.backend()}, {}
    {"handover": handover, "fork": fork, "torch_handover": torch_handover}[args.phase](record, arrays)
    _outputs.write(os.path.join(args.out, args.phase), 0, record, arrays)


if __name__ == "__main__":
    main()
