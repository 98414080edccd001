"""Datasets and probes for the engine lifecycle tests (TensorFlow-free: workers import
this module to unpickle the datasets)."""

import os
import time

import numpy as np

import kpipe


class Replacing:
    """The canonical Keras `Sequence` pattern: `on_epoch_end` *replaces* its index array
    (`self.indexes = np.arange(n)` then an in-place shuffle). With n >= 131,072 int64 the
    array (>= 1 MiB) is shared with workers through shared memory."""

    def __init__(self, n=200_000, batches=4, batch=4):
        self.n, self.batches, self.batch = n, batches, batch
        self.epoch = 0
        self.indexes = np.arange(n)

    def __len__(self):
        return self.batches

    def __getitem__(self, i):
        return self.indexes[i * self.batch : (i + 1) * self.batch].copy(), np.array([self.epoch])

    def on_epoch_end(self):
        self.epoch += 1
        self.indexes = np.arange(self.n)
        np.random.default_rng(self.epoch).shuffle(self.indexes)


class Resizing:
    """Edits one shared array in place, and resizes another in place (same object, new size)."""

    def __init__(self):
        self.edited = np.zeros(1 << 18, dtype="int64")  # 2 MiB
        self.resized = np.zeros(1 << 18, dtype="int64")

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.array([self.edited[0], self.resized.size, self.resized[-1]])

    def on_epoch_end(self):
        self.edited[0] += 1
        self.resized.resize(self.resized.size + 1024, refcheck=False)
        self.resized[-1] = self.resized.size


class StuckWithBigState:
    """~8 MB of non-array state (pickled inline, not shared) and a batch that hangs."""

    def __init__(self, hang_at=1, state_mb=8):
        self.hang_at = hang_at
        self.blob = [bytes(1 << 20) for _ in range(state_mb)]  # not an ndarray: pickled
        self.epoch = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == self.hang_at and self.epoch == 0:
            time.sleep(3600)
        return np.full((2, 2), i, "float32"), np.zeros(2)

    def on_epoch_end(self):
        self.epoch += 1


class StuckLoadingState:
    """Its state after the first `on_epoch_end` hangs a worker that loads it (not this
    process, where it is made: `owner` is its pid)."""

    def __init__(self):
        self.owner, self.epoch = os.getpid(), 0

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.full((2, 2), i + 10 * self.epoch, "float32")

    def on_epoch_end(self):
        self.epoch += 1

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.epoch == 1 and os.getpid() != self.owner:
            time.sleep(3600)


class Empty:
    """Batches of 0 rows (copied, and made with `kpipe.empty`), and a normal one. With
    `mixed`, batch 2 also has non-empty leaves beside the empty ones (another structure)."""

    def __init__(self, mixed=False):
        self.mixed = mixed

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 0:
            return np.zeros((0, 3), "float32"), np.zeros((0,), "int64")
        if i == 1:
            return kpipe.empty((0, 3), "float32"), kpipe.empty(0, "int64")
        if i == 2 and self.mixed:
            return {"x": np.zeros((0, 5), "uint8"), "n": np.arange(3)}, kpipe.empty((0, 2), "float64")
        if i == 2:
            return kpipe.empty((0, 3), "float32"), np.zeros((0,), "int64")
        return np.ones((2, 3), "float32"), np.arange(2)


class Slow:
    """Batch `slow` takes `seconds`; with `gate` (a path), it waits until that file exists
    instead, for at most `seconds`: the test decides when the batch arrives."""

    def __init__(self, slow=1, seconds=2.0, gate=None):
        self.slow, self.seconds, self.gate = slow, seconds, gate

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == self.slow:
            if self.gate is None:
                time.sleep(self.seconds)
            else:
                deadline = time.monotonic() + self.seconds
                while not os.path.exists(self.gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
        return np.full((2,), i, "float32")


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def memfd_count(pid):
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:kpipe" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def array_mappings(pid):
    """Distinct shared dataset arrays mapped by process `pid`."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if "memfd:kpipe-array" in line})
