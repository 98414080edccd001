"""Per-step records of `InputProfiler` in bounded memory, and what pattern the waits follow.

NOTE [ How the step timeline stays bounded ]

`StepTimeline` keeps one *row* per training step until `capacity` rows are used. Then it
halves itself: adjacent rows of the same epoch (and the same kind: measured, or left out
as a `skip_steps` warm-up step) are merged pairwise, and from then on each new row
collects `window` steps (1, 2, 4, 8, ... steps, doubling at every halving) before the
next row starts. A row always ends at an epoch boundary, so:

    rows:    | 1 | 1 | 1 | 1 | 1 | 1 | ... full -> | 2 | 2 | 2 | ... | 2 | 2 | 2 | ...
    epoch:   |<----- epoch 0 ----->|<-- 1 ...        |<- epoch 0 ->|<1 ...

* memory is `capacity` rows (about 60 bytes each) whatever the number of steps;
* the sums are exact: a row holds the *sums* of its steps' wait, step time and samples,
  so per-epoch and whole-fit totals over rows equal those over steps (the figures
  `InputProfiler` logs), and per-step means are `wait_s / steps`;
* resolution is uniform over the whole fit: a 100 000-step fit with the default 10 000
  rows keeps windows of 16 steps from the first step to the last (not the first 10 000
  steps in detail and nothing after).

Only when one fit records more epochs than `capacity // 2` (rows cannot merge across an
epoch boundary) do rows of neighbouring epochs merge too, each then counted in the epoch
of its first step; the whole-fit sums stay exact.

Queue depth (batches a `ProcessLoader` has requested and not yet handed out, sampled as
each step asks for its batch) is kept as a sum and a count of samples per row, so its
mean per row is exact as well; NaN where the input is not a `ProcessLoader`.
"""

import dataclasses

import numpy as np

# Row columns: name -> dtype. Sums unless noted.
_COLUMNS = {
    "epoch": np.int64,  # epoch of the row's first step (Keras's epoch index)
    "first_step": np.int64,  # index of the row's first step in this fit, 0-based
    "steps": np.int64,
    "start_s": np.float64,  # start of the row's first step, seconds since the fit began
    "wait_s": np.float64,
    "step_s": np.float64,
    "samples": np.int64,
    "depth_sum": np.float64,  # sum of queue-depth samples (one per training-function call)
    "counted": np.bool_,  # False for the warm-up steps left out by `skip_steps`
    "depth_n": np.int64,  # number of those samples (0: the input is not a ProcessLoader)
}
_PENDING = 256  # closed rows buffered before they are copied into the arrays


@dataclasses.dataclass(frozen=True)
class Steps:
    """The per-step record of an `InputProfiler`: one entry per step, or per window of steps.

    All fields are NumPy arrays of the same length, one entry per *row*; a row is one step
    until the record fills up, then a window of `steps[i]` consecutive steps of one epoch
    (see `window`). Sums over rows are exact; per-step means are e.g. `wait_s / steps`.

    Attributes:
        epoch: Epoch index (as Keras counts it) of each row.
        first_step: Index of the row's first step in the fit, counting from 0.
        steps: Training steps in the row (1 until the record is compacted).
        start_s: When the row's first step began, in seconds since `fit()` began.
        wait_s: Seconds the row's steps waited for their batches.
        step_s: Seconds of training wall time the row's steps took: from the end of the
            previous step of the same epoch (from its own start for an epoch's first step)
            to the end of this one, so the per-epoch sum is the epoch's `wall_s`.
        compute_s: `step_s - wait_s`: the compiled step plus Keras's per-step overhead.
        samples: Samples in the row's batches.
        queue_depth: Mean batches the `ProcessLoader` had requested and not yet handed
            out when the row's steps asked for a batch; NaN for other inputs.
        counted: False for the first `skip_steps` steps (compilation, worker start-up),
            which the epoch figures leave out (unless the epoch has no other step).
        window: Steps per row the record collects now: 1 until it first fills up, then
            2, 4, 8, ...
    """

    epoch: np.ndarray
    first_step: np.ndarray
    steps: np.ndarray
    start_s: np.ndarray
    wait_s: np.ndarray
    step_s: np.ndarray
    compute_s: np.ndarray
    samples: np.ndarray
    queue_depth: np.ndarray
    counted: np.ndarray
    window: int

    def __len__(self):
        return len(self.steps)

    def epoch_totals(self):
        """`{epoch: {"wait_s", "step_s", "steps", "samples"}}` summed the way the epoch
        figures are: over the counted rows, or over the warm-up rows if an epoch has none."""
        totals = {}
        for epoch in np.unique(self.epoch):
            rows = self.epoch == epoch
            if (rows & self.counted).any():
                rows &= self.counted
            totals[int(epoch)] = {
                "wait_s": float(self.wait_s[rows].sum()),
                "step_s": float(self.step_s[rows].sum()),
                "steps": int(self.steps[rows].sum()),
                "samples": int(self.samples[rows].sum()),
            }
        return totals


class StepTimeline:
    """Per-step rows in bounded memory (see the NOTE at the top of this module).

    Not thread-safe: one training loop adds to it.

    Args:
        capacity: Rows kept at most; >= 16. Defaults to 10 000.
    """

    def __init__(self, capacity=10_000):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 16:
            raise ValueError(
                f"`max_records` must be an int >= 16. Received: max_records={capacity!r}. "
                "The default, 10000, takes about 600 KB."
            )
        self.capacity = capacity
        self._cols = {name: np.zeros(capacity, dtype) for name, dtype in _COLUMNS.items()}
        self.clear()

    def clear(self):
        self._n = 0  # rows in the arrays
        self._pending = []  # closed rows not yet copied into the arrays (at most _PENDING)
        self._cur = None  # the open row, as a list in `_COLUMNS` order
        self.window = 1
        self.total_steps = 0

    def __len__(self):
        return self._n + len(self._pending) + (self._cur is not None)

    @property
    def nbytes(self):
        """Bytes held by the rows' arrays (fixed at construction; plus at most
        `_PENDING` rows buffered as tuples)."""
        return sum(a.nbytes for a in self._cols.values())

    def add(self, *, epoch, start_s, wait_s, step_s, steps=1, samples=0, depth=None, counted=True):
        """Adds one training-function call (`steps` steps) to the record.

        Costs about a microsecond: the open row is a Python list; closed rows reach the
        NumPy arrays `_PENDING` at a time."""
        first_step = self.total_steps
        self.total_steps += steps
        cur = self._cur
        if cur is not None and cur[0] == epoch and cur[8] == counted and cur[2] + steps <= self.window:
            cur[2] += steps
            cur[4] += wait_s
            cur[5] += step_s
            cur[6] += samples
            if depth is not None:
                cur[7] += depth
                cur[9] += 1
            return
        if cur is not None:
            self._pending.append(cur)
            if len(self._pending) >= _PENDING:
                self._flush()
        if self._n + len(self._pending) + 1 > self.capacity:
            self._flush()
            self._halve()
        self._cur = [epoch, first_step, steps, start_s, wait_s, step_s, samples,
                     0.0 if depth is None else depth, counted, 0 if depth is None else 1]

    def _flush(self):
        """Copies the pending rows into the arrays."""
        pending, n = self._pending, self._n
        if not pending:
            return
        m = len(pending)
        for k, name in enumerate(_COLUMNS):
            self._cols[name][n : n + m] = [row[k] for row in pending]
        self._n, self._pending = n + m, []

    def _halve(self):
        """Merges adjacent rows pairwise within runs of one epoch and kind; doubles `window`."""
        n, c = self._n, self._cols
        starts = _pair_starts(c["epoch"][:n], c["counted"][:n])
        if len(starts) > 3 * n // 4:  # more epochs than capacity/2: merge across epochs too
            starts = _pair_starts(np.zeros(n, np.int64), c["counted"][:n])
        m = len(starts)
        for name in ("steps", "wait_s", "step_s", "samples", "depth_sum", "depth_n"):
            c[name][:m] = np.add.reduceat(c[name][:n], starts)
        for name in ("epoch", "first_step", "start_s", "counted"):
            c[name][:m] = c[name][starts]
        self._n = m
        self.window *= 2

    def steps(self):
        """The record as a `Steps` of array copies (the open row included)."""
        self._flush()
        n, c = self._n, self._cols
        get = {name: c[name][:n].copy() for name in _COLUMNS}
        if self._cur is not None:
            get = {name: np.append(get[name], np.array(self._cur[k], dtype=_COLUMNS[name])) for k, name in enumerate(_COLUMNS)}
            n += 1
        depth_sum, depth_n = get.pop("depth_sum"), get.pop("depth_n")
        queue_depth = np.full(n, np.nan)
        np.divide(depth_sum, depth_n, out=queue_depth, where=depth_n > 0)
        return Steps(
            compute_s=get["step_s"] - get["wait_s"],
            queue_depth=queue_depth,
            window=self.window,
            **get,
        )


def _pair_starts(*keys):
    """Indices starting each pair of adjacent rows within runs of equal `keys`."""
    n = len(keys[0])
    new_run = np.zeros(n, bool)
    new_run[0] = True
    for key in keys:
        new_run[1:] |= key[1:] != key[:-1]
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(n), 0))
    pos = np.arange(n) - run_start
    return np.flatnonzero(new_run | (pos % 2 == 0))


# -- when the waits happen ------------------------------------------------------------------

#: Patterns `wait_pattern` tells apart.
START, PERIODIC, BURSTS, STEADY = "start of epoch", "periodic", "bursts", "steady"


def wait_pattern(wait_s, steps=None):
    """When in an epoch the steps waited: a pure function of the epoch's per-row waits.

    Args:
        wait_s: Seconds waited per row, in step order (one epoch, measured rows).
        steps: Steps per row; `None` means one each. Defaults to None.

    Returns:
        `(pattern, detail)`: `pattern` is one of `START` (most of the wait in the first
        tenth of the epoch: filling the pipeline), `PERIODIC` (a minority of steps hold
        most of the wait, at a regular spacing: `detail["every"]` steps), `BURSTS` (the
        same, irregularly spaced), `STEADY` (spread over the epoch), or `None` if nothing
        waited. `detail` has `head_share` (share of the wait in the first tenth of the
        steps) and `spike_steps` (share of the steps that hold the spikes).
    """
    wait = np.asarray(wait_s, dtype=np.float64)
    count = np.ones(len(wait), np.int64) if steps is None else np.asarray(steps, np.int64)
    total = wait.sum()
    if len(wait) == 0 or total <= 0:
        return None, {}
    position = np.cumsum(count) - count  # first step of each row
    n_steps = int(count.sum())
    head = position < max(1, int(np.ceil(0.1 * n_steps)))
    detail = {"head_share": float(wait[head].sum() / total)}
    if detail["head_share"] >= 0.5 and n_steps >= 5:
        return START, detail
    per_step = wait / count
    spikes = per_step > 2.0 * np.median(per_step)
    spike_steps = float(count[spikes].sum() / n_steps)
    detail["spike_steps"] = spike_steps
    if spikes.sum() >= 3 and spike_steps <= 0.34 and wait[spikes].sum() >= 0.6 * total:
        gaps = np.diff(position[spikes])
        values, counts = np.unique(gaps, return_counts=True)
        # a regular period: most gaps within one step (or one row) of the commonest gap
        mode = values[np.argmax(counts)]
        near = np.abs(gaps - mode) <= max(1, int(count.max()))
        if mode > 1 and near.mean() >= 0.6:
            detail["every"] = int(mode)
            return PERIODIC, detail
        return BURSTS, detail
    return STEADY, detail
