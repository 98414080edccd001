"""Datasets for the thread-budget tests: each batch reports, from inside its worker, what
the worker's native thread pools look like (TensorFlow-free: workers import this module)."""

import os

import numpy as np

from kpipe._engine import _threads

# Columns of a `Pools` batch: pid, threads of the process (/proc/self/task), the smallest
# and largest thread count threadpoolctl reports over the BLAS/OpenMP libraries loaded,
# how many such libraries, then each of `_threads.ENV_VARS` (-1 if unset).
COLUMNS = ("pid", "os_threads", "pool_min", "pool_max", "pools") + _threads.ENV_VARS


def blas_work(seed):
    """The issue's workload: six `tanh(a @ a.T)` on a 160x160 float32 matrix (OpenBLAS
    runs a multiply that size on all the threads it is allowed)."""
    a = np.random.default_rng(seed).random((160, 160), dtype=np.float32)
    for _ in range(6):
        a = np.tanh(a @ a.T / 160)
    return a


def pool_report():
    """One row of `COLUMNS` for this process."""
    from threadpoolctl import threadpool_info

    counts = [p["num_threads"] for p in threadpool_info()]
    env = [int(os.environ.get(name, -1)) for name in _threads.ENV_VARS]
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = -1
    return np.array([os.getpid(), tasks, min(counts, default=-1), max(counts, default=-1), len(counts)] + env,
                    dtype=np.int64)


def row(batch):
    return dict(zip(COLUMNS, (int(v) for v in batch)))


class Pools:
    """Each batch runs BLAS work, then reports the worker's pools (`COLUMNS`)."""

    def __init__(self, n=8):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        blas_work(i)
        return pool_report()


def pools_of(item):
    """For `ProcessMapper`: the same report, whatever the item."""
    blas_work(int(item[0]))
    return pool_report()


class LazyCv2:
    """Imports OpenCV in `__getitem__` only (after the budget was applied at start-up):
    returns pid and `cv2.getNumThreads()` after a blur that runs OpenCV's pool."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import cv2

        img = np.random.default_rng(i).random((256, 256), dtype=np.float32)
        cv2.GaussianBlur(img, (5, 5), 1.0)
        return np.array([os.getpid(), cv2.getNumThreads()], dtype=np.int64)
