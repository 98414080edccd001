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

    def plan(self, epoch, num_batches=None):
        """The dataset indices of this shard for pass `epoch`, in order (finite datasets);
        a pad's is the pass's first batch not of this shard's plan (see the class docstring)."""
        n = self.num_batches if num_batches is None else num_batches
        if self._cache[0] == (epoch, n):
            return self._cache[1]
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.num_shards > 1:
            positions = np.arange(self.shard_index, self.length(n) * self.num_shards, self.num_shards)
            order = order[positions % n]
        plan = order.tolist()
        self._cache = ((epoch, n), plan)
        return plan

    def index(self, epoch, position, num_batches=None):
        """Dataset index at `position` of pass `epoch`."""
        n = self.num_batches if num_batches is None else num_batches
        if n is None:
            return position * self.num_shards + self.shard_index
        return self.plan(epoch, n)[position]
