"""`kpipe.empty`: batch arrays allocated directly in the worker's shared-memory slot.

A worker normally copies each returned array into the slot of its batch. An array made
with `kpipe.empty` while a worker runs `__getitem__` already lives in that slot, so the
copy is skipped: for large batches (images read from HDF5 with `read_direct`, say) this
halves the memory traffic and removes the allocation of a fresh batch array per call.
Outside a process worker (main process, threads, `workers=0`) it is `numpy.empty`.
"""

import numpy as np

from kpipe._engine._shm import align

_CURRENT = None  # the SlotAllocator of the task this process is running, if any


class SlotAllocator:
    """Bump allocator over one slot `Segment`, for the duration of one task."""

    def __init__(self, segment):
        self.segment = segment
        self.used = 0
        self._maps = []  # (base address, size) of every mapping handed out

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in np.atleast_1d(shape)) if not isinstance(shape, (int, np.integer)) else (int(shape),)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:  # nothing to share (e.g. a batch of 0 rows)
            return np.empty(shape, dtype=dtype)
        offset = align(self.used)
        self.segment.reserve(offset + nbytes)
        mm = self.segment.mapping
        base = self.segment.address
        if (base, len(mm)) not in self._maps:
            self._maps.append((base, len(mm)))
        self.used = offset + nbytes
        return np.ndarray(shape, dtype=dtype, buffer=mm, offset=offset)

    def offset_of(self, arr):
        """The slot offset of `arr` if it is a C-contiguous array inside the slot, else None."""
        if not self._maps or not arr.flags.c_contiguous or arr.nbytes == 0:
            return None
        ptr = arr.__array_interface__["data"][0]
        for base, size in self._maps:
            if base <= ptr and ptr + arr.nbytes <= base + size:
                return ptr - base
        return None


def begin(segment):
    global _CURRENT
    _CURRENT = SlotAllocator(segment)
    return _CURRENT


def end():
    global _CURRENT
    _CURRENT = None


def empty(shape, dtype="float32"):
    """Like `numpy.empty`, but in a kpipe worker the array is the batch's shared memory.

    Return it (or a C-contiguous array of it) from `__getitem__` and the worker hands it
    over without copying it. Fill it completely (it is not zeroed) and do not keep it
    after `__getitem__` returns: the slot is reused for a later batch.

    Args:
        shape: An int or a tuple of ints.
        dtype: A numeric or bool dtype. Defaults to float32.

    Returns:
        An uninitialised `numpy.ndarray`.

    Example:

    >>> import numpy as np, kpipe
    >>> class Images:
    ...     def __len__(self):
    ...         return 2
    ...     def __getitem__(self, i):
    ...         x = kpipe.empty((4, 8, 8, 3), dtype=np.uint8)  # e.g. h5py read_direct(x, ...)
    ...         x[...] = i
    ...         return x, np.full(4, i)
    >>> with kpipe.ProcessLoader(Images(), workers=1) as loader:
    ...     int(loader[1][0].max())
    1
    """
    if _CURRENT is None:
        return np.empty(shape, dtype=dtype)
    return _CURRENT.empty(shape, dtype)
