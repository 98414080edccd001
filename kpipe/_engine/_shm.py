"""Shared-memory segments: anonymous, growable, and impossible to leak.

Each segment is a `memfd` (an anonymous in-memory file). It has no name in `/dev/shm`, so
nothing is left behind when a process dies, whatever the signal: the kernel frees the
memory when the last file descriptor and mapping are gone. Workers receive the file
descriptor over their control socket (SCM_RIGHTS) and map the same pages. A worker that
needs more room than a slot has grows the file with `ftruncate`; everyone who maps it
afterwards sees the new size, and existing (smaller) mappings stay valid, so a slot never
shrinks under a reader.

Mappings cost no file descriptor: a `Mapping` is made with libc's `mmap` (Python's
`mmap.mmap` would `dup()` the descriptor and keep the copy open for as long as the
mapping lives), and is unmapped when the last array viewing it is gone. A process may
therefore close a segment's descriptor and keep using its pages -- workers do, so that
the batches a consumer holds cost them no descriptor at all.

Zero-copy hand-off: `Segment.views(...)` returns arrays that view the segment directly.
Each array keeps a `Lease` alive through its `.base`; when the last array (or view of
one) from a batch is garbage collected, the lease calls `on_release`, and only then may
the slot be written again. Consumers therefore never see a batch change under them.
Arrays of zero bytes (a batch of 0 rows) need no shared memory: they are plain arrays.
"""

import ctypes
import errno
import mmap
import os
import sys
import tempfile
import threading
import time
import weakref

import numpy as np

from kpipe.errors import LoaderError

_ALIGN = 64  # bytes; cache-line alignment for every array in a slot
_PAGE = mmap.PAGESIZE
_HUGE_MIN_BYTES = 4 << 20
# posix_fallocate: allocates a file's pages without mapping them (None where Python lacks it).
_fallocate = getattr(os, "posix_fallocate", None)
# madvise(MADV_POPULATE_WRITE / _READ) (Linux >= 5.14) maps every page of a range in one call.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_FD_LIMIT_TARGET = 1 << 20  # soft RLIMIT_NOFILE asked for when the hard limit is unlimited


# Seconds this process spent in `Segment.reserve` growing, mapping and paging in slots:
# what a slot costs a worker once (see `setup_seconds`).
_setup_seconds = [0.0]


def setup_seconds():
    """Seconds this process has spent setting up shared memory for writing so far --
    growing segments, mapping them and paging them in (`Segment.reserve`); the pages'
    first allocation by the kernel counts here. A worker reports the part each batch
    paid, so that the main process knows what one more slot costs (`ProcessLoader`
    deepens its window only when workers idled longer than that, see `Window.starved` in `_window.py`)."""
    return _setup_seconds[0]


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


# ------------------------------------------------------------------ file-descriptor limit
_fd_limit_raised = False


def raise_fd_limit():
    """Raises this process's soft `RLIMIT_NOFILE` to its hard limit, once per process.

    Every live slot and shared array holds a descriptor in the main process; the usual
    default soft limit (1024) is far below the hard one on most systems. Workers started
    afterwards inherit the new limit. Returns `(soft, hard)` as they are now.
    """
    global _fd_limit_raised
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _fd_limit_raised:
        return soft, hard
    _fd_limit_raised = True
    target = _FD_LIMIT_TARGET if hard == resource.RLIM_INFINITY else min(hard, _FD_LIMIT_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. above fs.nr_open: keep what we have
            pass
    return soft, hard


def is_fd_exhaustion(exc):
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def fd_limit_error(exc, doing):
    """A `LoaderError` for an `OSError` EMFILE/ENFILE raised while `doing` something."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limits = f"soft limit {_limit_text(soft)}, hard limit {_limit_text(hard)}"
    except ImportError:
        limits = "limit unknown"
    if exc.errno == errno.ENFILE:
        what = "the system-wide limit on open files (fs.file-max) is reached"
        fix = "Close other programs' files or raise fs.file-max (sysctl), or hold fewer batches."
    else:
        what = f"this process reached its limit of open files (RLIMIT_NOFILE: {limits})"
        fix = (
            "kpipe keeps one file descriptor per batch you hold (arrays still referenced) and per "
            "shared dataset array: hold fewer batches at once, or raise the limit before starting "
            "Python, e.g. `ulimit -n 65536` in the shell (up to the hard limit; raising the hard "
            "limit needs root, e.g. in /etc/security/limits.conf)."
        )
    return LoaderError(f"kpipe could not {doing}: {what}. {fix}")


def _limit_text(value):
    try:
        import resource

        if value == resource.RLIM_INFINITY:
            return "unlimited"
    except ImportError:
        pass
    return str(value)


# ------------------------------------------------------------------------ mappings
def _load_libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_fn = getattr(libc, "mmap64", None) or libc.mmap
        mmap_fn.restype = ctypes.c_void_p
        mmap_fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return mmap_fn, libc.munmap, libc.madvise
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_FIXED = 0x10  # (Linux and the BSDs)


def _load_mremap():
    try:
        fn = ctypes.CDLL(None, use_errno=True).mremap
    except (OSError, AttributeError):  # not Linux
        return None
    fn.restype = ctypes.c_void_p
    return fn


_MREMAP = _load_mremap() if sys.platform.startswith("linux") else None
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


class Mapping:
    """`size` bytes of file `fd` mapped shared and writable, without duplicating `fd`.

    Exposes `__array_interface__` (uint8 bytes): `np.asarray(mapping)` views it, and the
    view keeps the mapping alive. Unmapped when the last reference is gone, in whichever
    thread drops it. Where libc cannot be loaded, falls back to `mmap.mmap` (which keeps a
    duplicate descriptor).
    """

    __slots__ = ("address", "size", "__array_interface__", "_mm", "__weakref__")

    def __init__(self, fd, size):
        self._mm = None
        self.address = None
        self.size = size
        if _LIBC is None:
            self._mm = mmap.mmap(fd, size)
            self.address = np.frombuffer(self._mm, dtype=np.uint8).__array_interface__["data"][0]
        else:
            addr = _LIBC[0](None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
            self.address = addr
        self.__array_interface__ = {"data": (self.address, False), "shape": (size,), "typestr": "|u1", "version": 3}

    def detach(self, keep):
        """Gives this process private pages at this mapping's addresses, holding a copy of
        its first `keep` bytes: arrays viewing it keep their addresses and values, but no
        longer share the file's pages (another process writing the file is not seen here,
        and writes here are not seen there). Returns False where that cannot be done (no
        libc): the mapping is then unchanged.

        For memory a dataset kept of a batch slot (`SlotAllocator.keep_apart` in
        `_alloc.py`): the consumer goes on reading the batch in the file's pages while the
        dataset writes its own copy.
        """
        if self._mm is not None or self.address is None or _LIBC is None:
            return False
        keep = min(align(keep, _PAGE), self.size)
        prot, private = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_ANONYMOUS
        if _MREMAP is not None:  # a copy made elsewhere, then moved onto these addresses in one call
            fresh = _LIBC[0](None, self.size, prot, private, -1, 0)
            if fresh is None or fresh == _MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {self.size} private bytes failed: {os.strerror(err)}")
            ctypes.memmove(fresh, self.address, keep)
            moved = _MREMAP(ctypes.c_void_p(fresh), ctypes.c_size_t(self.size), ctypes.c_size_t(self.size),
                            ctypes.c_int(_MREMAP_MAYMOVE | _MREMAP_FIXED), ctypes.c_void_p(self.address))
            if moved == self.address:
                return True
            _LIBC[1](fresh, self.size)  # (the old mapping is still in place)
        # elsewhere: through a temporary copy, private pages mapped over the old ones
        saved = ctypes.create_string_buffer(keep)
        ctypes.memmove(saved, self.address, keep)
        addr = _LIBC[0](ctypes.c_void_p(self.address), self.size, prot, private | _MAP_FIXED, -1, 0)
        if addr != self.address:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap over {self.size} mapped bytes failed: {os.strerror(err)}")
        ctypes.memmove(self.address, saved, keep)
        return True

    def madvise(self, advice, start=0, length=None):
        """Raises OSError if the kernel refuses `advice`."""
        length = self.size - start if length is None else length
        if self._mm is not None:
            self._mm.madvise(advice, start, length)
        elif _LIBC[2](self.address + start, length, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def __del__(self):
        if self._mm is None and self.address is not None and _LIBC is not None:
            _LIBC[1](self.address, self.size)
            self.address = None


class Segment:
    """A growable shared-memory file mapped into this process. Not thread-safe.

    `fd` may be closed (`close_fd`) while the mapping is kept: the segment can then still
    be read and written up to its mapped size, and `adopt_fd` gives it a descriptor again
    when it must grow or remap.
    """

    def __init__(self, fd):
        self.fd = fd
        self._map_obj = None  # the current Mapping
        self._buf = None  # uint8 array viewing all of it
        self._mapped = 0
        self._populated = 0  # bytes of the current mapping already paged in for writing

    @classmethod
    def create(cls, nbytes=0, name="kpipe"):
        fd = _anonymous_fd(name)
        seg = cls(fd)
        if nbytes:
            try:
                os.ftruncate(fd, align(nbytes, _PAGE))
            except BaseException:
                seg.close()
                raise
        return seg

    @property
    def size(self):
        if self.fd is None:
            return self._mapped
        return os.fstat(self.fd).st_size

    @property
    def mapped_size(self):
        return self._mapped

    def reserve(self, nbytes):
        """Grows the file to hold at least `nbytes` (never shrinks), maps it, and pages in
        the first `nbytes` for writing. The time that takes, where anything was to do,
        is added to `setup_seconds()`."""
        if nbytes <= 0 or (nbytes <= self._populated and self._buf is not None):
            return  # mapped and paged in that far already: nothing to ask the file or kernel
        t0 = time.perf_counter()
        if nbytes <= self._mapped and self._buf is not None:
            size = self._mapped  # already mapped that far: no need to ask the file
        else:
            size = self._need_fd().size
        grew = size < nbytes
        if grew:
            # Grow with headroom, so that the small arrays written after a big one, or a
            # slowly growing batch size, do not regrow (and remap) the file each time.
            # Headroom costs no memory until it is written: memfd pages are allocated on use.
            size = align(max(nbytes + nbytes // 8, size + size // 4), _PAGE)
            os.ftruncate(self.fd, size)
        self._map(nbytes)
        if nbytes > self._populated:
            self._populate(nbytes, allocate=grew)
        _setup_seconds[0] += time.perf_counter() - t0

    def _need_fd(self):
        if self.fd is None:
            raise ValueError("this segment's file descriptor was closed; it can no longer grow or be remapped")
        return self

    def _populate(self, nbytes, allocate=False):
        # A writer fills what it reserves: map those pages now, in one call. Write faults
        # come one per 4 KiB page (no fault-around), so an image batch would otherwise
        # take thousands of faults on the slot's first use in each worker.
        start = self._populated
        end = min(align(nbytes, _PAGE), self._mapped)
        self._populated = end
        if end <= start:
            return
        if allocate and _fallocate is not None:
            # The process that grows the file is the first to write most of it: have the
            # kernel allocate (and zero) the pages in one fallocate, which costs ~13% less
            # than allocating them one by one while populating (scripts/bench_shm.py);
            # pages that exist already cost it ~0.04 ms per MB.
            try:
                _fallocate(self.fd, start, end - start)
            except OSError:
                pass  # e.g. no fallocate on this file system: populating allocates them
        # Pages another process wrote already are mapped with read faults, which map 16
        # pages each (fault-around) where write faults map one: ~0.13 instead of ~0.22 ms
        # per MB (scripts/bench_shm.py, "2nd mapping"). A shared mapping's pages are
        # writable either way. The pages fallocate just allocated are not initialised
        # yet, which fault-around skips: those are populated for writing.
        advice = _MADV_POPULATE_WRITE if allocate else _MADV_POPULATE_READ
        if advice is None:
            return
        try:
            self._map_obj.madvise(advice, start, end - start)
        except OSError:
            pass  # kernels before 5.14: the pages fault in on first write instead

    def _map(self, nbytes):
        if nbytes <= 0 or (self._mapped >= nbytes and self._buf is not None):
            return
        size = self._need_fd().size
        if size < nbytes:
            raise ValueError(f"segment holds {size} bytes, {nbytes} needed")
        # An old, smaller mapping may still back arrays handed out earlier; it is unmapped
        # when those arrays die.
        self._map_obj = Mapping(self.fd, size)
        self._buf = np.asarray(self._map_obj)
        self._mapped = size
        self._populated = 0
        if size >= _HUGE_MIN_BYTES and _MADV_HUGEPAGE is not None:
            # Big batches on 4 KiB pages pay for TLB misses; where the kernel allows huge
            # pages for shared memory (transparent_hugepage/shmem_enabled = advise), ask.
            try:
                self._map_obj.madvise(_MADV_HUGEPAGE)
            except OSError:
                pass

    def map_all(self):
        """Maps the whole file as it is now (e.g. before closing the descriptor)."""
        self._map(self.size)

    @property
    def mapping(self):
        """A uint8 array viewing the whole current mapping (after `reserve`), or None."""
        return self._buf

    @property
    def address(self):
        return None if self._map_obj is None else self._map_obj.address

    def forget_mapping(self):
        """Drops this process's current mapping (arrays viewing it keep it); the next
        `reserve`/`views` maps the file again (it needs the descriptor)."""
        self._map_obj = None
        self._buf = None
        self._mapped = 0
        self._populated = 0

    def mapping_ref(self):
        """A weak reference to the current `Mapping` (None if unmapped): alive as long as
        this segment or any array viewing it is."""
        return None if self._map_obj is None else weakref.ref(self._map_obj)

    def write(self, leaves, layout):
        """Copies `leaves` into the segment at the offsets of `layout` (from `plan_layout`)."""
        self.reserve(max((o + n for o, n, _, _ in layout), default=0))
        for arr, (offset, nbytes, dtype, shape) in zip(leaves, layout):
            if nbytes:
                dst = np.ndarray(shape, dtype=as_dtype(dtype), buffer=self._buf, offset=offset)
                np.copyto(dst, arr, casting="no")

    def views(self, layout, lease=None, writable=False):
        """Arrays viewing the segment at `layout`. With `lease`, each array keeps it alive.

        Arrays of zero bytes are fresh empty arrays: they view nothing and hold no lease.
        """
        end = max((o + n for o, n, _, _ in layout), default=0)
        self._map(end)
        out = []
        for offset, nbytes, dtype, shape in layout:
            dtype = as_dtype(dtype)
            if nbytes == 0:
                arr = np.empty(shape, dtype=dtype)
            else:
                arr = np.ndarray(shape, dtype=dtype, buffer=self._buf, offset=offset)
                if lease is not None:
                    leased = np.asarray(_LeasedBuffer(arr, lease))
                    # (the interface names an ml_dtypes type by its bytes, '<V2': view it as itself)
                    arr = leased if leased.dtype == dtype else leased.view(dtype)
            if not writable:
                arr.flags.writeable = False
            out.append(arr)
        return out

    def close_fd(self):
        """Closes this process's descriptor; the mapping (and arrays viewing it) stay."""
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def adopt_fd(self, fd):
        """Takes `fd` (of the same file) as this segment's descriptor."""
        if self.fd is not None and self.fd != fd:
            self.close_fd()
        self.fd = fd

    def close(self):
        """Drops this process's mapping reference and file descriptor. Arrays still
        viewing the mapping keep it (not the descriptor) until they die."""
        self.forget_mapping()
        self.close_fd()


def dtype_token(dtype):
    """How a layout names `dtype`: its `str` (`'<f4'`), or the name of an `ml_dtypes` type
    (`'bfloat16'`: its `str` would be `'<V2'`, bytes without a meaning). `as_dtype` inverts it."""
    return dtype.name if is_ml_dtype(dtype) else dtype.str


def is_ml_dtype(dtype):
    """Whether `dtype` is one of `ml_dtypes`' (bfloat16, float8_*, int4...)."""
    return (getattr(dtype.type, "__module__", None) or "").split(".")[0] == "ml_dtypes"  # (its scalar type's)


def as_dtype(token):
    """The dtype a layout's `token` names (`dtype_token`); imports `ml_dtypes` for its names."""
    try:
        return np.dtype(token)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with NumPy)

        return np.dtype(token)


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
        layout.append((at, nbytes, dtype_token(arr.dtype), tuple(arr.shape)))
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
            except KeyboardInterrupt:
                # Python prints and drops an exception raised in __del__: a Ctrl-C that
                # lands here would be lost. It is raised by the engine's next wait instead
                # (`take_interrupt`); the slot of an interrupted release stays taken.
                _INTERRUPTED[0] = True
            except Exception:  # never raise from a finalizer (interpreter shutdown, etc.)
                pass


_INTERRUPTED = [False]  # a KeyboardInterrupt caught in Lease.__del__, not raised yet


def take_interrupt():
    """Raises the KeyboardInterrupt that a lease's release caught, if any (once)."""
    if _INTERRUPTED[0]:
        _INTERRUPTED[0] = False
        raise KeyboardInterrupt


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
        self._lock = threading.RLock()  # (re-entrant: see `lease`)
        self._free = []
        self.segments = {}
        self.retired = []  # slot ids closed here; workers are told to unmap them
        self._next_id = 0
        self._keep_idle = keep_idle
        self._name = name
        self._closed = False
        self.lease_releases = 0  # leases ended (batches the consumer let go), ever
        self._pinned = set()  # slots a worker's dataset still references: retired, never reused
        # KPIPE_REUSE_SLOTS=0: every slot is retired once let go of (the opt-out of slot reuse:
        # each batch then costs a new slot, as each costs a new array without kpipe)
        self._reuse = os.environ.get("KPIPE_REUSE_SLOTS", "1") != "0"

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
            return self._create(), True

    def create(self):
        """Returns the id of a new slot (in use, like an acquired one)."""
        with self._lock:
            return self._create()

    def _create(self):
        try:
            segment = Segment.create(0, self._name)
        except OSError as exc:
            if is_fd_exhaustion(exc):
                raise fd_limit_error(exc, f"create shared memory for one more batch ({len(self.segments)} in use)") from exc
            raise
        slot = self._next_id
        self._next_id += 1
        self.segments[slot] = segment
        return slot

    def __len__(self):
        """Slots alive: free, in flight or held by the consumer."""
        with self._lock:
            return len(self.segments)

    def has_free(self):
        """Whether a free slot exists (a task can take one without creating a slot)."""
        with self._lock:
            return bool(self._free)

    def free_ids(self):
        """The ids of the free slots, as a frozenset."""
        with self._lock:
            return frozenset(self._free)

    def pin(self, slot):
        """Marks `slot` as referenced by a worker's dataset: when released it is retired
        (the worker unmaps it; the dataset's arrays keep its pages), not reused."""
        with self._lock:
            if slot in self.segments:
                self._pinned.add(slot)

    def release(self, slot):
        with self._lock:
            if self._closed or slot not in self.segments:
                return
            if slot in self._pinned or not self._reuse or len(self._free) >= self._keep_idle:
                self._pinned.discard(slot)
                self.segments.pop(slot).close()
                self.retired.append(slot)
                return
            self._free.append(slot)

    def take_retired(self):
        with self._lock:
            out, self.retired = self.retired, []
            return out

    def lease(self, slot):
        # The release may run inside this pool's own methods: an allocation under the lock
        # can run the garbage collector, which frees a cycle holding an array of a batch --
        # hence the re-entrant lock (each method's state is whole between its statements).
        return Lease(lambda: self._release_lease(slot))

    def _release_lease(self, slot):
        with self._lock:
            self.lease_releases += 1
        self.release(slot)

    def in_use(self):
        """Slots not free: in flight, being prepared or held by the consumer."""
        with self._lock:
            return len(self.segments) - len(self._free)

    def close(self):
        """Closes every slot's descriptor; batches still held keep their mappings."""
        with self._lock:
            self._closed = True
            for seg in self.segments.values():
                seg.close()
            self.segments.clear()
            self._free.clear()
            self.retired.clear()
