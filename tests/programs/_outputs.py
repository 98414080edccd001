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
