"""Loading the next pass ahead of a dataset's `on_epoch_end` (`epoch_end_ahead=True`).

NOTE [ The next pass, ahead of the hook ]
-----------------------------------------
A dataset with `on_epoch_end` (a reshuffle, a new epoch counter) makes every pass wait at
its end: the next pass may depend on what the hook does, so plain Keras -- and kpipe by
default -- load nothing of it until the last batch is out and the hook has run. With
16 batches per pass and 2 workers, that barrier alone leaves 0.88-0.98x of what bare
processes reach (`python scripts/bench_loaders.py --workloads b`, "ceiling-passes", over
three runs on a 2-core VM).

With `ProcessLoader(..., epoch_end_ahead=True)`, once the last batch of pass p is sent
to the workers the loader

1. rebuilds a copy of the dataset from the bytes the workers hold (`dumps` output; big
   arrays are read-only views of their shared copies, so the copy cannot edit them; a
   class sent by value is rebuilt as the copy's own class, with its own globals, so the
   hook on the copy never touches the user's class, its methods or its globals --
   `_pickling.loads_apart`),
2. runs `on_epoch_end` (and `on_epoch_begin` if the dataset defines one) on the copy,
   with this process's `random` and `numpy.random` global states saved and restored
   around it (a hook calling `np.random.shuffle` draws the same numbers when it really
   runs),
3. pickles the copy: those bytes go to every worker behind its pass-p tasks, and the
   workers load pass p+1 from them while the consumer reads the end of pass p.

At the real pass end the dataset's own hook runs as it always does, and the dataset is
pickled as it always is. The batches loaded ahead are kept only if those bytes are the
copy's bytes, the dataset holds the same shared arrays with unchanged contents, and its
length is the copy's: the workers then hold exactly the state they would have received.
Otherwise they are discarded, the real state is sent and pass p+1 loads again, as
without the option. A miss costs only time: a hook that reads the clock, unseeded
randomness, a callback's metrics or anything else outside the dataset misses; after
`MISSES_OFF` misses in a row the loader stops trying (`stats()["ahead"]`, and a log
line at INFO).

The copy is not made (that pass waits as without the option) when the hook on the copy
raises, edits a shared array in place, or leaves a big array the workers do not hold
(a new index array of 1 MiB or more: on such large datasets the barrier is a tiny share
of a pass anyway). What the option changes for the user: the hook runs twice per pass,
once on the copy -- so a hook must only change the dataset itself (what it prints, it
prints twice; files it writes, it writes twice).

Anything that reads or loads pass p after the copy went out (a stream replaying the
pass, a probe, `set_epoch`, `restore`) or reads pass p+1 before the real hook ran first
drops the batches loaded ahead and sends the workers the dataset's real state
(`Reader.cancel_ahead` in `kpipe/_reader.py`); a new worker pool (after a failure) starts
from the real state. `LoadAhead` below keeps one loader's part of this: whether to try,
the pass loaded ahead, and the counts.
"""

import dataclasses
import logging
import random

import numpy as np

from kpipe._engine import _pickling

MISSES_OFF = 2  # misses in a row after which a loader stops loading ahead
SUGGEST_SHARE = 0.05  # `maybe_suggest` logs once pass-start waits reach this share of the time
logger = logging.getLogger("kpipe")


class NotAhead(Exception):
    """The copy's hook cannot stand for the real one this pass (the message says why)."""


@dataclasses.dataclass
class Ahead:
    """What was sent to the workers for pass `pass_`, to check at the real pass end."""

    pass_: int
    payload: bytes
    keys: list
    num_batches: int
    prev_payload: bytes  # what the workers held before: sent back if this is cancelled
    prev_keys: list
    real_hooks_ran: bool = False  # the dataset's on_epoch_end ran; its on_epoch_begin is awaited


class _ReadOnlyArrays:
    """`loads` segments: read-only views of the shared arrays, and which key each is."""

    def __init__(self, shared):
        self._shared = shared
        self.ids = {}
        self.views = []  # keeps every view alive, so that no id is reused meanwhile

    def __getitem__(self, key):
        return _Segment(self, key)


class _Segment:
    def __init__(self, owner, key):
        self._owner, self._key = owner, key

    def views(self, layouts):
        out = self._owner._shared.entries[self._key][0].views(layouts, writable=False)
        for arr in out:
            self._owner.ids[id(arr)] = self._key
            self._owner.views.append(arr)
        return out


class _Aliases:
    """`dumps` registry for the copy: its arrays must be the views it was built with."""

    def __init__(self, shared, ids):
        self._shared, self._ids = shared, ids

    def put(self, arr, compare=True):  # (SharedArrays.put's signature; the copy's views are read-only)
        key = self._ids.get(id(arr))
        if key is None:
            raise NotAhead(f"on_epoch_end left a {arr.nbytes}-byte array that the workers do not hold (a new or resized array)")
        return key, False

    def layout(self, key):
        return self._shared.layout(key)


def _rebuild(payload, shared):
    """`(copy, arrays)`: the dataset rebuilt here from `payload` -- classes sent by value
    as the copy's own (the user's class is never rebound), big arrays as read-only views of
    their shared copies (`arrays`, their registry; None where the payload carries them)."""
    arrays = _ReadOnlyArrays(shared) if shared is not None else None
    return _pickling.loads_apart(payload, arrays if arrays is not None else {}), arrays


def _dump(copy, shared, arrays, what):
    """`dumps` of a `_rebuild` copy: its arrays must be the views it was built with."""
    return _pickling.dumps(copy, _Aliases(shared, arrays.ids) if arrays is not None else None, what=what)


def repickled(payload, shared, what):
    """`payload` rebuilt as `run_hook_on_copy` rebuilds it and pickled again, without the
    hooks: how the dataset's own state would pickle had it been rebuilt like the copy.
    Rebuilt objects differ from the originals in what pickle memoises (a code object
    interns its names, an unpickled dict key is a string of its own), so equal states can
    pickle to other bytes; two rebuilt ones pickle alike. None where it cannot be done."""
    try:
        copy, arrays = _rebuild(payload, shared)
        return _dump(copy, shared, arrays, what)[0]
    except Exception:
        return None


def run_hook_on_copy(payload, shared, *, call_hooks, num_batches, what):
    """Runs the dataset's pass-end hooks on a copy rebuilt from `payload`.

    Args:
        payload: The `dumps` bytes the workers hold now.
        shared: The backend's `SharedArrays`, or None where the workers hold no shared
            arrays (Ray actors: the payload carries the arrays).
        call_hooks: `call_hooks(dataset)` runs its on_epoch_end (and on_epoch_begin).
        num_batches: `num_batches(dataset)` reads its length.
        what: How to name the dataset in messages.

    Returns:
        `(payload, keys, num_batches)` of the copy after its hooks.

    Raises:
        NotAhead: the copy cannot stand for the real dataset this pass.
    """
    try:
        copy, arrays = _rebuild(payload, shared)
    except Exception as exc:
        raise NotAhead(f"the dataset could not be rebuilt here: {type(exc).__name__}: {exc}") from None
    states = random.getstate(), np.random.get_state()
    try:
        call_hooks(copy)
        n = num_batches(copy)
    except ValueError as exc:
        if "read-only" in str(exc):
            raise NotAhead("on_epoch_end edits a shared array in place") from None
        raise NotAhead(f"on_epoch_end on the copy raised ValueError: {exc}") from None
    except Exception as exc:
        raise NotAhead(f"on_epoch_end on the copy raised {type(exc).__name__}: {exc}") from None
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    try:
        out, keys = _dump(copy, shared, arrays, what)
    except Exception as exc:
        if isinstance(exc.__cause__, NotAhead):  # dumps wraps what persistent_id raises
            raise exc.__cause__ from None
        raise NotAhead(f"the copy could not be pickled: {type(exc).__name__}: {exc}") from None
    return out, sorted(keys), n


class LoadAhead:
    """One loader's `epoch_end_ahead` bookkeeping (see the NOTE): whether to try, the pass
    loaded ahead now (`current`), and the counts `stats()["ahead"]` shows. Its owner moves
    the batches and the workers' state; this decides and records. Not thread-safe.

    Args:
        requested: `epoch_end_ahead` was asked for.
        stateful: The dataset has epoch hooks (otherwise passes load ahead anyway).
        in_process: Batches load in this process (threads, `workers=0`): nothing to send.
        name: The dataset's name, for messages.
        call_hooks: `call_hooks(dataset)` runs what a pass end runs.
        num_batches: `num_batches(dataset)` reads its length.
    """

    def __init__(self, requested, *, stateful, in_process, name, call_hooks, num_batches):
        self.requested = requested
        self.name = name
        self._call_hooks = call_hooks
        self._num_batches = num_batches
        self.current = None  # the next pass's state sent ahead of the hook (`Ahead`)
        self.stats = None
        if requested:
            off = None
            if not stateful:
                off = f"`{name}` has no on_epoch_end/on_epoch_begin: passes load ahead anyway"
            elif in_process:
                off = "batches load in this process (workers=0 or use_threads=True): only worker processes load ahead"
            self.stats = {"kept": 0, "missed": 0, "skipped": 0, "off": off, "last_reason": None}
        self.tried = None  # the pass whose end was last tried
        self._fails = 0  # misses and skips in a row
        self.suggested = False  # the INFO line of maybe_suggest, once

    def maybe_suggest(self, stats, since_first):
        """Once per loader of a dataset with hooks, at INFO, where the option is off: the
        consumer waited `SUGGEST_SHARE` or more of the `since_first` seconds since the first
        batch at the starts of passes the hook held back (`stats["pass_start_wait_s"]`)."""
        if self.requested or self.suggested or stats["passes"] < 3:
            return
        if since_first > 0 and stats["pass_start_wait_s"] >= SUGGEST_SHARE * since_first:
            self.suggested = True
            logger.info(
                "ProcessLoader(%s): the consumer waited %.2f s for the first batches of passes (%.0f%% of the %.1f s "
                "since the first batch; stats()['pass_start_wait_s']): the dataset's on_epoch_end makes each pass wait "
                "for the previous one's last batch. If the hook changes nothing but the dataset (a reshuffle, an epoch "
                "counter), epoch_end_ahead=True loads the next pass while this one ends.",
                self.name, stats["pass_start_wait_s"], 100 * stats["pass_start_wait_s"] / since_first, since_first)

    def may_try(self, pass_):
        """Whether to try loading the pass after `pass_` ahead now."""
        return self.requested and self.stats["off"] is None and self.current is None and self.tried != pass_

    def start(self, pass_, backend):
        """Runs the hooks on a copy of the state the workers of `backend` hold; returns
        the `Ahead` for pass `pass_` (now `current`), or None where the copy cannot stand
        for the real hook (counted as skipped)."""
        self.tried = pass_ - 1
        payload, keys = backend.current_state()
        try:
            if payload is None:
                raise NotAhead("the workers' state is not kept")
            out, out_keys, n = run_hook_on_copy(payload, backend.shared, call_hooks=self._call_hooks,
                                                num_batches=self._num_batches, what=f"`{self.name}`")
            if out_keys != keys:  # (both sorted)
                raise NotAhead("on_epoch_end drops a shared array")
            if n is None:
                raise NotAhead("the dataset becomes infinite")
        except NotAhead as exc:
            self.failed("skipped", str(exc))
            return None
        self.current = Ahead(pass_, out, out_keys, n, payload, keys)
        return self.current

    def kept(self, ahead, payload, keys, rewrote, n, shared=None):
        """Whether the batches loaded ahead from `ahead` stand: the dataset, after its real
        hooks, pickles to `payload` (with shared `keys`; `rewrote`: it edited a shared
        array in place) and has `n` batches -- exactly the copy's, once rebuilt as the copy
        was (`repickled`; `shared`: the backend's shared arrays)."""
        fits = keys == ahead.keys and not rewrote and n == ahead.num_batches
        if fits and (payload == ahead.payload or repickled(payload, shared, f"`{self.name}`") == ahead.payload):
            self.stats["kept"] += 1
            self._fails = 0
            return True
        why = ("on_epoch_end edited a shared array in place" if rewrote else
               f"the length became {n}, not {ahead.num_batches}" if n != ahead.num_batches else
               "the dataset's state after on_epoch_end differs from the copy's")
        self.failed("missed", why)
        return False

    def failed(self, kind, reason):
        stats = self.stats
        stats[kind] += 1
        stats["last_reason"] = reason
        self._fails += 1
        logger.debug("ProcessLoader(%s): pass not loaded ahead of on_epoch_end (%s): %s", self.name, kind, reason)
        if self._fails >= MISSES_OFF:
            stats["off"] = f"{self._fails} passes in a row could not load ahead; the last: {reason}"
            logger.info("ProcessLoader(%s, epoch_end_ahead=True): no longer loading ahead of on_epoch_end: %s",
                        self.name, stats["off"])
