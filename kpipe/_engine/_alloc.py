"""`kpipe.empty`: batch arrays allocated directly in the worker's shared-memory slot.

A worker normally copies each returned array into the slot of its batch. An array made
with `kpipe.empty` while a worker runs `__getitem__` already lives in that slot, so the
copy is skipped: for large batches (images read from HDF5 with `read_direct`, say) this
halves the memory traffic and removes the allocation of a fresh batch array per call.
Outside a process worker (main process, threads, `workers=0`) it is `numpy.empty`.

NOTE [ np.stack into the slot, and arrays a dataset keeps ]
----------------------------------------------------------
The commonest batch is built as users write it: `np.stack([sample(j) for j in ...])`, a
fresh array per call that the worker then copies into the slot (77 MB twice per batch on
workload b). While a process worker runs `__getitem__`, `numpy.stack` is wrapped
(`stacking_into`): a stack of plain ndarrays whose result is at least `STACK_MIN_BYTES`
gets `out=` an array in the slot -- same values, shape and dtype as NumPy's, but no new
allocation and no copy. Everything else (`out=` given, anything but a list or tuple of
arrays -- a generator, which NumPy 2 refuses --, object dtypes, subclasses,
`__array_function__` types, small results, mismatched shapes) goes to NumPy unchanged,
which returns or raises what it would. NumPy's own `np.stack` tests run through it
(tests/test_stack_slot.py). `KPIPE_STACK_INTO_SLOT=0` in the environment turns it off.
Code that bound `from numpy import stack` at import is not reached (nothing changes
for it).

That puts memory the dataset sees in the slot, and a slot is reused for a later batch. A
dataset that keeps such an array (a cache) -- or a `kpipe.empty` array, against its
docstring -- would see it overwritten; one that refills what it kept (`np.stack(rows,
out=self.buf)`, `self.buf[...] = ...` on a kept `kpipe.empty` buffer) would write into a
batch the consumer still reads. So after each task, whether it returned or raised (a
cache filled before an exception), the worker checks whether anything outside it still
references the slot's mappings (`SlotAllocator.kept`: their reference counts, with the
task's own references and the exception dropped); if so (`keep_apart`) it gives those
addresses private pages holding the same bytes -- the dataset keeps its arrays, values
and addresses, the consumer's batch stays in the file's pages, and neither sees the
other's writes -- and the batch is marked "pinned": the main process retires that slot
once the consumer lets go of it instead of reusing it. A cache costs a copy and a slot
per kept batch, as it costs an array per kept batch without kpipe.
"""

import math
import os
import sys
import threading

import numpy as np

from kpipe._engine._shm import align, plan_layout

_CURRENT = None  # the SlotAllocator of the task this process is running, if any
_OWNER = None  # the thread running that task: only its allocations go to the slot (a bump allocator)


class SlotAllocator:
    """Bump allocator over one slot `Segment`, for the duration of one task."""

    def __init__(self, segment):
        self.segment = segment
        self.used = 0
        self._maps = []  # (base address, size) of every mapping handed out
        self._bufs = []  # the mapping arrays handed-out arrays view (see `kept`)

    def place(self, leaves):
        """Lays a batch's `leaves` out in this slot: arrays allocated here (`kpipe.empty`,
        big `np.stack` results) stay where they are, the others are copied in after them.
        Returns the layout (`plan_layout`) the consumer's views are made from."""
        placed = [self.offset_of(a) for a in leaves]
        layout = plan_layout(leaves, placed, start=self.used)
        copies = [(a, lay) for a, lay, at in zip(leaves, layout, placed) if at is None]
        self.segment.write([a for a, _ in copies], [lay for _, lay in copies])
        return layout

    def _kept(self):
        """Indexes into `_bufs` of the mappings something other than the segment still
        references."""
        out = []
        for i in range(len(self._bufs)):
            buf = self._bufs[i]
            # references: this list, `buf`, getrefcount's argument (+ the segment's)
            if sys.getrefcount(buf) > 3 + (buf is self.segment.mapping):
                out.append(i)
            del buf
        return out

    def kept(self):
        """Whether something other than the segment still references memory this task
        allocated here (the dataset kept an array or a view of it): the caller must have
        dropped its own references to the batch first. See the NOTE."""
        return bool(self._kept())

    def keep_apart(self):
        """If the dataset kept memory of this slot (`kept`), gives the dataset its own
        copy of it: the mapping's addresses in this process get private pages holding the
        same bytes (`Mapping.detach`), so what the dataset writes there later (an `out=`
        target or a `kpipe.empty` buffer it refills) never reaches the batch the consumer
        reads from the slot's file. Returns whether it kept memory: the caller then has
        the slot retired (never written again: this process no longer maps it). See the
        NOTE."""
        kept = self._kept()
        for i in kept:
            buf = self._bufs[i]
            mapping = buf.base
            if getattr(mapping, "detach", None) is not None:
                mapping.detach(min(self.used, buf.nbytes))
            if buf is self.segment.mapping:
                self.segment.forget_mapping()  # (its addresses are the dataset's now)
            del buf, mapping
        return bool(kept)

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        if not (isinstance(shape, tuple) and all(type(d) is int for d in shape)):  # (a tuple of ints: as given, ~4 us less)
            shape = tuple(int(d) for d in np.atleast_1d(shape)) if not isinstance(shape, (int, np.integer)) else (int(shape),)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:  # nothing to share (e.g. a batch of 0 rows)
            return np.empty(shape, dtype=dtype)
        offset = align(self.used)
        self.segment.reserve(offset + nbytes)
        mm = self.segment.mapping
        base = self.segment.address
        if (base, len(mm)) not in self._maps:
            self._maps.append((base, len(mm)))
            self._bufs.append(mm)
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
    global _CURRENT, _OWNER
    _CURRENT, _OWNER = SlotAllocator(segment), threading.get_ident()
    return _CURRENT


def end():
    global _CURRENT
    _CURRENT = None


def empty(shape, dtype="float32"):
    """Like `numpy.empty`, but in a kpipe worker the array is the batch's shared memory.

    Return it (or a C-contiguous array of it) from `__getitem__` and the worker hands it
    over without copying it. Fill it completely (it is not zeroed). Keeping it after
    `__getitem__` returns costs a slot: the worker then retires that slot instead of
    reusing it for a later batch (the NOTE above).

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
    if _CURRENT is None or threading.get_ident() != _OWNER:  # (another thread of the dataset: its own memory)
        return np.empty(shape, dtype=dtype)
    return _CURRENT.empty(shape, dtype)


STACK_MIN_BYTES = 1 << 20  # smaller stacks stay NumPy's: a slot is for the batch, not its temporaries
_np_stack = np.stack


def _stack(arrays, axis=0, out=None, **kwargs):
    """`numpy.stack`, with the result in the current slot where it is big enough (the NOTE)."""
    if out is not None or _CURRENT is None or threading.get_ident() != _OWNER or type(arrays) not in (list, tuple):
        # (a generator or other iterable: NumPy 2 refuses it, NumPy 1 warns -- as NumPy does)
        return _np_stack(arrays, axis=axis, out=out, **kwargs)
    arrays = [np.asanyarray(a) for a in arrays]
    first = arrays[0] if arrays else None
    if first is None or any(type(a) is not np.ndarray or a.shape != first.shape for a in arrays):
        return _np_stack(arrays, axis=axis, **kwargs)  # (NumPy raises or dispatches as it would)
    dtype = kwargs.get("dtype")
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(*{a.dtype for a in arrays})
    ndim = first.ndim + 1
    if dtype.hasobject or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        return _np_stack(arrays, axis=axis, **kwargs)
    axis = int(axis) % ndim
    shape = first.shape[:axis] + (len(arrays),) + first.shape[axis:]
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize < STACK_MIN_BYTES:
        return _np_stack(arrays, axis=axis, **kwargs)
    kwargs.pop("dtype", None)  # (NumPy takes `out` or `dtype`, not both: `out` has it)
    return _np_stack(arrays, axis=axis, out=_CURRENT.empty(shape, dtype), **kwargs)


class stacking_into:
    """Context: `numpy.stack` places big results in the current slot (see the NOTE), unless
    `KPIPE_STACK_INTO_SLOT=0` is in the environment (the workers inherit it)."""

    def __enter__(self):
        if os.environ.get("KPIPE_STACK_INTO_SLOT", "1") != "0":
            np.stack = _stack
        return self

    def __exit__(self, *exc):
        np.stack = _np_stack
        return False
