"""`kpipe bench TARGET`: a dataset's loading throughput alone, by worker count.

TARGET names a factory that returns the dataset (anything `ProcessLoader` accepts):
`package.module:make_dataset` (importable) or `path/to/script.py:make_dataset` (loaded
from the file; its classes are sent to workers by value). A TARGET attribute that is
already a dataset (not callable) is used as it is.

For each worker count (processes, and with `--threads` threads too) the dataset runs
through a fresh `kpipe.ProcessLoader` for `--batches` batches, without a model: the figures
are what the loader can deliver, the ceiling of what `fit()` can consume. Reported per run:
batches/s and samples/s (steady state, after the first batch), MB/s of batch arrays,
first-batch latency (construction to first batch: worker start-up plus one batch), and the
peak resident memory of this process and all its children (sampled every 50 ms; shared
memory mapped by several processes is counted in each). The recommendation is the fewest
workers within 5% of the best samples/s.

    $ kpipe bench mypkg.data:train_dataset --workers 0,1,2,4 --batches 100
    $ kpipe bench train.py:make_dataset --threads --plot bench.png
    $ kpipe bench mypkg.data:train_dataset --json > bench.json
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import threading
import time

HELP = "measure a dataset's loader throughput by worker count"
_RSS_PERIOD_S = 0.05
_NEAR_BEST = 0.95


def add_arguments(parser):
    parser.description = ("Measure a dataset's loading throughput alone (no model) through "
                          "kpipe.ProcessLoader, by worker count, and recommend a count.")
    parser.epilog = ("TARGET: module:callable or path.py:callable returning the dataset, e.g. "
                     "mypkg.data:make_dataset or train.py:make_dataset.")
    parser.add_argument("target", metavar="TARGET", help="module:callable or path.py:callable returning a dataset")
    parser.add_argument("--workers", default="0,1,2,4,8", help="comma-separated worker counts. Defaults to 0,1,2,4,8.")
    parser.add_argument("--threads", action="store_true", help="also measure threads (use_threads=True) for each count > 0")
    parser.add_argument("--batches", type=int, default=50, help="batches loaded per run. Defaults to 50.")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one batch. Defaults to 120.")
    parser.add_argument("--plot", metavar="PNG", help="write a throughput-by-workers plot (needs matplotlib: pip install 'kpipe[plot]')")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of a table")


def run(args) -> int:
    try:
        counts = _parse_workers(args.workers)
        if args.batches < 2:
            raise ValueError(f"`--batches` must be >= 2 (one for latency, the rest for throughput). Received: --batches={args.batches}.")
        if args.plot:
            _require_matplotlib()
        from kpipe._cli import _quiet

        _quiet.quiet_tensorflow(getattr(args, "verbose", False))  # the target may import it
        factory = load_target(args.target)
    except (ValueError, ImportError) as exc:
        print(f"kpipe bench: error: {exc}", file=sys.stderr)
        return 2
    dataset = factory() if isinstance(factory, type) or (callable(factory) and not hasattr(factory, "__getitem__")) else factory
    if not hasattr(dataset, "__getitem__"):
        print(f"kpipe bench: error: {args.target} returned {type(dataset).__name__}, not a dataset: "
              "it must return an object with __getitem__ and __len__ (e.g. a keras.utils.PyDataset).", file=sys.stderr)
        return 2
    from kpipe import ProcessLoader  # noqa: F401 -- imports Keras now, not inside the first timed run

    dataset[0]  # warm-up, untimed: lazy imports and file opens of the dataset itself
    configs = [(w, False) for w in counts] + ([(w, True) for w in counts if w > 0] if args.threads else [])
    results = []
    with _workers_quiet(getattr(args, "verbose", False)) as stderr:
        progress = _Progress(len(configs), args.batches, stderr)
        for i, (workers, threads) in enumerate(configs):
            results.append(measure(dataset, workers, threads, args.batches, args.timeout, lambda n, i=i, w=workers, t=threads: progress.update(i, w, t, n)))
        progress.done()
    best = recommend(results)
    report = {"target": args.target, "batches": args.batches, "cpu_count": os.cpu_count(), "results": results, "recommended": best}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(results, best))
    if args.plot:
        plot(results, args.plot, args.target)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def load_target(target):
    """Returns the object TARGET names: `module:attr` or `path.py:attr` (dotted attrs ok).

    Raises:
        ValueError: if TARGET is malformed or names nothing.
        ImportError: if the module cannot be imported.
    """
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"TARGET must be module:callable or path.py:callable. Received: {target!r}. "
            "Example: kpipe bench mypkg.data:make_dataset"
        )
    if module_part.endswith(".py") or os.sep in module_part:
        module = _load_script(module_part)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: modules in the current directory
        module = importlib.import_module(module_part)
    obj = module
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise ValueError(f"{module_part!r} has no attribute {attr!r} (from TARGET={target!r}).")
        obj = getattr(obj, name)
    return obj


def _load_script(path):
    import cloudpickle

    if not os.path.isfile(path):
        raise ValueError(f"TARGET script {path!r} does not exist (relative to {os.getcwd()}).")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_kpipe_bench_{''.join(c if c.isalnum() else '_' for c in stem)}"
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # the script's own imports, as `python script.py` would
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # workers cannot import it by this name
    return module


def _parse_workers(text):
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = None
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"`--workers` must be comma-separated integers >= 0. Received: --workers={text}. Example: --workers 0,1,2,4")
    return sorted(set(counts))


def measure(dataset, workers, threads, batches, timeout, on_batch=None):
    """Loads `batches` batches through a fresh `ProcessLoader`; returns a dict of figures."""
    import kpipe

    sampler = _RssSampler()
    sampler.start()
    n_bytes = n_samples = 0
    try:
        t0 = time.perf_counter()
        with kpipe.ProcessLoader(dataset, workers=workers, use_threads=threads, timeout=timeout) as loader:
            n = loader.num_batches
            t_first = t_last = None
            for k in range(batches):
                if n is not None and k and k % n == 0:
                    loader.on_epoch_end()
                batch = loader[k % n if n else k]
                size, nbytes = _measure_batch(batch)
                del batch
                t_last = time.perf_counter()
                if k == 0:
                    t_first = t_last
                else:
                    n_samples += size
                    n_bytes += nbytes
                if on_batch:
                    on_batch(k + 1)
    finally:
        peak = sampler.stop()
    steady_s = max(t_last - t_first, 1e-9)
    return {
        "workers": workers,
        "mode": "threads" if threads else ("inline" if workers == 0 else "processes"),
        "batches_per_s": (batches - 1) / steady_s,
        "samples_per_s": n_samples / steady_s,
        "mb_per_s": n_bytes / steady_s / 1e6,
        "first_batch_s": t_first - t0,
        "peak_rss_mb": peak / 1e6,
    }


def _measure_batch(batch):
    """(samples, bytes) of a batch: leading dimension of the first array, total array bytes."""
    import numpy as np

    leaves, stack = [], [batch]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, (tuple, list)):
            stack.extend(reversed(node))
        elif node is not None:
            leaves.append(np.asarray(node))
    size = next((int(a.shape[0]) for a in leaves if a.ndim), 0)
    return size, sum(int(a.nbytes) for a in leaves)


def recommend(results):
    """The fewest workers (processes preferred) within 5% of the best samples/s."""
    best = max(r["samples_per_s"] for r in results)
    good = [r for r in results if r["samples_per_s"] >= _NEAR_BEST * best]
    pick = min(good, key=lambda r: (r["workers"], r["mode"] == "threads"))
    return {"workers": pick["workers"], "use_threads": pick["mode"] == "threads", "samples_per_s": pick["samples_per_s"]}


def format_table(results, best):
    base = next((r["samples_per_s"] for r in results if r["workers"] == 0), None)
    head = f"{'workers':>7} {'mode':<9} {'batches/s':>10} {'samples/s':>11} {'MB/s':>8} {'vs 0':>6} {'first batch':>12} {'peak RSS':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"{r['workers']:>7} {r['mode']:<9} {r['batches_per_s']:>10.1f} {r['samples_per_s']:>11.1f} {r['mb_per_s']:>8.1f} "
            f"{ratio:>6} {r['first_batch_s']:>11.2f}s {r['peak_rss_mb']:>8.0f}MB"
        )
    threads = ", use_threads=True" if best["use_threads"] else ""
    lines.append(f"recommended: kpipe.ProcessLoader(dataset, workers={best['workers']}{threads})  "
                 f"# {best['samples_per_s']:.0f} samples/s, within 5% of the best")
    return "\n".join(lines)


def plot(results, path, title):
    plt = _require_matplotlib()
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = [m for m in ("processes", "threads") if any(r["mode"] == m for r in results)] or ["inline"]
    for mode in modes:  # the inline run (workers=0) starts every line
        rows = sorted((r for r in results if r["mode"] in (mode, "inline")), key=lambda r: r["workers"])
        ax.plot([r["workers"] for r in rows], [r["samples_per_s"] for r in rows], marker="o" if mode != "threads" else "s", label=mode)
    ax.set_xticks(sorted({r["workers"] for r in results}))
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s")
    ax.set_title(f"kpipe bench {title}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("`--plot` needs matplotlib, which is not installed. Install it with: pip install 'kpipe[plot]' (or pip install matplotlib)") from None
    return plt


class _RssSampler:
    """Peak RSS (bytes) of this process plus its children, sampled on a daemon thread."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kpipe-bench-rss", daemon=True)
        self.peak = 0

    def _sample(self):
        psutil = self._psutil
        me = psutil.Process()
        total = 0
        for proc in [me] + me.children(recursive=True):
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self.peak = max(self.peak, total)

    def _loop(self):
        while not self._stop.wait(_RSS_PERIOD_S):
            self._sample()

    def start(self):
        self._sample()
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sample()
        return self.peak


@contextlib.contextmanager
def _workers_quiet(verbose):
    """Runs the block with TensorFlow's start-up log hidden from the workers' output too (a
    dataset whose own code imports TensorFlow makes each worker log it), as the other
    commands hide it; yields the real stderr, for the progress bar. `verbose`: no filter."""
    if verbose:
        yield sys.stderr
        return
    from kpipe._cli import _quiet

    try:
        sys.stderr.flush()
        real = os.fdopen(os.dup(2), "w")
    except (OSError, ValueError, AttributeError):  # (no fd 2 to route: nothing to hide)
        yield sys.stderr
        return
    with real, _quiet.filtered_stderr(_quiet.startup_noise_filter()):
        yield real


class _Progress:
    """A one-line progress bar on `stream` (a line per run when it is not a terminal)."""

    def __init__(self, runs, batches, stream=None):
        self.runs, self.batches = runs, batches
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, run, workers, threads, done):
        label = f"run {run + 1}/{self.runs}: workers={workers}{' threads' if threads else ''}"
        if self.tty:
            filled = int(30 * done / self.batches)
            self.stream.write(f"\r{label:<32} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.batches}")
            self.stream.flush()
        elif done == self.batches:
            print(f"{label}: {done} batches", file=self.stream, flush=True)

    def done(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kpipe bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
