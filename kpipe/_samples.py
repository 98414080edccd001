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
"""

import os

import numpy as np

from kpipe import _args
from kpipe._engine import _alloc, _tree
from kpipe.errors import BatchStructureError


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
    """

    _kpipe_keyed_by_pass = True  # the loader gives __getitem__ `(pass, batch)` keys

    def __init__(self, dataset, batch_size, *, shuffle, seed, drop_remainder):
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self._order = (None, None)  # (pass, order) of the last pass a batch came from

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_order"}

    def __setstate__(self, state):
        self.__dict__.update(state, _order=(None, None))

    def num_samples(self):
        return len(self.dataset)

    def __len__(self):
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
            self._order = ((pass_, seed), order)
        return self._order[1]

    def samples(self, key):
        """The sample indices of batch `key`: `(pass, batch, seed)` as the loader gives it
        (its order of that pass: `seed` None is in order), `(pass, batch)` or a batch of
        pass 0 (this object's own order)."""
        if not isinstance(key, tuple):
            key = (0, key)
        pass_, b, seed = key if len(key) == 3 else (*key, False)
        if not 0 <= b < len(self):
            raise IndexError(f"batch {b} is out of range for {len(self)} batches of {self.batch_size} samples")
        return self.order(pass_, seed)[b * self.batch_size:(b + 1) * self.batch_size]

    def __getitem__(self, key):
        samples = self.samples(key).tolist()
        first = self.dataset[samples[0]]
        treedef, leaves, paths = _tree.flatten(first, what="sample")
        batch = [_alloc.empty((len(samples),) + leaf.shape, leaf.dtype) for leaf in leaves]
        for out, leaf in zip(batch, leaves):
            out[0] = leaf
        first = leaves = leaf = None
        leaves_of = _leaves_of(treedef)
        rows = [(path, out, out.shape[1:], out.dtype) for path, out in zip(paths, batch)]
        for row in range(1, len(samples)):
            j = samples[row]
            sample = self.dataset[j]
            values = leaves_of(sample)
            if values is None:
                raise BatchStructureError(
                    f"Sample {j} of `{_name(self.dataset)}` has structure "
                    f"{_tree.describe(_tree.flatten(sample, what='sample')[0])}, but sample {samples[0]} of the "
                    f"same batch had {_tree.describe(treedef)}. Every sample must have the same structure.")
            for (path, out, shape, dtype), value in zip(rows, values):
                # (NumPy scalars have a shape and dtype already: no array made for a label)
                leaf = value if type(value) is np.ndarray or isinstance(value, np.generic) else np.asarray(value)
                if leaf.shape != shape or leaf.dtype != dtype:
                    raise BatchStructureError(
                        f"Sample {j} of `{_name(self.dataset)}` has {path} with shape {leaf.shape} and dtype "
                        f"{leaf.dtype}, but sample {samples[0]} of the same batch had {shape} and "
                        f"{dtype}. Samples are stacked into one batch array: give them one shape and dtype "
                        "in __getitem__ (resize, crop or pad them), or batch them yourself in a PyDataset.")
                out[row] = leaf
            # (drop this sample before the next is made: its memory is then reused for it)
            sample = values = value = leaf = None
        return _tree.unflatten(treedef, batch)


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


def for_loader(dataset, batch_size, *, shuffle, seed, drop_remainder, has_hooks):
    """The `SampleBatches` of `ProcessLoader.from_samples(...)`, its arguments checked (a
    random seed for None); the dataset's own epoch hooks (`has_hooks`) are passed on."""
    batch_size = _args.check_int("batch_size", batch_size, 1, "It is the number of samples per batch.")
    _args.check_dataset(dataset)
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"`dataset` must have __len__ (its number of samples) for from_samples. Received: "
                        f"{_name(dataset)}. An infinite dataset is read through a PyDataset of batches.")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else _args.check_int("seed", seed, 0, "")
    cls = _SampleBatchesWithHooks if has_hooks else SampleBatches
    batches = cls(dataset, batch_size, shuffle=bool(shuffle), seed=seed, drop_remainder=bool(drop_remainder))
    if len(batches) == 0:
        raise ValueError(f"`{_name(dataset)}` has {batches.num_samples()} samples, fewer than batch_size={batch_size} "
                         "with drop_remainder=True: no batch. Use a smaller batch_size.")
    return batches


def _name(dataset):
    return type(dataset).__name__
