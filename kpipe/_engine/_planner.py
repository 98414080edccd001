"""Pass plans: which dataset batch index comes at each position of a pass.

A *pass* is one trip through every batch of the dataset (of this shard). Plans depend only
on `(seed, pass, num_batches, num_shards, shard_index)` -- never on the number of workers
-- so the same seed yields the same batches whatever `workers` is.
"""

import numpy as np


class EpochPlanner:
    """Orders (and shards) the batch indices of each pass. Cheap; not thread-safe.

    With `num_shards=W`, shard `w` gets positions `w, w+W, w+2W, ...` of the pass's
    (shuffled) order: every batch of the pass, once, across the shards. Every shard has
    `ceil(n / W)` positions, so that all of them run the same number of steps, as
    synchronous data parallelism requires: where `n % W != 0` the last position of shards
    `w >= n % W` is a *pad* (`is_pad`), which the loader hands out with no rows -- what
    `tf.distribute`'s datasets give a replica that has no data left in a step (see the
    NOTE in kpipe/distribute/_global_batch.py). A pad loads the pass's first batch(es)
    again, for their structure only.

    `num_batches` is the dataset's length; a dataset whose length changes between passes
    (bucketing, curriculum) passes the new length to `plan`/`index`/`length`.
    """

    def __init__(self, num_batches, *, shuffle=False, seed=None, num_shards=1, shard_index=0):
        self.num_batches = num_batches
        self.shuffle = shuffle
        self.seed = seed
        self.num_shards = num_shards
        self.shard_index = shard_index
        self._cache = (None, None)

    def length(self, num_batches=None):
        """Batches per pass for this shard (pads included), or None when the dataset is infinite."""
        n = self.num_batches if num_batches is None else num_batches
        if n is None:
            return None
        return -(-n // self.num_shards) if self.num_shards > 1 else n

    def is_pad(self, position, num_batches=None):
        """Whether `position` of this shard's passes is a pad (a step without data)."""
        n = self.num_batches if num_batches is None else num_batches
        return n is not None and self.num_shards > 1 and position * self.num_shards + self.shard_index >= n

    def plan(self, epoch, num_batches=None, order=None):
        """The dataset indices of this shard for pass `epoch`, in order (finite datasets);
        a pad's is the pass's first batch not of this shard's plan (see the class docstring).
        `order`: `(shuffle, seed)` of that pass, instead of the planner's own."""
        n = self.num_batches if num_batches is None else num_batches
        shuffle, seed = (self.shuffle, self.seed) if order is None else order
        if self._cache[0] == (epoch, n, shuffle, seed):
            return self._cache[1]
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        if self.num_shards > 1:
            positions = np.arange(self.shard_index, self.length(n) * self.num_shards, self.num_shards)
            order = order[positions % n]
        plan = order.tolist()
        self._cache = ((epoch, n, shuffle, seed), plan)
        return plan

    def index(self, epoch, position, num_batches=None, order=None):
        """Dataset index at `position` of pass `epoch` (`order`: see `plan`)."""
        n = self.num_batches if num_batches is None else num_batches
        if n is None:
            return position * self.num_shards + self.shard_index
        return self.plan(epoch, n, order)[position]


class PassOrders:
    """The order each pass takes, `(shuffle, seed)`, as runs from a first pass on: the
    loader's own order from pass 0, and from some later pass the order a consumer asked
    for (`fit(shuffle=...)`, see kpipe/_order.py) or a restored state recorded. Pure;
    not thread-safe.

    Example:

    >>> orders = PassOrders(False, 7)
    >>> orders.set_from(2, True, 11)
    True
    >>> orders.at(0), orders.at(5)
    ((False, 7), (True, 11))
    """

    def __init__(self, shuffle, seed):
        self._runs = [(0, bool(shuffle), seed)]  # (first pass, shuffle, seed), ascending

    def at(self, pass_):
        """`(shuffle, seed)` of pass `pass_`."""
        for first, shuffle, seed in reversed(self._runs):
            if first <= pass_:
                return shuffle, seed
        return self._runs[0][1:]

    def set_from(self, pass_, shuffle, seed):
        """Pass `pass_` and every later one take `(shuffle, seed)`. Returns whether any
        of them changed."""
        changed = any(first > pass_ for first, _, _ in self._runs) or self.at(pass_) != (bool(shuffle), seed)
        runs = [run for run in self._runs if run[0] < pass_]
        if not runs or runs[-1][1:] != (bool(shuffle), seed):  # (one run per order in a row: `at` stays short)
            runs.append((pass_, bool(shuffle), seed))
        self._runs = runs
        return changed
