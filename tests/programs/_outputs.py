"""What a test program started once per worker leaves for its test: `worker{i}.json` (a
record of what it did) and `worker{i}.npz` (arrays: its final weights and the like), in
one folder. The programs write them with `write`; the tests read them with `read`."""

import json
import os

import numpy as np


def write(out_dir, worker_index, record, arrays):
    """Writes worker `worker_index`'s record (a JSON-serialisable dict) and arrays."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"worker{worker_index}")
    np.savez(stem + ".npz", **arrays)
    with open(stem + ".json", "w") as f:
        json.dump(record, f)


def read(out_dir, worker_index):
    """`(record, arrays)` worker `worker_index` wrote: `(None, None)` if it did not finish."""
    stem = os.path.join(str(out_dir), f"worker{worker_index}")
    if not os.path.exists(stem + ".json"):
        return None, None
    with open(stem + ".json") as f:
        record = json.load(f)
    with np.load(stem + ".npz") as f:
        arrays = {k: f[k] for k in f.files}
    return record, arrays


def leave(status):
    """Ends a job's worker once its results are written: runs the exit handlers (kpipe's
    removal of a worker's temporary save directory among them), then leaves without the
    interpreter's teardown of TensorFlow, in which a worker can hang once the other task
    is gone (a chief that trains its one-process reference after the job ends minutes
    after the workers on a loaded machine: worker 1 printed "done", then hung until the
    launch's 240 s timeout; tensorflow/tensorflow#58434 is that class of exit)."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_program(program, out, *args, backend="tensorflow", timeout=240, env=None):
    """Runs `tests/programs/<program>` in a fresh interpreter with `KERAS_BACKEND=backend`
    (Keras picks its backend at import) and this checkout's kpipe first on the path; fails
    the test with the program's stderr if it exits non-zero. Returns the finished process."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    full_env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
                    PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, os.path.join(here, program), "--out", str(out), *args],
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
