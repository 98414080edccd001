#!/usr/bin/env python3
"""Loader throughput, side by side in one run: serial, Keras PyDataset (threads and
multiprocessing), tf.data + tf.numpy_function, kpipe.ProcessLoader, the peers (Grain's
two APIs and PyTorch's DataLoader, where installed), and the ceiling.

Workloads (issue #2):
  a        64x64x3 uint8 images with NumPy augmentation (crop, flip, jitter), batch 64
  b        224x224x3 uint8 images in an HDF5 file (~300 MB, generated), batch 128, read
           as a shuffled training loader does: one h5py read per sample in a new random
           order each epoch, each scaled to float32 in [0, 1] (600 KB per sample)
  b-direct the same file as contiguous uint8 slices, one `read_direct` of 19 MB per
           batch: no per-sample work at all, a pure memory-bandwidth workload
  b-fixed  (not in the default set) workload b with one order for every epoch and no
           `on_epoch_end`: a loader may then load the next pass ahead, where b's hook
           makes it wait at each pass end (as Keras does) for the last batch to be taken
           and the new state to reach the workers -- b against b-fixed is that cost
  b-stack-fixed (not in the default set) b-stack in the order of its first epoch every
           epoch, with no `on_epoch_end`: the np.stack hand-off without the pass-end barrier
  c        5 ms of waiting (I/O) per sample, batch 32
  b-stack  workload b as users write it (issue #33): each sample read and scaled, the
           batch made with `np.stack` (a new 77 MB array per batch); its ceiling is the
           same np.stack code in bare processes
  s        small samples (issue #33): 32x32x3 uint8 images in memory, batch 256, each
           scaled to float32 in a new order each epoch; PyTorch's row batches the records
           itself (`DataLoader(records, batch_size=256, shuffle=True)`, default collate)
  blas     small linear algebra per batch: a 160x160 float32 matrix put through six
           `tanh(a @ a.T)` (60 batches per epoch), run at every count of
           `--blas-workers` (default 1,2,4) and, for kpipe, at workers="auto": NumPy's
           BLAS pool in each worker, sized for the whole machine, can make more workers
           slower than one (issue #30). Printed as a grid of batches/s with multiples of
           the serial loop and of the same loader at workers=1, and the issue's targets
           (workers=2 >= 1.3x workers=1; "auto" >= 0.9x the best fixed count; no fixed
           count below 0.8x workers=1) as PASS/MISS lines
  jpeg     (not in the default set; issue #45) a folder of JPEG photos decoded to 224x224:
           Keras's image_dataset_from_directory, kpipe.data.from_files / from_packed, the
           hand-written tf.data random-resized crop, the fused one, and per-sample decoders
           (PIL, OpenCV, simplejpeg: kpipe.data.PackedImages over the pack and the folder) in
           bare processes, ProcessLoader.from_samples, PyTorch's DataLoader and Grain, each row
           in a fresh process; its file, rows and options (--jpeg-images, --jpeg-rows) are in
           scripts/_workloads/jpeg.py, behind the registry of scripts/_workloads/

"kpipe-samples" is `kpipe.ProcessLoader.from_samples(records, batch_size, shuffle=...)` on
the workload's per-sample records (Grain's, below, with its random map applied per record):
the workers write each sample into its row of the batch's shared memory (issue #33; not on
b-direct and blas, whose records are whole batches). The ceiling of a, b and s is the same
per-sample work written in place (`kpipe.empty`) in bare processes.

Peers, each with the same worker count as kpipe (`--workers`; `--io-workers` for c@N,
each count for blas), timed by the same rules (samples/s after the warm-up epochs, best
of the rounds, at least `--min-seconds`); a peer whose package does not import is
skipped, with its reason printed and under "skipped" in the JSON:
  grain-loader   `grain.DataLoader(data_source=..., sampler=IndexSampler(..., num_epochs=
                 None), operations=[..., Batch(B)], worker_count=W)`
  grain-dataset  `grain.MapDataset.source(...)[.shuffle()][.random_map()].repeat()
                 .to_iter_dataset()[.batch(B)].mp_prefetch(MultiprocessingOptions(num_workers=W))`
  torch          `torch.utils.data.DataLoader(ds, batch_size=None, num_workers=W,
                 persistent_workers=True)` on the PyDataset itself (its items are batches)
Grain is written as its docs write a pipeline: one record per sample where the workload
works per sample (a: the stored image, then the augmentation as a random map with
Grain's per-record generator; b: one HDF5 read per record, in Grain's shuffle, a new
order each epoch; c: one 5 ms wait per record), batched by Grain; in b-direct and blas
a record is a whole batch (one read, one matrix), with no batch step. Its `ReadOptions`
follow its docs: no reading threads for in-memory or computed records (a, blas), its
default 16 threads and 500-record buffer per worker process otherwise (b, b-direct, c:
in c that is 16 waits at once per worker). Grain and PyTorch run one iterator on across
epochs (their workers persist), taking one epoch's batches at a time; neither runs the
PyDataset's `on_epoch_end`. Grain starts its workers with "spawn": each imports this
script again, and so Keras and TensorFlow, as it would a Keras training script -- that
is in their first batch and peak RSS. Install Grain with `pip install -e '.[bench]'`
(Python >= 3.11), PyTorch with `pip install torch --index-url
https://download.pytorch.org/whl/cpu`.

The ceiling is the same per-batch work done by `--workers` bare processes that return
nothing (no hand-off at all), set up as kpipe's workers are: each fills one reused
buffer where the dataset calls `kpipe.empty`, and glibc keeps freed memory for reuse.
For a workload whose dataset has `on_epoch_end` (b), two more rows: "kpipe-ahead" is
kpipe with `epoch_end_ahead=True` (the next pass loads from the hook run on a copy; it
prints how many passes loaded ahead were kept), and "ceiling-passes" is the ceiling's
bare processes with the barrier Keras's semantics put at every pass end: each runs whole
passes and, once all have finished one, runs the hook on its own copy and goes on. The
ceiling against ceiling-passes is what that barrier alone costs (no hand-off, a free
hook); a loader that waits at pass ends stays below ceiling-passes. With `--ceiling-slots
N`, each b workload also gets "ceiling-N-slots": the ceiling's processes writing their
batches into N shared-memory slots in turn, as kpipe's workers do (2 per worker in
flight and one the consumer holds: 5 at workers=2), instead of reusing one buffer --
what handing batches over in several buffers costs the workers by itself (each slot is
paged in before timing starts). On the 2-core VM this was written on: 0.95-1.00x the
ceiling for b-stack, within the spread of the workers' CPU per sample from run to run.
With `--ceiling-read N`, each b workload also gets "ceiling-read": the ceiling's
processes, each with N shared-memory slots of its own, hand every batch to the
benchmark's process, which reads one byte per 4 KiB page of it (as `consume` does) and
hands the slot back -- the least a loader whose consumer reads its batches pays on
these CPUs (no order, no task messages, no pickling: what is left is the reads, on the
cores the workers fill); where the dataset has `on_epoch_end`, "ceiling-read-passes" is
the same with ceiling-passes' barrier (a pass ends once its last batches are read): the
bound for a loader that keeps Keras's hook semantics and whose batches are read.
"kpipe-noread" (only when named in `--loaders`) is kpipe with a consumer that takes each
batch and reads none of it: every other row reads one value per 4 KiB page of every
batch (see `consume`), which on a machine whose cores the workers fill is CPU taken
from them -- a cost the bare processes of the ceiling never pay. The two kpipe rows side
by side are what those reads cost.
Throughput is measured over whole epochs after `--warmup-epochs` (default 1) untimed
ones, so per-epoch costs (Keras re-forking its pool, say) count and one-time ones are
reported on their own, as the ceiling's are left out (its workers do one batch before
timing starts: the file opened, the buffer's pages and the heap's set up): "1st batch
s" is the time from constructing the loader to receiving its first batch (median of the
runs), and "from 1st" is the multiple of the ceiling timed from that first batch, the
warm-up epochs included -- for kpipe in (b), what the shared-memory slots and the
workers' first batches cost once (a 77 MB slot takes 46 ms to set up here, 250-400 ms
on memory the VM's host had taken back). Each run takes at least `--epochs` timed
epochs and goes on, whole epochs at a time, until `--min-seconds` have passed since
they began; the ceiling's workers run as long (stopping at a batch's end). On a fast
machine a workload's default epochs take about a second (workload b: 8 epochs of 16
batches took 1.1-1.4 s here), too short to measure a rate: the ceiling's best of 3 such
runs varied from 14.3 to 18.1 thousand samples/s from one run to the next (in 5 s
runs the ceilings came out 5-49% higher against serial). `--min-seconds 0` times the
epochs alone. `--warmup-epochs 0` times every run from its first batch instead: the
first epochs are where a loader pays once for its buffers (each of kpipe's shared-memory
slots costs the kernel ~0.6 ms per MB on first use, and ~0.12 ms per MB in each further
worker that maps it), where the ceiling's workers touch their one buffer before timing
starts.

Every loader runs `--repeats` times, in
rounds; its best throughput is reported (this 2-core VM's speed drifts by +-20% from
minute to minute; interference only ever slows a run). Peak RSS is summed over the
process tree (shared pages count once per process that maps them). Because a best run
and a best ceiling run may come from different minutes, each row also shows "paired":
the median over rounds of its run divided by the ceiling run of the same round.

Why a run is where it is: for kpipe and the ceilings, the benchmark also records where
all CPUs' time went while the run was timed -- to the loader's workers, to the consuming
process, idle, or stolen by the hypervisor (/proc/stat) -- and the workers' CPU time per
sample. samples/s is the workers' share of the CPUs divided by their CPU per sample, so
"x ceiling" splits into `capacity` (the workers' share against the ceiling's: what the
consumer, pass-end waits and steal take) times `cost` (the ceiling's CPU per sample
against the workers': what the work costs more in them -- one-time slot set-up within
the timed window (with `--warmup-epochs 0`), caches shared with the consumer). The
workers' CPU counts from the first timed epoch (or the first batch; the batches in flight
then were partly made before it) to the last one taken (a pass loaded ahead of it counts,
its samples do not); both are a few batches in hundreds.

Before each run (the ceiling's too) the benchmark writes and frees `--warm-mb` MB of
memory. A virtual machine that reports free memory to its host (virtio-balloon free
page reporting, as on the VM this was written on) hands memory back seconds after it is
freed, and the guest's next first touch of it then costs the host's page faults too:
1 GiB took 1.7 s to populate after a 3 s pause here, 0.32 s right after another
populate. Without the warm-up, whichever loader allocates new memory early in its run
(a process pool forked per epoch, shared-memory slots) pays that at random.

    python scripts/bench_loaders.py                 # all workloads, workers=2
    python scripts/bench_loaders.py --workloads b,b-direct
    python scripts/bench_loaders.py --json out.json
    python scripts/bench_loaders.py --workloads b --min-seconds 0   # 8 epochs, however short
    python scripts/bench_loaders.py --workloads blas --blas-workers 1,2,4,8
"""

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

import keras  # noqa: E402

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # (imported by its path, as the tests do)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402  (the scripts' option parsing and tables)
import _workloads  # noqa: E402  (workloads with a file of their own: jpeg)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kpipe  # noqa: E402


# ----------------------------------------------------------------------------- datasets
class Augment(keras.utils.PyDataset):
    """(a) In-memory 64x64x3 images, NumPy augmentation per sample, float32 out."""

    def __init__(self, num_images=2048, batch=64, **kw):
        super().__init__(**kw)
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, size=(num_images, 72, 72, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=num_images).astype("int64")
        self.batch = batch

    def __len__(self):
        return len(self.images) // self.batch

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        idx = np.arange(i * self.batch, (i + 1) * self.batch)
        out = kpipe.empty((self.batch, 64, 64, 3), dtype=np.float32)  # numpy.empty outside kpipe workers
        for k, j in enumerate(idx):
            out[k] = augment(self.images[j], rng)
        return out, self.labels[idx]

    def grain_plan(self):
        """The same work as Grain's docs write it: stored records, a random map, a batch."""
        n = len(self) * self.batch
        return GrainPlan(AugmentRecords(self.images[:n], self.labels[:n]), self.batch, AugmentMap(), in_memory=True)


def augment(image, rng):
    """One sample of (a): a random 64x64 crop of a 72x72x3 uint8 `image`, a random flip
    and brightness/contrast jitter, as float32 in [0, 1]."""
    dy, dx = rng.integers(0, 9, size=2)
    img = image[dy : dy + 64, dx : dx + 64].astype(np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = (img - img.mean()) * rng.uniform(0.8, 1.2) + img.mean() + rng.uniform(-20, 20)
    return np.clip(img, 0, 255) * (1.0 / 255.0)


class H5Contiguous(keras.utils.PyDataset):
    """(b-direct) 224x224x3 uint8 batches read as contiguous slices from an HDF5 file."""

    def __init__(self, path, batch=128, **kw):
        super().__init__(**kw)
        import h5py

        self.path, self.batch = path, batch
        with h5py.File(path, "r") as f:
            self.n = len(f["y"]) // batch
        self._h5 = None

    def __len__(self):
        return self.n

    def _file(self):
        import h5py

        if self._h5 is None:  # opened lazily, once per process
            self._h5 = h5py.File(self.path, "r")
        return self._h5

    def __getitem__(self, i):
        f = self._file()
        s = slice(i * self.batch, (i + 1) * self.batch)
        x = kpipe.empty((self.batch, 224, 224, 3), np.uint8)  # numpy.empty outside kpipe workers
        f["x"].read_direct(x, np.s_[s])
        return x, f["y"][s]

    def grain_plan(self):
        """One read per batch is the workload: Grain's records are these batches (no batch step)."""
        return GrainPlan(self, None)


class H5Samples(H5Contiguous):
    """(b) The same file read as a shuffled training loader does: samples in a new random
    order each epoch, one h5py read each, each scaled to float32 (600 KB per sample)."""

    def __init__(self, path, batch=128, **kw):
        super().__init__(path, batch, **kw)
        self.epoch = 0

    def __getitem__(self, i):
        f = self._file()
        order = np.random.default_rng(self.epoch).permutation(self.n * self.batch)
        idx = order[i * self.batch : (i + 1) * self.batch]
        x = kpipe.empty((self.batch, 224, 224, 3), np.float32)  # numpy.empty outside kpipe workers
        images = f["x"]
        for k, j in enumerate(idx):
            x[k] = scale_image(images[j])
        return x, f["y"][np.sort(idx)]

    def on_epoch_end(self):
        self.epoch += 1

    def grain_plan(self):
        """Grain's form: one record per sample, shuffled anew each epoch by Grain, batched."""
        return GrainPlan(H5Records(self.path, self.n * self.batch), self.batch, shuffle=True)


class H5SamplesStack(H5Samples):
    """(b-stack) workload b as users write it: each sample read and scaled, then the batch
    stacked into a new array (`np.stack`), which the loader then hands over."""

    def __getitem__(self, i):
        f = self._file()
        order = np.random.default_rng(self.epoch).permutation(self.n * self.batch)
        idx = order[i * self.batch : (i + 1) * self.batch]
        images = f["x"]
        return np.stack([scale_image(images[j]) for j in idx]), f["y"][np.sort(idx)]


class SmallSamples(keras.utils.PyDataset):
    """(s) small samples: 32x32x3 uint8 images in memory, batch 256, each scaled to float32
    in a new random order each epoch -- where the per-sample cost of a loader shows."""

    torch_per_sample = True  # PyTorch's row: its DataLoader batching the records (default collate)

    def __init__(self, num_images=20480, batch=256, **kw):
        super().__init__(**kw)
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, size=(num_images, 32, 32, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=num_images).astype("int64")
        self.batch, self.epoch = batch, 0

    def __len__(self):
        return len(self.images) // self.batch

    def __getitem__(self, i):
        order = np.random.default_rng(self.epoch).permutation(len(self) * self.batch)
        idx = order[i * self.batch : (i + 1) * self.batch]
        x = kpipe.empty((self.batch, 32, 32, 3), np.float32)  # numpy.empty outside kpipe workers
        for k, j in enumerate(idx):
            x[k] = self.images[j] * np.float32(1 / 255)
        return x, self.labels[idx]

    def on_epoch_end(self):
        self.epoch += 1

    def grain_plan(self):
        n = len(self) * self.batch
        return GrainPlan(SmallRecords(self.images[:n], self.labels[:n]), self.batch, shuffle=True, in_memory=True)


class PerSample:
    """A workload's records as the per-sample dataset of `ProcessLoader.from_samples`
    ("kpipe-samples"): record `j`, with the workload's per-record random map applied (its
    generator drawn from `numpy.random`, which kpipe's workers reseed for every batch)."""

    def __init__(self, plan):
        self.source, self.random_map = plan.source, plan.random_map

    def __len__(self):
        return len(self.source)

    def __getitem__(self, j):
        record = self.source[j]
        if self.random_map is not None:
            record = self.random_map(record, np.random.default_rng(np.random.randint(2**31)))
        return record


class H5SamplesFixed(H5Contiguous):
    """(b-fixed) H5Samples' reads in the order of its first epoch, every epoch, with no
    `on_epoch_end` (nothing changes between passes)."""

    __getitem__ = H5Samples.__getitem__
    grain_plan = H5Samples.grain_plan  # (Grain has no pass-end hook either way)
    epoch = 0


class H5SamplesStackFixed(H5Contiguous):
    """(b-stack-fixed) H5SamplesStack's np.stack code in the order of its first epoch, every
    epoch, with no `on_epoch_end`: the np.stack hand-off without the pass-end barrier."""

    __getitem__ = H5SamplesStack.__getitem__
    grain_plan = H5Samples.grain_plan
    epoch = 0


class Waits(keras.utils.PyDataset):
    """(c) 5 ms of waiting per sample (a remote read, say), tiny arrays out."""

    def __init__(self, n=48, batch=32, wait_s=0.005, **kw):
        super().__init__(**kw)
        self.n, self.batch, self.wait_s = n, batch, wait_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        for _ in range(self.batch):
            time.sleep(self.wait_s)
        return np.full((self.batch, 16), i, dtype=np.float32), np.zeros(self.batch, dtype=np.int64)

    def grain_plan(self):
        """Grain's form: one 5 ms wait per record, batched."""
        return GrainPlan(WaitRecords(self.n * self.batch, self.batch, self.wait_s), self.batch)


_BLAS_SIZE = 160  # the BLAS workload's matrix side: rows (samples) per batch


class Blas(keras.utils.PyDataset):
    """(blas) Small linear algebra per batch: a 160x160 float32 matrix put through six
    `tanh(a @ a.T)` (160 samples of 160 features out). NumPy's BLAS runs the products
    with its own thread pool, sized for the whole machine unless something limits it:
    in each of several worker processes, that pool oversubscribes the CPUs."""

    def __init__(self, n=60, size=_BLAS_SIZE, rounds=6, **kw):
        super().__init__(**kw)
        self.n, self.size, self.rounds = n, size, rounds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        a = np.random.default_rng(i).standard_normal((self.size, self.size), dtype=np.float32)
        for _ in range(self.rounds):
            a = np.tanh(a @ a.T)
        return a, np.zeros(self.size, dtype=np.int64)

    def grain_plan(self):
        """A batch is one matrix: Grain's records are these batches (no batch step)."""
        return GrainPlan(self, None, in_memory=True)


def scale_image(image):
    """One sample of (b): a uint8 image as float32 in [0, 1] (600 KB at 224x224x3)."""
    return image.astype(np.float32) * (1 / 255)


# ----------------------------------------------------------------- Grain's form of each workload
class GrainPlan:
    """A workload as Grain's docs write a pipeline: a random-access `source` of records,
    an optional per-record `random_map` (a `random_map(element, rng)` object), then a
    batch of `batch_size` records (None: the records are whole batches already), with
    Grain's own shuffle (a new order each epoch) where the workload shuffles.

    `in_memory`: the records are in memory or computed, for which Grain's `ReadOptions`
    advise no reading threads (`num_threads=0`: they would only contend for the GIL);
    otherwise its default (16 threads and a 500-record buffer per worker process)."""

    def __init__(self, source, batch_size, random_map=None, *, shuffle=False, in_memory=False):
        self.source, self.batch_size, self.random_map = source, batch_size, random_map
        self.shuffle, self.in_memory = shuffle, in_memory

    def batches_per_epoch(self):
        return len(self.source) // (self.batch_size or 1)


class AugmentRecords:
    """(a) for Grain: record `j` is the stored 72x72x3 uint8 image and its label."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, j):
        return self.images[j], self.labels[j]


class SmallRecords(AugmentRecords):
    """(s) record `j`: image `j` scaled to float32, and its label."""

    def __getitem__(self, j):
        image, label = super().__getitem__(j)
        return image * np.float32(1 / 255), label


class AugmentMap:
    """(a)'s per-sample augmentation as a Grain random map (`augment` with Grain's
    per-record generator). Registered as a `grain.transforms.RandomMap` when Grain runs."""

    def random_map(self, element, rng):
        image, label = element
        return augment(image, rng), label

    def __call__(self, element, rng):
        return self.random_map(element, rng)


class H5Records:
    """(b) for Grain: record `j` is sample `j` of the HDF5 file scaled to float32, with its
    label (the labels are read once per process; the file is opened lazily in each)."""

    def __init__(self, path, n):
        self.path, self.n = path, n
        self._h5 = self._x = self._y = None

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        if self._h5 is None:  # (Grain's reading threads may race here: the images and labels go first)
            import h5py

            f = h5py.File(self.path, "r")
            self._y = f["y"][: self.n]
            self._x = f["x"]  # the dataset object, looked up once (a lookup per read costs ~45 us)
            self._h5 = f
        return scale_image(self._x[j]), self._y[j]

    def __getstate__(self):
        return {"path": self.path, "n": self.n, "_h5": None, "_x": None, "_y": None}


class WaitRecords:
    """(c) for Grain: each record waits 5 ms, then is 16 float32s (its batch's index)."""

    def __init__(self, n, batch, wait_s):
        self.n, self.batch, self.wait_s = n, batch, wait_s

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        time.sleep(self.wait_s)
        return np.full(16, j // self.batch, dtype=np.float32), np.int64(0)


def make_h5(path, mb):
    import h5py

    n = max(256, int(mb * 2**20 // (224 * 224 * 3)))
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(n, 224, 224, 3), dtype=np.uint8, chunks=(32, 224, 224, 3))
        for lo in range(0, n, 256):
            hi = min(n, lo + 256)
            x[lo:hi] = rng.integers(0, 256, size=(hi - lo, 224, 224, 3), dtype=np.uint8)
        f["y"] = rng.integers(0, 10, size=n).astype("int64")
    return path


# ------------------------------------------------------------------------------ meters
class PeakRSS:
    """Samples the RSS of this process and all its descendants every 50 ms.

    Finding the descendants reads every process's /proc entry (3.4 ms of CPU here), so
    the sampler looks for new ones every `refresh_s` and reads the RSS of those it knows
    in between (~0.1 ms): at every 50 ms, the search alone took 3.4% of this 2-CPU
    machine from whichever run was sampled. The ceiling's runs are sampled too, so that
    what remains costs every row alike."""

    def __init__(self, interval_s=0.05, refresh_s=0.5):
        self.peak = 0
        self.samples = []
        self._interval_s, self._refresh_s = interval_s, refresh_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree():
        me = psutil.Process()
        return [me] + me.children(recursive=True)

    @staticmethod
    def _rss(procs):
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def now(self):
        return self._rss(self._tree())

    def _run(self):
        procs, found = None, 0.0
        while not self._stop.is_set():
            if procs is None or time.perf_counter() - found >= self._refresh_s:
                procs, found = self._tree(), time.perf_counter()
            value = self._rss(procs)
            self.peak = max(self.peak, value)
            self.samples.append(value)
            self._stop.wait(self._interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def consume(iterator, counts, on_first=None, read=True):
    """Receives every batch and reads one value per 4 KiB page of it, so that every loader
    pays for making its memory visible here (page faults on shared memory included).
    `on_first()` is called as the first batch arrives. `read=False` ("kpipe-noread")
    takes the batches without reading them."""
    for batch in iterator:
        for leaf in (batch[0], batch[1]) if read else ():
            flat = leaf.reshape(-1)
            flat[:: max(1, 4096 // leaf.itemsize)].sum()
        counts[0] += 1
        counts[1] += len(batch[0])
        if counts[2] is None:  # time and size of the first batch
            counts[2] = time.perf_counter()
            counts[3] = len(batch[0])
            if on_first is not None:
                on_first()


def _proc_stat():
    """`(idle, steal, total)` ticks of all CPUs so far (/proc/stat; idle counts iowait),
    or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    ticks += [0] * (8 - len(ticks))
    return ticks[3] + ticks[4], ticks[7], sum(ticks)


class CpuWindow:
    """Where the machine's CPU time went while a loader was timed: to its worker
    processes, to this (the consuming) process, left idle, or stolen by the hypervisor.

    A loader's samples/s is the CPU its workers got divided by the CPU they spend per
    sample, so these shares say why a run is below its ceiling: the consumer's own work,
    workers waiting (idle), the VM's other tenants (steal) -- or workers that spend
    more per sample.
    """

    def __init__(self):
        self._start = None

    def begin(self, pids=()):
        self._procs = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                self._procs.append((proc, sum(proc.cpu_times()[:2])))
            except psutil.Error:
                pass
        self._start = (time.process_time(), _proc_stat())

    def end(self, samples):
        """The shares since `begin` (None if it was not called), for `samples` samples."""
        if self._start is None:
            return None
        workers_s = 0.0
        for proc, before in self._procs:
            try:
                workers_s += sum(proc.cpu_times()[:2]) - before
            except psutil.Error:
                pass
        return cpu_shares(workers_s, time.process_time() - self._start[0], self._start[1], _proc_stat(), samples)


def cpu_shares(workers_s, main_s, stat0, stat1, samples):
    """Shares of the machine's CPU time between two /proc/stat readings: `workers`
    (`workers_s` CPU seconds), `main` (`main_s`), `idle`, `steal`; and the workers' CPU
    microseconds per sample."""
    out = {"worker_us_per_sample": 1e6 * workers_s / samples if samples else None}
    if stat0 is None or stat1 is None or stat1[2] <= stat0[2]:
        return out
    total_s = (stat1[2] - stat0[2]) / os.sysconf("SC_CLK_TCK")
    out.update(workers=workers_s / total_s, main=main_s / total_s,
               idle=(stat1[0] - stat0[0]) / (stat1[2] - stat0[2]), steal=(stat1[1] - stat0[1]) / (stat1[2] - stat0[2]))
    return out


def more_epochs(done, epochs, elapsed_s, min_seconds):
    """Whether a run that has timed `done` epochs (of at least `epochs`) in `elapsed_s`
    seconds goes on for another one: until both minimums are reached."""
    return done < epochs or elapsed_s < min_seconds


def _timed_epochs(counts, start, warmup, epochs, min_seconds):
    """Epoch numbers of a run: `warmup` untimed ones, then timed ones while
    `more_epochs` says so, timed from `start[1]` (after a warm-up) or the first batch."""
    epoch = 0
    while epoch < warmup:
        yield epoch
        epoch += 1
    start[:] = [counts[1], time.perf_counter()]
    while True:
        since = start[1] if warmup or counts[2] is None else counts[2]
        if not more_epochs(epoch - warmup, epochs, time.perf_counter() - since, min_seconds):
            return
        yield epoch
        epoch += 1


def _timed_samples(counts, start, warmup):
    """Samples timed: after the warm-up epochs, or (none) after the first batch."""
    return counts[1] - (start[0] if warmup else counts[3])


def _rate(counts, start, end, warmup):
    """Samples/s: after the warm-up epochs, or (none) from the first batch on."""
    return _timed_samples(counts, start, warmup) / (end - (start[1] if warmup else counts[2]))


def run_pydataset(make, kind, epochs, workers, max_queue, warmup=0, min_seconds=0):
    """serial / keras-threads / keras-mp / kpipe through Keras's own PyDataset adapter."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    counts = [0, 0, None, 0]
    if kind == "serial":
        ds = make()
    elif kind == "keras-threads":
        ds = make(workers=workers, use_multiprocessing=False, max_queue_size=max_queue)
    elif kind == "keras-mp":
        ds = make(workers=workers, use_multiprocessing=True, max_queue_size=max_queue)
    elif kind == "kpipe-samples":
        plan = make().grain_plan()
        inner = PerSample(plan)
    elif kind.startswith("kpipe"):
        inner = make()
    t0 = time.perf_counter()  # the dataset exists; the loader is constructed from here on
    if kind == "kpipe-samples":  # the per-sample form: samples written into the batch's slot
        ds = kpipe.ProcessLoader.from_samples(inner, plan.batch_size, shuffle=plan.shuffle, seed=0, drop_remainder=True,
                                              workers=workers, max_queue_size=max_queue)
    elif kind.startswith("kpipe"):
        ds = kpipe.ProcessLoader(inner, workers=workers, max_queue_size=None if workers == "auto" else max_queue,
                                 use_threads=kind == "kpipe-threads", epoch_end_ahead=kind == "kpipe-ahead")
    adapter = PyDatasetAdapter(ds, shuffle=False)
    start = []
    # Where the CPU time goes while kpipe is timed (see CpuWindow): from its first batch,
    # or from the first timed epoch after a warm-up.
    # (not with workers="auto": the workers it adds later would go uncounted)
    cpu = CpuWindow() if kind.startswith("kpipe") and workers != "auto" else None
    begin = None if cpu is None else (lambda: cpu.begin(ds.stats()["pids"]))
    for epoch in _timed_epochs(counts, start, warmup, epochs, min_seconds):
        if warmup and epoch == warmup and begin is not None:
            begin()
        adapter.on_epoch_begin()
        consume(adapter.get_numpy_iterator(), counts, on_first=None if warmup else begin, read=kind != "kpipe-noread")
        adapter.on_epoch_end()
    end = time.perf_counter()
    shares = None if cpu is None else cpu.end(_timed_samples(counts, start, warmup))
    if kind == "kpipe-ahead":
        ahead = ds.stats()["ahead"]
        print(f"    kpipe-ahead: passes loaded ahead of on_epoch_end kept {ahead['kept']}, missed {ahead['missed']}, "
              f"skipped {ahead['skipped']}{'; off: ' + ahead['off'] if ahead['off'] else ''}", flush=True)
    info = {}
    if kind.startswith("kpipe"):
        stats = ds.stats()
        info["workers_end"] = stats["workers"]
        # what the loader says of its workers' native threads, where it says anything
        info.update({key: value for key, value in stats.items() if "thread" in key})
    if hasattr(ds, "close"):
        ds.close()
    return _rate(counts, start, end, warmup), counts[2] - t0, counts[0], shares, _rate(counts, start, end, 0), info


def run_tfdata(make, epochs, workers, max_queue, warmup=0, min_seconds=0):
    import tensorflow as tf

    counts = [0, 0, None, 0]
    ds = make()
    t0 = time.perf_counter()
    x0, y0 = ds[0]

    def load(i):
        return ds[int(i)]

    def fn(i):
        x, y = tf.numpy_function(load, [i], (tf.as_dtype(x0.dtype), tf.as_dtype(y0.dtype)))
        return tf.ensure_shape(x, (None,) + x0.shape[1:]), y

    tfds = tf.data.Dataset.range(len(ds)).map(fn, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    start = []
    for _ in _timed_epochs(counts, start, warmup, epochs, min_seconds):
        consume(tfds.as_numpy_iterator(), counts)
    end = time.perf_counter()
    return _rate(counts, start, end, warmup), counts[2] - t0, counts[0], None, _rate(counts, start, end, 0), {}


# Peers that are not kpipe's dependencies: each row runs only where its package imports.
_PEER_PACKAGES = {"grain-loader": "grain", "grain-dataset": "grain", "torch": "torch"}
_PEER_INSTALL = {"grain": "pip install -e '.[bench]'", "torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu"}


def peer_missing(loader):
    """Why `loader` cannot run here (its package does not import), or None if it can."""
    package = _PEER_PACKAGES.get(loader)
    if package is None:
        return None
    try:
        __import__(package)
    except Exception as e:  # noqa: BLE001 - any failure to import skips the row, with its reason
        return f"{package} does not import ({type(e).__name__}: {e}); install it with {_PEER_INSTALL[package]}"
    return None


def _epochs_of(iterator, steps, counts, start, warmup, epochs, min_seconds):
    """Consumes `steps` batches of one long-lived `iterator` per epoch, for the epochs
    `_timed_epochs` gives (a loader that runs on across epochs, as Grain's and PyTorch's
    persistent workers do)."""
    for _ in _timed_epochs(counts, start, warmup, epochs, min_seconds):
        consume(itertools.islice(iterator, steps), counts)
        if counts[0] % steps:
            raise RuntimeError(f"the loader ended after {counts[0]} batches, inside an epoch of {steps}")


def run_grain(make, kind, epochs, workers, warmup=0, min_seconds=0):
    """Grain with `workers` processes, on the workload's `grain_plan()`, as Grain's docs
    write it: `grain.DataLoader(data_source=..., sampler=IndexSampler(...), operations=
    [random map, Batch], worker_count=workers)` ("grain-loader"), or
    `MapDataset.source(...).shuffle().random_map().repeat().to_iter_dataset().batch()
    .mp_prefetch(MultiprocessingOptions(num_workers=workers))` ("grain-dataset"). One
    iterator over endless epochs, taken one epoch's batches at a time (Grain's workers
    run on across epochs, as they do in a training loop)."""
    import grain

    counts = [0, 0, None, 0]
    plan = make().grain_plan()
    steps = plan.batches_per_epoch()
    read = grain.ReadOptions(num_threads=0) if plan.in_memory else grain.ReadOptions()
    t0 = time.perf_counter()  # the dataset exists; the loader is constructed from here on
    if kind == "grain-loader":
        operations = []
        if plan.random_map is not None:
            grain.transforms.RandomMap.register(type(plan.random_map))
            operations.append(plan.random_map)
        if plan.batch_size:
            operations.append(grain.transforms.Batch(batch_size=plan.batch_size, drop_remainder=True))
        sampler = grain.samplers.IndexSampler(num_records=len(plan.source), shard_options=grain.sharding.NoSharding(),
                                              shuffle=plan.shuffle, num_epochs=None, seed=0)
        loader = grain.DataLoader(data_source=plan.source, sampler=sampler, operations=operations, worker_count=workers,
                                  read_options=read)
    else:
        ds = grain.MapDataset.source(plan.source)
        if plan.shuffle:
            ds = ds.shuffle(seed=0)
        if plan.random_map is not None:
            ds = ds.random_map(plan.random_map, seed=0)
        ds = ds.repeat().to_iter_dataset(read)
        if plan.batch_size:
            ds = ds.batch(plan.batch_size, drop_remainder=True)
        loader = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    iterator = iter(loader)
    start = []
    try:
        _epochs_of(iterator, steps, counts, start, warmup, epochs, min_seconds)
        end = time.perf_counter()
    finally:
        for it in (iterator, getattr(iterator, "_iterator", None)):  # DataLoaderIterator wraps a DatasetIterator
            if hasattr(it, "close"):
                it.close()
        del iterator, loader
        gc.collect()
    return _rate(counts, start, end, warmup), counts[2] - t0, counts[0], None, _rate(counts, start, end, 0), {}


def run_torch(make, epochs, workers, warmup=0, min_seconds=0):
    """PyTorch's `DataLoader(ds, batch_size=None, num_workers=workers,
    persistent_workers=True)` on the per-batch dataset itself (`batch_size=None`: each
    item is a whole batch), its tensors read as NumPy arrays without a copy, as Keras's
    adapter for a PyTorch loader does. The workers persist across epochs."""
    import torch.utils.data

    counts = [0, 0, None, 0]
    ds = make()
    t0 = time.perf_counter()
    if getattr(ds, "torch_per_sample", False):  # (s): the records, batched by PyTorch as its users write it
        plan = ds.grain_plan()
        loader = torch.utils.data.DataLoader(plan.source, batch_size=plan.batch_size, shuffle=plan.shuffle, drop_last=True,
                                             num_workers=workers, persistent_workers=True)
    else:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True)
    start = []
    try:
        for _ in _timed_epochs(counts, start, warmup, epochs, min_seconds):
            consume((tuple(t.numpy() for t in batch) for batch in loader), counts)
        end = time.perf_counter()
    finally:
        del loader
        gc.collect()
    return _rate(counts, start, end, warmup), counts[2] - t0, counts[0], None, _rate(counts, start, end, 0), {}


_CEILING_CHILD = r"""
import sys, time, cloudpickle
from kpipe._engine import _alloc
from kpipe._engine._shm import Segment
with open(sys.argv[1], "rb") as f:
    ds = cloudpickle.load(f)
w, n_workers, epochs, min_seconds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
pass_ends = sys.argv[6] == "1"
# The same buffers a kpipe worker has: `kpipe.empty` returns memory of a reused slot --
# or, with more than one slot, of each slot in turn, where big np.stack results go too.
slots = [Segment.create(0) for _ in range(int(sys.argv[7]))]
turn = [0]
# With a reader (ceiling-read): each batch's slot goes to the main process, which reads
# it and hands it back; a slot is written again only once handed back.
read = sys.argv[8] == "1"
free = list(range(len(slots)))
def next_slot():
    if not read:
        return turn[0] % len(slots)
    while not free:
        free.append(int(sys.stdin.readline().split()[1]))  # "F <slot>"
    return free.pop(0)
def fill(k, i):  # batch i, its kpipe.empty arrays (and, with several slots or a reader, big np.stack results) in slot k
    _alloc.begin(slots[k])
    try:
        if len(slots) == 1 and not read:
            return ds[i]
        with _alloc.stacking_into():
            return ds[i]
    finally:
        _alloc.end()
def load(i):
    turn[0] += 1
    k = next_slot()
    batch = fill(k, i)
    if read:
        print("B", k, sum(leaf.nbytes for leaf in batch), flush=True)
    return batch
for k in range(len(slots)):  # warm-up (lazy file opening, each slot's pages), not timed
    fill(k, (w + k * n_workers) % len(ds))
print("READY", *(seg.fd for seg in slots), flush=True)
sys.stdin.readline()  # all workers start together
t0 = time.time(); c0 = time.process_time(); samples = 0; epoch = 0
if pass_ends:  # whole passes; at each end all wait for the last, then run the hook
    while True:
        for i in range(w, len(ds), n_workers):
            samples += len(load(i)[0])
        print("END", flush=True)
        reply = sys.stdin.readline().split()
        while reply and reply[0] == "F":  # (ceiling-read: the last slots handed back)
            free.append(int(reply[1]))
            reply = sys.stdin.readline().split()
        if reply != ["GO"]:
            break
        ds.on_epoch_end()
else:
    while epoch < epochs or time.time() - t0 < min_seconds:
        for i in range(w, len(ds), n_workers):
            samples += len(load(i)[0])
            if epoch >= epochs and time.time() - t0 >= min_seconds:
                break
        epoch += 1
print("DONE", turn[0], samples, t0, time.time(), time.process_time() - c0, flush=True)
"""


def _read_slots(procs, slot_fds, pass_end=None):
    """ceiling-read's consumer: takes each batch a bare process announces ("B <slot>
    <bytes>"), reads one byte per 4 KiB page of it, as `consume` does, and hands the slot
    back ("F <slot>"), until every process is done ("DONE <batches> ..."). With
    `pass_end`, once every process has ended its pass ("END", after its last batch) and
    those batches are read, each is told `pass_end()` ("GO" or "STOP"). Returns the
    processes' last lines; raises if any batch went unread."""
    import mmap
    import selectors

    maps = {}
    sel = selectors.DefaultSelector()
    pending = {}
    for p in procs:
        sel.register(p.stdout.fileno(), selectors.EVENT_READ, p)
        pending[p.pid] = b""
    done, read, ended = {}, 0, set()

    def tell(p, line):
        try:
            p.stdin.write(line)
            p.stdin.flush()
        except BrokenPipeError:  # it wrote its last batch and is gone
            pass

    try:
        while len(done) < len(procs):
            for key, _ in sel.select():
                p = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    raise RuntimeError(f"a ceiling-read process (pid {p.pid}) ended without its result")
                *lines, pending[p.pid] = (pending[p.pid] + chunk).split(b"\n")
                for line in lines:
                    words = line.split()
                    if words and words[0] == b"DONE":
                        done[p.pid] = line.decode()
                        sel.unregister(key.fd)
                    elif words == [b"END"] and pass_end is not None:
                        ended.add(p.pid)
                        if len(ended) == len(procs):
                            reply = pass_end()
                            for q in procs:
                                tell(q, reply + "\n")
                            ended.clear()
                    elif words and words[0] == b"B":
                        slot, nbytes = int(words[1]), int(words[2])
                        m = maps.get((p.pid, slot))
                        if m is None or len(m) < nbytes:
                            fd = os.open(f"/proc/{p.pid}/fd/{slot_fds[p.pid][slot]}", os.O_RDONLY)
                            try:
                                m = maps[(p.pid, slot)] = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
                            finally:
                                os.close(fd)
                        np.frombuffer(m, np.uint8, count=min(nbytes, len(m)))[::4096].sum()
                        read += 1
                        tell(p, f"F {slot}\n")
    finally:
        sel.close()
        for m in maps.values():
            m.close()
    written = sum(int(line.split()[1]) for line in done.values())
    if read != written:
        raise RuntimeError(f"ceiling-read: the reader took {read} batches of the {written} the processes wrote")
    return [done[p.pid] for p in procs]


def run_ceiling(make, epochs, workers, min_seconds=0, pass_ends=False, slots=1, read=False):
    """`workers` bare processes doing the same batches, returning nothing, for at least
    `epochs` epochs and `min_seconds` seconds. With `pass_ends`, they run whole passes
    and, at each pass end, wait until all have finished it and then each run the
    dataset's `on_epoch_end` on its own copy: the barrier a hook of Keras's semantics
    puts at every pass end (the next pass may depend on it), at no cost of its own. With
    `slots` > 1, each writes its batches (`kpipe.empty` arrays and big `np.stack` results,
    as kpipe's workers do) into that many shared-memory slots in turn instead of one.
    With `read` ("ceiling-read"), each has `slots` slots of its own and hands every batch
    to this process, which reads one byte per 4 KiB page of it (as `consume` does) and
    hands the slot back: the least any loader whose consumer reads its batches pays (no
    order, no task messages, no pickling), where `consume` runs on the same CPUs; with
    `pass_ends` too ("ceiling-read-passes"), a pass ends once its last batches are read.
    Returns `(samples/s, cpu_shares(...))` (the workers' CPU over their timed work, and
    this process's while it reads)."""
    import cloudpickle

    from kpipe._engine import _pydataset_shim

    ds = make()
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        cloudpickle.dump(ds, f)
        path = f.name
    # Children import keras for the PyDataset base; give them the TF-free stand-in instead.
    code = (
        "import sys, types, kpipe._engine._pydataset_shim as s\n"
        "for name in ['keras', 'keras.src', 'keras.src.trainers', 'keras.src.trainers.data_adapters']:\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "m = types.ModuleType('keras.src.trainers.data_adapters.py_dataset_adapter'); m.PyDataset = s.PyDataset\n"
        "sys.modules[m.__name__] = m\n" + _CEILING_CHILD
    )
    del _pydataset_shim
    from kpipe._engine._pool import _WORKER_ENV

    # The environment of kpipe's workers too (glibc keeps freed buffers for reuse).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **_WORKER_ENV)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, path, str(w), str(workers), str(epochs), str(min_seconds), str(int(pass_ends)), str(slots),
                          str(int(read))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for w in range(workers)
    ]
    slot_fds = {}
    for p in procs:
        ready = p.stdout.readline().split()
        assert ready and ready[0] == "READY", ready
        slot_fds[p.pid] = [int(fd) for fd in ready[1:]]
    stat0, main0 = _proc_stat(), time.process_time()
    for p in procs:
        p.stdin.write("GO\n")
        p.stdin.flush()
    t0, done = time.time(), [0]

    def pass_end():
        done[0] += 1
        return "GO" if done[0] < epochs or time.time() - t0 < min_seconds else "STOP"

    while pass_ends and not read:
        for p in procs:
            assert p.stdout.readline().strip() == "END"
        go = pass_end()
        for p in procs:
            p.stdin.write(go + "\n")
            p.stdin.flush()
        if go != "GO":
            break
    lasts = _read_slots(procs, slot_fds, pass_end if pass_ends else None) if read else None
    main_s = time.process_time() - main0 if read else 0.0
    total, starts, ends, cpu_s = 0, [], [], 0.0
    for n, p in enumerate(procs):
        out, _ = p.communicate(timeout=1800)
        samples, start, end, used = (lasts[n] if read else out).split()[-4:]
        total += int(samples)
        starts.append(float(start))
        ends.append(float(end))
        cpu_s += float(used)
    stat1 = _proc_stat()
    os.unlink(path)
    return total / (max(ends) - min(starts)), cpu_shares(cpu_s, main_s, stat0, stat1, total)


def warm_memory(mb):
    """Writes and frees `mb` MB, so that the next allocations of this machine reuse memory
    its hypervisor has not taken back (see the module docstring)."""
    if mb > 0:
        np.ones(int(mb) << 20, dtype=np.uint8)  # allocated, written and freed (munmap)


# ------------------------------------------------------------------------------- driver
def measure(workload, make, loaders, epochs, workers, max_queue, repeats, warmup=0, warm_mb=0, min_seconds=0, ceiling_slots=0,
            ceiling_read=0):
    """Runs every loader (and the ceiling) `repeats` times, in rounds, so that drift in
    the machine's speed spreads over all of them; keeps each one's best throughput (noise
    only ever slows a run down), the median time to first batch and the highest RSS.

    Each row also gets `x_ceiling_paired`: the median over rounds of its run divided by
    the ceiling run of the same round, minutes closer in time than two best runs may be
    (`x_ceiling` divides the best by the best); and `cpu`, the CPU shares (`CpuWindow`)
    of its best run, where measured (kpipe and the ceilings). With `workers="auto"`
    (kpipe alone) there is no ceiling: the rows' ceiling multiples are None."""
    ceilings, barrier_ceilings, slot_ceilings, read_ceilings, read_barrier_ceilings = [], [], [], [], []
    with_ceiling = workers != "auto"
    has_hook = _has_epoch_hook(make())
    loaders = [k for k in loaders if k != "kpipe-ahead" or has_hook]  # the option is for epoch hooks
    probe = make()
    plan = probe.grain_plan() if hasattr(probe, "grain_plan") else None
    del probe
    if "kpipe-samples" in loaders and (plan is None or not plan.batch_size):
        loaders = [k for k in loaders if k != "kpipe-samples"]  # its records are whole batches: no per-sample form
    runs = {kind: [] for kind in loaders}
    for _ in range(repeats):
        for kind in loaders:
            warm_memory(warm_mb)
            with PeakRSS() as rss:
                if kind == "tf.data":
                    result = run_tfdata(make, epochs, workers, max_queue, warmup, min_seconds)
                elif kind.startswith("grain"):
                    result = run_grain(make, kind, epochs, workers, warmup, min_seconds)
                elif kind == "torch":
                    result = run_torch(make, epochs, workers, warmup, min_seconds)
                else:
                    result = run_pydataset(make, kind, epochs, workers, max_queue, warmup, min_seconds)
            rate, first_s, batches, cpu, from_first, info = result
            runs[kind].append((rate, first_s, rss.peak / 2**20, batches, cpu, from_first, info))
            ended = f"  (ended with {info['workers_end']} workers)" if workers == "auto" and "workers_end" in info else ""
            print(f"  {workload}: {kind:<19} {rate:10.1f} samples/s{_cpu_text(cpu)}{ended}", flush=True)
        if not with_ceiling:
            continue
        warm_memory(warm_mb)
        with PeakRSS():  # (not reported: sampled so that every run pays the sampler alike)
            ceilings.append(run_ceiling(make, epochs, workers, min_seconds))
        print(f"  {workload}: {'ceiling':<19} {ceilings[-1][0]:10.1f} samples/s{_cpu_text(ceilings[-1][1])}", flush=True)
        if has_hook:
            warm_memory(warm_mb)
            with PeakRSS():
                barrier_ceilings.append(run_ceiling(make, epochs, workers, min_seconds, pass_ends=True))
            print(f"  {workload}: {'ceiling-passes':<19} {barrier_ceilings[-1][0]:10.1f} samples/s{_cpu_text(barrier_ceilings[-1][1])}", flush=True)
        if ceiling_slots > 1:
            warm_memory(warm_mb)
            with PeakRSS():
                slot_ceilings.append(run_ceiling(make, epochs, workers, min_seconds, slots=ceiling_slots))
            print(f"  {workload}: {f'ceiling-{ceiling_slots}-slots':<19} {slot_ceilings[-1][0]:10.1f} samples/s{_cpu_text(slot_ceilings[-1][1])}", flush=True)
        if ceiling_read:
            warm_memory(warm_mb)
            with PeakRSS():
                read_ceilings.append(run_ceiling(make, epochs, workers, min_seconds, slots=ceiling_read, read=True))
            print(f"  {workload}: {'ceiling-read':<19} {read_ceilings[-1][0]:10.1f} samples/s{_cpu_text(read_ceilings[-1][1])}", flush=True)
            if has_hook:
                warm_memory(warm_mb)
                with PeakRSS():
                    read_barrier_ceilings.append(run_ceiling(make, epochs, workers, min_seconds, pass_ends=True, slots=ceiling_read, read=True))
                print(f"  {workload}: {'ceiling-read-passes':<19} {read_barrier_ceilings[-1][0]:10.1f} samples/s"
                      f"{_cpu_text(read_barrier_ceilings[-1][1])}", flush=True)
    ceiling_runs = [c[0] for c in ceilings]
    ceiling = max(ceiling_runs) if ceiling_runs else None
    rows = []
    for kind in loaders:
        speeds = [r[0] for r in runs[kind]]
        paired = [rate / c for rate, c in zip(speeds, ceiling_runs)]
        best = max(runs[kind], key=lambda r: r[0])
        rows.append(
            {
                "workload": workload,
                "loader": kind,
                "workers": 0 if kind == "serial" else workers,
                "batches": runs[kind][0][3],
                "samples_per_s": max(speeds),
                "samples_per_s_runs": speeds,
                "first_batch_s": statistics.median(r[1] for r in runs[kind]),
                "peak_rss_mb": max(r[2] for r in runs[kind]),
                "x_ceiling_rounds": paired,
                "x_ceiling_paired": statistics.median(paired) if paired else None,
                "cpu": best[4],
                # from the first batch, the warm-up epochs included (the same runs)
                "samples_per_s_from_first": max(r[5] for r in runs[kind]),
                **best[6],  # kpipe: the workers it ended with (and what it says of their threads)
            }
        )
    serial = next((r["samples_per_s"] for r in rows if r["loader"] == "serial"), None)
    for r in rows:
        r["x_serial"] = r["samples_per_s"] / serial if serial else None
        r["x_ceiling"] = r["samples_per_s"] / ceiling if ceiling else None
        r["x_ceiling_from_first"] = r["samples_per_s_from_first"] / ceiling if ceiling else None
    if not with_ceiling:
        return rows
    rows.append({"workload": workload, "loader": "ceiling", "workers": workers, "samples_per_s": ceiling, "samples_per_s_runs": ceiling_runs,
                 "x_serial": ceiling / serial if serial else None, "x_ceiling": 1.0, "cpu": max(ceilings, key=lambda c: c[0])[1]})
    for name, extra in (("ceiling-passes", barrier_ceilings), (f"ceiling-{ceiling_slots}-slots", slot_ceilings), ("ceiling-read", read_ceilings),
                        ("ceiling-read-passes", read_barrier_ceilings)):
        if extra:
            extra_runs = [c[0] for c in extra]
            rate = max(extra_runs)
            paired = [b / c for b, c in zip(extra_runs, ceiling_runs)]
            rows.append({"workload": workload, "loader": name, "workers": workers, "samples_per_s": rate, "samples_per_s_runs": extra_runs,
                         "x_serial": rate / serial if serial else None, "x_ceiling": rate / ceiling, "x_ceiling_rounds": paired,
                         "x_ceiling_paired": statistics.median(paired), "cpu": max(extra, key=lambda c: c[0])[1]})
    return rows


def _cpu_text(cpu):
    """`CpuWindow` shares as printed beside a run, or nothing where not measured."""
    if not cpu or "workers" not in cpu:
        return ""
    return (f"   CPU: workers {100 * cpu['workers']:.0f}%, consumer {100 * cpu['main']:.0f}%, idle {100 * cpu['idle']:.0f}%, "
            f"steal {100 * cpu['steal']:.0f}%; workers {cpu['worker_us_per_sample']:.0f} us/sample")


def _has_epoch_hook(ds):
    """Whether `ds` defines its own `on_epoch_end` (the Keras base class's does nothing)."""
    own = type(ds).on_epoch_end
    return all(own is not getattr(base, "on_epoch_end", None) for base in (keras.utils.PyDataset, keras.utils.Sequence))


def rss_growth(make, epochs, workers):
    """kpipe's process-tree RSS after epoch 2 vs the peak over the remaining epochs."""
    loader = kpipe.ProcessLoader(make(), workers=workers)
    meter = PeakRSS()
    after = []
    for epoch in range(epochs):
        for i in range(len(loader)):
            loader[i]
        loader.on_epoch_end()
        after.append(meter.now())
    loader.close()
    base = after[1]
    return {"epochs": epochs, "rss_after_epoch2_mb": base / 2**20, "rss_max_later_mb": max(after[2:]) / 2**20, "growth_pct": 100.0 * (max(after[2:]) - base) / base}


_TABLE = (  # (key in a row, title, alignment and width, format)
    ("workload", "workload", "<10", ""), ("loader", "loader", "<20", ""), ("workers", "workers", ">8", ""),
    ("samples_per_s", "samples/s", ">12", ".1f"), ("x_serial", "x serial", ">10", ".2f"), ("x_ceiling", "x ceiling", ">11", ".2f"),
    ("x_ceiling_paired", "paired", ">8", ".2f"), ("x_ceiling_from_first", "from 1st", ">10", ".2f"),
    ("first_batch_s", "1st batch s", ">13", ".3f"), ("peak_rss_mb", "peak RSS MB", ">13", ".0f"),
)


def print_table(rows):
    _bench.print_table([(title, width, fmt) for _, title, width, fmt in _TABLE], [[r.get(key) for key, *_ in _TABLE] for r in rows])
    print("(x ceiling: best run / best ceiling run; paired: median over rounds of run / that round's ceiling run;\n"
          " from 1st: best run timed from its first batch, warm-up epochs included / best ceiling run)")


def cpu_breakdown(row, ceiling):
    """Why `row` (a kpipe row) is at its multiple of the ceiling, from both best runs' CPU
    shares: samples/s = the workers' CPU share x the machine's CPU / their CPU per sample,
    so x ceiling = `capacity` (the workers' share against the ceiling's) x `cost` (the
    ceiling's CPU per sample against theirs). None where either was not measured."""
    a, c = row.get("cpu") or {}, ceiling.get("cpu") or {}
    if "workers" not in a or "workers" not in c or not a["worker_us_per_sample"] or not c["workers"]:
        return None
    capacity = a["workers"] / c["workers"]
    cost = c["worker_us_per_sample"] / a["worker_us_per_sample"]
    return {"capacity": capacity, "cost": cost, "predicted": capacity * cost}


def print_cpu_breakdown(rows):
    """Where the CPU time went in the best runs of kpipe and the ceilings (see CpuWindow)."""
    lines = []
    for r in rows:
        if "workers" not in (r.get("cpu") or {}):
            continue
        ceiling = next((c for c in rows if c["workload"] == r["workload"] and c["loader"] == "ceiling"), None)
        split = cpu_breakdown(r, ceiling) if ceiling is not None and r is not ceiling else None
        cpu = r["cpu"]
        lines.append(
            f"{r['workload']:<10}{r['loader']:<20}{100 * cpu['workers']:>8.0f}%{100 * cpu['main']:>9.0f}%{100 * cpu['idle']:>5.0f}%"
            f"{100 * cpu['steal']:>6.0f}%{cpu['worker_us_per_sample']:>11.0f}"
            + (f"{split['capacity']:>10.2f}{split['cost']:>7.2f}{split['predicted']:>9.2f}{r['x_ceiling']:>10.2f}" if split else "")
        )
    if lines:
        print("\nWhere the CPU time went in those best runs (shares of all CPUs' time while timed; "
              "x ceiling = capacity x cost):")
        print(f"{'workload':<10}{'loader':<20}{'workers':>9}{'consumer':>10}{'idle':>6}{'steal':>7}{'us/sample':>11}"
              f"{'capacity':>10}{'cost':>7}{'product':>9}{'measured':>10}")
        print("\n".join(lines))


def check_targets(rows, growth, io_workers):
    def get(w, loader):
        return next((r for r in rows if r["workload"] == w and r["loader"] == loader), None)

    checks = []
    b_k, b_mp, b_s = get("b", "kpipe"), get("b", "keras-mp"), get("b", "serial")
    if b_k and b_mp and b_s:
        checks.append(("(b) kpipe >= 3x keras-mp", b_k["samples_per_s"] / b_mp["samples_per_s"], 3.0))
        checks.append(("(b) kpipe >= 1.5x serial", b_k["x_serial"], 1.5))
    if b_k:
        checks.append(("(b) kpipe >= 0.85x ceiling", b_k["x_ceiling"], 0.85))
        checks.append(("(b) kpipe >= 0.85x ceiling, paired", b_k["x_ceiling_paired"], 0.85))
        b_a = get("b", "kpipe-ahead")
        if b_a:
            checks.append(("(b) kpipe epoch_end_ahead=True >= 0.85x ceiling", b_a["x_ceiling"], 0.85))
            checks.append(("(b) kpipe epoch_end_ahead=True >= 0.85x ceiling, paired", b_a["x_ceiling_paired"], 0.85))
        b_p = get("b", "ceiling-passes")
        if b_p:  # what the hook's pass-end barrier alone leaves of the ceiling, and kpipe of that
            print(f"\n(b) the ceiling with a barrier and the hook at each pass end reaches {b_p['x_ceiling']:.2f}x the ceiling; "
                  f"kpipe reaches {b_k['samples_per_s'] / b_p['samples_per_s']:.2f}x of that")
        if b_k.get("x_ceiling_from_first") is not None:  # (the same as x ceiling with --warmup-epochs 0)
            print(f"(b) timed from the first batch, the warm-up epochs and the slots' set-up included: kpipe "
                  f"{b_k['x_ceiling_from_first']:.2f}x the ceiling"
                  + (f", with epoch_end_ahead=True {b_a['x_ceiling_from_first']:.2f}x" if b_a else ""))
    peers = [r for r in (get("b", k) for k in _PEERS) if r]
    if b_k and peers:  # issue #30: against every other way to load (b) with the same workers
        best = max(peers, key=lambda r: r["samples_per_s"])
        checks.append((f"(b) kpipe >= 2x the best peer ({best['loader']}; of {', '.join(r['loader'] for r in peers)})",
                       b_k["samples_per_s"] / best["samples_per_s"], 2.0))
    # issue #33: batches built where they are handed over
    b_ps = get("b", "kpipe-samples")
    if b_ps:
        checks.append(("(b) kpipe-samples (from_samples) >= 0.9x the in-place ceiling", b_ps["x_ceiling"], 0.9))
        checks.append(("(b) kpipe-samples (from_samples) >= 0.9x the in-place ceiling, paired", b_ps["x_ceiling_paired"], 0.9))
    stack = get("b-stack", "kpipe")
    if stack:
        checks.append(("(b-stack) kpipe >= 0.9x bare processes running the same np.stack code", stack["x_ceiling"], 0.9))
        checks.append(("(b-stack) kpipe >= 0.9x bare processes running the same np.stack code, paired", stack["x_ceiling_paired"], 0.9))
        stack_a = get("b-stack", "kpipe-ahead")
        if stack_a:  # the same, without the pass-end barrier of the dataset's hook
            checks.append(("(b-stack) kpipe epoch_end_ahead=True >= 0.9x bare processes", stack_a["x_ceiling"], 0.9))
            checks.append(("(b-stack) kpipe epoch_end_ahead=True >= 0.9x bare processes, paired", stack_a["x_ceiling_paired"], 0.9))
    # where the rest goes: the pass-end barrier, batches written into slots in turn, the consumer's reads
    for workload in ("b", "b-stack", "b-stack-fixed", "b-fixed", "b-direct"):
        mine, samples = get(workload, "kpipe"), get(workload, "kpipe-samples")
        unread = get(workload, "kpipe-noread")
        if mine and unread:
            print(f"({workload}) kpipe with a consumer that reads nothing of its batches reaches {unread['x_ceiling']:.2f}x the ceiling "
                  f"(paired {unread['x_ceiling_paired']:.2f}); the consumer's one read per page leaves kpipe "
                  f"{mine['samples_per_s'] / unread['samples_per_s']:.2f}x of that")
        for extra in [r for r in rows if r["workload"] == workload and r["loader"].startswith("ceiling-")
                      and (workload, r["loader"]) != ("b", "ceiling-passes")]:  # ((b) has its line above)
            # (from_samples has no pass-end barrier: it is set beside the other rows only)
            ours = [(name, row) for name, row in (("kpipe", mine), ("kpipe-samples", samples))
                    if row and not (name == "kpipe-samples" and extra["loader"].endswith("passes"))]
            if ours:
                print(f"({workload}) {extra['loader']} reaches {extra['x_ceiling']:.2f}x the ceiling (paired {extra['x_ceiling_paired']:.2f}); "
                      + ", ".join(f"{name} reaches {row['samples_per_s'] / extra['samples_per_s']:.2f}x of that" for name, row in ours))
    s_ps, s_ceiling = get("s", "kpipe-samples"), get("s", "ceiling")
    if s_ps and s_ceiling and (s_ps.get("cpu") or {}).get("worker_us_per_sample") and (s_ceiling.get("cpu") or {}).get("worker_us_per_sample"):
        mine, bare = s_ps["cpu"]["worker_us_per_sample"], s_ceiling["cpu"]["worker_us_per_sample"]
        print(f"\n(s) per-sample overhead of from_samples: the workers' CPU per sample {mine:.1f} us against {bare:.1f} us "
              f"for the same work in place in bare processes: {mine - bare:+.1f} us per sample")
    s_peers = [r for r in (get("s", k) for k in ("grain-loader", "grain-dataset", "torch")) if r]
    if s_ps and s_peers:
        best = max(s_peers, key=lambda r: r["samples_per_s"])
        checks.append((f"(s) kpipe-samples >= 2x the best per-sample peer ({best['loader']}; of {', '.join(r['loader'] for r in s_peers)})",
                       s_ps["samples_per_s"] / best["samples_per_s"], 2.0))
    a_k, a_mp = get("a", "kpipe"), get("a", "keras-mp")
    if a_k and a_mp:
        checks.append(("(a) kpipe >= 0.85x ceiling", a_k["x_ceiling"], 0.85))
        checks.append(("(a) kpipe >= 1.2x keras-mp", a_k["samples_per_s"] / a_mp["samples_per_s"], 1.2))
    for loader in ("kpipe", "kpipe-threads"):
        c = get(f"c@{io_workers}", loader)
        if c:
            checks.append((f"(c) {loader} x{io_workers} >= 8x serial", c["x_serial"], 8.0))
    firsts = [r["first_batch_s"] for r in rows if r["loader"] == "kpipe" and r["workers"] == 2 and r.get("first_batch_s") is not None]
    if firsts:
        checks.append(("kpipe first batch <= 0.5 s (worst workload, workers=2)", max(firsts), 0.5))
    if growth:
        checks.append((f"kpipe RSS growth over {growth['epochs']} epochs < 5%", growth["growth_pct"], 5.0))
    checks += blas_checks({r["workers"]: r["samples_per_s"] for r in rows if r["workload"].startswith("blas@") and r["loader"] == "kpipe"})
    print("\nTargets:")
    print_checks(checks)
    return checks


def print_checks(checks):
    """One PASS or MISS line per `(name, measured, target)`: a name saying `>=` wants at
    least the target, any other (`<=`, `<`) at most."""
    for name, value, target in checks:
        ok = value >= target if " >= " in name else value <= target
        print(f"  {'PASS' if ok else 'MISS'}  {name}: measured {value:.2f}")


def blas_checks(rates, who="kpipe"):
    """Issue #30's targets on the BLAS workload, from `who`'s samples/s by worker count
    (`{1: ..., 2: ..., 4: ..., "auto": ...}`): workers=2 >= 1.3x workers=1, "auto" >= 0.9x
    the best fixed count, and no fixed count below 0.8x workers=1. A check whose counts
    were not run is left out. Returns `(name, measured, target)` triples."""
    fixed = {c: rate for c, rate in rates.items() if c != "auto"}
    one, checks = fixed.get(1), []
    if one and 2 in fixed:
        checks.append((f"(blas) {who} workers=2 >= 1.3x workers=1", fixed[2] / one, 1.3))
    if "auto" in rates and fixed:
        best = max(fixed, key=fixed.get)
        checks.append((f"(blas) {who} workers='auto' >= 0.9x the best fixed count (workers={best})", rates["auto"] / fixed[best], 0.9))
    if one and len(fixed) > 1:
        worst = min(fixed, key=fixed.get)
        checks.append((f"(blas) {who} slowest fixed count (workers={worst}) >= 0.8x workers=1", fixed[worst] / one, 0.8))
    return checks


def blas_ratios(rows):
    """Gives every row of the BLAS workload's groups (`blas@N`, `blas@auto`) its multiple
    of the serial loop (run in the first group only) and `x_workers1`, its multiple of the
    same loader at workers=1 (None where that did not run)."""
    blas = [r for r in rows if r["workload"].startswith("blas@")]
    serial = next((r["samples_per_s"] for r in blas if r["loader"] == "serial"), None)
    for r in blas:
        r["x_serial"] = r["samples_per_s"] / serial if serial else None
        one = next((o for o in blas if o["workload"] == "blas@1" and o["loader"] == r["loader"]), None)
        r["x_workers1"] = r["samples_per_s"] / one["samples_per_s"] if one and r["loader"] not in ("serial", "tf.data") else None


def print_blas(rows):
    """The BLAS workload as a grid: each loader's batches/s at every worker count, with
    its multiples of the serial loop and of itself at workers=1."""
    blas = [r for r in rows if r["workload"].startswith("blas@")]
    if not blas:
        return
    counts = list(dict.fromkeys(r["workload"].split("@")[1] for r in blas))
    loaders = list(dict.fromkeys(r["loader"] for r in blas))
    print(f"\nBLAS workload: batches/s ({_BLAS_SIZE}x{_BLAS_SIZE} float32, six tanh(a @ a.T) each), and in brackets "
          "x serial / x the same loader at workers=1:")
    print(f"{'loader':<15}" + "".join(f"{'workers=' + c:>26}" for c in counts))
    for loader in loaders:
        cells = []
        for c in counts:
            r = next((r for r in blas if r["workload"] == f"blas@{c}" and r["loader"] == loader), None)
            if r is None:
                cells.append(f"{'':>26}")
                continue
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            end = f" ->{r['workers_end']}" if c == "auto" and "workers_end" in r else ""
            cells.append(f"{r['samples_per_s'] / _BLAS_SIZE:>10.1f} ({fmt(r['x_serial'])} / {fmt(r.get('x_workers1'))}){end}".rjust(26))
        print(f"{loader:<15}" + "".join(cells))
    threads = {r["workload"]: {k: v for k, v in r.items() if "thread" in k} for r in blas if r["loader"] == "kpipe"}
    if any(threads.values()):
        print("kpipe's workers' native threads (its stats): " + "; ".join(f"{w}: {t}" for w, t in threads.items() if t))


_WORKLOADS = ("a", "b", "b-stack", "b-direct", "c", "blas", "s")
_EXTRA_WORKLOADS = ("b-fixed", "b-stack-fixed") + tuple(_workloads.WORKLOADS)  # run only when named
_ALL_WORKLOADS = _WORKLOADS + _EXTRA_WORKLOADS
_PEERS = ("grain-loader", "grain-dataset", "torch", "tf.data", "keras-mp")  # for (b)'s target: the other ways to load
_LOADERS = ("serial", "keras-threads", "keras-mp", "tf.data", "kpipe", "kpipe-ahead", "kpipe-samples", "grain-loader", "grain-dataset",
            "torch")
_EXTRA_LOADERS = ("kpipe-noread",)  # run only when named
_EPOCHS = "a=10,b=8,b-stack=8,b-fixed=8,b-stack-fixed=8,b-direct=30,c=2,blas=5,s=10"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(_WORKLOADS), help=f"comma-separated subset of {','.join(_ALL_WORKLOADS)}. Default: {','.join(_WORKLOADS)}")
    parser.add_argument("--workers", type=int, default=2, help="workers for every parallel loader. Default: 2")
    parser.add_argument("--io-workers", type=int, default=16, help="workers for workload c (plus a run at --workers). Default: 16")
    parser.add_argument("--epochs", default=_EPOCHS, help=f"epochs timed per loader, per workload (a single number for all). Default: {_EPOCHS}")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="untimed epochs of each loader before the timed ones (the ceiling's workers do one batch untimed); 'from 1st' also times them. Default: 1")
    parser.add_argument("--min-seconds", type=float, default=None, help="each run goes on, whole epochs at a time, until this long after its timed epochs began (the ceiling's too; 0: --epochs only). Default: 5 (0 with --quick)")
    parser.add_argument("--max-queue-size", type=int, default=10, help="batches in flight. Default: 10")
    parser.add_argument("--h5-mb", type=float, default=300, help="size of the generated HDF5 file. Default: 300")
    parser.add_argument("--rss-epochs", type=int, default=20, help="epochs of the RSS-growth check (0: skip). Default: 20")
    parser.add_argument("--ceiling-read", type=int, default=0, metavar="SLOTS",
                        help="also run the ceiling of the b workloads with a consumer: each bare process has this many shared-memory slots "
                             "of its own and hands every batch to the main process, which reads one byte per 4 KiB page of it (as every "
                             "loader's consumer here does) and hands the slot back -- a row 'ceiling-read': what a loader whose batches are "
                             "read can reach at best on these CPUs (no order, no task messages). Default: 0 (off)")
    parser.add_argument("--ceiling-slots", type=int, default=0, help="also run the ceiling of the b workloads with each bare process writing into this many shared-memory slots in turn, as kpipe's workers do (2 per worker in flight and the consumer's: 5 at workers=2), instead of one reused buffer: a row 'ceiling-N-slots'. Default: 0 (off)")
    parser.add_argument("--warm-mb", type=int, default=1024, help="MB written and freed before each run (0: none; see above). Default: 1024")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every loader, in rounds; the best throughput counts. Default: 3")
    parser.add_argument("--blas-workers", default="1,2,4", help="worker counts of the BLAS workload (each loader at each; kpipe also at workers='auto'). Default: 1,2,4")
    parser.add_argument("--loaders", default=",".join(_LOADERS), help=f"comma-separated subset of {','.join(_LOADERS + _EXTRA_LOADERS)} (the ceiling always runs; "
                        "a peer whose package does not import is skipped, with its reason). Default: all but kpipe-noread")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (a smoke test, not a measurement)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    for name in _workloads.WORKLOADS:  # the workloads with a file of their own (scripts/_workloads/)
        _workloads.load(name).add_arguments(parser)
    args = parser.parse_args(argv)

    if args.rss_epochs and args.rss_epochs < 3:
        parser.error(f"--rss-epochs must be 0 (skip) or >= 3 (growth is measured after epoch 2). Received: {args.rss_epochs}")
    epochs = _bench.parse_epochs(parser, "--epochs", args.epochs, _ALL_WORKLOADS)
    workloads = _bench.parse_names(parser, "--workloads", args.workloads, _ALL_WORKLOADS, allow_empty=True)
    loaders = _bench.parse_names(parser, "--loaders", args.loaders, _LOADERS + _EXTRA_LOADERS)
    blas_counts = _bench.parse_counts(parser, "--blas-workers", args.blas_workers)
    skipped = {k: reason for k in loaders if (reason := peer_missing(k))}
    for k, reason in skipped.items():
        print(f"skipped {k}: {reason}", flush=True)
    loaders = [k for k in loaders if k not in skipped]
    scale = 0.125 if args.quick else 1.0
    repeats = 1 if args.quick else args.repeats
    if args.warmup_epochs < 0:
        parser.error(f"--warmup-epochs must be >= 0. Received: {args.warmup_epochs}")
    if repeats < 1:
        parser.error(f"--repeats must be >= 1. Received: {args.repeats}")
    min_seconds = (0.0 if args.quick else 5.0) if args.min_seconds is None else args.min_seconds
    if not min_seconds >= 0:
        parser.error(f"--min-seconds must be >= 0. Received: {args.min_seconds}")
    if args.ceiling_read and args.ceiling_read < 2:
        parser.error(f"--ceiling-read must be 0 (off) or at least 2 slots per process (one written while one is read). "
                     f"Received: {args.ceiling_read}")
    if args.warm_mb < 0:
        parser.error(f"--warm-mb must be >= 0. Received: {args.warm_mb}")
    warm_mb = int(args.warm_mb * scale)
    rows, growth, own_rows = [], None, {}
    for name in _workloads.WORKLOADS:
        if name in workloads:
            own_rows[name], own_skipped = _workloads.load(name).run(args, args.workers, repeats, args.quick)
            skipped.update({f"{name}/{k}": reason for k, reason in own_skipped.items()})
    tmpdir = tempfile.mkdtemp(prefix="kpipe-bench-")
    try:
        if "a" in workloads:
            make = lambda **kw: Augment(num_images=int(2048 * scale), **kw)  # noqa: E731
            rows += measure("a", make, loaders, epochs["a"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds)
            if args.rss_epochs:
                growth = rss_growth(make, min(args.rss_epochs, 4) if args.quick else args.rss_epochs, args.workers)
        if any(w.startswith("b") for w in workloads):
            path = make_h5(os.path.join(tmpdir, "images.h5"), args.h5_mb * scale)
        if "b" in workloads:
            make = lambda **kw: H5Samples(path, **kw)  # noqa: E731
            rows += measure("b", make, loaders, epochs["b"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds, args.ceiling_slots,
                            args.ceiling_read)
        stack_loaders = [x for x in loaders if x != "kpipe-samples"]  # np.stack batches: no per-sample form ((b)'s rows have it)
        if "b-stack" in workloads:
            make = lambda **kw: H5SamplesStack(path, **kw)  # noqa: E731
            rows += measure("b-stack", make, stack_loaders, epochs["b-stack"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds, args.ceiling_slots,
                            args.ceiling_read)
        if "b-stack-fixed" in workloads:
            make = lambda **kw: H5SamplesStackFixed(path, **kw)  # noqa: E731
            rows += measure("b-stack-fixed", make, stack_loaders, epochs["b-stack-fixed"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds, args.ceiling_slots,
                            args.ceiling_read)
        if "b-fixed" in workloads:
            make = lambda **kw: H5SamplesFixed(path, **kw)  # noqa: E731
            rows += measure("b-fixed", make, loaders, epochs["b-fixed"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds, args.ceiling_slots,
                            args.ceiling_read)
        if "b-direct" in workloads:
            make = lambda **kw: H5Contiguous(path, **kw)  # noqa: E731
            rows += measure("b-direct", make, loaders, epochs["b-direct"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds, args.ceiling_slots,
                            args.ceiling_read)
        if "c" in workloads:
            n = max(8, int(48 * scale))
            make = lambda **kw: Waits(n=n, **kw)  # noqa: E731
            rows += measure("c", make, loaders, epochs["c"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds)
            io_loaders = [x for x in loaders if x != "tf.data"] + (["kpipe-threads"] if "kpipe" in loaders else [])
            io_rows = measure(f"c@{args.io_workers}", make, io_loaders, epochs["c"], args.io_workers, max(args.max_queue_size, 2 * args.io_workers), repeats, args.warmup_epochs, warm_mb, min_seconds)
            rows += io_rows
        if "s" in workloads:
            make = lambda **kw: SmallSamples(num_images=int(20480 * scale), **kw)  # noqa: E731
            rows += measure("s", make, loaders, epochs["s"], args.workers, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds)
        if "blas" in workloads:
            n = max(8, int(60 * scale))
            make = lambda **kw: Blas(n=n, **kw)  # noqa: E731
            for i, count in enumerate(blas_counts):  # serial and tf.data (no worker count) in the first group only
                group = loaders if i == 0 else [x for x in loaders if x not in ("serial", "tf.data")]
                rows += measure(f"blas@{count}", make, group, epochs["blas"], count, args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds)
            if "kpipe" in loaders:
                rows += measure("blas@auto", make, ["kpipe"], epochs["blas"], "auto", args.max_queue_size, repeats, args.warmup_epochs, warm_mb, min_seconds)
            blas_ratios(rows)
    finally:
        for name in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, name))
        os.rmdir(tmpdir)

    print(f"\nLoader benchmark: {os.cpu_count()} CPUs, epochs {args.epochs}{f' after {args.warmup_epochs} untimed' if args.warmup_epochs else ''}"
          f"{f' and at least {min_seconds:g} s' if min_seconds else ''} per run, workers={args.workers}, best of {repeats} runs, {warm_mb} MB warmed before each, "
          f"tensorflow {__import__('tensorflow').__version__}, keras {keras.__version__}\n")
    print_table(rows)
    for name, own in own_rows.items():
        _workloads.load(name).print_rows(own, args.workers, repeats)
    for k, reason in skipped.items():
        print(f"(skipped {k}: {reason})")
    print_blas(rows)
    print_cpu_breakdown(rows)
    if growth:
        print(f"\nkpipe RSS over {growth['epochs']} epochs (workload a): after epoch 2 {growth['rss_after_epoch2_mb']:.0f} MB, "
              f"max later {growth['rss_max_later_mb']:.0f} MB, growth {growth['growth_pct']:+.1f}%")
    check_targets(rows, growth, args.io_workers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows + [r for own in own_rows.values() for r in own], "skipped": skipped, "rss_growth": growth, "warmup_epochs": args.warmup_epochs, "min_seconds": min_seconds, "warm_mb": warm_mb, "argv": sys.argv[1:] if argv is None else argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
