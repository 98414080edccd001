"""Variable-length batches: `ProcessLoader.from_samples(padding=..., buckets=...)` against
the same padding done by bare processes into a reused buffer, tf.data's
`bucket_by_sequence_length`, and PyTorch's DataLoader with a `pad_sequence` collate (when
torch is importable; Grain likewise).

Workloads (also in scripts/bench_loaders.py's registry: `--workloads text,audio`, through
scripts/_workloads/text.py and audio.py):
    text   token ids of lognormal lengths around 128 (max 512), each sample made by a
           Python tokenizer (words split and looked up in a dict: its cost per sample)
    audio  float32 waveforms of 1-10 s (16 kHz; `--smoke`: 400 Hz, few samples)

Every row reads the same samples in a fresh shuffled order per epoch, bucketed by the same
boundaries (the PyTorch and Grain rows pad plain random batches: what their collate
functions do; Grain has no length buckets). Method:
`--epochs` passes per row, the first a warm-up (it includes starting the workers); the
rows' passes are interleaved (pass e of each row in turn), so the machine's load reaches
every row alike; the rate of each later pass is its samples / wall time, reported as
median and best; ratios are of medians measured in this run. Each measured pass follows
an unmeasured pass of the same row at once (`interleaved`'s lead-in; `--no-lead-in` to
leave it out): a loader whose workers go on preparing batches after its pass (Grain's
per-worker buffers) would otherwise start its next pass with them made, and do that work
during -- and in the CPU count of -- the next row's pass. Each peer runs at its best
setting here (`PEER_SETTINGS`). Padding waste = padded elements / real elements over
the pass. Run: `python scripts/bench_varlen.py [--smoke] [--workers 2] [--json out.json]`.

CPU per sample: each row's passes also report the CPU time of this process and its
children (workers) per sample, split main + workers. On a shared machine the wall clock
measures the share of the cores a row's processes and threads won (tf.data's many threads
win more of a crowded machine); CPU per sample is what the row's work cost, and moves
less with the load (it still rises ~20-40% on a crowded machine: caches, SMT).

Measured (issue 46's second session, `--epochs 4`, one run per `--workers` setting, passes
interleaved; the 2-core machine shared with four other sessions at load average 20-35, so
samples/s moved 3-10x between passes; torch/grain rows: see the issue's notes):

    --workers                       1       2       4
    text  kpipe/bare, samples/s    0.18x   0.60x   0.43x
          kpipe/bare, CPU/sample   0.57x   0.67x   0.68x   (an earlier run: 0.83x)
          kpipe/tf.data, CPU       3.50x   2.88x   3.12x
    audio kpipe/bare, samples/s    1.04x   0.91x   0.86x
          kpipe/bare, CPU/sample   1.02x   1.06x   1.14x
          kpipe/tf.data, samples/s 0.50x   0.85x   0.80x
          kpipe/tf.data, CPU       1.38x   1.34x   1.45x

On a quiet moment of the same machine (load average 0.5-1.4; `--workers 2 --epochs 3`,
torch 2.13 CPU and grain 0.2.18 installed), medians of samples/s:

            kpipe   bare    tf.data  torch   grain   kpipe/bare  kpipe/best peer
    text    23228   28241   2689     10872   13271   0.82x       1.75x (grain)
    audio    1609    1589    803       942    1110   1.01x       1.45x (grain)

The workers knob at quiet moments (load 0.5-2.5, `--epochs 3`, no torch/grain rows),
kpipe / bare by samples/s (by CPU per sample), kpipe / tf.data by samples/s:

    --workers          1              2              4
    text   / bare     0.82x (0.85x)  0.82x (0.80x)  0.76x (0.84x)
           / tf.data  4.45x          8.64x          6.45x
    audio  / bare     1.04x (1.06x)  1.01x (0.98x)  1.09x (1.17x)
           / tf.data  2.49x          2.00x          1.27x

and, passes interleaved in one process at load 0.4 (text, 2 workers): kpipe 26091 with
the default `max_queue_size` (4), 29516 with `max_queue_size=16`, bare 29194: with more
batches in flight the consumer's hand-over no longer stalls the workers, and text reaches
~1.0x bare.

Since then `from_samples` left at the default `max_queue_size` lets small batches go up to
16 in flight (`kpipe/_args.py`'s `small_batch_queue`). Issue 46's third session measured
it beside the old default with `--kpipe-queues 4` (medians of 4-5 passes, rows interleaved;
the 2-core machine shared, load average 3-7, so samples/s moved 2x between runs; kpipe /
bare by samples/s, old default in brackets):

    --workers                 1                2                         4
    text   kpipe / bare       0.55x (0.48x)    0.98x (0.82x), 1.01x      0.46x (0.46x)
                              0.79x (0.81x)*   (0.71x)                   1.13x (0.74x)*
    audio  kpipe / bare       0.65x (0.66x)    1.06x (0.80x), 0.73x      0.78x (0.64x)
                                               (0.70x)
    (* text rows only, `kpipe`/`bare` interleaved, load 3.2-4.9)
    end of the session, final code, load 5.0-5.8, `--epochs 5`:
    text   kpipe / bare       0.73x (0.68x)    0.76x (0.63x)             0.84x (0.72x)
           by CPU per sample  0.79x (0.79x)    0.93x (0.82x)             0.82x (0.78x)
    audio  kpipe / bare       0.48x (0.50x)    0.81x (0.60x)             0.80x (0.68x)
           by CPU per sample  0.98x (0.95x)    1.11x (0.96x)             1.19x (0.95x)

With one worker the depth changes nothing (the worker's CPU per sample bounds it: 46.7 us
kpipe vs 38.3 bare in the starred run -- kpipe's padding path ~1.5 us a sample more than a
hand loop, and the engine's per-task cost, ~130 us a batch in the worker and ~120 in the
consumer measured with a 1-sample batch). The run with torch and Grain (2 workers, load
4.8-7.0): text kpipe 17,814, bare 17,684, PyTorch 10,045, Grain 8,179 = 1.77x the best peer
(1.84x by CPU); audio kpipe 694, bare 954, Grain 1,303 by samples/s, but by CPU per sample
kpipe 1,054 us vs Grain 1,412 (1.34x) and tf.data 1,457: on a crowded machine the wall
clock measures the share of the cores each row's processes won. Where audio's CPU goes and
the cap the dataset sets: `scripts/bench_varlen_parts.py`.

Where kpipe's text CPU goes (per batch of 32, ~1.3 ms of the dataset's own tokenizing):
the padding write ~75 us (a hand-written loop ~35; ~100 before this session's change), the
engine's worker side ~0.2-0.3 ms per task (receive, allocate, lay out, send the
descriptor), the consumer's hand-over ~0.25 ms (window, submit, poll, views: ~30 Python
calls), and one pickle of the dataset per pass end (the state check), ~2-28 ms a pass.
Bare processes pay a queue put/get per batch only: small batches make the per-batch
hand-over the difference. On audio (8 waveforms of ~350 KB a batch) the dataset itself
costs ~935 us a sample serially, kpipe ~1160-1310 in all, tf.data ~1690-1800 (its
`numpy_function` copy into a tensor, the padded batch copy, its threads' spinning): even
with no overhead at all a loader doing the dataset's work would be at most ~1.8x tf.data
by CPU, and kpipe is at 1.34-1.45x.

Issue 46's fourth session: the padding write per batch of 32 text rows 82 -> ~35-46 us
(cached samples, serial; a hand-written loop 18-26): a padded array of <= 64 KiB is filled
with the pad in one call, then each row gets its values only; one read loop per batch.
Figures after it (`--workers 1/2/4 --epochs 4`, lead-in, load 2.2-4.3 during the runs;
samples/s, CPU us per sample in brackets; the table in docs/guides/variable-length.md):
    text   kpipe / bare   0.86x (0.87x)   0.91x (0.80x)   0.85x (0.84x)
           kpipe / best   1.58x (1.57x)   1.64x (1.45x)   1.73x (1.72x)
    audio  kpipe / bare   1.05x (1.07x)   1.07x (1.02x)   0.94x (1.00x)
           kpipe / best   1.47x (1.55x)   1.44x (1.40x)   1.31x (1.33x)
Where a text batch's worker CPU goes beyond the dataset's ~1.2 ms (instrumented worker,
1 worker, per batch of 32, load ~3): allocating its arrays in the slot ~28 us (two
kpipe.empty; one since), the padding's writes and checks ~30, laying the batch out and the
kept-memory check ~20, the two structure walks ~14, reseeding random and numpy.random ~17,
the run-queue clock ~11, the done message ~24 and the task message ~10: ~150 us, ~5 us a
sample, the gap to bare processes with the consumer's ~4.
and at a quiet moment (load 1.0-1.4, `bench_varlen_parts.py --workloads text --epochs 3`)
text at 2 workers: kpipe 37,473/s, bare processes 38,870/s (0.96x; 0.85x by CPU). Grain's
audio rate moved 616-1,286/s between runs minutes apart: on this machine samples/s ratios
between rows are within that noise; CPU per sample moves ~10%.
"""

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kpipe  # noqa: E402

WORDS = [f"w{k:x}" for k in range(4096)]
VOCAB = {w: k + 2 for k, w in enumerate(WORDS)}  # 0 pads, 1 is unknown


class Text:
    """Sample j: (token ids int32, label int32); its text is made from j's seed and
    tokenized in Python (split + dict lookup), the cost a tokenizer has per sample."""

    def __init__(self, n, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths = np.clip(rng.lognormal(np.log(128) - 0.18, 0.6, n).astype(np.int64), 1, 512)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, j):
        words = np.random.default_rng(j).integers(0, len(WORDS), self.lengths[j])
        text = " ".join([WORDS[k] for k in words])
        ids = np.fromiter((VOCAB.get(w, 1) for w in text.split()), np.int32, self.lengths[j])
        return ids, np.int32(j % 2)


class Audio:
    """Sample j: (a float32 waveform of 1-10 s at `rate` Hz, label int32)."""

    def __init__(self, n, rate, seed=0):
        self.rate = rate
        self.lengths = np.random.default_rng(seed).integers(rate, 10 * rate + 1, n)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, j):
        wave = np.random.default_rng(j).standard_normal(self.lengths[j], dtype=np.float32)
        wave *= 0.1
        return wave, np.int32(j % 2)


def workloads(smoke):
    rate = 400 if smoke else 16000
    n_text, n_audio = (240, 48) if smoke else (6000, 480)
    return {
        "text": dict(make=lambda: Text(n_text), batch=32, boundaries=[32, 64, 96, 128, 192, 256, 384]),
        "audio": dict(make=lambda: Audio(n_audio, rate), batch=8, boundaries=[r * rate for r in (2, 4, 6, 8)]),
    }


def _order(n, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n)


def cpu_seconds():
    """CPU seconds used so far by this process (all its threads) and by its live children
    (workers), as a pair: a pass's difference is what the pass cost the machine, whatever
    share of the cores a loaded machine gave it."""
    children = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # (exited meanwhile)
            continue
        children += times.user + times.system
    return np.array([time.process_time(), children])


def passes_for(epochs, lead_in=True):
    """Passes each row's generator must give for `interleaved(..., epochs, lead_in)`."""
    return 1 + (epochs - 1) * (2 if lead_in else 1)


def interleaved(runs, epochs, lead_in=True):
    """Runs the rows' passes in turn -- pass e of every row, then pass e + 1 -- so a change
    in the machine's load reaches every row alike. `runs`: {row: generator yielding
    `(samples, padded, real)` per pass, set up in its first; `passes_for(epochs, lead_in)`
    passes}. With `lead_in`, each measured pass of a row follows an unmeasured pass of the
    same row at once, as epochs follow each other in training: a loader whose workers go
    on preparing batches (Grain's per-worker buffers, a next pass started ahead) fill them
    after its own pass, while the next row runs -- so its next pass would start with those
    batches made and its workers' CPU counted in the other row's pass. The lead-in pass
    takes both: the measured pass finds the loader as the previous pass of its own left
    it. Returns {row: (rates of the measured passes (all but the first), padding waste, CPU
    microseconds per sample of those passes as (this process, its children) pairs)}."""
    rates, waste, cpu = {row: [] for row in runs}, {}, {row: [] for row in runs}
    try:
        for e in range(epochs):
            for row, run in runs.items():
                if e and lead_in:
                    next(run)
                cpu_start, start = cpu_seconds(), time.perf_counter()
                samples, padded, real = next(run)
                elapsed, used = time.perf_counter() - start, cpu_seconds() - cpu_start
                waste[row] = padded / max(real, 1)
                if e:
                    rates[row].append(samples / elapsed)
                    cpu[row].append((used / samples * 1e6).tolist())
    finally:
        for run in runs.values():
            run.close()
    return {row: (rates[row], waste[row], cpu[row]) for row in runs}


def run_kpipe(spec, workers, epochs, seed, max_queue_size=None):
    """kpipe's row: `from_samples` with buckets, at the default `max_queue_size` (None) or
    the one given (the `--kpipe-queues` rows)."""
    ds = spec["make"]()
    buckets = kpipe.Buckets(spec["boundaries"])
    with kpipe.ProcessLoader.from_samples(ds, spec["batch"], buckets=buckets, lengths=ds.lengths, shuffle=True, seed=seed,
                                          workers=workers, max_queue_size=max_queue_size) as loader:
        for _ in range(epochs):
            samples = padded = 0
            for i in range(len(loader)):
                x, y = loader[i]
                samples, padded = samples + len(y), padded + x.size
                float(x[0, 0])  # (read it, as a consumer would)
            yield samples, padded, int(ds.lengths.sum())


# ------------------------------------------------------------------ bare processes
def _bare_worker(ds, names, size, tasks, done):
    bufs = [shared_memory.SharedMemory(name) for name in names]
    for buf in bufs:  # (attaching registered them with the resource tracker as if this process made them:
        resource_tracker.unregister(buf._name, "shared_memory")  # it then warned of "leaked" ones the parent unlinks)
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            i, samples, slot = task
            rows = [ds[int(j)] for j in samples]
            longest = max(len(x) for x, _ in rows)
            x = np.ndarray((len(rows), longest), rows[0][0].dtype, buffer=bufs[slot].buf)
            y = np.ndarray((len(rows),), np.int32, buffer=bufs[slot].buf, offset=x.nbytes)
            for r, (row, label) in enumerate(rows):
                x[r, :len(row)] = row
                x[r, len(row):] = 0
                y[r] = label
            del x, y
            rows = None
            done.put((i, slot, longest))
    finally:
        for buf in bufs:
            buf.close()


def run_bare(spec, workers, epochs, seed, slots=2):
    """The same bucketed batches, padded by `workers` plain processes straight into
    reused shared-memory buffers (`slots` per worker), read in order by this process."""
    ds = spec["make"]()
    buckets = kpipe.Buckets(spec["boundaries"])
    size = spec["batch"] * int(ds.lengths.max()) * 4 + spec["batch"] * 4 + 64
    ctx = multiprocessing.get_context("forkserver")
    shms = [[shared_memory.SharedMemory(create=True, size=size) for _ in range(slots)] for _ in range(workers)]
    tasks, done = [ctx.Queue() for _ in range(workers)], [ctx.Queue() for _ in range(workers)]
    procs = [ctx.Process(target=_bare_worker, args=(ds, [s.name for s in shms[w]], size, tasks[w], done[w]), daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()
    try:
        for e in range(epochs):
            plan = buckets.plan(_order(len(ds), seed, e), ds.lengths, spec["batch"], False, None)
            for i in range(min(len(plan), workers * slots)):
                tasks[i % workers].put((i, plan[i][1], i // workers))
            samples = padded = 0
            for i in range(len(plan)):
                w = i % workers
                got, slot, longest = done[w].get(timeout=600)
                rows = len(plan[i][1])
                x = np.ndarray((rows, longest), np.float32 if isinstance(ds, Audio) else np.int32, buffer=shms[w][slot].buf)
                samples, padded = samples + rows, padded + x.size
                float(x[0, 0])  # (read it, as a consumer would)
                del x
                nxt = i + workers * slots
                if nxt < len(plan):
                    tasks[w].put((nxt, plan[nxt][1], slot))
            yield samples, padded, int(ds.lengths.sum())
    finally:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        for row in shms:
            for s in row:
                s.close()
                s.unlink()


# ------------------------------------------------------------------ peers
def run_tfdata(spec, workers, epochs, seed, parallel=None):
    """tf.data's row: `parallel` map calls (None: `workers`; "autotune": tf.data.AUTOTUNE)."""
    import tensorflow as tf

    ds = spec["make"]()
    dtype = tf.float32 if isinstance(ds, Audio) else tf.int32
    sizes = [spec["batch"]] * (len(spec["boundaries"]) + 1)

    def load(j):
        x, y = ds[int(j)]
        return x, y

    for e in range(epochs):
        source = tf.data.Dataset.from_tensor_slices(_order(len(ds), seed, e))
        calls = workers if parallel is None else tf.data.AUTOTUNE if parallel == "autotune" else parallel
        source = source.map(lambda j: tf.numpy_function(load, [j], (dtype, tf.int32)), num_parallel_calls=calls)
        source = source.map(lambda x, y: (tf.ensure_shape(x, [None]), tf.ensure_shape(y, [])))
        source = source.bucket_by_sequence_length(lambda x, y: tf.shape(x)[0], spec["boundaries"], sizes)
        samples = padded = 0
        for x, y in source.prefetch(tf.data.AUTOTUNE).as_numpy_iterator():
            samples, padded = samples + len(y), padded + x.size
        yield samples, padded, int(ds.lengths.sum())


def _torch_pad(batch):
    import torch
    from torch.nn.utils.rnn import pad_sequence

    return pad_sequence([torch.from_numpy(x) for x, _ in batch], batch_first=True), torch.tensor([y for _, y in batch])


def run_torch(spec, workers, epochs, seed, prefetch=2):
    import torch

    ds = spec["make"]()
    gen = torch.Generator()
    gen.manual_seed(seed)
    # (forkserver: TensorFlow is loaded in this process by the tf.data row, and a fork of it may hang)
    loader = torch.utils.data.DataLoader(ds, batch_size=spec["batch"], shuffle=True, num_workers=workers,
                                         collate_fn=_torch_pad, generator=gen, persistent_workers=True, prefetch_factor=prefetch,
                                         multiprocessing_context="forkserver")

    for _ in range(epochs):
        samples = padded = 0
        for x, y in loader:
            samples, padded = samples + len(y), padded + x.numel()
        yield samples, padded, int(ds.lengths.sum())


def _grain_pad(samples):
    """Grain's `batch_fn`: the batch's sequences padded with 0 to its longest, as a
    hand-written collate does (np.zeros, then each row copied), the labels, and the real
    lengths (for the padding waste: Grain's batches run across pass ends)."""
    longest = max(len(x) for x, _ in samples)
    x = np.zeros((len(samples), longest), samples[0][0].dtype)
    for r, (row, _) in enumerate(samples):
        x[r, :len(row)] = row
    return x, np.array([y for _, y in samples], np.int32), np.array([len(x) for x, _ in samples])


def run_grain(spec, workers, epochs, seed, buffer=4, threads=0):
    """Grain as its docs write a map-style pipeline: `MapDataset.source(ds).shuffle(seed)
    .repeat().to_iter_dataset().batch(B, batch_fn=pad).mp_prefetch(workers)`, plain
    shuffled batches padded to their longest (Grain has no length buckets); one iterator
    over endless passes, `len(ds) // B` batches taken per pass. `buffer`: each worker's
    `per_worker_buffer_size`; `threads`: `ReadOptions.num_threads` in each worker. The
    defaults are Grain's best here (`PEER_SETTINGS`)."""
    import grain

    ds = spec["make"]()
    source = grain.MapDataset.source(ds).shuffle(seed=seed).repeat()
    batched = source.to_iter_dataset(grain.ReadOptions(num_threads=threads)).batch(spec["batch"], batch_fn=_grain_pad)
    iterator = iter(batched.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer)))
    steps = len(ds) // spec["batch"]
    try:
        for _ in range(epochs):
            samples = padded = real = 0
            for _ in range(steps):
                x, y, lengths = next(iterator)
                samples, padded, real = samples + len(y), padded + x.size, real + int(lengths.sum())
            yield samples, padded, real
    finally:
        if hasattr(iterator, "close"):
            iterator.close()


PEER_SETTINGS = """Each peer at its best setting here, checked side by side (issue 46's fourth session,
2 workers, passes interleaved with lead-in unless said, load 4-8, one run per workload;
median samples/s, CPU us per sample):
    Grain per_worker_buffer_size 1 / 2 / 4 / 8 (num_threads=0): text 14018 / 12144 / 14906 /
        11617 (118 / 128 / 124 / 130 us); audio 718 / 752 / 782 / 777 (1735 / 1733 / 1689 /
        1737 us) -- 4 kept (it was 1; without lead-in, where a buffer's head start counts,
        audio gave 688 / - / 1420 / -); num_threads=16 (Grain's default) in each worker:
        text 3207/s (431 us), audio 822/s (2110 us): its threads contend for the GIL
    PyTorch prefetch_factor 2 / 4: text 11007 / 10991 (118 / 121 us), audio 575 / 423
        (1686 / 1625 us): 2 kept (PyTorch's default)
    tf.data num_parallel_calls=workers / AUTOTUNE: text 4734 / 4458 (191 / 248 us); audio,
        without lead-in, 833 / 728 (1433 / 1400 us): workers kept"""


def plain_waste(lengths, batch, seed):
    """Padded / real elements of plain shuffled batches padded to their longest (what a
    `pad_sequence` collate over random batches pads)."""
    order = lengths[_order(len(lengths), seed, 0)]
    padded = sum(int(order[i:i + batch].max()) * len(order[i:i + batch]) for i in range(0, len(order), batch))
    return padded / int(lengths.sum())


def peer_missing(module):
    try:
        __import__(module)
    except ImportError as e:
        return f"{module} is not importable here ({e}); row skipped"
    return None


ROWS = [("kpipe", run_kpipe, None), ("bare processes", run_bare, None), ("tf.data bucket_by_sequence_length", run_tfdata, None),
        ("torch DataLoader pad_sequence", run_torch, "torch"), ("grain", run_grain, "grain")]


def queue_rows(queues):
    """Rows of kpipe at the explicit `max_queue_size`s `queues` (`--kpipe-queues`), beside
    the default's: the window's depth measured in the same run."""
    return [(f"kpipe max_queue_size={q}", functools.partial(run_kpipe, max_queue_size=q), None) for q in queues]


def measure(name, spec, workers, epochs, seed, rows=None, result=None, queues=(), lead_in=True):
    """Measures workload `name` (`spec` from `workloads()`): its rows' passes interleaved.
    Adds its rows, skipped rows and ratios to `result` (a dict, made if None) and returns
    it. `rows`: the row names to run (None: all; "kpipe" and "bare processes" always);
    `queues`: kpipe rows at these `max_queue_size`s besides; `lead_in`: see `interleaved`."""
    result = {"rows": [], "skipped": []} if result is None else result
    runs = {}
    for row, run, module in ROWS[:1] + queue_rows(queues) + ROWS[1:]:
        if rows is not None and row not in rows and row not in ("kpipe", "bare processes") and not row.startswith("kpipe "):
            continue
        reason = peer_missing(module) if module else None
        if reason:
            print(f"  {name}: {row}: {reason}", flush=True)
            result["skipped"].append({"workload": name, "row": row, "reason": reason})
            continue
        runs[row] = run(spec, workers, passes_for(epochs, lead_in), seed)
    rates, cpus = {}, {}
    for row, (per_epoch, waste, cpu) in interleaved(runs, epochs, lead_in).items():
        rates[row], cpus[row] = statistics.median(per_epoch), statistics.median(sum(c) for c in cpu)
        result["rows"].append({"workload": name, "row": row, "median_samples_per_s": rates[row],
                               "best_samples_per_s": max(per_epoch), "epoch_rates": per_epoch, "padding_waste": waste,
                               "cpu_us_per_sample": cpus[row],
                               "main_cpu_us_per_sample": statistics.median(c[0] for c in cpu),
                               "workers_cpu_us_per_sample": statistics.median(c[1] for c in cpu),
                               "epoch_cpu_us_per_sample": cpu})
    bare = rates["bare processes"]
    peers = {k: r for k, r in rates.items() if k not in ("kpipe", "bare processes") and not k.startswith("kpipe ")}
    peer_cpu = {k: c for k, c in cpus.items() if k in peers}
    for entry in result["rows"]:
        if entry["workload"] == name:
            entry["vs_bare"] = entry["median_samples_per_s"] / bare
            entry["cpu_vs_bare"] = cpus["bare processes"] / entry["cpu_us_per_sample"]
    result.setdefault("ratios", {})[name] = {
        "kpipe_vs_bare": rates["kpipe"] / bare,
        "kpipe_vs_bare_by_cpu": cpus["bare processes"] / cpus["kpipe"],
        "kpipe_vs_best_peer": rates["kpipe"] / max(peers.values()) if peers else None,
        "best_peer": max(peers, key=peers.get) if peers else None,
        "kpipe_vs_best_peer_by_cpu": min(peer_cpu.values()) / cpus["kpipe"] if peers else None,
        "waste_without_buckets": plain_waste(spec["make"]().lengths, spec["batch"], seed)}
    return result


def report(name, spec, result):
    """Prints workload `name`'s table and ratios from `result` (see `measure`)."""
    ratios = result["ratios"][name]
    print(f"\n{name} (batch {spec['batch']}, boundaries {spec['boundaries']}; padding waste of plain shuffled "
          f"batches, no buckets: {ratios['waste_without_buckets']:.2f})")
    print(f"  {'row':36s} {'median/s':>10s} {'best/s':>10s} {'vs bare':>8s} {'waste':>6s} {'cpu us/sample':>14s} "
          f"{'(main+workers)':>15s} {'bare cpu / cpu':>14s}")
    for entry in (e for e in result["rows"] if e["workload"] == name):
        print(f"  {entry['row']:36s} {entry['median_samples_per_s']:10.1f} {entry['best_samples_per_s']:10.1f} "
              f"{entry['vs_bare']:8.2f} {entry['padding_waste']:6.2f} {entry['cpu_us_per_sample']:14.1f} "
              f"{entry['main_cpu_us_per_sample']:7.1f}+{entry['workers_cpu_us_per_sample']:7.1f} "
              f"{entry['cpu_vs_bare']:14.2f}")
    best = ratios["kpipe_vs_best_peer"]
    best_peer = "n/a" if best is None else (f"{best:.2f}x by samples/s, {ratios['kpipe_vs_best_peer_by_cpu']:.2f}x by "
                                            f"CPU per sample (best: {ratios['best_peer']})")
    print(f"  kpipe / bare processes: {ratios['kpipe_vs_bare']:.2f}x by samples/s, {ratios['kpipe_vs_bare_by_cpu']:.2f}x "
          f"by CPU per sample (target >= 0.9x); kpipe / best peer: {best_peer} (target >= 1.5x)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="few, small samples (a check that every row runs)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4, help="passes per row, the first a warm-up (>= 2)")
    parser.add_argument("--no-lead-in", action="store_true", help="measure each row's pass right after the other "
                        "rows' (no unmeasured pass of the same row before it: see `interleaved`)")
    parser.add_argument("--workloads", default="text,audio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--kpipe-queues", default="", help="comma-separated max_queue_size values: a kpipe row at each, "
                        "beside the default's (e.g. 4: the default before the deeper window for small batches)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1. Received: --workers {args.workers}")
    if args.epochs < 2:
        parser.error(f"--epochs must be >= 2 (the first is a warm-up). Received: --epochs {args.epochs}")
    try:
        queues = [int(q) for q in args.kpipe_queues.split(",") if q.strip()]
    except ValueError:
        queues = [0]
    if any(q < 1 for q in queues):
        parser.error(f"--kpipe-queues takes comma-separated integers >= 1. Received: {args.kpipe_queues!r}")
    specs = workloads(args.smoke)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names or any(w not in specs for w in names):
        parser.error(f"--workloads takes a comma-separated subset of {', '.join(specs)}. Received: {args.workloads!r}")
    print(f"bench_varlen: {args.workers} workers, {args.epochs} passes per row (first a warm-up), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    result = {"workers": args.workers, "epochs": args.epochs, "smoke": args.smoke, "lead_in": not args.no_lead_in,
              "rows": [], "skipped": []}
    for name in names:
        measure(name, specs[name], args.workers, args.epochs, args.seed, result=result, queues=queues,
                lead_in=not args.no_lead_in)
        report(name, specs[name], result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
