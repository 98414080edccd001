"""Datasets for the `workers="auto"` tests (TensorFlow-free: workers import this module)."""

import time

import numpy as np


class Sleeps:
    """I/O-bound: each batch waits `wait_s` (a remote read, say) and draws one random
    number (per-batch randomness must not depend on the worker count)."""

    def __init__(self, n=48, wait_s=0.05):
        self.n, self.wait_s, self.epoch = n, wait_s, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.wait_s)
        return np.array([i, self.epoch, np.random.randint(1 << 30)], dtype=np.int64)

    def on_epoch_end(self):
        self.epoch += 1


class Spins:
    """CPU-bound: each batch burns `cpu_s` of CPU time."""

    def __init__(self, n=48, cpu_s=0.02):
        self.n, self.cpu_s = n, cpu_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t0 = time.process_time()
        x = 0
        while time.process_time() - t0 < self.cpu_s:
            x += 1
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)
