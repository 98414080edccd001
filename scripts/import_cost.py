"""What `import kpipe` and loading batches cost on each Keras backend: import time, the
process's resident memory, and whether TensorFlow was imported (issue 47).

Each backend runs in a fresh interpreter with `KERAS_BACKEND` set (Keras picks its backend
at import): `import keras, kpipe`, then a `ProcessLoader` of a tiny PyDataset with one
worker reads its two batches (a batch of TensorFlow-presence flags from the worker). Method:
one whole run per backend, wall time of the imports (`time.perf_counter`), RSS from
/proc/self/status (VmRSS) after the imports and after loading; `--repeat N` takes the median.

    python scripts/import_cost.py                     # tensorflow, jax, torch (those installed)
    python scripts/import_cost.py --backends jax --repeat 3
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import keras, kpipe
import_s = time.perf_counter() - t0
import numpy as np

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")

class Flags(keras.utils.PyDataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return np.array([["tensorflow" in sys.modules]], dtype="float32")

rss_import = rss_mb()
tf_after_import = "tensorflow" in sys.modules
with kpipe.ProcessLoader(Flags(), workers=1) as loader:
    worker_tf = [bool(loader[i][0, 0]) for i in range(len(loader))]
print(json.dumps({"backend": keras.backend.backend(), "import_s": import_s, "rss_import_mb": rss_import,
                  "rss_loaded_mb": rss_mb(), "tf_after_import": tf_after_import,
                  "tf_after_loading": "tensorflow" in sys.modules, "tf_in_worker": any(worker_tf)}))
"""

_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def measure(backend, repeat=1, timeout=300):
    """Median figures of `repeat` fresh interpreters on `backend` (a dict)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    runs = []
    for _ in range(repeat):
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{backend}: the measuring interpreter failed:\n{proc.stderr[-2000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result = dict(runs[-1])
    for key in ("import_s", "rss_import_mb", "rss_loaded_mb"):
        result[key] = statistics.median(r[key] for r in runs)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch",
                        help="comma-separated Keras backends; those not installed are skipped")
    parser.add_argument("--repeat", type=int, default=1, help="fresh interpreters per backend (median)")
    args = parser.parse_args(argv)
    print("backend     import kpipe+keras   RSS after import   RSS after loading   TensorFlow imported (process / worker)")
    for backend in args.backends.split(","):
        module = _MODULES.get(backend)
        if module is None:
            parser.error(f"--backends: unknown backend {backend!r}; use tensorflow, jax or torch")
        if importlib.util.find_spec(module) is None:
            print(f"{backend:<11} skipped: {module} is not installed")
            continue
        r = measure(backend, args.repeat)
        print(f"{r['backend']:<11} {r['import_s']:>14.2f} s {r['rss_import_mb']:>15.0f} MB {r['rss_loaded_mb']:>16.0f} MB"
              f"   {'yes' if r['tf_after_loading'] else 'no'} / {'yes' if r['tf_in_worker'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
