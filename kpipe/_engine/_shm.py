"""Shared-memory segments: anonymous, growable, and impossible to leak.

Each segment is a `memfd` (an anonymous in-memory file). It has no name in `/dev/shm`, so
nothing is left behind when a process dies, whatever the signal: the kernel frees the
memory when the last file descriptor and mapping are gone. Workers receive the file
descriptor over their control socket (SCM_RIGHTS) and map the same pages. A worker that
needs more room than a slot has grows the file with `ftruncate`; everyone who maps it
afterwards sees the new size, and existing (smaller) mappings stay valid, so a slot never
shrinks under a reader.

Zero-copy hand-off: `Segment.arrays(...)` returns arrays that view the segment directly.
Each array keeps a `_Lease` alive through its `.base`; when the last array (or view of
one) from a batch is garbage collected, the lease calls `on_release`, and only then may
the slot be written again. Consumers therefore never see a batch change under them.
"""

import mmap
import os
import sys
import tempfile
import threading

import numpy as np

_ALIGN = 64  # bytes; cache-line alignment for every array in a slot
_PAGE = mmap.PAGESIZE
_HUGE_MIN_BYTES = 4 << 20
# madvise(MADV_POPULATE_WRITE) (Linux >= 5.14) maps every page of a range, writable, in one call.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def align(n, to=_ALIGN):
    return (n + to - 1) // to * to


def _anonymous_fd(name):
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    # Fallback (non-Linux): an unlinked temporary file, preferably on a RAM disk.
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=name, dir=directory)
    os.unlink(path)
    return fd


class Segment:
    """A growable shared-memory file mapped into this process. Not thread-safe."""

    def __init__(self, fd):
        self.fd = fd
        self._mm = None
        self._mapped = 0
        self._populated = 0  # bytes of the current mapping already paged in for writing

    @classmethod
    def create(cls, nbytes=0, name="kpipe"):
        fd = _anonymous_fd(name)
        seg = cls(fd)
        if nbytes:
            os.ftruncate(fd, align(nbytes, _PAGE))
        return seg

    @property
    def size(self):
        return os.fstat(self.fd).st_size

    def reserve(self, nbytes):
        """Grows the file to hold at least `nbytes` (never shrinks), maps it, and pages in
        the first `nbytes` for writing."""
        size = self.size
        if size < nbytes:
            # Grow with headroom, so that the small arrays written after a big one, or a
            # slowly growing batch size, do not regrow (and remap) the file each time.
            # Headroom costs no memory until it is written: memfd pages are allocated on use.
            size = align(max(nbytes + nbytes // 8, size + size // 4), _PAGE)
            os.ftruncate(self.fd, size)
        self._map(nbytes)
        if nbytes > self._populated:
            self._populate(nbytes)

    def _populate(self, nbytes):
        # A writer fills what it reserves: map those pages now, in one call. Write faults
        # come one per 4 KiB page (no fault-around), so an image batch would otherwise
        # take thousands of faults on the slot's first use in each worker.
        start = self._populated
        end = min(align(nbytes, _PAGE), self._mapped)
        self._populated = end
        if _MADV_POPULATE_WRITE is None or end <= start:
            return
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE, start, end - start)
        except OSError:
            pass  # kernels before 5.14: the pages fault in on first write instead

    def _map(self, nbytes):
        if self._mapped >= nbytes and self._mm is not None:
            return
        size = self.size
        if size < nbytes:
            raise ValueError(f"segment holds {size} bytes, {nbytes} needed")
        # An old, smaller mapping may still back arrays handed out earlier; it is unmapped
        # when those arrays die (mmap objects close themselves when unreferenced).
        self._mm = mmap.mmap(self.fd, size)
        self._mapped = size
        self._populated = 0
        if size >= _HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            # Big batches on 4 KiB pages pay for TLB misses; where the kernel allows huge
            # pages for shared memory (transparent_hugepage/shmem_enabled = advise), ask.
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass

    @property
    def mapping(self):
        """The current `mmap` of the whole segment (after `reserve`)."""
        return self._mm

    def write(self, leaves, layout):
        """Copies `leaves` into the segment at the offsets of `layout` (from `plan_layout`)."""
        self.reserve(max((o + n for o, n, _, _ in layout), default=0))
        for arr, (offset, nbytes, dtype, shape) in zip(leaves, layout):
            if nbytes:
                dst = np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=offset)
                np.copyto(dst, arr, casting="no")

    def views(self, layout, lease=None, writable=False):
        """Arrays viewing the segment at `layout`. With `lease`, each array keeps it alive."""
        end = max((o + n for o, n, _, _ in layout), default=0)
        self._map(end)
        out = []
        for offset, nbytes, dtype, shape in layout:
            arr = np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=offset)
            if lease is not None:
                arr = np.asarray(_LeasedBuffer(arr, lease))
            if not writable:
                arr.flags.writeable = False
            out.append(arr)
        return out

    def close(self):
        """Drops this process's mapping reference and file descriptor."""
        self._mm = None
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def plan_layout(leaves, placed=None, start=0):
    """`[(offset, nbytes, dtype_str, shape)]` for `leaves`, each aligned to 64 bytes.

    `placed[i]`, when not None, is the offset where leaf i already lies in the segment
    (see `kpipe.empty`); the other leaves are laid out from `start` on.
    """
    layout, offset = [], align(start)
    for i, arr in enumerate(leaves):
        nbytes = int(arr.nbytes)
        at = placed[i] if placed is not None else None
        if at is None:
            at, offset = offset, align(offset + nbytes)
        layout.append((at, nbytes, arr.dtype.str, tuple(arr.shape)))
    return layout


class Lease:
    """Calls `on_release()` once, when the last array holding it is garbage collected.

    Thread-safe: the release may run in whichever thread drops the last reference.
    """

    __slots__ = ("_on_release", "__weakref__")

    def __init__(self, on_release):
        self._on_release = on_release

    def __del__(self):
        cb, self._on_release = self._on_release, None
        if cb is not None:
            try:
                cb()
            except Exception:  # never raise from a finalizer (interpreter shutdown, etc.)
                pass


class _LeasedBuffer:
    """Exposes an array through `__array_interface__` so the new array's `.base` is us.

    NumPy stops collapsing `.base` chains at non-ndarray owners, so every view derived from
    the returned array keeps this object -- and through it the lease -- alive.
    """

    __slots__ = ("__array_interface__", "_arr", "_lease")

    def __init__(self, arr, lease):
        self._arr = arr
        self._lease = lease
        self.__array_interface__ = arr.__array_interface__


class SlotPool:
    """Slots of shared memory for batches in flight, recycled when their lease ends.

    `acquire()` returns a free slot id, creating a slot if none is free: the number of
    slots in flight is bounded by the caller (the loader's `max_queue_size`); slots still
    held by the consumer do not block progress. Extra idle slots beyond `keep_idle` are
    closed. Thread-safe.
    """

    def __init__(self, keep_idle, name="kpipe-slot"):
        self._lock = threading.Lock()
        self._free = []
        self.segments = {}
        self.retired = []  # slot ids closed here; workers are told to unmap them
        self._next_id = 0
        self._keep_idle = keep_idle
        self._name = name
        self._closed = False

    def acquire(self, prefer=()):
        """Returns `(slot_id, created)`: preferably a free slot in `prefer`, else the most
        recently freed one, else a new slot.

        Workers pass the slots they have already mapped: each worker then cycles through
        a few slots of its own instead of mapping (and page-faulting) every slot.
        """
        with self._lock:
            if self._free:
                for i in range(len(self._free) - 1, -1, -1):
                    if self._free[i] in prefer:
                        return self._free.pop(i), False
                return self._free.pop(), False
            slot = self._next_id
            self._next_id += 1
            self.segments[slot] = Segment.create(0, self._name)
            return slot, True

    def release(self, slot):
        with self._lock:
            if self._closed or slot not in self.segments:
                return
            if len(self._free) >= self._keep_idle:
                self.segments.pop(slot).close()
                self.retired.append(slot)
                return
            self._free.append(slot)

    def take_retired(self):
        with self._lock:
            out, self.retired = self.retired, []
            return out

    def lease(self, slot):
        return Lease(lambda: self.release(slot))

    def close(self):
        with self._lock:
            self._closed = True
            for seg in self.segments.values():
                seg.close()
            self.segments.clear()
            self._free.clear()
