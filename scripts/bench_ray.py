#!/usr/bin/env python3
"""The Ray backend against kpipe's shared-memory process workers, side by side in one run
(issue #32): `ProcessLoader(dataset, workers=2)` vs `workers=kpipe.RayWorkers(...)`.

Rows (samples/s over whole epochs after one untimed epoch, best of `--rounds`, taken in
rounds; every batch received and one value per 4 KiB page read, as scripts/bench_loaders.py
does):

  b        workload (b) of bench_loaders (224x224x3 HDF5 images, one read per sample,
           float32, 77 MB batches) on one node: 2 process workers vs 2 Ray actors on this
           node. Actors on the trainer's node write each batch into a shared-memory slot
           of their own, as process workers do, and only its place travels through Ray;
           the third arm turns that off after construction (`slots_reachable = False`,
           what kpipe does where /proc/<pid>/fd cannot be opened), so batches come
           through Ray's object store (a copy into it in the actor, read without a copy
           here): where the rest of the gap goes.
  c        5 ms of waiting per sample (I/O), batch 32: 2 local process workers vs 16 Ray
           actors spread over 2 Ray nodes simulated on this machine
           (`ray.cluster_utils.Cluster`, 8 CPUs' worth of actors each). Waiting costs no
           CPU, so simulated nodes show the scaling honestly; the target is 0.9 x 8 x the
           2 local workers.
  blas     "more actors never slower" (issue #30's rule, for actors): the BLAS workload of
           bench_loaders (a 160x160 float32 matrix through six `tanh(a @ a.T)` per batch;
           NumPy's BLAS pool in each actor) at every count of `--counts` (default
           1,2,4,8,16) and at count="auto", process workers and Ray actors on this node
           side by side. Each actor reserves num_cpus = 2/max(counts) (so that every
           count fits on this node's 2 CPUs; a real node places num_cpus=1 actors up to its
           cores) and limits its pools to 1 thread; process workers share the host's
           CPUs among themselves. Printed as a grid with multiples of count=1 of the same
           backend, and issue #30's targets for the actors.
  fit      `model.fit()` on 1.5 MB batches (128 x 64 x 64 x 3 uint8) and a near-free
           model: steps/s of the best epoch, 2 process workers vs 2 Ray actors.
  shrink   a node lost at full capacity and added back (issue #44): 4 Ray actors on two
           "spot" nodes of 2 CPUs (every CPU held), batches of 16 x 5 ms of waiting (no
           CPU: simulated nodes show the rates honestly); steps/s read in plan order,
           pass after pass. One node SIGKILLed (`remove_node(allow_graceful=False)`)
           mid-pass: the longest wait for a batch after it (the dip: until a call to a
           lost actor fails; --quick shortens Ray's health checks), the time lost
           against the steady rate (batches after the loss), the dip's length (from
           the loss until every 8 batches in a row come at >= 0.9x the rate on the
           actors left), the steady rate on the 2
           actors left against a loader that had only 2 actors from the start (target
           >= 0.9x), and the rate once a node was added back and the 2 replacements
           waiting were placed there, against the rate before the loss.

    python scripts/bench_ray.py                      # all rows
    python scripts/bench_ray.py --rows c --json ray.json
    python scripts/bench_ray.py --rows blas --counts 1,2,4,8,16
    python scripts/bench_ray.py --quick              # a smoke test, not a measurement
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench  # noqa: E402
import bench_loaders  # noqa: E402

import kpipe  # noqa: E402

_ROWS = ("b", "c", "blas", "fit", "shrink")
_FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}


def rate(loader, epochs):
    """Samples/s of `epochs` whole passes after one untimed pass (every page read)."""
    counts = [0, 0, None, 0]
    bench_loaders.consume((loader[i] for i in range(len(loader))), counts)
    loader.on_epoch_end()
    counts[:] = [0, 0, None, 0]
    t0 = time.perf_counter()
    for _ in range(epochs):
        bench_loaders.consume((loader[i] for i in range(len(loader))), counts)
        loader.on_epoch_end()
    return counts[1] / (time.perf_counter() - t0)


class Images:
    """(fit) 1.5 MB uint8 batches held in memory, 16 distinct, served round-robin."""

    def __init__(self, steps, batch=128):
        rng = np.random.default_rng(0)
        self.x = rng.integers(0, 256, size=(16, batch, 64, 64, 3), dtype=np.uint8)
        self.y = rng.integers(0, 10, size=(16, batch)).astype("int64")
        self.steps = steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        return self.x[i % 16], self.y[i % 16]


def fit_rate(make_loader, steps, epochs):
    import keras

    model = keras.Sequential([keras.Input((64, 64, 3), dtype="uint8"), keras.layers.Cropping2D(30),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rates = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            rates.append(steps / (time.perf_counter() - self.t0))

    with make_loader() as loader:
        model.fit(loader, epochs=1 + epochs, verbose=0, callbacks=[Timer()])
    return max(rates[1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(_ROWS), help=f"comma-separated subset of {','.join(_ROWS)}. Default: all")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every arm, in rounds; the best counts. Default: 2")
    parser.add_argument("--counts", default="1,2,4,8,16", help="worker/actor counts of the blas row (and 'auto'). Default: 1,2,4,8,16")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke test, not a measurement)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    rows = _bench.parse_names(parser, "--rows", args.rows, _ROWS)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1. Received: {args.rounds}")
    rounds = 1 if args.quick else args.rounds
    counts = [1, 2] if args.quick else _bench.parse_counts(parser, "--counts", args.counts)
    import ray
    from ray.cluster_utils import Cluster

    # the head node is this process's (its object store is read without a copy here); "head"
    # pins actors to it, "io" to the two other nodes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 2},
                                                            **({"_system_config": _FAST_HEALTH} if args.quick else {})})
    nodes = [cluster.add_node(num_cpus=8, resources={"io": 8}) for _ in range(2)] if "c" in rows else []
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    results, tmpdir = [], tempfile.mkdtemp(prefix="kpipe-bench-ray-")
    try:
        if "b" in rows:
            path = bench_loaders.make_h5(os.path.join(tmpdir, "images.h5"), 40 if args.quick else 300)
            arms = {"process workers=2": lambda: kpipe.ProcessLoader(bench_loaders.H5Samples(path), workers=2),
                    "ray actors=2 (this node)": lambda: kpipe.ProcessLoader(
                        bench_loaders.H5Samples(path), workers=kpipe.RayWorkers(2, resources={"head": 1})),
                    "ray actors=2 (object store)": lambda: _object_store(kpipe.ProcessLoader(
                        bench_loaders.H5Samples(path), workers=kpipe.RayWorkers(2, resources={"head": 1})))}
            results += _compare("b", arms, 1 if args.quick else 3, rounds)
        if "c" in rows:
            n = 8 if args.quick else 48
            arms = {"process workers=2": lambda: kpipe.ProcessLoader(bench_loaders.Waits(n=n), workers=2),
                    "ray actors=16 (2 nodes)": lambda: kpipe.ProcessLoader(
                        bench_loaders.Waits(n=n), workers=kpipe.RayWorkers(16, num_cpus=1, resources={"io": 1}))}
            results += _compare("c", arms, 1 if args.quick else 3, rounds)
        if "blas" in rows:
            n, share = 8 if args.quick else 60, 2 / max(counts)
            for count in counts + ["auto"]:
                spec = kpipe.RayWorkers(count, num_cpus=share, resources={"head": share})
                arms = {f"process workers={count}": lambda count=count: kpipe.ProcessLoader(bench_loaders.Blas(n=n), workers=count),
                        f"ray actors={count}": lambda spec=spec: kpipe.ProcessLoader(bench_loaders.Blas(n=n), workers=spec)}
                results += _compare(f"blas@{count}", arms, 1 if args.quick else 10, rounds)
        if "fit" in rows:
            steps = 8 if args.quick else 64
            arms = {"process workers=2": lambda: kpipe.ProcessLoader(Images(steps), workers=2),
                    "ray actors=2 (this node)": lambda: kpipe.ProcessLoader(Images(steps), workers=kpipe.RayWorkers(2, num_cpus=0.5, resources={"head": 1}))}
            for _ in range(rounds):
                for arm, make in arms.items():
                    results.append({"row": "fit", "arm": arm, "rate": fit_rate(make, steps, 1 if args.quick else 3), "unit": "steps/s"})
                    print(f"  fit: {arm:<26} {results[-1]['rate']:10.1f} steps/s", flush=True)
        shrunk = shrink(cluster, args.quick) if "shrink" in rows else None
    finally:
        ray.shutdown()
        cluster.shutdown()
        for name in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, name))
        os.rmdir(tmpdir)
    table = _summary(results)
    print()
    columns = [("row", "<6", ""), ("arm", "<28", ""), ("best", ">12", ".1f"), ("unit", ">11", ""), ("x process", ">11", ".2f")]
    main_rows = [[r[title] for title, _, _ in columns] for r in table if not r["row"].startswith("blas@")]
    if main_rows:
        _bench.print_table(columns, main_rows)
    _print_blas(table)
    checks = _checks(table)
    if shrunk is not None:
        _print_shrink(shrunk)
        checks += [("(shrink) steps/s on the 2 actors left after a node loss >= 0.9x 2 actors from the start",
                    shrunk["left"] / shrunk["only_left"], 0.9),
                    ("(shrink) steps/s once the node is back >= 0.9x before the loss", shrunk["back"] / shrunk["before"], 0.9)]
    print("\nTargets:")
    bench_loaders.print_checks(checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "table": table, "checks": checks, "nodes": [n.node_id for n in nodes],
                       "shrink": shrunk}, f, indent=2)
    return 0


def shrink(cluster, quick):
    """The shrink row (see the module's docstring): steps/s through a node loss and return."""
    spot = {"spot": 1}
    nodes = [cluster.add_node(num_cpus=2, resources={"spot": 2}) for _ in range(2)]
    n, steady = (16, 24) if quick else (32, 96)  # batches a pass; batches a steady rate is taken over
    data = lambda: bench_loaders.Waits(n=n, batch=16)  # noqa: E731
    out = {"method": f"batches read in plan order, {n} a pass; rates: batches/s over {steady} batches"}
    try:
        with kpipe.ProcessLoader(data(), workers=kpipe.RayWorkers(2, resources=spot), max_queue_size=8) as loader:
            out["only_left"] = _rate(_Reader(loader), steady, warm=n)
        with kpipe.ProcessLoader(data(), workers=kpipe.RayWorkers(4, resources=spot), max_queue_size=8) as loader:
            reader, backend = _Reader(loader), kpipe._stream.source_of(loader).backend
            out["before"] = _rate(reader, steady, warm=n)
            victim = next(node for node in nodes if node.node_id == backend.nodes()[0])
            t_loss = time.perf_counter()
            cluster.remove_node(victim, allow_graceful=False)  # 2 actors lost; no room for their replacements
            nodes.remove(victim)
            times = [reader.next() for _ in range(steady)]
            out["longest_wait_s"] = max(b - a for a, b in zip([t_loss] + times, times))
            out["left"] = _rate(reader, steady)
            out["lost_s"] = (times[-1] - t_loss) - steady / out["left"]  # against the steady rate on the 2 left
            out["dip_s"] = _dip(t_loss, times, out["left"])
            t_back = time.perf_counter()
            nodes.append(cluster.add_node(num_cpus=2, resources={"spot": 2}))  # (`ray start` again)
            while sum(a["state"] == "live" for a in backend.actors()) < 4:  # (read on: the loader takes them in)
                reader.next()
                if time.perf_counter() - t_back > 300:
                    raise RuntimeError(f"the replacements were not placed within 300 s: {backend.actors()}")
            out["placed_after_s"] = time.perf_counter() - t_back
            out["back"] = _rate(reader, steady, warm=n)
    finally:
        for node in nodes:
            cluster.remove_node(node)
    for key in ("only_left", "before", "left", "back"):
        print(f"  shrink: {key:<10} {out[key]:8.1f} steps/s", flush=True)
    return out


class _Reader:
    """Reads a loader's batches in plan order, pass after pass; `next()` returns the time
    each arrived."""

    def __init__(self, loader):
        self.loader, self.i = loader, 0

    def next(self):
        bench_loaders.consume([self.loader[self.i]], [0, 0, None, 0])
        self.i += 1
        if self.i == len(self.loader):
            self.i = 0
            self.loader.on_epoch_end()
        return time.perf_counter()


def _rate(reader, count, warm=0):
    for _ in range(warm):
        reader.next()
    t0 = time.perf_counter()
    for _ in range(count):
        t = reader.next()
    return count / (t - t0)


def _dip(t_loss, times, steady, span=8):
    """The dip's length: seconds from the loss until the rate over every `span` batches
    from then on is at least 0.9x `steady` (the rate on the actors left) -- batches loaded
    ahead before the loss come at once and then the stall follows, so the dip ends after
    the last slow window, not at the first quick one; the whole of `times` when the last
    window is still slow."""
    starts = [t_loss] + times[:-1]
    quick = [span / (times[k + span - 1] - starts[k]) >= 0.9 * steady for k in range(len(times) - span + 1)]
    k = len(quick)
    while k > 0 and quick[k - 1]:
        k -= 1
    return starts[k] - t_loss if k < len(quick) else times[-1] - t_loss


def _print_shrink(out):
    print(f"\nshrink: a node lost at full capacity ({out['method']})")
    print(f"  4 actors before the loss        {out['before']:8.1f} steps/s")
    print(f"  longest wait for a batch after   {out['longest_wait_s']:8.2f} s   (time lost against the steady rate: "
          f"{out['lost_s']:.2f} s)")
    print(f"  the dip's length                 {out['dip_s']:8.2f} s   (from the loss until every 8 batches in a row "
          "come at >= 0.9x the rate on the 2 left)")
    print(f"  2 actors left                    {out['left']:8.1f} steps/s   ({out['left'] / out['only_left']:.2f}x 2 actors "
          f"from the start: {out['only_left']:.1f})")
    print(f"  node back (placed after {out['placed_after_s']:5.1f} s) {out['back']:8.1f} steps/s   "
          f"({out['back'] / out['before']:.2f}x before the loss)")


def _object_store(loader):
    """The loader's actors hand batches over through Ray's object store from now on."""
    kpipe._stream.source_of(loader).backend.slots_reachable = False
    return loader


def _compare(row, arms, epochs, rounds):
    out = []
    for _ in range(rounds):
        for arm, make in arms.items():
            with make() as loader:
                value = rate(loader, epochs)
                extra = {}
                backend = getattr(kpipe._stream.source_of(loader), "backend", None)
                if hasattr(backend, "nodes"):
                    extra["actor_nodes"] = sorted(set(backend.nodes()))
            out.append({"row": row, "arm": arm, "rate": value, "unit": "samples/s", **extra})
            print(f"  {row}: {arm:<26} {value:10.1f} samples/s" + (f"  (actors on {len(extra['actor_nodes'])} nodes)" if extra else ""),
                  flush=True)
    return out


def _summary(results):
    table = []
    for row in dict.fromkeys(r["row"] for r in results):
        runs = [r for r in results if r["row"] == row]
        base = max(r["rate"] for r in runs if r["arm"].startswith("process"))
        for arm in dict.fromkeys(r["arm"] for r in runs):
            best = max(r["rate"] for r in runs if r["arm"] == arm)
            table.append({"row": row, "arm": arm, "best": best, "unit": runs[0]["unit"], "x process": best / base})
    return table


def _print_blas(table):
    """The blas row as a grid: samples/s by count, with multiples of count=1 of the same backend."""
    blas = [r for r in table if r["row"].startswith("blas@")]
    if not blas:
        return
    counts = list(dict.fromkeys(r["row"].split("@")[1] for r in blas))
    print("\nblas: samples/s by count (x count=1 of the same backend; ray x process at that count)")
    print(f"{'count':>6}  {'process workers':>24}  {'ray actors':>24}  {'ray x process':>13}")
    for c in counts:
        cells, rates = [], {}
        for backend in ("process", "ray"):
            r = next(r for r in blas if r["row"] == f"blas@{c}" and r["arm"].startswith(backend))
            one = next((o["best"] for o in blas if o["row"] == "blas@1" and o["arm"].startswith(backend)), None)
            rates[backend] = r["best"]
            cells.append(f"{r['best']:10.1f}" + (f" ({r['best'] / one:4.2f}x)" if one else ""))
        print(f"{c:>6}  {cells[0]:>24}  {cells[1]:>24}  {rates['ray'] / rates['process']:13.2f}")


def _checks(table):
    def x(row, prefix):
        return next((r["x process"] for r in table if r["row"] == row and r["arm"].startswith(prefix)), None)

    checks = []
    if x("b", "ray") is not None:
        checks.append(("(b) Ray actors on the same node >= 0.8x the shared-memory process workers", x("b", "ray"), 0.8))
    if x("c", "ray") is not None:
        checks.append(("(c) 16 Ray actors on 2 nodes >= 0.9 x 8 x 2 local workers", x("c", "ray") / 8, 0.9))
    rates = {r["row"].split("@")[1]: r["best"] for r in table if r["row"].startswith("blas@") and r["arm"].startswith("ray")}
    checks += bench_loaders.blas_checks({c if c == "auto" else int(c): rate for c, rate in rates.items()}, who="ray actors")
    if x("fit", "ray") is not None:
        checks.append(("(fit) steps/s from Ray actors >= 0.8x from process workers", x("fit", "ray"), 0.8))
    return checks


if __name__ == "__main__":
    sys.exit(main())
