"""Where a loader stands: passes, streams, the read-ahead order and resumable state.

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
(the rule is `ProcessLoader`'s docstring; the calls live in `kpipe/loader.py`), so the
cursor only answers where a consumer stands: at a pass start (`at_pass_start`), or
inside a pass.

State: `{format, pass, position, num_batches, seed, shuffle, num_shards, shard_index}`
-- position is the first key of that pass not yet consumed. Restoring sets `head` there,
so the next stream starts exactly where the saved run stopped.
"""

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


class PassCursor:
    """The pass bookkeeping of one loader: pure logic, no I/O. Not thread-safe.

    `length_of(pass)` must return the batches of that pass for this shard (None when
    infinite) for every pass from `head` on that the loader has planned.
    """

    def __init__(self, length):
        self.head = (0, 0)
        self._lengths = {0: length}
        self._probe_depth = 0
        self._probe_streams = []
        self._reading = None  # the last non-probe stream opened (read_position)
        self._handed_in_pass = False  # anything of the head pass handed out outside a probe
        self._direct_expect = 0  # the position a direct read in order asks for next
        self._direct_done = 0  # positions of the head pass read in order by direct reads

    # ------------------------------------------------------------------ lengths
    def length_of(self, pass_):
        return self._lengths.get(pass_, self._lengths[max(self._lengths)])

    def set_length(self, pass_, length):
        self._lengths[pass_] = length  # kept for every pass: walks from old keys need them

    def forget_length(self, pass_):
        """Forgets a length set ahead for a later pass (never the only one known)."""
        if pass_ in self._lengths and len(self._lengths) > 1:
            del self._lengths[pass_]

    def forget_lengths_after(self, pass_):
        """Forgets the lengths set for passes after `pass_` (the dataset changed)."""
        for p in [p for p in self._lengths if p > pass_]:
            self.forget_length(p)

    def successor(self, key, *, cross_passes):
        """The key after `key` in the sequence, or None where the plan is not known yet."""
        pass_, pos = key
        n = self.length_of(pass_)
        if n is None or pos + 1 < n:
            return (pass_, pos + 1)
        return (pass_ + 1, 0) if cross_passes else None

    def walk(self, base, steps):
        """The key `steps` after `base` (lengths of later passes must be known)."""
        pass_, pos = base
        pos += steps
        while True:
            n = self.length_of(pass_)
            if n is None or pos < n:
                return (pass_, pos)
            pos -= n
            pass_ += 1

    def read_ahead_limit(self):
        """The last pass worth loading now: the head's, and the next one only once the
        head's pass is being read (tiny passes must not fill the queue two passes ahead)."""
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
        """Ends the head's pass: new streams and direct reads start at the next pass."""
        self.head = (self.head[0] + 1, 0)
        self._handed_in_pass = False
        self._direct_expect = self._direct_done = 0

    def pass_begun(self):
        """Whether any of the head's pass was read (or resumed into): `loader.on_epoch_end()`
        by hand then ends it early."""
        return self._handed_in_pass or self.head[1] > 0

    def jump(self, pass_, position=0):
        """Moves `head` (set_epoch, restore); streams opened before start there no more."""
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
