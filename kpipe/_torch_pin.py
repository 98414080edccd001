"""Pinned host memory and an ahead copy to Keras's CUDA device, on the PyTorch backend.

NOTE [ The ahead copy: pinned buffers, a side stream, events ]
--------------------------------------------------------------
On the torch backend with a CUDA device, Keras copies each batch's tensors to the device
(`x.to(device)` in its `convert_to_tensor`) from pageable memory, in the step's stream:
the step waits for the copy, and the driver stages pageable memory through its own
pinned buffer. torch's `DataLoader(pin_memory=True)` pins each batch in a thread; the
copy still runs in the step. Here an `AheadCopy` does both ahead of the step:

- it is the feed of the other backends (`kpipe._feed.Feed`: a thread per stream, a
  bounded queue of `depth` batches in plan order, the consumer counting only what Keras
  took, the read limit lifted when Keras asks past it, errors re-raised in Keras's thread)
  with a pinning placement (`_Pinning`, as `kpipe._jax_feed` gives one that puts on JAX's
  device): the thread standardizes each batch and copies every leaf torch can wrap
  (`_torch_feed.wrappable`) into one pinned host buffer per batch, taken from a pool of at
  most `depth + 1` buffers (reused; one that is too small for a batch is replaced by one
  that fits);
- it then issues `.to(device, non_blocking=True)` for each leaf on a side CUDA stream and
  records an event after them;
- the consumer (Keras's trainer, in the main thread) gets the batches in order as tensors
  already on its device; before a batch is handed over the step's stream waits for that
  event (`wait_event`, on the GPU: the CPU does not block) and each tensor is marked as
  used by the step's stream (`record_stream`), so the caching allocator does not give
  its memory to the side stream while the step may still read it. Keras's
  `convert_to_tensor` then keeps the tensor as it is (its `.to(device)` is a no-op for a
  tensor already there): no second copy.
- a batch's pinned buffer and its source arrays (which hold the loader's slot lease,
  `kpipe/_engine/_shm.py`) are kept until the copy's event has completed, then the buffer
  goes back to the pool and the slot back to the loader.

Leaves torch cannot wrap are handed over as they are (Keras converts them, as before).
The thread stops at the end of its batches, on an error (raised by `next()` in order,
after the batches before it), or when the consumer is closed or garbage collected (the
consumer then waits for it: no thread is left); batches read ahead and not taken are
dropped with it, and the copies in flight are waited for before their slots go back.

The copier is injectable: `CudaCopier` does the CUDA calls (guarded by
`torch.cuda.is_available()`); `CpuCopier` makes the CPU the "device" (pinning a no-op, the
"copy" a plain one) so the thread's ordering, bounding, buffer reuse and lease release run
and are tested without a GPU (`KPIPE_TORCH_PIN=cpu`). `KPIPE_TORCH_PIN=0` turns the ahead
copy off (today's zero-copy hand-over, NOTE in `kpipe/_torch_feed.py`).

Example:

>>> import numpy as np
>>> batches = [(np.full(3, i, "float32"),) for i in range(4)]
>>> ahead = AheadCopy(iter(batches), _NumpyCopier(), depth=2)
>>> [int(b[0][0]) for b in ahead]
[0, 1, 2, 3]
>>> ahead.alive()
False
"""

import collections
import os
import queue
import threading
import weakref

import numpy as np

from kpipe import _feed

DEPTH = 2  # batches copied ahead of the step
_ALIGN = 64  # bytes: each leaf's offset in a pinned buffer
_ROUND = 1 << 16  # buffers are sized up to a multiple of this (a batch that grows a little reuses them)
_ENV = "KPIPE_TORCH_PIN"


def mode():
    """`KPIPE_TORCH_PIN`: "auto" (unset or 1: pin for a CUDA device), "off" (0) or "cpu"."""
    value = os.environ.get(_ENV, "1").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value == "cpu":
        return "cpu"
    raise ValueError(
        f"{_ENV}={value!r}: expected 1 (the default: pinned memory and an ahead copy for a CUDA device), "
        "0 (off: batches handed over as tensors over the loader's slots) or cpu (the ahead copy with the CPU "
        "as the device, for tests)")


def copier_for(device):
    """The copier for Keras's torch `device`, or None where nothing changes (a CPU device,
    no CUDA, or `KPIPE_TORCH_PIN=0`)."""
    chosen = mode()
    if chosen == "off":
        return None
    if chosen == "cpu":
        return CpuCopier()
    try:
        import torch
    except ImportError:
        return None

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return CudaCopier(device)


class _Buffer:
    __slots__ = ("handle", "array", "capacity")

    def __init__(self, handle, array):
        self.handle, self.array, self.capacity = handle, array, array.nbytes


class _NumpyCopier:
    """The copier's interface, on NumPy alone: the "device" is host memory, the copy a
    plain one, every copy complete at once (event None)."""

    def alloc(self, nbytes):
        """A host buffer of `nbytes`: (handle, uint8 NumPy view of it)."""
        array = np.empty(nbytes, np.uint8)
        return array, array

    def view(self, buffer, offset, dtype, shape):
        return buffer.array[offset:offset + np.dtype(dtype).itemsize * int(np.prod(shape))].view(dtype).reshape(shape)

    def send(self, buffer, places):
        """Starts the copy of `buffer`'s leaves at `places` [(offset, dtype, shape)] to the
        device: (device leaves, event)."""
        return [self.view(buffer, *place).copy() for place in places], None

    def query(self, event):
        return event is None

    def wait(self, event):
        """Blocks until `event` completed."""

    def hand(self, leaves, event):
        """In the consumer's thread, before the leaves are handed over."""


class CpuCopier(_NumpyCopier):
    """The CPU as the device: torch tensors copied out of the (unpinned) buffer."""

    def send(self, buffer, places):
        import torch

        return [torch.from_numpy(self.view(buffer, *place).copy()) for place in places], None


def host_view(handle, offset, dtype, shape):
    """The torch tensor over a leaf in a (pinned) uint8 torch buffer: the same memory, so
    the copy from it is from pinned memory."""
    import torch

    n = np.dtype(dtype).itemsize * int(np.prod(shape))
    return handle[offset:offset + n].view(torch.from_numpy(np.empty(0, dtype)).dtype).view(tuple(shape))


class CudaCopier(_NumpyCopier):
    """Pinned host buffers, `.to(device, non_blocking=True)` on a side stream, an event."""

    def __init__(self, device):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"CudaCopier(device={device!r}): torch.cuda.is_available() is False; use "
                               "copier_for(), which keeps the zero-copy hand-over without CUDA")
        self._torch, self.device = torch, torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device)

    def alloc(self, nbytes):
        handle = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
        return handle, handle.numpy()

    def send(self, buffer, places):
        torch = self._torch
        leaves = []
        with torch.cuda.stream(self._stream):
            for offset, dtype, shape in places:
                leaves.append(host_view(buffer.handle, offset, dtype, shape).to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        return leaves, event

    def query(self, event):
        return event is None or event.query()

    def wait(self, event):
        if event is not None:
            event.synchronize()

    def hand(self, leaves, event):
        current = self._torch.cuda.current_stream(self.device)
        if event is not None:
            current.wait_event(event)
        for leaf in leaves:
            leaf.record_stream(current)


def _places(leaves):
    """Each leaf's (offset, dtype, shape) in one buffer, offsets 64-byte aligned; the bytes."""
    places, end = [], 0
    for leaf in leaves:
        places.append((end, leaf.dtype, leaf.shape))
        end += -(-leaf.nbytes // _ALIGN) * _ALIGN
    return places, end


def _is_array(x):
    return isinstance(x, np.ndarray)


def _same(batch):
    return batch


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


class _Stopped(Exception):
    pass


class _Pinning:
    """The feed thread's placement (`kpipe._feed.Feed`'s `place`): a batch's leaves copied
    into a pooled pinned buffer and sent to the device; (batch on the device, its leaves,
    the copy's event). Holds the pool and the copies in flight; it does not hold the feed,
    so dropping the feed stops the thread."""

    def __init__(self, copier, wrap, depth):
        self.copier, self.wrap, self.limit = copier, wrap, depth + 1
        self.stop = None  # the feed's stop event (AheadCopy sets it)
        self.free, self.made = [], 0  # the pool: idle buffers, buffers in existence
        self.flight = collections.deque()  # [event, buffer, source batch]: copies maybe not completed
        self.released = 0  # batches whose buffer and source were given back (tests)
        self.buffers_made = 0  # buffers allocated in all (tests: reuse)

    def __call__(self, batch, whole=False):
        from keras.src import tree

        picked = []

        def mark(x):
            if self.wrap(x):
                picked.append(x)
                return _Slot(len(picked) - 1)
            return x

        skeleton = tree.map_structure(mark, batch)
        if not picked:
            return skeleton, [], None
        places, nbytes = _places(picked)
        buffer = self.take(nbytes)
        for place, leaf in zip(places, picked):
            np.copyto(self.copier.view(buffer, *place), leaf, casting="no")
        leaves, event = self.copier.send(buffer, places)
        self.flight.append([event, buffer, batch])  # the slot's lease, until the copy completed
        del batch, picked
        self.reclaim()
        out = tree.map_structure(lambda x: leaves[x.i] if isinstance(x, _Slot) else x, skeleton)
        return out, leaves, event

    def reclaim(self):
        while self.flight and self.copier.query(self.flight[0][0]):
            _, buffer, _ = self.flight.popleft()
            self.free.append(buffer)
            self.released += 1

    def close(self):
        """Waits for every copy in flight, then gives their buffers and slots back (the
        feed's thread, as it ends)."""
        for event, _, _ in self.flight:
            self.copier.wait(event)
        self.reclaim()
        self.free.clear()

    def take(self, nbytes):
        """A buffer of at least `nbytes`: an idle one, a new one while fewer than the limit
        exist, else the oldest copy's once it completed."""
        while True:
            if self.stop is not None and self.stop.is_set():
                raise _Stopped
            self.reclaim()
            for i, buffer in enumerate(self.free):
                if buffer.capacity >= nbytes:
                    return self.free.pop(i)
            if self.free and self.made >= self.limit:
                self.free.pop(0)  # too small for this batch: replaced by one that fits
                self.made -= 1
            if self.made < self.limit:
                self.made += 1
                self.buffers_made += 1
                return _Buffer(*self.copier.alloc(-(-nbytes // _ROUND) * _ROUND))
            self.copier.wait(self.flight[0][0])


def _stop(stop, thread, out):
    stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=10)
    while True:  # batches read ahead and not taken: dropped now
        try:
            out.get_nowait()
        except queue.Empty:
            break


class AheadCopy(_feed.Feed):
    """Batches (structures of arrays) copied to a device by a feed thread (`kpipe._feed.Feed`
    with a pinning placement), `depth` ahead, in order; see the NOTE above.

    Args:
        batches: An iterator of batches (read in the thread, which starts at once; closed
            there if it has `close`), or None: the stream of the loader behind `loader_ref`
            (read from the first `next()`, as Keras's feeds read it).
        copier: `CudaCopier`, `CpuCopier` (or another object with their methods).
        depth: Batches copied ahead of the consumer at most (>= 1).
        wrap: Which leaves are copied (others are handed over as they are); default: every
            NumPy array (the torch feed passes `kpipe._torch_feed.wrappable`).
        loader_ref, standardize, consumer: With `batches=None`: `kpipe._feed.Feed`'s (a weak
            reference to the loader, Keras's batch standardization, the adapter's consumer).
    """

    def __init__(self, batches, copier, depth=DEPTH, wrap=None, *, loader_ref=None, standardize=None, consumer=None):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"AheadCopy(depth={depth!r}): expected an int >= 1 (batches copied ahead)")
        if (batches is None) == (loader_ref is None):
            raise ValueError(f"AheadCopy(batches={type(batches).__name__}, loader_ref={loader_ref!r}): give one "
                             "of them (an iterator of batches, or a weak reference to a ProcessLoader)")
        self._copier = copier
        self._pin = _Pinning(copier, wrap if wrap is not None else _is_array, depth)
        self._finalizer = None
        super().__init__(loader_ref, standardize or _same, None, depth=depth, consumer=consumer, place=self._pin,
                         source=batches, name="kpipe-torch-pin")
        self._pin.stop = self._stop
        if batches is not None:
            self._start()

    def _start(self):
        super()._start()
        if self._thread is not None:  # (none in a probe: read in the calling thread)
            self._finalizer = weakref.finalize(self, _stop, self._stop, self._thread, self._queue)

    def __next__(self):
        try:
            out, leaves, event = super().__next__()
        except BaseException:  # the end, or an error (raised after the batches before it)
            self.close()
            raise
        self._copier.hand(leaves, event)
        return out

    def close(self):
        """Stops the thread (batches read ahead are dropped) and waits for it."""
        self._done = True
        self._stop.set()
        if self._finalizer is not None:
            self._finalizer()
        else:  # no thread (not started, or a probe read in this thread): the copies in flight, here
            self._pin.close()

    def alive(self):
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self):
        """{"released": batches whose buffer and slot were given back, "buffers": buffers
        allocated in all, "in_flight": copies not known to be complete}."""
        pin = self._pin
        return {"released": pin.released, "buffers": pin.buffers_made, "in_flight": len(pin.flight)}

