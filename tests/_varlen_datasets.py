"""Variable-length per-sample datasets for tests/test_variable_length.py and
scripts/bench_varlen.py, in a module that imports only NumPy: the workers that unpickle
them must not import TensorFlow on their account."""

import os

import numpy as np


def token_lengths(n, seed=0, low=0, high=30):
    return np.random.default_rng(seed).integers(low, high, size=n)


class Tokens:
    """Sample j: token ids 1..vocab-1 of length `lengths[j]` (int32) and a label j % 2;
    as a dict `{"input_ids", "attention_mask", "labels"}` with `dict_samples`. `bad`:
    {j: "rank" | "dtype" | "inner"} makes sample j's ids 2-D, int64, or (L, 2) instead;
    `index_labels`: the label is j; `column_targets`: a float32 (1,) target (a model's
    output shape) instead."""

    def __init__(self, lengths, dict_samples=False, mask=False, bad=None, vocab=50, index_labels=False,
                 column_targets=False):
        self.lengths, self.dict_samples, self.mask = np.asarray(lengths), dict_samples, mask
        self.index_labels, self.column_targets = index_labels, column_targets
        self.bad, self.vocab = bad or {}, vocab
        self.reads = 0  # samples read in this process

    def __len__(self):
        return len(self.lengths)

    def ids(self, j):
        return ((np.arange(self.lengths[j]) * 7 + j * 3) % (self.vocab - 1) + 1).astype(np.int32)

    def __getitem__(self, j):
        if not 0 <= j < len(self):
            raise IndexError(j)
        self.reads += 1
        ids = self.ids(j)
        kind = self.bad.get(j)
        if kind == "rank":
            ids = ids[:, None]
        elif kind == "dtype":
            ids = ids.astype(np.int64)
        label = np.int32(j if self.index_labels else j % 2)
        if self.column_targets:
            return ids, np.float32([label])
        if not self.dict_samples:
            return ids, label
        sample = {"input_ids": ids, "labels": label}
        if self.mask:
            sample["attention_mask"] = np.ones(len(ids), np.int32)
        return sample


class Frames(Tokens):
    """Sample j: a float32 (length, 2) array of j and a float32 target j; sample `bad`'s
    frames are (length, 3)."""

    def __getitem__(self, j):
        if not 0 <= j < len(self):
            raise IndexError(j)
        width = 3 if self.bad.get(j) == "inner" else 2
        x = np.full((self.lengths[j], width), j, np.float32)
        return (x, np.float32([j])) if self.column_targets else (x, np.float32(j))


class Pids(Tokens):
    """Tokens whose label is the id of the process that read the sample."""

    def __getitem__(self, j):
        ids, _ = super().__getitem__(j)
        return ids, os.getpid()


def pad_right(samples):
    """A collate function: ids padded with -1 to the batch's longest, labels stacked, and
    the pid of the process that collated them."""
    longest = max(len(ids) for ids, _ in samples)
    ids = np.full((len(samples), longest), -1, np.int32)
    for r, (row, _) in enumerate(samples):
        ids[r, :len(row)] = row
    return ids, np.array([label for _, label in samples]), np.full(len(samples), os.getpid())


class Watched(Tokens):
    """Tokens that note, at each `__getitem__`, which earlier samples' ids are still alive
    (a weak reference each)."""

    def __init__(self, lengths):
        super().__init__(lengths)
        self.alive_at_load, self._refs = [], []

    def __getitem__(self, j):
        import weakref

        self.alive_at_load.append([k for k, ref in self._refs if ref() is not None])
        ids, label = super().__getitem__(j)
        self._refs.append((j, weakref.ref(ids)))
        return ids, label
