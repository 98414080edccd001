"""Batches built from a per-sample dataset where they are handed over
(`ProcessLoader.from_samples`).

NOTE [ Per-sample batches in shared memory ]
--------------------------------------------
The commonest loader reads one sample at a time and stacks a batch (`np.stack`, PyTorch's
collate, Grain's `Batch`): a fresh batch array per call -- its pages faulted and zeroed --
filled, then copied again into the shared-memory slot that hands it over. Here a worker
builds batch `b` of pass `p` itself:

    order(p)   = the pass's sample order: a permutation of range(n) from (seed, p), or
                 range(n) unshuffled -- the same in every process, whatever the worker count
    samples    = order(p)[b * B : (b + 1) * B]
    first      = dataset[samples[0]]                  a tree of arrays (one sample)
    batch      = kpipe.empty((rows,) + leaf.shape, leaf.dtype) for each leaf: in a worker
                 process that is the batch's own slot (see `_alloc.py`), elsewhere NumPy
    batch[r]   = dataset[samples[r]], leaf by leaf    each sample written once, in place

and returns the batch arrays, which already live in the slot: the worker hands them over
without a copy. Each sample is dropped before the next is read, so the allocator reuses
its memory (still in the core's cache) for the next one: holding it made the allocator
cycle through one more buffer per sample, 10 us more per 600 KB image (workload b of
`scripts/bench_loaders.py`: 0.86x -> 0.91x of the same work done in place).

Built so, each sample is read once per pass (every sample exactly once; the `n % B` left
over form a smaller last batch, or are left out with `drop_remainder`, and rotate with
the shuffle), deterministically, and `state()`/`restore()`, sharding
(`num_shards` splits a pass's batches) and epoch hooks work as for any dataset: this is a
dataset of batches to the loader. The loader hands workers the key `(pass, batch, seed)`
(not only the batch index; `seed` None for a pass in order), so no state needs to travel
at a pass end to reshuffle, and the order `fit(shuffle=...)` chooses for a pass (the NOTE
in `kpipe/_order.py`) is a sample order: the loader keeps the batches of a keyed dataset
in order and shuffles the samples instead. Samples of
one batch must agree in structure, dtype and shape (a named error otherwise).

Variable-length samples take three options, all built into the same slot:

    padding=kpipe.Padding(...)   each leaf padded along its first axis (`kpipe/_padding.py`)
    buckets=kpipe.Buckets(...)   the pass's batches group samples of similar length
                                 (`kpipe/_buckets.py`); padding defaults to Padding()
    collate=f                    f(list of samples) -> the batch, run in the worker; its
                                 arrays are copied into the slot (or made there with
                                 `kpipe.empty`), as any `__getitem__`'s are

Lengths (`lengths=`: an array of `len(dataset)` ints, or a function of the index called
once per sample when the loader is built) let the plan avoid loading samples: buckets
and `Padding(too_long="drop")` need every length before a pass, and without `lengths`
each sample is read once, in the main process, when the loader is built to measure it
(the first padded leaf's first axis). Given lengths are checked against the samples as
they are padded (a named error when they disagree; a collate function sees the samples
as they are).

The window: left at its default, `max_queue_size` is `max(4, 2 * workers)` as for any
loader, but with worker processes the window may deepen (when workers idled behind a
slower batch: `_engine/_window.py`) up to 16 batches in flight while 16 of the last batch
take at most 32 MiB (`_args.small_batch_queue`; never below the default). Per-sample
batches are often small (32 token rows: ~64 KB, ~2 ms of work) and of uneven cost (length
buckets), so at two per worker a worker ran out of work while the consumer waited for a
longer bucket's batch: 0.82x bare processes on `scripts/bench_varlen.py`'s text, ~1.0x at
16. An explicit `max_queue_size` is the bound as given.
"""

import os
import warnings

import numpy as np

from kpipe import _args, _buckets, _padding, _samples_into
from kpipe._engine import _alloc, _tree
from kpipe.errors import BatchStructureError

_OPTIONS = ("padding", "buckets", "lengths", "collate")


class SampleBatches:
    """Batches of `batch_size` samples of a per-sample `dataset` (see the NOTE). Picklable;
    the loader sends it to its workers.

    Args:
        dataset: `__getitem__(j)` returns sample `j` (an array, or a tuple/dict of arrays
            or scalars); `__len__()` the number of samples.
        batch_size: Samples per batch.
        shuffle: A new sample order every pass, from `(seed, pass)`.
        seed: The shuffle's seed.
        drop_remainder: Leave out the last `n % batch_size` samples of each pass (a
            smaller last batch otherwise).
        padding: A `kpipe.Padding`, or None (samples stacked: one shape per batch).
        buckets: A `kpipe.Buckets`, or None.
        lengths: The samples' lengths (an int array), or None.
        collate: A function `list of samples -> batch`, or None.
        pool: The sample indices a pass reads (None: all; fewer after `too_long="drop"`).
    """

    _kpipe_keyed_by_pass = True  # the loader gives __getitem__ `(pass, batch)` keys
    default_queue = False  # from_samples left max_queue_size at its default (the reader's _args.small_batch_queue)

    def __init__(self, dataset, batch_size, *, shuffle, seed, drop_remainder, padding=None, buckets=None,
                 lengths=None, collate=None, pool=None):
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.padding, self.buckets, self.lengths, self.collate, self.pool = padding, buckets, lengths, collate, pool
        self._count = None if buckets is None else buckets.count(self._pool_lengths(), batch_size, drop_remainder)
        self._order = (None, None)  # (pass, order) of the last pass a batch came from
        self._plan = (None, None)  # (pass, buckets' batches) likewise
        self._pad = None  # the padding `_padding.Plan` of the samples' structure
        self._walk = None  # its `_leaves_of`

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_order", "_plan", "_pad", "_walk")}

    def __setstate__(self, state):
        self.__dict__.update(state, _order=(None, None), _plan=(None, None), _pad=None, _walk=None)

    @property
    def kpipe_varying_shapes(self):
        """Whether batches' inner sizes vary (padding, collate): `as_dataset()`'s spec
        leaves them None."""
        return self.padding is not None or self.collate is not None

    def num_samples(self):
        return len(self.dataset) if self.pool is None else len(self.pool)

    def _pool_lengths(self):
        return self.lengths if self.pool is None else self.lengths[self.pool]

    def __len__(self):
        if self._count is not None:
            return self._count
        n = self.num_samples()
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def order(self, pass_, seed=False):
        """The sample order of pass `pass_` (cached for the pass being read): shuffled by
        `seed` (None: in order; default: this object's own `shuffle` and `seed`)."""
        if seed is False:
            seed = self.seed if self.shuffle else None
        if self._order[0] != (pass_, seed):
            n = self.num_samples()
            order = np.random.default_rng([seed, pass_]).permutation(n) if seed is not None else np.arange(n)
            if self.pool is not None:
                order = self.pool[order]
            self._order = ((pass_, seed), order)
        return self._order[1]

    def batch(self, key):
        """`(bucket, sample indices)` of batch `key`: `(pass, batch, seed)` as the loader
        gives it (its order of that pass: `seed` None is in order), `(pass, batch)` or a
        batch of pass 0 (this object's own order); bucket None without buckets."""
        if not isinstance(key, tuple):
            key = (0, key)
        pass_, b, seed = key if len(key) == 3 else (*key, False)
        if not 0 <= b < len(self):
            raise IndexError(f"batch {b} is out of range for {len(self)} batches of {self.batch_size} samples")
        order = self.order(pass_, seed)
        if self.buckets is None:
            return None, order[b * self.batch_size:(b + 1) * self.batch_size]
        if self._plan[0] != self._order[0]:
            seed = self._order[0][1]
            rng = np.random.default_rng([seed, pass_, 1]) if seed is not None else None
            plan = self.buckets.plan(order, self.lengths, self.batch_size, self.drop_remainder, rng)
            self._plan = (self._order[0], plan)
        return self._plan[1][b]

    def samples(self, key):
        """The sample indices of batch `key` (see `batch`)."""
        return self.batch(key)[1]

    def __getitem__(self, key):
        if self.padding is None and self.collate is None:
            return self._stacked(self.samples(key).tolist())
        bucket, indices = self.batch(key)
        samples = indices.tolist()
        if self.collate is not None:
            return self.collate([self.dataset[j] for j in samples])
        limit = self.buckets.limit(bucket) if self.buckets is not None else None
        given = None if self.lengths is None else self.lengths[indices].tolist()
        dataset = self.dataset
        first = dataset[samples[0]]
        treedef, leaves, _ = _tree.flatten(first, what="sample")
        if self._pad is None or self._pad.treedef != treedef:
            self._pad = _padding.Plan(self.padding, treedef, leaves, _name(dataset))
            self._walk = _leaves_of(treedef)
        targets = self._pad.targets(limit, given=given)
        leaves_of = self._walk
        if targets is None:  # (the padded lengths are known once every sample is read)
            rows = [leaves]
            for j in samples[1:]:
                sample = dataset[j]
                leaves = leaves_of(sample)
                if leaves is None:
                    raise _structure_error(dataset, j, sample, samples[0], treedef)
                rows.append([_padding.as_leaf(v) for v in leaves])
            return self._pad.fill(samples, rows, limit, given)
        batch = self._pad.batch(len(samples), samples[0], leaves, targets, limit)
        batch.put(0, samples[0], leaves, None if given is None else given[0])
        first = leaves = None
        # (each written as it is read, and dropped before the next is read: the NOTE)
        batch.read(1, samples[1:], dataset.__getitem__, leaves_of, None if given is None else given[1:],
                   lambda j, sample: _structure_error(dataset, j, sample, samples[0], treedef))
        return batch.finish()

    def _stacked(self, samples):
        first = self.dataset[samples[0]]
        treedef, leaves, paths = _tree.flatten(first, what="sample")
        batch = [_alloc.empty((len(samples),) + leaf.shape, leaf.dtype) for leaf in leaves]
        for out, leaf in zip(batch, leaves):
            out[0] = leaf
        first = leaves = leaf = None
        into = _samples_into.hook(self.dataset)
        if into is not None:  # (the dataset writes each sample into its row: kpipe/_samples_into.py)
            _samples_into.fill(into, treedef, batch, samples)
            return _tree.unflatten(treedef, batch)
        leaves_of = _leaves_of(treedef)
        rows = [(path, out, out.shape[1:], out.dtype) for path, out in zip(paths, batch)]
        for row in range(1, len(samples)):
            j = samples[row]
            sample = self.dataset[j]
            values = leaves_of(sample)
            if values is None:
                raise _structure_error(self.dataset, j, sample, samples[0], treedef)
            for (path, out, shape, dtype), value in zip(rows, values):
                # (NumPy scalars have a shape and dtype already: no array made for a label)
                leaf = value if type(value) is np.ndarray or isinstance(value, np.generic) else np.asarray(value)
                if leaf.shape != shape or leaf.dtype != dtype:
                    raise BatchStructureError(
                        f"Sample {j} of `{_name(self.dataset)}` has {path} with shape {leaf.shape} and dtype "
                        f"{leaf.dtype}, but sample {samples[0]} of the same batch had {shape} and "
                        f"{dtype}. Samples are stacked into one batch array: give them one shape and dtype "
                        "in __getitem__ (resize, crop or pad them: from_samples(padding=kpipe.Padding())), "
                        "or batch them yourself in a PyDataset.")
                out[row] = leaf
            # (drop this sample before the next is made: its memory is then reused for it)
            sample = values = value = leaf = None
        return _tree.unflatten(treedef, batch)


def _structure_error(dataset, j, sample, first, treedef):
    return BatchStructureError(
        f"Sample {j} of `{_name(dataset)}` has structure "
        f"{_tree.describe(_tree.flatten(sample, what='sample')[0])}, but sample {first} of the "
        f"same batch had {_tree.describe(treedef)}. Every sample must have the same structure.")


def _leaves_of(treedef):
    """A function `sample -> its leaves` for samples of structure `treedef` (None for a
    sample of another structure): the per-sample walk without building the paths and
    checks `_tree.flatten` makes for the first sample of a batch."""
    tag = treedef[0]
    if tag == "leaf":
        return lambda node: [node]
    if tag == "none":
        return lambda node: [] if node is None else None
    if tag in ("tuple", "list"):
        kind = tuple if tag == "tuple" else list
        children = treedef[1]
        if all(c[0] == "leaf" for c in children):  # the common sample, (x, y) of arrays
            n = len(children)
            return lambda node: list(node) if type(node) is kind and len(node) == n else None
        walks = [_leaves_of(c) for c in children]

        def items(node):
            return list(node) if type(node) is kind and len(node) == len(walks) else None
    else:  # dict
        keys, walks = treedef[1], [_leaves_of(c) for c in treedef[2]]

        def items(node):
            return [node[k] for k in keys] if type(node) is dict and node.keys() == set(keys) else None

    def walk(node):
        values = items(node)
        if values is None:
            return None
        out = []
        for value, leaves_of in zip(values, walks):
            leaves = leaves_of(value)
            if leaves is None:
                return None
            out += leaves
        return out

    return walk


class _SampleBatchesWithHooks(SampleBatches):
    """The same, for a dataset with epoch hooks of its own: they run when the loader's
    consumer calls them (the `ProcessLoader` rule), and the new state reaches workers."""

    def on_epoch_begin(self):
        hook = getattr(self.dataset, "on_epoch_begin", None)
        if callable(hook):
            hook()

    def on_epoch_end(self):
        hook = getattr(self.dataset, "on_epoch_end", None)
        if callable(hook):
            hook()


def for_loader(dataset, batch_size, *, shuffle, seed, drop_remainder, has_hooks, options=None):
    """The `SampleBatches` of `ProcessLoader.from_samples(...)`, its arguments checked (a
    random seed for None); the dataset's own epoch hooks (`has_hooks`) are passed on.
    `options`: the from_samples keyword arguments; the variable-length ones (`padding`,
    `buckets`, `lengths`, `collate`: the NOTE) are taken out of it."""
    options = {} if options is None else options
    padding, buckets, lengths, collate = (options.pop(k, None) for k in _OPTIONS)
    batch_size = _args.check_int("batch_size", batch_size, 1, "It is the number of samples per batch.")
    _args.check_dataset(dataset)
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"`dataset` must have __len__ (its number of samples) for from_samples. Received: "
                        f"{_name(dataset)}. An infinite dataset is read through a PyDataset of batches.")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else _args.check_int("seed", seed, 0, "")
    padding, buckets, collate = _check_options(padding, buckets, collate)
    pool = None
    if lengths is not None or buckets is not None or (padding is not None and padding.too_long == "drop"):
        lengths, pool = _lengths_and_pool(dataset, lengths, padding, buckets)
    cls = _SampleBatchesWithHooks if has_hooks else SampleBatches
    batches = cls(dataset, batch_size, shuffle=bool(shuffle), seed=seed, drop_remainder=bool(drop_remainder),
                  padding=padding, buckets=buckets, lengths=lengths, collate=collate, pool=pool)
    batches.default_queue = options.get("max_queue_size") is None  # (an explicit one always wins)
    if len(batches) == 0:
        raise ValueError(f"`{_name(dataset)}` has {batches.num_samples()} samples, fewer than batch_size={batch_size} "
                         "with drop_remainder=True: no batch. Use a smaller batch_size.")
    return batches


def _check_options(padding, buckets, collate):
    if padding is not None and not isinstance(padding, _padding.Padding):
        raise TypeError(f"`padding` must be a kpipe.Padding or None. Received: padding={padding!r}.")
    if buckets is not None and not isinstance(buckets, _buckets.Buckets):
        raise TypeError(f"`buckets` must be a kpipe.Buckets or None. Received: buckets={buckets!r}.")
    if collate is not None and not callable(collate):
        raise TypeError(f"`collate` must be a function (list of samples -> batch). Received: collate={collate!r}.")
    if collate is not None and padding is not None:
        raise ValueError("Give `padding` or `collate`, not both: a collate function builds the whole batch. "
                         f"Received: padding={padding!r}, collate={collate!r}.")
    if buckets is not None and padding is None and collate is None:
        padding = _padding.Padding()
    return padding, buckets, collate


def _lengths_and_pool(dataset, lengths, padding, buckets):
    """The samples' lengths (given, or measured by reading each sample once) and the
    indices a pass reads: all, or those not too long with `Padding(too_long="drop")`
    (counted by a warning). A sample too long for "raise" is refused here already."""
    n = len(dataset)
    if lengths is None:
        lengths = _measure(dataset, padding)
    else:
        if callable(lengths):
            lengths = [lengths(j) for j in range(n)]
        given = lengths
        lengths = np.asarray(given)
        if lengths.shape != (n,) or lengths.dtype.kind not in "iu" or (n and lengths.min() < 0):
            raise ValueError(f"`lengths` must give one int >= 0 per sample ({n} for `{_name(dataset)}`), as an array "
                             f"or a function of the index. Received: {_short(given)} (shape {lengths.shape}, dtype "
                             f"{lengths.dtype}).")
        lengths = lengths.astype(np.int64)
    limit = None if padding is None else padding.max_length(None if buckets is None else buckets.max_length())
    if limit is None or padding.too_long == "truncate" or not (lengths > limit).any():
        return lengths, None
    long = np.flatnonzero(lengths > limit)
    if padding.too_long == "raise":
        raise BatchStructureError(
            f"Sample {long[0]} of `{_name(dataset)}` has length {lengths[long[0]]}, longer than the padded length "
            f"{limit} ({len(long)} of {n} samples are). Give Padding(too_long='truncate') to cut them, or "
            "too_long='drop' to leave them out, or a larger length.")
    warnings.warn(f"from_samples: {len(long)} of {n} samples of `{_name(dataset)}` are longer than {limit} and are left "
                  "out of every pass (Padding(too_long='drop')).", stacklevel=4)
    return lengths, np.setdiff1d(np.arange(n), long)


def _measure(dataset, padding):
    """Every sample's length, each read once: the first axis of its first padded leaf."""
    if not len(dataset):
        return np.empty(0, np.int64)
    sample = dataset[0]
    treedef, leaves, _ = _tree.flatten(sample, what="sample")
    k = _padding.Plan(padding or _padding.Padding(), treedef, leaves, _name(dataset)).length_leaf
    leaves_of, lengths = _leaves_of(treedef), np.empty(len(dataset), np.int64)
    for j in range(len(dataset)):
        sample = dataset[j] if j else sample
        values = leaves_of(sample)
        if values is None:
            raise _structure_error(dataset, j, sample, 0, treedef)
        lengths[j] = np.shape(values[k])[0]
    return lengths


def _short(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _name(dataset):
    return type(dataset).__name__
