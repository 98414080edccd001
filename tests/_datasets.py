"""Datasets for the loader tests. TensorFlow-free on purpose: spawned workers import this
module to unpickle them, and must not import TensorFlow on kpipe's account."""

import ctypes
import os
import signal
import sys
import threading
import time

import numpy as np


class Squares:
    """n batches; batch i holds x = i*10 + arange(b), y = x**2 (ragged last batch)."""

    def __init__(self, n=16, batch=4, last=None):
        self.n, self.batch, self.last = n, batch, last

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        b = self.last if (self.last and i == self.n - 1) else self.batch
        x = (i * 10 + np.arange(b)).astype("float32")
        return x[:, None], (x**2)[:, None]


def serial(ds, order=None):
    return [ds[i] for i in (order if order is not None else range(len(ds)))]


class Structured:
    """Dicts, nesting, bool and int leaves, sample weights, variable sizes."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        size = 8 + i  # image size varies between batches
        img = np.full((2, size, size, 1), i, dtype="uint8")
        return (
            {"image": img, "meta": [np.array([i, -i], dtype="int64"), np.array([True, i % 2 == 0])]},
            np.arange(2, dtype="float64") + i,
            np.ones(2, dtype="float32"),
        )


class Info:
    """Reports where it runs: worker id/seed, whether TF is imported, a random draw."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import kpipe

        info = kpipe.worker_info()
        return (
            np.array([i, info.id if info else -1, info.seed if info else -1, os.getpid()], dtype="int64"),
            np.array(["tensorflow" in sys.modules]),
            np.array([np.random.randint(1 << 30)], dtype="int64"),
        )


class Failing:
    """Batch `bad` fails in the way named by `how`."""

    def __init__(self, how, bad=3, n=8):
        self.how, self.bad, self.n = how, bad, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            if self.how == "raise":
                raise ValueError(f"cannot decode record {i}")
            if self.how == "keyerror":
                raise KeyError("missing-label")
            if self.how == "exit":
                sys.exit(3)
            if self.how == "os_exit":
                os._exit(3)
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "segfault":
                ctypes.string_at(0)
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "string":
                return np.array(["a", "b"]), np.zeros(2)
            if self.how == "structure":
                return np.zeros((2, 1)), np.zeros(2), np.zeros(2)
            if self.how == "dtype":  # (float64 would be cast to batch 0's float32, as Keras casts it)
                return np.zeros((2, 1), dtype="complex128"), np.zeros(2)
            if self.how == "rank":
                return np.zeros((2, 1, 1), dtype="float32"), np.zeros(2)
        return np.zeros((2, 1), dtype="float32") + i, np.zeros(2)


class Reshuffling:
    """Reorders its samples in on_epoch_end -- in place, in a big (shared) array."""

    def __init__(self, n=8, batch=4, big=True):
        size = (1 << 18) if big else 16  # 1 MiB of int32 when big: shared via memory
        self.order = np.arange(n * batch, dtype="int32")
        self.pad = np.zeros(size, dtype="int32")
        self.n, self.batch = n, batch
        self.epochs_seen = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.order[i * self.batch : (i + 1) * self.batch].copy(), np.array([self.epochs_seen, int(self.pad[0])])

    def on_epoch_end(self):
        self.epochs_seen += 1
        rng = np.random.default_rng(self.epochs_seen)
        rng.shuffle(self.order)  # in place
        self.pad[0] = self.epochs_seen


class BigArray:
    """Holds an 8 MiB array that must reach workers once, through shared memory."""

    def __init__(self):
        self.data = np.arange(1 << 21, dtype="float32")

    def __len__(self):
        return 4

    def __getitem__(self, i):
        chunk = self.data[i * 1000 : (i + 1) * 1000]
        return chunk.copy(), np.array([self.data.flags.writeable, float(self.data.sum())])


class MissingValues:
    """A 2 MiB float32 array holding NaNs (missing values) and zeros, shared with the
    workers; `on_epoch_end` counts passes and, at the first, flips the sign of the zero at
    `data[1]` in place (-0.0: equal to 0.0 by value, other bytes)."""

    def __init__(self):
        self.data = np.zeros(1 << 19, dtype="float32")
        self.data[::7] = np.nan
        self.epoch = 0

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.data[:4].copy(), np.array([self.epoch, i], "int64")

    def on_epoch_end(self):
        if self.epoch == 0:
            self.data[1] = -0.0
        self.epoch += 1


class Infinite:
    num_batches = None

    def __getitem__(self, i):
        return np.full((4, 2), i, "float32"), np.full((4,), i % 2, "int64")


class Locked:
    def __init__(self):
        self.lock = threading.Lock()

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.zeros(1)


class LazyH5:
    """Opens its HDF5 file lazily, once per process."""

    def __init__(self, path, batch=4):
        import h5py

        self.path, self.batch = path, batch
        with h5py.File(path, "r") as f:
            self.n = len(f["x"]) // batch
        self._h5 = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import h5py

        if self._h5 is None:
            self._h5 = h5py.File(self.path, "r")
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self._h5["x"][s], self._h5["y"][s]


class EagerH5(LazyH5):
    """Opens its file in __init__: sent to workers as its file name, reopened there."""

    def __init__(self, path, batch=4):
        import h5py

        super().__init__(path, batch)
        self.handle = h5py.File(path, "r")


class Regression:
    """A fixed linear-regression problem with optional sample weights."""

    def __init__(self, n=6, batch=16, weights=False, classes=False):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n * batch, 4)).astype("float32")
        w = np.array([1.0, -2.0, 0.5, 3.0], dtype="float32")
        self.y = (self.x @ w > 0).astype("int64") if classes else (self.x @ w)[:, None]
        self.w = rng.uniform(0.5, 2.0, size=n * batch).astype("float32")
        self.n, self.batch, self.weights = n, batch, weights

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        if self.weights:
            return self.x[s], self.y[s], self.w[s]
        return self.x[s], self.y[s]


class BreaksInWorkers:
    """Pickles fine, but cannot be restored in a worker."""

    def __init__(self):
        self.state = 1

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.zeros(1)

    def __setstate__(self, state):
        raise RuntimeError("cannot restore BreaksInWorkers here")


class InSlot:
    """Builds its batch with kpipe.empty: whole, sliced and strided views, plus a copy."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        import kpipe

        big = kpipe.empty((3, 1000), dtype="int32")
        big[...] = i
        big[1] += 1
        tail = kpipe.empty(5, dtype="float64")
        tail[:] = np.arange(5) * i
        return big, big[1], big[:, ::7], tail, np.full(3, i, "uint8")


class Stalls:
    """Batch i sleeps `stall_s` when i % every == 0; the others return at once."""

    def __init__(self, n=16, every=4, stall_s=0.3):
        self.n, self.every, self.stall_s = n, every, stall_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % self.every == 0:
            time.sleep(self.stall_s)
        return np.full((2, 3), i, dtype="float32")


class Sized:
    """`n` batches of `nbytes` each (uint8, every byte = the batch index)."""

    def __init__(self, n=4, nbytes=4 << 20):
        self.n, self.nbytes = n, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.nbytes, i % 256, dtype="uint8")


class MallocEnv:
    """Batch i: whether the process loading it runs with kpipe's glibc settings."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        from kpipe._engine._procs import WORKER_ENV

        return np.array([os.environ.get(k) == v for k, v in WORKER_ENV.items()])


class Versioned:
    """Batch i is `[version * 100 + i]`. With `gate` (a path), batch 0 first writes
    `gate + ".inside"` and then waits until `gate` exists (60 s at most): the test knows
    the loading process is inside `__getitem__` and decides when it may go on."""

    def __init__(self, version=0, gate=None, n=4):
        self.version, self.gate, self.n = version, gate, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.gate is not None and i == 0:
            with open(self.gate + ".inside", "w"):
                pass
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return np.array([self.version * 100 + i])


class Stacked:
    """Batch i of pass p: `np.stack` of `batch` samples of 64x64x3 float32 (1.5 MiB for 32)
    holding i + 100 p, and a report `[owndata, intact, kept]`: whether the stacked array
    owns its memory (False where kpipe placed it in a slot), whether every array kept from
    earlier calls still holds its values, how many are kept. `keep`: remember each batch
    index's first array (`"array"`), a view of it (`"view"`) or a `kpipe.empty` array
    (`"empty"`), as a cache would -- later passes write other values wherever memory is
    reused."""

    def __init__(self, n=6, batch=32, keep=None):
        self.n, self.batch, self.keep = n, batch, keep
        self.kept = {}
        self.epoch = 0

    def __len__(self):
        return self.n

    def on_epoch_end(self):
        self.epoch += 1

    def __getitem__(self, i):
        value = i + 100 * self.epoch
        x = np.stack([np.full((64, 64, 3), value, np.float32) for _ in range(self.batch)])
        intact = all(bool((a == v).all()) for a, v in self.kept.values())
        if self.keep and i not in self.kept:
            if self.keep == "array":
                self.kept[i] = (x, value)
            elif self.keep == "view":
                self.kept[i] = (x[1:, ::2], value)
            elif self.keep == "empty":
                import kpipe

                e = kpipe.empty(x.shape, x.dtype)
                e[...] = value
                self.kept[i] = (e, value)
        return x, np.array([x.flags.owndata, intact, len(self.kept)])
