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
    with a distribution strategy                 -> a tf.data iterator is made, 1+ batches
                                                    pulled ("symbolic build"), then dropped
    every iterator Keras makes                   -> a generator over positions 0..n-1
    steps_per_epoch=None                         -> a new iterator every Keras epoch
    steps_per_epoch=S                            -> one iterator across Keras epochs, a
                                                    new one when n steps were taken
    on_epoch_end()                               -> after every Keras epoch (mid-pass when
                                                    S < n) and once before the first

so Keras's epoch ends say nothing about passes. kpipe's adapter (`kpipe/_keras_hook.py`)
therefore never forwards them; instead:

* each iterator Keras makes is a stream that ends with its pass;
* a pass is *complete* when a stream hands out its last position; `head` then moves to
  the next pass, and the dataset's own `on_epoch_end` runs (see `ProcessLoader`);
* a new stream begins at `head`: after a complete pass that is the next pass, after a
  stream dropped mid-pass (a `fit()` that ended there, `evaluate(steps=k)`) it is the
  same pass again from its start, as plain Keras restarts from batch 0;
* reads for the tensor spec and the symbolic build happen in a *probe*: they are served
  from the batches loaded for the head (and kept for the real stream, so they cost no
  extra load), complete nothing, and their streams end when the probe does.

Direct indexing (`loader[i]`, manual loops, Keras without kpipe's adapter) is an implicit
stream: index 0 starts a new one at `head`, index i is the i-th key after it (crossing
into the next pass after a resume point), and reading the last position of a pass in
order completes it.

State: `{format, pass, position, num_batches, seed, shuffle, num_shards, shard_index}`
-- position is the first key of that pass not yet consumed. Restoring sets `head` there,
so the next stream starts exactly where the saved run stopped.
"""

STATE_FORMAT = 1


class Stream:
    """One consumer's run through the sequence, from `base` on. Not thread-safe."""

    __slots__ = ("base", "taken", "next_index", "probe", "live", "ends_with_pass")

    def __init__(self, base, *, probe, ends_with_pass):
        self.base = base
        self.taken = 0
        self.next_index = 0
        self.probe = probe
        self.live = True
        self.ends_with_pass = ends_with_pass


class PassCursor:
    """The pass bookkeeping of one loader: pure logic, no I/O. Not thread-safe.

    `length_of(pass)` must return the batches of that pass for this shard (None when
    infinite) for every pass from `head` on that the loader has planned.
    """

    def __init__(self, length):
        self.head = (0, 0)
        self._lengths = {0: length}
        self._direct = None
        self._probe_depth = 0
        self._probe_streams = []
        self._handed_in_pass = False  # anything of the head pass handed out outside a probe

    # ------------------------------------------------------------------ lengths
    def length_of(self, pass_):
        return self._lengths.get(pass_, self._lengths[max(self._lengths)])

    def set_length(self, pass_, length):
        self._lengths[pass_] = length  # kept for every pass: walks from old keys need them

    def forget_length(self, pass_):
        """Forgets a length set ahead for a later pass (never the only one known)."""
        if pass_ in self._lengths and len(self._lengths) > 1:
            del self._lengths[pass_]

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

    def open_stream(self):
        """A stream that hands out the rest of the head's pass (one Keras iterator)."""
        stream = Stream(self.head, probe=self.probing, ends_with_pass=True)
        if stream.probe:
            self._probe_streams.append(stream)
        return stream

    def next_key(self, stream):
        """The key `stream` hands out next, or None when its pass has ended."""
        if not stream.live:
            return None
        key = self.walk(stream.base, stream.taken)
        if stream.ends_with_pass and key[0] != stream.base[0]:
            return None
        return key

    def direct_key(self, index):
        """The key of `loader[index]`: see the NOTE (implicit stream)."""
        stream = self._direct
        if index == 0 or stream is None or not stream.live or stream.probe != self.probing:
            stream = self._direct = Stream(self.head, probe=self.probing, ends_with_pass=False)
            if stream.probe:
                self._probe_streams.append(stream)
        sequential = index == stream.next_index
        stream.next_index = index + 1
        if sequential:
            stream.taken = index
        return stream, self.walk(stream.base, index), sequential

    def handed_out(self, stream, key, sequential=True):
        """Records that `key` was handed out by `stream`. Returns True when this completed
        the head's pass (the caller then moves on with `complete_pass`)."""
        if stream.ends_with_pass or sequential:
            stream.taken += 1
        if stream.probe:
            return False
        self._handed_in_pass = True
        n = self.length_of(key[0])
        return sequential and key[0] == self.head[0] and n is not None and key[1] == n - 1

    def complete_pass(self):
        """Ends the head's pass: new streams start at the next pass."""
        self.head = (self.head[0] + 1, 0)
        self._handed_in_pass = False

    def end_pass_early(self):
        """`loader.on_epoch_end()` called by hand: ends the head pass unless nothing of it
        was handed out yet. Returns True if it ended one."""
        if not self._handed_in_pass:
            return False
        self._direct = None
        self.complete_pass()
        return True

    def jump(self, pass_, position=0):
        """Moves `head` (set_epoch, restore); every open stream ends."""
        self.head = (pass_, position)
        self._handed_in_pass = False
        self._direct = None

    def begin_probe(self):
        self._probe_depth += 1

    def end_probe(self):
        """Ends a probe: its streams hand out nothing more."""
        self._probe_depth = max(0, self._probe_depth - 1)
        if self._probe_depth == 0:
            for stream in self._probe_streams:
                stream.live = False
            self._probe_streams.clear()
            if self._direct is not None and self._direct.probe:
                self._direct = None

    def direct_position(self):
        """The key the implicit stream hands out next (the head if none is open)."""
        stream = self._direct
        if stream is None or not stream.live or stream.probe:
            return self.head
        return max(self.head, self.walk(stream.base, stream.taken))
