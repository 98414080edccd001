"""`kpipe.Buckets`: batches of samples of similar length (`ProcessLoader.from_samples`),
as tf.data's `bucket_by_sequence_length` and speech pipelines' sorted windows make them.

NOTE [ A pass's buckets ]
-------------------------
Grouping by length keeps padding -- and the batch shapes Keras traces a step for --
down. A pass's batches are a pure function of `(order(p), lengths)`, where `order(p)` is
the pass's sample order (`kpipe/_samples.py`: from `(seed, pass)`), so every worker
computes the same plan whatever the worker count, `state()`/`restore()` resume it
exactly (the loader saves `(pass, batch, seed)`) and shards split its batches:

    boundaries b_0 < ... < b_{k-1}: sample j goes to bucket i = #{b <= len(j)} (bucket i
        holds lengths in [b_{i-1}, b_i)); the samples stream in `order(p)` and a bucket's
        batch is emitted when it holds its `batch_sizes[i]` samples; at the end of the pass
        the partial batches follow in bucket order (or are dropped: `drop_remainder`) --
        tf.data's `bucket_by_sequence_length` (`group_by_window`) batch for batch
    sort_within=N: `order(p)` cut into windows of N batches, each window's samples sorted
        by length (stable), cut into batches, and the pass's batches shuffled from
        `(seed, pass)` when the pass is shuffled

Either way each sample is in exactly one batch per pass and the number of batches is the
same every pass (`sum(ceil(count_i / batch_sizes[i]))` for boundaries), so `len()` is known
before the pass. Lengths come from `from_samples(lengths=...)` (an array or a function of
the index, cheap: metadata), else from one read of every sample when the loader is built.
"""

import numpy as np

from kpipe._padding import _is_int


class Buckets:
    """Length buckets for `ProcessLoader.from_samples(..., buckets=kpipe.Buckets(...))`
    (see the NOTE): either `boundaries` (tf.data's `bucket_by_sequence_length`) or
    `sort_within` (sort by length within windows of that many batches).

    Args:
        boundaries: Increasing ints: bucket i holds samples of length in
            `[boundaries[i-1], boundaries[i])` (the first from 0, the last unbounded).
        batch_sizes: One batch size per bucket (`len(boundaries) + 1` ints); None: the
            `batch_size` given to `from_samples` for every bucket. Defaults to None.
        pad_to_boundary: Pad each bucket's batches to its `boundary - 1` (one shape per
            bucket: one trace per bucket) instead of the batch's longest; samples of the
            last bucket (length >= the last boundary) are then too long
            (`Padding(too_long=...)`). Defaults to False.
        sort_within: Instead of boundaries: sort samples by length within windows of
            this many batches. Defaults to None.

    Example:

    >>> import numpy as np, kpipe
    >>> class Tokens:
    ...     def __len__(self):
    ...         return 6
    ...     def __getitem__(self, j):
    ...         return np.ones([1, 9, 2, 8, 3, 7][j], np.int32)
    >>> buckets = kpipe.Buckets([5], batch_sizes=[2, 2])
    >>> with kpipe.ProcessLoader.from_samples(Tokens(), 2, buckets=buckets, workers=0) as loader:
    ...     [loader[i].shape for i in range(len(loader))]
    [(2, 2), (2, 9), (1, 3), (1, 7)]
    """

    def __init__(self, boundaries=None, batch_sizes=None, *, pad_to_boundary=False, sort_within=None):
        if (boundaries is None) == (sort_within is None):
            raise ValueError("Give `Buckets` either `boundaries` or `sort_within`. Received: "
                             f"boundaries={boundaries!r}, sort_within={sort_within!r}.")
        if sort_within is not None:
            if not (_is_int(sort_within) and sort_within >= 1):
                raise ValueError(f"`sort_within` must be an int >= 1 (batches per window). Received: "
                                 f"sort_within={sort_within!r}.")
            if batch_sizes is not None or pad_to_boundary:
                raise ValueError("`batch_sizes` and `pad_to_boundary` go with `boundaries`, not `sort_within`. "
                                 f"Received: batch_sizes={batch_sizes!r}, pad_to_boundary={pad_to_boundary!r}.")
            self.boundaries, self.sort_within = None, int(sort_within)
        else:
            bounds = list(boundaries)
            if not bounds or not all(_is_int(b) and b >= 1 for b in bounds) or any(
                    a >= b for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"`boundaries` must be increasing ints >= 1. Received: boundaries={boundaries!r}.")
            self.boundaries, self.sort_within = [int(b) for b in bounds], None
        if batch_sizes is not None:
            sizes = list(batch_sizes)
            if len(sizes) != len(self.boundaries) + 1 or not all(_is_int(s) and s >= 1 for s in sizes):
                raise ValueError(f"`batch_sizes` must be {len(self.boundaries) + 1} ints >= 1 (len(boundaries) + 1). "
                                 f"Received: batch_sizes={batch_sizes!r}.")
            batch_sizes = [int(s) for s in sizes]
        self.batch_sizes = batch_sizes
        self.pad_to_boundary = bool(pad_to_boundary)

    def __repr__(self):
        if self.sort_within is not None:
            return f"Buckets(sort_within={self.sort_within})"
        return f"Buckets({self.boundaries}, batch_sizes={self.batch_sizes}, pad_to_boundary={self.pad_to_boundary})"

    def sizes(self, batch_size):
        """The batch size of each bucket (`batch_size` where `batch_sizes` is None)."""
        return self.batch_sizes or [batch_size] * (len(self.boundaries) + 1)

    def limit(self, bucket):
        """The padded length of bucket `bucket`'s batches (None: the batch's longest)."""
        if not self.pad_to_boundary:
            return None
        return self.boundaries[bucket] - 1 if bucket < len(self.boundaries) else self.boundaries[-1] - 1

    def max_length(self):
        """The longest sample the buckets take (None: any)."""
        return self.boundaries[-1] - 1 if self.pad_to_boundary else None

    def bucket_of(self, lengths):
        """The bucket of each length (an int array)."""
        return np.searchsorted(np.asarray(self.boundaries), lengths, side="right")

    def count(self, lengths, batch_size, drop_remainder):
        """Batches per pass over samples of these `lengths` (the same every pass)."""
        if self.sort_within is not None:
            n = len(lengths)
            return n // batch_size if drop_remainder else -(-n // batch_size)
        counts = np.bincount(self.bucket_of(lengths), minlength=len(self.boundaries) + 1)
        sizes = self.sizes(batch_size)
        return int(sum(c // s if drop_remainder else -(-c // s) for c, s in zip(counts, sizes)))

    def plan(self, order, lengths, batch_size, drop_remainder, rng):
        """A pass's batches: `[(bucket, sample indices)]` for the samples of `order` (the
        pass's order; `lengths[j]` sample j's length). `rng` (None: in order) shuffles
        the batches of sorted windows."""
        if self.sort_within is not None:
            return self._sorted_windows(order, lengths, batch_size, drop_remainder, rng)
        ids = self.bucket_of(lengths[order])
        full, tails = [], []
        for k, size in enumerate(self.sizes(batch_size)):
            pos = np.flatnonzero(ids == k)
            members = order[pos]
            whole = len(pos) // size
            full += [(int(pos[(i + 1) * size - 1]), k, members[i * size:(i + 1) * size]) for i in range(whole)]
            if len(pos) % size and not drop_remainder:
                tails.append((k, members[whole * size:]))
        full.sort(key=lambda t: t[0])
        return [(k, m) for _, k, m in full] + tails

    def _sorted_windows(self, order, lengths, batch_size, drop_remainder, rng):
        if drop_remainder:
            order = order[:len(order) - len(order) % batch_size]
        window = self.sort_within * batch_size
        batches = []
        for start in range(0, len(order), window):
            part = order[start:start + window]
            part = part[np.argsort(lengths[part], kind="stable")]
            batches += [(0, part[i:i + batch_size]) for i in range(0, len(part), batch_size)]
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches
