"""What a pass end costs the consumer: `loader.on_epoch_end()` of a dataset without a hook,
whose state the loader compares with what its workers hold (edits between passes reach
them), by how much state the dataset holds.

Two kinds of state, each at several sizes: a list of file names (pickled, compared as
bytes) and NumPy arrays of 1 MiB or more (shared with the workers, compared by bytes a
chunk at a time). Prints the median `on_epoch_end()` time over `--passes` pass ends with
the loader running (its next pass loading meanwhile), and per MB of state.

    python scripts/bench_pass_end.py [--passes 15] [--workers 2]
"""

import argparse
import statistics
import time

import numpy as np

import kpipe


class Names:
    """A dataset of `n` file names (a list of str), batches of 8 names' hashes."""

    def __init__(self, n):
        self.names = [f"/data/train/images/{k:08d}.jpg" for k in range(n)]

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.array([hash(self.names[(i * 8 + r) % len(self.names)]) % 1000 for r in range(8)])


class InMemory:
    """A dataset holding `mb` MB of images in memory (a shared array)."""

    def __init__(self, mb):
        self.images = np.zeros((mb, 1 << 20), np.uint8)

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.images[i % len(self.images), :4096].copy()


def _state_mb(dataset):
    from kpipe._engine import _pickling

    payload, _ = _pickling.dumps(dataset, _pickling.SharedArrays())
    arrays = sum(v.nbytes for v in vars(dataset).values() if isinstance(v, np.ndarray))
    return len(payload) / 1e6, arrays / 1e6


def measure(dataset, passes, workers):
    times = []
    with kpipe.ProcessLoader(dataset, workers=workers) as loader:
        for _ in range(passes):
            for i in range(len(loader)):
                loader[i]
            t0 = time.perf_counter()
            loader.on_epoch_end()
            times.append(time.perf_counter() - t0)
        assert loader.stats()["passes"] == passes
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{'state':<28} {'pickled MB':>10} {'array MB':>9} {'pass end ms':>12} {'ms per MB':>10}")
    for name, dataset in [("names: 10,000", Names(10_000)), ("names: 100,000", Names(100_000)),
                          ("names: 1,000,000", Names(1_000_000)), ("arrays: 16 MB", InMemory(16)),
                          ("arrays: 256 MB", InMemory(256)), ("arrays: 1024 MB", InMemory(1024))]:
        pickled, arrays = _state_mb(dataset)
        ms = 1e3 * measure(dataset, args.passes, args.workers)
        print(f"{name:<28} {pickled:>10.2f} {arrays:>9.1f} {ms:>12.2f} {ms / max(pickled + arrays, 1e-9):>10.3f}",
              flush=True)


if __name__ == "__main__":
    main()
