"""This process's side of the shared-memory slots of Ray actors on its node (the NOTE in
`_ray.py`): the slots mapped here, those the consumer let go of (told to each actor with
its next call), and the slots of discarded batches, released once their calls end."""

import collections
import functools
import logging
import os
import weakref

from kpipe._engine import _shm
from kpipe._engine._ray_cluster import ray_module as _ray

logger = logging.getLogger("kpipe")


class Slots:
    """The slots of one `RayBackend`'s actors mapped into this process. Used from the
    backend's thread, but for `released`, which a batch's lease appends to from any."""

    def __init__(self, name):
        self.name = name
        self.reachable = True  # False once an actor's slot could not be opened here
        self._segments = {}  # (actor pid, slot) -> this process's Segment of that slot
        self.released = collections.deque()  # (actor pid, slot) the consumer let go of (any thread)
        self._free = {}  # actor pid -> slots released, to tell it with its next task
        self._orphans = []  # (ref, j): batches discarded in flight; their slots are released when they end
        self._finalizer = weakref.finalize(self, _close_segments, self._segments)

    def released_for(self, pid):
        """The slots of actor `pid` the consumer let go of since its last call (the
        others' are kept for their next calls)."""
        released = self.released
        while released:
            owner, slot = released.popleft()
            self._free.setdefault(owner, []).append(slot)
        self._reap_orphans()
        return self._free.pop(pid, ())

    def views(self, slot, actor):
        """The arrays of a batch left in `actor`'s slot: views of this process's mapping
        of it (its descriptor opened through /proc once per slot), each holding a lease
        that tells the actor, with its next task, that the slot is free again. None where
        the slot cannot be opened here (then every later batch uses the object store)."""
        index, fd, pid, layout = slot
        segment = self._segments.get((pid, index))
        if segment is None:
            try:
                segment = _shm.Segment(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC))
            except OSError as exc:
                said, self.reachable = not self.reachable, False
                if not said:  # (batches already in slots come this way too: said once)
                    logger.warning("ProcessLoader(%s): cannot open the shared memory of Ray actor %s (pid %s) on this "
                                   "node (%s): batches come through Ray's object store from now on.", self.name,
                                   actor.id, pid, exc)
                self.released.append((pid, index))
                return None
            self._segments[(pid, index)] = segment
        lease = _shm.Lease(functools.partial(self.released.append, (pid, index)))
        return segment.views(layout, lease=lease, writable=True), [(d, s) for _, _, d, s in layout]

    def count(self):
        """Slots of actors on this node mapped here now (each is reused once released)."""
        return len(self._segments)

    def forget(self, pid):
        """Actor `pid` is gone: this process's descriptors of its slots are closed (arrays
        still viewing them keep their mappings), and what was released for it is dropped."""
        self._free.pop(pid, None)
        for key in [k for k in self._segments if k[0] == pid]:
            self._segments.pop(key).close()

    def orphan(self, ref, j):
        """Batch `j` of call `ref` was discarded in flight: a slot it fills is released
        when the call ends."""
        self._orphans.append((ref, j))

    def _reap_orphans(self):
        """Releases the slots of discarded batches whose calls ended (they are unused)."""
        if not self._orphans:
            return
        ray = _ray()
        refs = list({id(ref): ref for ref, _ in self._orphans}.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = {id(ref) for ref in done}
        orphans, self._orphans = self._orphans, []
        for ref, j in orphans:
            if id(ref) not in done:
                self._orphans.append((ref, j))
                continue
            try:
                kind, value = ray.get(ref)[0][j]
            except Exception:  # noqa: BLE001 -- the call failed: no slot was kept
                continue
            if kind == "ok" and value[3] is not None:
                self.released.append((value[3][2], value[3][0]))

    def close(self):
        self._orphans.clear()
        self._finalizer()  # (arrays still viewing slots keep their mappings)


def _close_segments(segments):
    for segment in segments.values():
        segment.close()
    segments.clear()
