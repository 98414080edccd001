"""Datasets with epoch hooks for the `epoch_end_ahead=True` tests (TensorFlow-free:
workers import this module)."""

import time

import numpy as np

EXTERNAL = {"scale": 1.0}  # what a callback might set between passes (main process only)


class Reshuffles:
    """on_epoch_end counts passes and reshuffles the sample order -- with its own
    generator, or with the process's global `numpy.random` (`global_rng=True`, the
    classic Keras Sequence). Each batch also draws from `numpy.random` (per-batch seeds)."""

    def __init__(self, n=10, per=4, global_rng=False, big=False, sleep_s=0.0):
        self.n, self.per, self.global_rng, self.sleep_s = n, per, global_rng, sleep_s
        self.epoch = 0
        self.order = np.arange(n * per)
        self.rng = np.random.default_rng(1)
        self.big = np.zeros(200_000) if big else None  # 1.6 MB: shared, not pickled

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        idx = self.order[i * self.per : (i + 1) * self.per]
        extra = float(self.big[0]) if self.big is not None else 0.0
        return np.concatenate([[self.epoch, i, np.random.randint(1 << 20), extra, self.scale()], idx]).astype(np.float64)

    def scale(self):
        return 1.0

    def on_epoch_end(self):
        self.epoch += 1
        if self.global_rng:
            np.random.shuffle(self.order)
        else:
            self.rng.shuffle(self.order)


class ReadsOutside(Reshuffles):
    """on_epoch_end also copies a value from outside the dataset (`EXTERNAL`)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._scale = EXTERNAL["scale"]

    def scale(self):
        return self._scale

    def on_epoch_end(self):
        super().on_epoch_end()
        self._scale = EXTERNAL["scale"]


class EditsInPlace(Reshuffles):
    """on_epoch_end edits its shared array in place."""

    def __init__(self, **kw):
        super().__init__(big=True, **kw)

    def on_epoch_end(self):
        super().on_epoch_end()
        self.big += 1


class ReplacesArray(Reshuffles):
    """on_epoch_end replaces its shared array with a new one."""

    def __init__(self, **kw):
        super().__init__(big=True, **kw)

    def on_epoch_end(self):
        super().on_epoch_end()
        self.big = self.big + 1


class Grows(Reshuffles):
    """A curriculum: every on_epoch_end adds a batch (the order covers 40 batches)."""

    def __init__(self, **kw):
        super().__init__(n=4, **kw)
        self.order = np.arange(40 * self.per)

    def on_epoch_end(self):
        super().on_epoch_end()
        self.n += 1


class FailsWhenTold(Reshuffles):
    """on_epoch_end raises while `EXTERNAL["fail"]` is set (after changing the epoch)."""

    def on_epoch_end(self):
        super().on_epoch_end()
        if EXTERNAL.get("fail"):
            raise RuntimeError("on_epoch_end failed as told")
