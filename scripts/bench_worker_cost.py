#!/usr/bin/env python3
"""Where a loader worker's CPU goes, per batch (issue 47): the dataset's `__getitem__`, the
structure check (`_tree.flatten`), the copy into the slot (`Segment.write`, of it
`reserve`: growing, mapping and paging in the slot), the kept-memory check (`keep_apart`),
the control socket (`recv`, `send`, the wait for the next message), and page faults.

One worker (`workers=1`), read by a plain loop in this process (no model: the worker's
cost alone, beside a consumer that takes ~nothing). Rows, interleaved over `--rounds`:

  tiny             __getitem__ returns 4 ints and 128 labels: the fixed cost of a batch
  view             a view of an in-memory uint8 array (128 x 64 x 64 x 3, 1.5 MB, as in
                   scripts/bench_feed.py) and 128 labels: the worker copies it into the slot
  kpipe.empty      the same bytes written into a `kpipe.empty` array: no copy into the slot

Columns: the worker process's CPU per batch from /proc (user + system, an uninstrumented
run; least of the rounds), its minor page faults per batch, and a breakdown from a second,
instrumented run (CPU time of each part, `time.thread_time`, per batch; median of the
rounds); "rest" is the instrumented run's worker CPU (from /proc) less those parts: the
worker's loop, its wait for messages, timers and Python (median of the rounds); "copied
MB" the bytes copied into the slot per batch.
"copy alone" is `np.copyto` of the same 1.5 MB from an array into a shared-memory slot in
this process, in a loop (best of 9): what the copy costs without a loader around it.

    python scripts/bench_worker_cost.py                 # 400 batches x 3 epochs, 3 rounds
    python scripts/bench_worker_cost.py --small         # a smoke test, not a measurement
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kpipe  # noqa: E402

_MAIN = os.getpid()
_PARTS = ("getitem", "flatten", "copy", "reserve", "keep_apart", "recv", "send")


def _instrument(acc):
    """In a worker: wraps the parts of a batch's work with CPU-time counters in `acc`."""
    from multiprocessing import connection

    from kpipe._engine import _alloc, _shm, _tree

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] = acc.get(label, 0.0) + time.thread_time() - t0

        setattr(owner, name, timed)

    wrap(_tree, "flatten", "flatten")
    wrap(_shm.Segment, "write", "copy")  # (reserve is inside it)
    write = _shm.Segment.write

    def counted(self, leaves, layout):  # the bytes copied into slots
        acc["copied_bytes"] = acc.get("copied_bytes", 0) + sum(int(n) for _, n, _, _ in layout)
        return write(self, leaves, layout)

    _shm.Segment.write = counted
    wrap(_shm.Segment, "reserve", "reserve")
    wrap(_alloc.SlotAllocator, "keep_apart", "keep_apart")
    wrap(connection.Connection, "recv", "recv")
    wrap(connection.Connection, "send", "send")


class Batches:
    """`n` batches of `kind` (see the module's docstring); `profile`: a file the worker
    writes its counters to (those of every batch since the warm-up epoch) when it starts
    batch 0 of a later epoch."""

    def __init__(self, kind, n, x, profile=None):
        self.kind, self.n, self.x, self.profile = kind, n, x, profile
        self._acc, self._reset = None, False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.profile and os.getpid() != _MAIN and i == 0:
            if self._acc is None:
                self._acc = {}
                _instrument(self._acc)
            elif not self._reset:  # the warm-up epoch is done: count the measured ones only
                self._acc.clear()
                self._reset = True
            else:  # every batch before this one, complete
                with open(self.profile, "w") as f:
                    json.dump(self._acc, f)
        t0 = time.thread_time()
        if self.kind == "tiny":
            out = np.full(4, i), np.full(128, i)
        elif self.kind == "view":
            out = self.x[i % len(self.x)], np.full(128, i)
        else:
            batch = kpipe.empty(self.x.shape[1:], dtype=self.x.dtype)
            batch[...] = self.x[i % len(self.x)]
            out = batch, np.full(128, i)
        if self._acc is not None:
            self._acc["getitem"] = self._acc.get("getitem", 0.0) + time.thread_time() - t0
            self._acc["batches"] = self._acc.get("batches", 0) + 1
        return out


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _descendants(pid):
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
            except OSError:
                continue
    out, todo = [], list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def run(kind, x, n, epochs, profile=None):
    """Worker CPU ms and minor faults per batch over `epochs` epochs after a warm-up one;
    with `profile`, the worker's breakdown (ms per batch, every batch it loaded) instead of
    /proc figures."""
    with kpipe.ProcessLoader(Batches(kind, n, x, profile), workers=1) as loader:
        for _ in loader:  # warm-up: the worker started, its slots made
            pass
        procs = _descendants(os.getpid())
        before = {p: _stat(p) for p in procs}
        for _ in range(epochs):
            for _ in loader:
                pass
        if profile:
            loader[0]  # (the worker writes its counters of every batch before it)
        after = {p: _stat(p) for p in procs if os.path.exists(f"/proc/{p}")}
    batches = epochs * n
    cpu = sum(after[p][0] - before[p][0] for p in after)
    faults = sum(after[p][1] - before[p][1] for p in after)
    out = {"cpu_ms": 1e3 * cpu / batches, "minflt": faults / batches}
    if profile:
        with open(profile) as f:
            acc = json.load(f)
        per = max(1, acc.pop("batches", 0))
        out.update({k: 1e3 * acc.get(k, 0.0) / per for k in _PARTS}, copied_bytes=acc.get("copied_bytes", 0) / per)
    return out


def copy_alone(x):
    from kpipe._engine._shm import Segment

    seg = Segment.create(0)
    seg.reserve(x[0].nbytes)
    dst = np.ndarray(x.shape[1:], dtype=x.dtype, buffer=seg.mapping)
    best = float("inf")
    for _ in range(9):
        t0 = time.thread_time()
        for i in range(64):
            np.copyto(dst, x[i % len(x)])
        best = min(best, (time.thread_time() - t0) / 64)
    seg.close()
    return 1e3 * best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=400, help="batches per epoch. Default: 400")
    parser.add_argument("--epochs", type=int, default=3, help="epochs measured after a warm-up one. Default: 3")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every row. Default: 3")
    parser.add_argument("--small", action="store_true", help="tiny batches, few steps: a smoke test, not a measurement")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for name in ("batches", "epochs", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1. Received: {getattr(args, name)}")
    shape = (16, 16, 16, 3) if args.small else (128, 64, 64, 3)
    n, epochs, rounds = (8, 1, 1) if args.small else (args.batches, args.epochs, args.rounds)
    x = np.random.default_rng(0).integers(0, 256, size=(16,) + shape, dtype=np.uint8)
    rows = ("tiny", "view", "kpipe.empty")
    plain = {r: [] for r in rows}
    parts = {r: [] for r in rows}
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for row in rows:
                plain[row].append(run(row, x, n, epochs))
                parts[row].append(run(row, x, n, epochs, profile=os.path.join(tmp, "profile.json")))
    load.append(os.getloadavg())
    alone = copy_alone(x)
    results = []
    print(f"\nWorker cost per batch: 1 worker, {n} batches x {epochs} epochs (after a warm-up epoch), {rounds} "
          f"interleaved rounds; batch {x[0].nbytes / 1e6:.2f} MB; load {load[0][0]:.1f} -> {load[1][0]:.1f} "
          f"(1-min average; {len(os.sched_getaffinity(0))} CPUs)" + (" (--small: smoke test)" if args.small else ""))
    print("CPU ms per batch: worker process from /proc, least of the rounds; the parts (ms, thread CPU time) from an "
          "instrumented run, median of the rounds; 'copy' includes 'reserve'")
    head = f"{'batch':<12}{'worker CPU':>11}{'minflt':>8}" + "".join(f"{p:>11}" for p in _PARTS) + f"{'rest':>9}{'copied MB':>11}"
    print(head)
    for row in rows:
        best = min(plain[row], key=lambda r: r["cpu_ms"])
        median = {p: sorted(r[p] for r in parts[row])[len(parts[row]) // 2] for p in _PARTS + ("copied_bytes",)}
        rests = sorted(r["cpu_ms"] - sum(r[p] for p in _PARTS if p != "reserve") for r in parts[row])
        rest = rests[len(rests) // 2]
        results.append({"row": row, **best, "parts_ms": median, "rest_ms": rest})
        print(f"{row:<12}{best['cpu_ms']:>11.3f}{best['minflt']:>8.1f}" + "".join(f"{median[p]:>11.3f}" for p in _PARTS)
              + f"{rest:>9.3f}{median['copied_bytes'] / 1e6:>11.3f}")
    print(f"copy alone: np.copyto of one batch into a shared-memory slot, in a loop here: {alone:.3f} ms (best of 9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "copy_alone_ms": alone, "load": load, "argv": sys.argv[1:] if argv is None else argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
