"""Epoch plans: which dataset batch index comes at each position of an epoch.

Plans depend only on `(seed, epoch, num_shards, shard_index)` -- never on the number of
workers -- so the same seed yields the same batches whatever `workers` is.
"""

import numpy as np


class EpochPlanner:
    """Orders (and shards) the batch indices of each epoch. Cheap; not thread-safe.

    With `num_shards=W`, shard `w` gets positions `w, w+W, w+2W, ...` of the epoch's
    (shuffled) order, truncated to `n // W` so every shard runs the same number of steps,
    as synchronous data parallelism requires; the `n % W` left-over batches rotate with the
    shuffle, so over epochs every batch is used.
    """

    def __init__(self, num_batches, *, shuffle=False, seed=None, num_shards=1, shard_index=0):
        self.num_batches = num_batches
        self.shuffle = shuffle
        self.seed = seed
        self.num_shards = num_shards
        self.shard_index = shard_index
        self._cache = (None, None)

    @property
    def length(self):
        """Batches per epoch for this shard, or None when the dataset is infinite."""
        if self.num_batches is None:
            return None
        return self.num_batches // self.num_shards if self.num_shards > 1 else self.num_batches

    def plan(self, epoch):
        """The dataset indices of this shard for `epoch`, in order (finite datasets)."""
        if self._cache[0] == epoch:
            return self._cache[1]
        n = self.num_batches
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.num_shards > 1:
            order = order[: self.length * self.num_shards][self.shard_index :: self.num_shards]
        plan = order.tolist()
        self._cache = (epoch, plan)
        return plan

    def index(self, epoch, position):
        """Dataset index at `position` of `epoch`."""
        if self.num_batches is None:
            return position * self.num_shards + self.shard_index
        return self.plan(epoch)[position]
