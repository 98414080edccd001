"""Datasets of tests/test_ray_shrink.py (a module of their own: Ray actors import it by
name, as they import `_datasets`). Both give Squares' batches, so that plain Keras on
`Squares` is the reference."""

import time

import numpy as np

from _datasets import Squares


class SlowSquares(Squares):
    """Squares whose every batch waits `stall_s` (I/O-bound: `RayWorkers("auto")` adds
    actors while the consumer waits for them)."""

    def __init__(self, n=16, stall_s=0.1):
        super().__init__(n=n)
        self.stall_s = stall_s

    def __getitem__(self, i):
        time.sleep(self.stall_s)
        return super().__getitem__(i)


class Ballasted(Squares):
    """Squares holding `ballast_bytes` of data it never reads: its state (what each
    actor, and each replacement, is sent) weighs that much, so that a state or actor
    handle kept per lost actor shows in the driver's and the object store's memory."""

    def __init__(self, n=8, ballast_bytes=4 << 20):
        super().__init__(n=n)
        self.ballast = np.ones(ballast_bytes, dtype="uint8")
