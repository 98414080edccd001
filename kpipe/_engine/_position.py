"""Where a loader stands -- pure logic, no processes, no I/O: the plan of each pass, the
position of its readers, each pass's length, and the state that resumes it.

NOTE [ Passes, streams and what Keras asks for ]
------------------------------------------------
A *pass* is one trip through every batch of the dataset (this shard's share of it), in
the pass's plan order (`EpochPlanner`). Batches are named by keys `(pass, position)`;
the keys of all passes, in order, form the loader's one sequence of batches. Training
must consume that sequence as it is: every pass complete, each batch once per pass.

Consumers read the sequence through *streams*. A stream starts at the `head` -- the
first position of the current pass, or the resume point of a restored loader -- and
hands out consecutive keys. What Keras 3 does with a `PyDataset` (read from
`keras/src/trainers/epoch_iterator.py` and the TensorFlow trainer):

    fit()/evaluate()/predict() build an adapter  -> 2 batches read for the tensor spec
                                                    (Keras < 3.7, or when Keras asks
                                                    kpipe's iterator for its tf.data
                                                    dataset: kpipe builds it lazily)
    with a distribution strategy                 -> a tf.data iterator is made, 1+ batches
                                                    pulled ("symbolic build"), then dropped
    every iterator Keras makes                   -> a generator over positions 0..n-1
    steps_per_epoch=None                         -> a new iterator every Keras epoch
    steps_per_epoch=S                            -> one iterator across Keras epochs, a
                                                    new one when n steps were taken
    on_epoch_begin()/on_epoch_end()              -> around every Keras epoch (mid-pass
                                                    when S < n); from Keras 3.7 also
                                                    on_epoch_end once before the first
                                                    (`EpochIterator.reset`)

so:

* each iterator Keras makes is a stream that ends with its pass;
* a pass is *complete* when a stream hands out its last position; `head` then moves to
  the next pass. A stream read through `tf.data` (Keras < 3.7: `from_generator` and its
  prefetch, which run ahead of Keras's steps) *confirms*: its pass completes at the
  Keras epoch end that took the last position, so an `evaluate(steps=k)` whose prefetch
  read the pass to its end still leaves it to be replayed, as plain Keras replays it;
* a new stream begins at `head`: after a complete pass that is the next pass, after a
  stream dropped mid-pass (a `fit()` that ended there, `evaluate(steps=k)`) it is the
  same pass again from its start, as plain Keras restarts from batch 0;
* reads for the tensor spec and the symbolic build happen in a *probe*: they are served
  from the batches loaded for the head (and kept for the real stream, so they cost no
  extra load), complete nothing, and their streams end when the probe does.

Direct indexing (`loader[i]`, manual loops) is random access into the head's pass:
`loader[i]` is position `i` of it (batch `i` with `shuffle=False`), whatever was read
before, in any order. Reads in order -- position `i` right after `i - 1`, or at the
resume point -- advance the *direct position* (what `state()` saves), and reading the
last position in order completes the pass.

The dataset's own `on_epoch_begin`/`on_epoch_end` run only when a consumer calls them
(the rule is `ProcessLoader`'s docstring; the calls live in `kpipe/_reader.py`), so the
cursor only answers where a consumer stands: at a pass start (`at_pass_start`), or
inside a pass.

Lengths: a dataset whose `on_epoch_end` changes its `len()` (bucketing, curriculum) has
passes of different lengths. Each pass's length is recorded once, as the dataset's own
`len()` when the pass was planned (`dataset_length`); the batches of this shard follow
from it (`length_of`). A later pass whose length is not recorded yet has the newest one.

State: `{format, pass, position, num_batches, seed, shuffle, num_shards, shard_index}`
-- position is the first key of that pass not yet consumed. Restoring sets `head` there,
so the next stream starts exactly where the saved run stopped; a state is checked against
the configuration it is restored into (`check_state`).
"""

import bisect

from kpipe._args import check_int
from kpipe._engine import _tree
from kpipe._engine import worker_info as _wi
from kpipe._engine._planner import EpochPlanner, PassOrders

STATE_FORMAT = 1


class Stream:
    """One consumer's run through the sequence, from `base` on. Not thread-safe.

    `hooks` says who calls the dataset's epoch hooks for it: "keras" (Keras's adapter
    passes its calls on), "iteration" (`as_dataset()`: the stream's start and end are an
    epoch's) or None (a probe)."""

    __slots__ = ("base", "taken", "probe", "live", "hooks", "began", "ended", "resume", "confirm", "pending")

    def __init__(self, base, *, probe, hooks=None, confirm=False):
        self.base = base
        self.taken = 0
        self.probe = probe
        self.live = True
        self.hooks = None if probe else hooks
        self.began = False  # (iteration streams) the dataset's on_epoch_begin ran for it
        self.ended = False  # (iteration streams) ... and its on_epoch_end
        self.resume = None  # a threading.Event for a reader that waits at the read limit
        # `confirm`: handing out the pass's last batch does not complete the pass; the
        # consumer's epoch end does, if the consumer took it (`pending` until then)
        self.confirm = confirm and not probe
        self.pending = False


class PassLengths:
    """The dataset's `len()` for each pass recorded, as runs of consecutive recorded passes
    of one length (`[first, last, length]`, in order): a loader that has run 10,000 passes
    of one length keeps one run, and finds any pass's length in O(log runs) -- a dict of
    every pass, with `max()` over it for the newest, cost 127 us a lookup after 10,000
    passes, five lookups a batch. A pass not recorded has the newest length (the highest
    pass recorded's); never empty once a length is set.
    """

    def __init__(self, length):
        self._runs = [[0, 0, length]]
        self._firsts = [0]  # each run's first pass (for bisect)

    @property
    def newest(self):
        return self._runs[-1][2]

    def _run_of(self, pass_):
        i = bisect.bisect_right(self._firsts, pass_) - 1
        return i if i >= 0 and self._runs[i][1] >= pass_ else None

    def get(self, pass_):
        i = self._run_of(pass_)
        return self.newest if i is None else self._runs[i][2]

    def has(self, pass_):
        return self._run_of(pass_) is not None

    def count(self):
        """How many passes are recorded."""
        return sum(last - first + 1 for first, last, _ in self._runs)

    def runs(self):
        return [tuple(run) for run in self._runs]

    def set(self, pass_, length):
        """Records `length` for pass `pass_` (that pass only; later ones not recorded
        still take the newest)."""
        runs = self._runs
        if runs and pass_ == runs[-1][1] + 1 and length == runs[-1][2]:  # the usual record: the next pass
            runs[-1][1] = pass_
            return
        self._remove(pass_)
        i = bisect.bisect_left(self._firsts, pass_)
        runs.insert(i, [pass_, pass_, length])
        self._firsts.insert(i, pass_)
        for j in (i, i - 1):  # merge with the run after, then the one before
            if 0 <= j < len(runs) - 1 and runs[j][1] + 1 == runs[j + 1][0] and runs[j][2] == runs[j + 1][2]:
                runs[j][1] = runs[j + 1][1]
                del runs[j + 1], self._firsts[j + 1]

    def forget(self, pass_):
        """Forgets pass `pass_`'s length (never the only one recorded)."""
        if self.has(pass_) and self.count() > 1:
            self._remove(pass_)

    def forget_after(self, pass_):
        """Forgets the lengths recorded for passes after `pass_`."""
        runs = self._runs
        while runs and runs[-1][0] > pass_:
            runs.pop()
            self._firsts.pop()
        if runs and runs[-1][1] > pass_:
            runs[-1][1] = pass_

    def _remove(self, pass_):
        i = self._run_of(pass_)
        if i is None:
            return
        first, last, length = self._runs[i]
        pieces = ([[first, pass_ - 1, length]] if first < pass_ else []) + ([[pass_ + 1, last, length]] if pass_ < last else [])
        self._runs[i:i + 1] = pieces
        self._firsts[i:i + 1] = [piece[0] for piece in pieces]


class Position:
    """Where one loader stands: the plan, the head and its readers, each pass's length
    and the saved state (see the NOTE). Pure logic; not thread-safe.

    Args:
        num_batches: The dataset's `len()` (None: infinite).
        shuffle, seed, num_shards, shard_index: The loader's (checked by it); `shuffle`
            None: in order until a consumer asks for an order (`follow`).
        keyed_by_pass: Hand out dataset indices as `(pass, index, seed)`.
        seed_given: The loader's `seed` was given: a state of another seed is refused
            (otherwise the state's seed is taken).
    """

    def __init__(self, num_batches, *, shuffle=False, seed=0, num_shards=1, shard_index=0, keyed_by_pass=False,
                 seed_given=True):
        self.planner = EpochPlanner(num_batches, shuffle=bool(shuffle), seed=seed, num_shards=num_shards, shard_index=shard_index)
        self.own_shuffle = shuffle  # the loader's own setting: None, True or False
        self.seed_given = seed_given
        self.orders = PassOrders(bool(shuffle), seed)  # each pass's (shuffle, seed): see `follow`
        # shuffle=None: nothing loads ahead until a consumer says which order (`follow`)
        # or reads -- what loaded before fit() chose a permutation would be thrown away
        self.order_due = shuffle is None
        self.keyed_by_pass = keyed_by_pass  # index() gives `(pass, index, seed)`: see `index`
        self.head = (0, 0)
        self.lengths = PassLengths(num_batches)  # the dataset's own len(), per pass, recorded once
        self._probe_depth = 0
        self._probe_streams = []
        self._reading = None  # the last non-probe stream opened (read_position)
        self._handed_in_pass = False  # anything of the head pass handed out outside a probe
        self._direct_expect = 0  # the position a direct read in order asks for next
        self._direct_done = 0  # positions of the head pass read in order by direct reads

    @property
    def seed(self):
        return self.planner.seed

    @property
    def shuffle(self):
        """Whether the head's pass is shuffled."""
        return self.orders.at(self.head[0])[0]

    @property
    def num_shards(self):
        return self.planner.num_shards

    @property
    def shard_index(self):
        return self.planner.shard_index

    # ------------------------------------------------------------------ lengths
    def dataset_length(self, pass_=None):
        """The dataset's own `len()` at pass `pass_` (the newest recorded when that pass's
        is not, or when `pass_` is None)."""
        return self.lengths.newest if pass_ is None else self.lengths.get(pass_)

    def length_of(self, pass_):
        """Batches of pass `pass_` for this shard (None: infinite)."""
        return self.planner.length(self.dataset_length(pass_))

    def record_length(self, pass_, num_batches):
        """Records the dataset's length for pass `pass_` (kept for every pass: walks from old
        keys need them)."""
        self.lengths.set(pass_, num_batches)

    def has_length(self, pass_):
        return self.lengths.has(pass_)

    def forget_length(self, pass_):
        """Forgets a length recorded ahead for a later pass (never the only one known)."""
        self.lengths.forget(pass_)

    def next_unread_pass(self):
        """The first pass nothing of which was read: where a new length applies."""
        head = self.head
        return head[0] if head[1] == 0 and not self._handed_in_pass else head[0] + 1

    def set_length(self, num_batches):
        """The dataset's length changed (its hook ran): from the first pass nothing of
        which was read on, it is `num_batches`; lengths recorded for later passes go."""
        pass_ = self.next_unread_pass()
        self.lengths.forget_after(pass_)
        self.record_length(pass_, num_batches)

    # ------------------------------------------------------------------ the plan
    def index(self, key):
        """The dataset index of the batch at `key` -- as `(pass, index, seed)` for a dataset
        that orders its own samples per pass (`keyed_by_pass`: `ProcessLoader.from_samples`;
        `seed` None: in order), whose batches the plan keeps in order."""
        shuffle, seed = self.orders.at(key[0])
        if self.keyed_by_pass:
            index = self.planner.index(key[0], key[1], self.dataset_length(key[0]), (False, seed))
            return (key[0], index, seed if shuffle else None)
        return self.planner.index(key[0], key[1], self.dataset_length(key[0]), (shuffle, seed))

    def as_handed_out(self, key, batch):
        """The batch loaded for `key` as consumers get it: without rows at a pad (a step
        of this shard without data; see `EpochPlanner`)."""
        return _tree.without_rows(batch) if self.planner.is_pad(key[1], self.dataset_length(key[0])) else batch

    def seed_of(self, key):
        """The seed workers reseed `random`/`numpy.random` with before loading `key`."""
        return _wi.batch_seed(self.orders.at(key[0])[1], key[0], key[1])

    def follow(self, shuffle, seed):
        """The passes from the first one no stream has begun on (the head's, unless a
        restore put the head inside it) take `(shuffle, seed)`. Returns that first pass if
        their order changed (what was loaded for them is stale), else None."""
        self.order_due = False
        first = self.head[0] if self.head[1] == 0 else self.head[0] + 1
        return first if self.orders.set_from(first, shuffle, seed) else None

    def successor(self, key, *, cross_passes):
        """The key after `key` in the sequence, or None where the plan is not known yet."""
        pass_, pos = key
        n = self.length_of(pass_)
        if n is None or pos + 1 < n:
            return (pass_, pos + 1)
        return (pass_ + 1, 0) if cross_passes else None

    def walk(self, base, steps):
        """The key `steps` after `base` (the key after `steps` consumed batches)."""
        pass_, pos = base
        pos += steps
        while True:
            n = self.length_of(pass_)
            if n is None or pos < n:
                return (pass_, pos)
            pos -= n
            pass_ += 1

    def distance(self, a, b, limit):
        """Batches from `a` to `b` in the sequence, counted up to `limit + 1`."""
        steps = 0
        while a < b and steps <= limit:
            a = self.successor(a, cross_passes=True)
            steps += 1
        return steps

    def read_ahead_limit(self):
        """The last pass worth loading now: the head's, and the next one only once the
        head's pass is being read (tiny passes must not fill the queue two passes ahead);
        none while the order is due (`order_due`)."""
        if self.order_due:
            return self.head[0] - 1
        return self.head[0] + 1 if self._handed_in_pass else self.head[0]

    # ------------------------------------------------------------------ streams
    @property
    def probing(self):
        return self._probe_depth > 0

    @property
    def handed_in_pass(self):
        """Whether anything of the head pass was handed out outside a probe."""
        return self._handed_in_pass

    def open_stream(self, hooks=None, confirm=False):
        """A stream that hands out the rest of the head's pass (one Keras iterator);
        `confirm`: see `Stream`."""
        stream = Stream(self.head, probe=self.probing, hooks=hooks, confirm=confirm)
        self.order_due = self.order_due and stream.probe  # a reader: the order is the one it finds
        if stream.probe:
            self._probe_streams.append(stream)
        else:
            self._reading = stream
        return stream

    def next_key(self, stream):
        """The key `stream` hands out next, or None when its pass has ended."""
        if not stream.live:
            return None
        key = self.walk(stream.base, stream.taken)
        if key[0] != stream.base[0]:
            return None
        return key

    def stream_at_pass_end(self, stream, consumed=None):
        """Whether `stream` handed out the last batch of its pass -- or, with `consumed`
        (what its consumer really took of what it handed out: a feed reads ahead), whether
        the consumer took it."""
        n = self.length_of(stream.base[0])
        taken = stream.taken if consumed is None else consumed
        return n is not None and stream.base[1] + taken >= n

    def at_pass_start(self, stream=None, consumed=None):
        """Whether a consumer reading through `stream` (None: none yet, or a new one)
        stands at the start of a pass: the head is a pass's first position and the
        consumer took nothing of `stream` (`consumed` batches; None: what it handed
        out), or all of its pass. A stream that is no longer live (dropped) counts as
        none: the next one starts the head's pass again."""
        if self.head[1] != 0:
            return False
        taken = stream.taken if stream is not None and consumed is None else consumed
        if stream is None or not stream.live or taken == 0:
            return True
        return self.stream_at_pass_end(stream, taken)

    def stream_position(self, stream=None, consumed=None):
        """The key a consumer reading through `stream` reads next, having taken
        `consumed` batches of it (None: what it handed out); the head for a new one.
        The stream's pass may have completed already (the head moved on) when its reader
        ran ahead of the consumer (kpipe's feed) to the pass's last batch: the consumer
        still stands where it took `consumed`."""
        taken = stream.taken if stream is not None and consumed is None else consumed
        if stream is None or not stream.live or stream.probe or self.stream_at_pass_end(stream, taken):
            return self.head
        return self.walk(stream.base, taken)

    def direct_key(self, index):
        """The key of `loader[index]` and whether the read is in order: see the NOTE."""
        key = (self.head[0], index)
        if self.probing:
            return key, False
        self.order_due = False
        sequential = index == self._direct_expect
        self._direct_expect = index + 1
        return key, sequential

    def handed_out(self, stream, key):
        """Records that `key` was handed out by `stream`. Returns True when this completed
        the head's pass (the caller then moves on with `complete_pass`)."""
        stream.taken += 1
        if stream.probe:
            return False
        self._handed_in_pass = True
        n = self.length_of(key[0])
        return key[0] == self.head[0] and n is not None and key[1] == n - 1

    def handed_out_direct(self, key, sequential):
        """Records that `loader[i]` handed out `key`. Returns True when this completed the
        head's pass: its last position, read in order."""
        if self.probing:
            return False
        self._handed_in_pass = True
        if not sequential or key[0] != self.head[0]:
            return False
        self._direct_done = max(self._direct_done, key[1] + 1)
        n = self.length_of(key[0])
        return n is not None and key[1] == n - 1

    def complete_pass(self):
        """Ends the head's pass: new streams and direct reads start at the next pass,
        whose length is the dataset's length at the pass that ended unless recorded."""
        ended = self.head[0]
        self.head = (ended + 1, 0)
        self._handed_in_pass = False
        self._direct_expect = self._direct_done = 0
        if not self.has_length(ended + 1):  # (epoch_end_ahead may have recorded it)
            self.record_length(ended + 1, self.dataset_length(ended))

    def pass_begun(self):
        """Whether any of the head's pass was read (or resumed into): `loader.on_epoch_end()`
        by hand then ends it early."""
        return self._handed_in_pass or self.head[1] > 0

    def jump(self, pass_, position=0, num_batches=None, order=None):
        """Moves `head` (set_epoch, restore) to `position` of pass `pass_`, whose dataset
        length is `num_batches` (default: the newest known) and whose order, and the later
        passes', is `order` (`(shuffle, seed)`; default: as it was)."""
        self.record_length(pass_, self.dataset_length() if num_batches is None else num_batches)
        if order is not None:
            self.orders.set_from(pass_, *order)
            self.order_due = False
        self.head = (pass_, position)
        self._handed_in_pass = False
        self._direct_expect = self._direct_done = position

    def begin_probe(self):
        self._probe_depth += 1

    def end_probe(self):
        """Ends a probe: its streams hand out nothing more."""
        self._probe_depth = max(0, self._probe_depth - 1)
        if self._probe_depth == 0:
            for stream in self._probe_streams:
                stream.live = False
            self._probe_streams.clear()

    def read_position(self):
        """Where reading goes on: the next key of the last stream opened, while it is live
        and has handed out anything of its pass (an infinite dataset's stream never ends
        its pass), else `direct_position()`."""
        stream = self._reading
        if stream is not None and stream.live and stream.taken > 0:
            key = self.next_key(stream)
            if key is not None:
                return max(key, self.head)
        return self.direct_position()

    def direct_position(self):
        """The first position of the head pass not read in order by direct reads (the
        head's own position if none were made)."""
        return (self.head[0], max(self.head[1], self._direct_done))

    # ------------------------------------------------------------------ state
    def state_at(self, key):
        """The state that resumes at `key` (a JSON-serialisable dict)."""
        return {
            "format": STATE_FORMAT,
            "pass": int(key[0]),
            "position": int(key[1]),
            "num_batches": self.dataset_length(key[0]),
            "seed": self.orders.at(key[0])[1],
            "shuffle": self.orders.at(key[0])[0],
            "num_shards": self.planner.num_shards,
            "shard_index": self.planner.shard_index,
        }

    def state_dict(self):
        """The state at the first batch not read in order yet (`loader.state()`)."""
        return self.state_at(self.direct_position())

    def check_state(self, state, *, same_length, name):
        """Checks `state` against this configuration. Returns `(pass, position,
        num_batches, (shuffle, seed))`: a loader whose `shuffle` is None takes the state's
        shuffle, one built without a seed its seed (what fixed the saved pass's order).

        Args:
            state: A dict from `state_dict()`/`state_at()`.
            same_length: The dataset's length cannot change between passes (no epoch
                hooks): a state saved for another length is another dataset's.
            name: The dataset's name, for messages.

        Raises:
            ValueError: a malformed state, or one saved for another configuration.
        """
        if not isinstance(state, dict):
            raise ValueError(f"`state` must be a dict from `loader.state()`. Received: {str(state)[:100]} of type {type(state).__name__}.")
        fmt = state.get("format")
        if fmt != STATE_FORMAT:
            newer = isinstance(fmt, int) and fmt > STATE_FORMAT
            raise ValueError(
                f"Cannot restore a loader state of format {fmt!r}: this kpipe reads format {STATE_FORMAT}"
                + (" (the state comes from a newer kpipe; upgrade kpipe here)." if newer else ".")
            )
        try:
            pass_, position = check_int("state['pass']", state["pass"], 0, ""), check_int("state['position']", state["position"], 0, "")
        except KeyError as exc:
            raise ValueError(f"`state` lacks the entry {exc}; pass a dict from `loader.state()`.") from None
        planner = self.planner
        expected = {"num_shards": planner.num_shards, "shard_index": planner.shard_index}
        if self.seed_given:
            expected["seed"] = planner.seed
        if self.own_shuffle is not None:
            expected["shuffle"] = self.own_shuffle
        for field, want in expected.items():
            if state.get(field) != want:
                raise ValueError(
                    f"The state was saved by a loader with {field}={state.get(field)!r}, but this loader has "
                    f"{field}={want!r}. Restore it into a loader built with the same {field}."
                )
        saved_n = state.get("num_batches")
        current_n = self.dataset_length()
        if same_length and saved_n != current_n:
            raise ValueError(
                f"The state was saved for a dataset of {saved_n} batches, but `{name}` has {current_n}: "
                "it is not the same data. Restore it into a loader of the same dataset."
            )
        length = planner.length(saved_n)
        if length is not None and position >= length:
            raise ValueError(f"state['position']={position} is out of range for a pass of {length} batches.")
        shuffle, seed = state.get("shuffle"), state.get("seed")
        if not isinstance(shuffle, bool) or isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"state['shuffle'] must be a bool and state['seed'] an int. Received: shuffle={shuffle!r}, "
                             f"seed={seed!r}; pass a dict from `loader.state()`.")
        return pass_, position, saved_n, (shuffle, seed)

    def load_state_dict(self, state, *, same_length, name):
        """Moves to where `state` resumes (after `check_state`). Returns its key."""
        pass_, position, num_batches, order = self.check_state(state, same_length=same_length, name=name)
        self.jump(pass_, position, num_batches, order)
        return self.head
