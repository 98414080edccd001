"""What a loader has in flight: the ordered queue of batches asked of the backend, how
deep it goes, and the wait for one of them.

The window holds entries keyed `(pass, position)` in ascending order (see the NOTE in
`_position.py`): each is a task submitted to the backend, or a batch a probe read and keeps
for the read that consumes it. It submits the next keys up to its depth (`fill`), in the
order its owner says (`next_key`: what loads next is a policy of the loader's, which knows
the hooks and read limits), drops what is no longer wanted, and waits for a key (`take`).

How deep, and when a batch may take a new shared-memory slot, is the NOTE in `_pool.py`
("kpipe worker shutdown and slot lifecycle"); the deepening rule itself is `deepen`, a pure
function of measured times. A backend without slots (threads, inline) answers the slot
questions with its defaults (`_backend.Backend`), which make every such rule a no-op.

Not thread-safe: the loader calls it under its lock.
"""

import collections
import time

_UNSET = object()


class Entry:
    """A queued batch: its dataset index, the backend task, and the batch once a probe
    read it (kept for the read that consumes it)."""

    __slots__ = ("index", "seq", "batch")

    def __init__(self, index, seq):
        self.index = index
        self.seq = seq
        self.batch = None


def deepen(*, idle_behind_s, slot_price_s, mean_batch_s):
    """Whether one more batch in flight per worker pays ("rent before buying").

    Workers that idled behind slow batches with the window full would have been busy with
    more batches in flight -- but each batch in flight holds a slot, and a new slot costs
    its worker a one-time set-up (`slot_price_s` for the slots the deepening adds). So the
    window deepens once the worker-seconds spent idle so (`idle_behind_s`, since it last
    deepened) reach that price, or at once where the slots cost less than loading one batch
    (`mean_batch_s`: threads need no slot, small batches' slots cost microseconds)."""
    return idle_behind_s >= slot_price_s or slot_price_s <= mean_batch_s


class Window:
    """The batches in flight for one loader (see the module docstring).

    Args:
        position: The loader's `Position` (keys, their indices and seeds, distances).
        stats: The loader's counters: `loads`, `discards`, `wait_s` and `last_batch_bytes`
            are kept here.
        max_queue_size: The most batches in flight.
        max_queue_bytes: Also bound the bytes in flight (None: batches only).
        small_batches: `(base, max_bytes)`: more than `base` batches in flight (up to
            max_queue_size) only while that many of the last batch take at most
            `max_bytes` (see `ceiling`); None: up to max_queue_size whatever their size.
        workers: Workers loading (0: in the calling thread).
        next_key: `next_key(after)` -> the key to load next after the last queued one (or
            from `after` when the queue is empty; `_UNSET`: where reading goes on), or None.
        before_submit: `before_submit(key)`, called before a key is submitted.
    """

    def __init__(self, position, stats, *, max_queue_size, max_queue_bytes, workers, next_key, before_submit,
                 small_batches=None):
        self.position = position
        self.stats = stats
        self.max_queue_size = max_queue_size
        self.max_queue_bytes = max_queue_bytes
        self.small_batches = small_batches
        self.backend = None
        self.queue = collections.OrderedDict()  # key (pass, position) -> Entry, keys ascending
        self._next_key = next_key
        self._before_submit = before_submit
        self.set_workers(workers)
        self._consumer_releases = True  # it drops each batch as it takes the next one
        self._slot_awaited = False  # a batch waits for the consumer to release a slot
        self._releases_seen = 0  # slot releases when it began to wait

    def set_workers(self, workers):
        """Starts over at two batches per worker (with `workers` workers), grown (up to
        max_queue_size) when a worker idles behind a slow batch. Fewer slots in flight
        means less shared memory, and fewer slots to create (and page in) before the first
        pass flows (the NOTE in kpipe/_engine/_pool.py)."""
        self.workers = workers
        self.depth = self.max_queue_size if workers == 0 else min(self.max_queue_size, 2 * workers)
        # Worker-seconds spent idle behind slow batches with the window full since it last
        # deepened, and when (with how many idle) the current such wait began: see starved.
        self.idle_behind_s = 0.0
        self._idle_since = None

    # ------------------------------------------------------------------ contents
    def ceiling(self):
        """The most batches in flight the window may deepen to: max_queue_size, or with
        `small_batches=(base, max_bytes)`, `base` until a batch is known, then as many of
        the last batch as `max_bytes` hold, between `base` and max_queue_size."""
        if self.small_batches is None:
            return self.max_queue_size
        base, max_bytes = self.small_batches
        last = self.stats["last_batch_bytes"]
        return max(base, min(self.max_queue_size, max_bytes // last)) if last else base

    def limit(self):
        """Batches to keep in flight now: the depth (in worker calls: `batches_per_call`),
        within the ceiling, and within max_queue_bytes if set."""
        limit = min(self.depth, self.ceiling())
        if self.backend is not None:  # batches that share a worker call count as one towards the depth
            limit = min(self.max_queue_size, limit * self.backend.batches_per_call())
        last = self.stats["last_batch_bytes"]
        if self.max_queue_bytes is not None:  # until a batch size is known: one per worker
            limit = max(1, self.workers, min(limit, self.max_queue_bytes // last if last else 0))
        return limit

    def in_flight(self):
        return sum(1 for e in self.queue.values() if e.batch is None)

    def last_key(self):
        return next(reversed(self.queue), None)

    def submit(self, key):
        self._before_submit(key)
        index = self.position.index(key)
        self.stats["loads"] += 1
        return Entry(index, self.backend.submit(index, seed=self.position.seed_of(key)))

    def drop(self, key):
        """Drops `key`'s entry; a task in flight is discarded (counted in `discards`)."""
        entry = self.queue.pop(key)
        if entry.batch is None:
            self.stats["discards"] += 1
            if entry.seq is not None and self.backend is not None:
                self.backend.discard(entry.seq)

    def drop_where(self, condition):
        for k in [k for k in self.queue if condition(k)]:
            self.drop(k)

    def drop_all(self):
        self.drop_where(lambda k: True)

    def forget(self):
        """Forgets every entry without telling the backend (it was closed)."""
        self.queue.clear()

    # ------------------------------------------------------------------ filling
    def fill(self, after=_UNSET, new_slot=True):
        """Submits batches up to the window. One that would need a new shared-memory slot
        (none free) waits while every worker has work -- or, with `new_slot=False`, even
        if one idles -- for the consumer to release one (see `starved`). Returns True
        if a batch waits so."""
        backend = self.backend
        if backend is None or backend.closed:
            return False
        limit = self.limit()
        while self.in_flight() < limit:
            key = self._next_key(after)
            if key is None:
                return False
            if backend.needs_new_slot(for_idle_worker=new_slot):
                return True
            self.queue[key] = self.submit(key)
        return False

    def fill_after_read(self, after=_UNSET):
        """The fill after a read (loading on from `after`) or a pass end. A consumer that
        holds an older batch besides this one usually releases it as it takes this one (`x,
        y = loader[i]`), so a batch that needs a new slot waits for the next read, even for
        an idle worker -- unless the consumer released nothing between the last such wait
        and the next read (it keeps its batches, in a list say): then loading goes on in new
        slots, until it holds one batch at most again."""
        backend = self.backend
        wait = self._consumer_releases and backend is not None and backend.slots_held() >= 2
        if self.fill(after=after, new_slot=not wait) and wait:
            self._slot_awaited, self._releases_seen = True, backend.slot_releases

    # ------------------------------------------------------------------ reading
    def seek(self, key, probe):
        """The entry of `key`, submitting it if needed. A real read drops every entry
        before `key` (those batches were skipped); a probe keeps them."""
        queue = self.queue
        if not probe:
            self.drop_where(lambda k: k < key)
        entry = queue.get(key)
        if entry is not None:
            return entry
        first = next(iter(queue), None)
        if first is not None and key < first and self.position.distance(key, first, self.max_queue_size) <= self.max_queue_size:
            # e.g. a new stream replays the start of a pass whose batches were consumed
            missing, k = [], key
            while k < first:
                missing.append(k)
                k = self.position.successor(k, cross_passes=True)
            for k in reversed(missing):
                queue[k] = self.submit(k)
                queue.move_to_end(k, last=False)
            return queue[key]
        if not probe or first is None or key > next(reversed(queue)):
            self.drop_where(lambda k: not (probe and queue[k].batch is not None))
        if key not in queue:
            queue[key] = self.submit(key)
            for k in sorted(queue):
                queue.move_to_end(k)
        self.fill(after=key)
        return queue[key]

    def wait(self, key, entry):
        """Waits for `entry` (of `key`, from `seek`); returns `(batch, treedef, meta)` and
        leaves the entry queued (the caller keeps it for the real read, or drops it). When
        the wait raises, the entry leaves the queue (the caller then sees whether the
        backend broke). The time waited is added to `stats["wait_s"]`."""
        backend = self.backend
        if self._slot_awaited:  # did the consumer release a batch since (fill_after_read)?
            self._slot_awaited = False
            self._consumer_releases = backend.slot_releases > self._releases_seen
        elif not self._consumer_releases:
            self._consumer_releases = backend.slots_held() <= 1  # it holds its last batch only
        self.fill()
        t0 = time.perf_counter()
        try:
            batch, treedef, meta = backend.get(entry.seq, on_starved=lambda: self.starved(entry.seq))
        except BaseException:
            self.queue.pop(key, None)
            raise
        finally:
            now = time.perf_counter()
            self.stats["wait_s"] += now - t0
            if self._idle_since is not None:  # workers idled behind this batch (see starved)
                self.idle_behind_s += (now - self._idle_since[0]) * self._idle_since[1]
                self._idle_since = None
        entry.seq = None
        return batch, treedef, meta

    def starved(self, seq):
        """A worker ran out of work while the consumer waits for batch `seq`. Returns
        whether to be told again during this wait.

        First it gets the next batch to load: one that waited for a free slot now takes
        a new slot, since a worker idles otherwise. If the window is full instead, batch
        times vary, and one more batch in flight per worker would keep every worker
        busy -- at a price: with processes, each batch in flight holds a slot, and a
        new slot costs its worker a one-time set-up (the kernel allocating and mapping
        its pages: 46 ms for a 77 MB batch here, 250-400 ms on memory a virtual
        machine's host had taken back), besides the memory. So the window deepens
        (once per wait) by `deepen`, and never for a wait behind `seq`'s first use of
        its slot, a delay that does not recur, where more batches in flight would mean
        more slots, each paying it again. A wait that does not deepen counts its idle
        worker-seconds towards the price (see `take`). Then (or when the window is at
        `max_queue_size`) the idle worker allocates a slot the window will need -- one
        per batch in flight and one the consumer holds -- instead of idling
        (`prepare_slots`).
        """
        loads = self.stats["loads"]
        self.fill()
        if self.stats["loads"] > loads:
            return True
        backend = self.backend
        if self.in_flight() >= self.limit() and self._next_key(_UNSET) is not None:
            if self.depth < self.ceiling() and not backend.is_first_use(seq):
                if deepen(idle_behind_s=self.idle_behind_s, slot_price_s=self.workers * backend.slot_setup_s(),
                          mean_batch_s=backend.mean_batch_s()):
                    self.depth = min(self.ceiling(), self.depth + self.workers)
                    self.idle_behind_s = 0.0
                    self.fill()
                    return False
                if self._idle_since is None:
                    self._idle_since = (time.perf_counter(), max(1, backend.idle_workers()))
            return backend.prepare_slots(up_to=self.limit() + 1) > 0
        return False
