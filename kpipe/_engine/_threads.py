"""The thread budget of worker processes: how many threads each worker's native pools get.

`budget()` is the pure rule (the main process computes it); `env()` the variables a worker
starts with; `PoolLimiter` applies a budget inside a worker (threadpoolctl, OpenCV,
TensorFlow) and says what it set. Imports only the standard library at module level: a
worker imports threadpoolctl when it first applies a budget, and never imports OpenCV or
TensorFlow (it acts on them only when the dataset has already imported them).

NOTE [ Thread budget of worker processes ]
------------------------------------------
Native libraries size their thread pools for the whole machine: NumPy's OpenBLAS starts
one thread per CPU in every process that imports it, and so do MKL, OpenMP runtimes
(scikit-image, numba), OpenCV's own pool and TensorFlow's intra/inter-op pools. N workers
each running such a pool on C CPUs run N x C threads, and OpenBLAS threads spin while
they wait: 2 workers doing small matmuls on 2 cores ran 15x slower than 1 worker. So each
worker gets a budget of `max(1, floor(cpu_limit) // workers)` threads (the CPU limit of
`workers="auto"`: affinity mask and cgroup quota), or a fixed `worker_threads`, and when
`workers="auto"` changes the count every live worker gets the new budget. The consumer
process is never limited.

How a budget reaches each kind of worker (main -> worker messages: `_worker.py`):

    spawn       the worker's environment holds the variables of `env(n)` before its
                interpreter starts, so NumPy's OpenBLAS (imported by the worker module)
                and every library the dataset loads later start with n threads; after
                unpickling, `PoolLimiter.apply(n)` limits what still differs (threadpoolctl)
                and sets OpenCV/TensorFlow if the dataset imported them.
    forkserver  the fork server is spawned with `env(n)` and applies the budget to itself
                after unpickling and again before a fork when the budget changed
                (`("fork", ..., threads)`); a forked worker inherits it and changes
                nothing. OpenBLAS shuts its threads down before a fork (its
                `pthread_atfork` handler) and starts them again at the first BLAS call
                after it, with the count it had: a forked child starts with 1 thread and
                gets n - 1 more at its first matmul. Calling `openblas_set_num_threads`
                in a child before that starts the pool at once, at the *old* size, even
                when the count does not change -- hence "changes nothing" above. OpenBLAS
                never shrinks a pool: a worker forked after the budget was lowered starts
                as many threads as the server's pool ever had, the extra ones asleep.
    fork        the child of this process inherits the consumer's full-size pools and
                applies the budget in `init` (threadpoolctl; its OpenBLAS then holds idle,
                sleeping threads up to the consumer's pool size).
    any         `("threads", n)` (workers="auto" changed the count) re-applies it between
                tasks: lowering a pool leaves its extra threads asleep, raising it starts
                threads. After each message a worker checks whether modules were imported
                since it last applied the budget (`len(sys.modules)`, one call): the
                dataset may import OpenCV or TensorFlow lazily in `__getitem__`.

Each application is reported to the main process (`("threads", report)`), where
`ProcessLoader.stats()["worker_thread_pools"]` shows it. TensorFlow's pools can only be
sized before its runtime starts (`tf.config.threading` raises after): the report says so
when it is too late; `TF_NUM_INTRAOP_THREADS`/`TF_NUM_INTEROP_THREADS` cover a TensorFlow
imported later. Threads (`use_threads=True`) share the consumer's process and its pools:
no budget applies there, nor with `workers=0`.
"""

import math
import os
import sys

# Read by the libraries when they load (and by OpenBLAS, MKL, OpenMP runtimes at start-up).
ENV_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "OPENCV_FOR_THREADS_NUM",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
)


def budget(cpu_limit, workers, fixed=None):
    """Threads per worker: `fixed` if given, else `max(1, floor(cpu_limit) // workers)`.

    Args:
        cpu_limit: CPUs the loader's process may use (`_autoscale.cpu_limit()`).
        workers: Worker processes running (or about to).
        fixed: A budget chosen by the user. Defaults to None.

    Returns:
        An int >= 1.
    """
    if fixed is not None:
        return int(fixed)
    return max(1, int(math.floor(cpu_limit + 1e-9)) // max(1, int(workers)))


def check(worker_threads):
    """`worker_threads` validated: None or an int >= 1 (a clear error otherwise)."""
    if worker_threads is None:
        return None
    if isinstance(worker_threads, bool) or not isinstance(worker_threads, int) and not _is_numpy_int(worker_threads):
        raise TypeError(
            "`worker_threads` must be an integer or None. Received: "
            f"worker_threads={worker_threads!r} of type {type(worker_threads).__name__}. Use None for "
            "max(1, CPUs // workers) threads per worker, or e.g. worker_threads=1."
        )
    if worker_threads < 1:
        raise ValueError(
            f"`worker_threads` must be >= 1. Received: worker_threads={worker_threads}. It is the number "
            "of threads each worker's BLAS/OpenMP/OpenCV pools may use; use None for max(1, CPUs // workers)."
        )
    return int(worker_threads)


def _is_numpy_int(value):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.integer)


def env(threads):
    """The environment variables that give libraries loaded from now on `threads` threads."""
    return {name: str(int(threads)) for name in ENV_VARS}


class PoolLimiter:
    """Applies a thread budget to the pools of this (worker) process. Not thread-safe:
    used by the worker's main thread, between tasks."""

    def __init__(self):
        self.threads = None
        self.report = None
        self._modules_seen = -1

    def set_env(self, threads):
        """Sets the variables of `env(threads)` here (before the dataset is unpickled)."""
        os.environ.update(env(threads))

    def apply(self, threads):
        """Sets the environment and limits every pool loaded now to `threads`. Returns the
        report: `{"threads": n, "pools": [...], "not_limited": [...]}`."""
        self.threads = int(threads)
        self.set_env(self.threads)
        pools, problems = _limit_native(self.threads)
        for name, fn in (("opencv", _limit_opencv), ("tensorflow", _limit_tensorflow)):
            entry = fn(self.threads)
            if entry is None:
                continue
            if isinstance(entry, str):
                problems.append(entry)
            else:
                pools.append(entry)
        self._modules_seen = len(sys.modules)
        self.report = {"threads": self.threads, "pools": pools, "not_limited": problems}
        return self.report

    def refresh(self):
        """Applies the budget again if modules were imported since the last time (a dataset
        importing OpenCV in `__getitem__`, say). Returns the new report, or None."""
        if self.threads is None or len(sys.modules) == self._modules_seen:
            return None
        return self.apply(self.threads)


def preload():
    """Imports threadpoolctl (~15-20 ms) if it is there: a worker calls it while it waits
    for its target, so that applying the budget later costs only the libraries' calls."""
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        pass


def _limit_native(threads):
    """BLAS and OpenMP libraries through threadpoolctl: only those whose count differs (in
    a forked child, OpenBLAS starts its pool when told, even to the count it has).

    The budget is a ceiling: a library built for fewer threads than the budget (OpenCV
    4.x wheels bundle a single-threaded OpenBLAS 0.3.3 beside NumPy's) keeps its count,
    which cannot oversubscribe; its pool entry says so with `max_threads`. Only a pool
    left above the budget is `not_limited`."""
    try:
        import threadpoolctl
    except ImportError as exc:  # an install without kpipe's requirements
        return [], [f"BLAS/OpenMP: threadpoolctl is not importable ({exc}); only the environment variables are set"]
    problems = []
    try:
        controller = threadpoolctl.ThreadpoolController()
        stale = [i["filepath"] for i in controller.info() if i.get("num_threads") != threads]
        if stale:
            controller.select(filepath=stale).limit(limits=threads)
        infos = controller.info()  # read again: the counts are the libraries' own, now
    except Exception as exc:  # a library threadpoolctl cannot drive must not stop the worker
        return [], [f"BLAS/OpenMP: threadpoolctl failed: {type(exc).__name__}: {exc}"]
    pools = []
    for info in infos:
        pools.append({
            "library": info.get("internal_api"),
            "api": info.get("user_api"),
            "file": os.path.basename(info.get("filepath") or ""),
            "threads": info.get("num_threads"),
        })
        count = info.get("num_threads")
        if count is None or count > threads:  # above the budget: it oversubscribes the CPUs
            problems.append(f"{info.get('internal_api')} ({pools[-1]['file']}) stays at {count} threads")
        elif count < threads:  # a build with fewer threads (OpenCV 4.x bundles a 1-thread OpenBLAS)
            pools[-1]["max_threads"] = count
    return pools, problems


def _limit_opencv(threads):
    cv2 = sys.modules.get("cv2")
    if cv2 is None or not hasattr(cv2, "setNumThreads"):
        return None
    try:
        cv2.setNumThreads(threads)
        return {"library": "opencv", "api": "opencv", "file": "cv2", "threads": int(cv2.getNumThreads())}
    except Exception as exc:
        return f"opencv: cv2.setNumThreads failed: {type(exc).__name__}: {exc}"


def _limit_tensorflow(threads):
    tf = sys.modules.get("tensorflow")
    threading_api = getattr(getattr(tf, "config", None), "threading", None)
    if threading_api is None:
        return None
    try:
        for kind in ("intra", "inter"):
            getattr(threading_api, f"set_{kind}_op_parallelism_threads")(threads)
    except RuntimeError:
        intra = _quietly(threading_api.get_intra_op_parallelism_threads)
        return (
            f"tensorflow: its runtime started before the budget was applied (intra-op threads stay "
            f"{intra}, 0 meaning one per CPU); set tf.config.threading in the dataset before its first op"
        )
    except Exception as exc:
        return f"tensorflow: tf.config.threading failed: {type(exc).__name__}: {exc}"
    return {"library": "tensorflow", "api": "tensorflow", "file": "tf.config.threading",
            "threads": _quietly(threading_api.get_intra_op_parallelism_threads)}


def _quietly(fn):
    try:
        return fn()
    except Exception:
        return None
