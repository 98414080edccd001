#!/usr/bin/env python3
"""What one shared-memory slot costs the first time, against writing it once mapped.

A kpipe slot is a memfd that each process maps on its own. The kernel allocates (and
zeroes) its pages on the first write, and every further mapping fills its own page tables.
This prints, for a slot of `--mb` megabytes (default 77: one 128x224x224x3 float32 batch,
the loader benchmark's workload b), the median of `--repeats` rounds of:

  create + populate   a new slot made writable as the first worker to write it does:
                      its pages allocated in one fallocate, then mapped writable in
                      one call (MADV_POPULATE_WRITE)
  ... no fallocate    the same with the pages allocated while populating (kpipe before
                      it used fallocate)
  2nd mapping         the same pages populated through a second mapping, as another
                      worker that writes the slot later does: for reading
                      (MADV_POPULATE_READ, 16 pages per fault; the pages of a shared
                      mapping are writable either way)
  ... for writing     the same through a third mapping with MADV_POPULATE_WRITE (one
                      page per fault; what kpipe did before)
  read, page by page  a third mapping read one value per 4 KiB page, as a consumer
                      that touches the whole batch does
  full write          writing every byte through a mapping that is already populated:
                      the cost that recurs for every batch

Separate mappings in one process stand in for separate processes: page tables are per
mapping range either way.

    python scripts/bench_shm.py
    python scripts/bench_shm.py --mb 9.6 --repeats 9
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kpipe._engine import _shm  # noqa: E402
from kpipe._engine._shm import _MADV_POPULATE_WRITE, Segment  # noqa: E402

_ROWS = ("create + populate", "... no fallocate", "2nd mapping", "... for writing", "read, page by page", "full write")


def _timed_reserve(segment, nbytes, **constants):
    """Seconds of `segment.reserve(nbytes)` with `_shm`'s `constants` set for its duration."""
    saved = {name: getattr(_shm, name) for name in constants}
    for name, value in constants.items():
        setattr(_shm, name, value)
    try:
        t = time.perf_counter()
        segment.reserve(nbytes)
        return time.perf_counter() - t
    finally:
        for name, value in saved.items():
            setattr(_shm, name, value)


def one_round(nbytes):
    """Seconds of each step of `_ROWS`, for one fresh slot."""
    out = []
    first = Segment.create(0)
    others = []
    try:
        out.append(_timed_reserve(first, nbytes))
        plain = Segment.create(0)
        others.append(plain)
        out.append(_timed_reserve(plain, nbytes, _fallocate=None))
        second = Segment(os.dup(first.fd))
        others.append(second)
        out.append(_timed_reserve(second, nbytes))
        writer = Segment(os.dup(first.fd))
        others.append(writer)
        out.append(_timed_reserve(writer, nbytes, _MADV_POPULATE_READ=_shm._MADV_POPULATE_WRITE))
        third = Segment(os.dup(first.fd))
        others.append(third)
        third.map_all()
        t = time.perf_counter()
        third.mapping[:nbytes:4096].sum()
        out.append(time.perf_counter() - t)
        t = time.perf_counter()
        first.mapping[:nbytes] = 1
        out.append(time.perf_counter() - t)
    finally:
        for seg in [first] + others:
            seg.close()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=77.07, help="slot size in MB (10^6 bytes). Default: 77.07")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each with a new slot; medians are printed. Default: 5")
    parser.add_argument("--json", metavar="FILE", help="also write the raw medians (seconds, unrounded) to FILE")
    args = parser.parse_args(argv)
    if not args.mb > 0 or args.repeats < 1:
        parser.error(f"--mb must be > 0 and --repeats >= 1. Received: --mb {args.mb} --repeats {args.repeats}")
    nbytes = int(args.mb * 1e6)
    rounds = [one_round(nbytes) for _ in range(args.repeats)]
    medians = [statistics.median(r[i] for r in rounds) for i in range(len(_ROWS))]
    write = medians[-1]
    populate = "MADV_POPULATE_WRITE/_READ" if _MADV_POPULATE_WRITE is not None else "page faults (no MADV_POPULATE_WRITE)"
    print(f"One {args.mb:g} MB shared-memory slot, median of {args.repeats} rounds ({populate}):\n")
    print(f"{'step':<22}{'ms':>10}{'ms per MB':>11}{'x full write':>14}")
    for name, seconds in zip(_ROWS, medians):
        # 3 significant digits: a 2 MB write takes ~0.05 ms, which one decimal prints as 0.0
        print(f"{name:<22}{seconds * 1e3:>10.3g}{seconds * 1e3 / args.mb:>11.3g}{seconds / write:>14.3g}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"mb": args.mb, "repeats": args.repeats, "populate": populate,
                       "median_s": dict(zip(_ROWS, medians)), "rounds_s": [dict(zip(_ROWS, r)) for r in rounds]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
