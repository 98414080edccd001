"""The hand-over of a ProcessLoader's batches into Keras's compiled step functions.

NOTE [ The feed: batches ready before the step asks ]
-----------------------------------------------------
Keras 3 (>= 3.7) on TensorFlow calls `model.train_function(iterator)` once per step; when
`iterator` is not a `tf.data` iterator it takes the next `steps_per_execution` batches
from it in Python and calls the compiled one-step function on each
(`keras/src/backend/tensorflow/trainer.py`, `_make_function`). So a ProcessLoader need
not go through `tf.data.Dataset.from_generator`, whose per-batch Python call, checks and
copies cost ~1 ms of main-process time and capped `fit()` at ~0.4x of an in-memory
tf.data pipeline. Instead kpipe's epoch iterator (`kpipe/_keras_hook.py`) gives Keras a
`Feed`: a thread per stream reads the loader, applies Keras's batch standardization
(class weights), turns every array into a tensor and puts it in a queue of `depth`
batches. The main thread's share of a step is a queue `get`; the GIL-bound work of the
next batches runs while TensorFlow executes the current step (which releases the GIL).

Tensors alias the loader's shared-memory slots where TensorFlow can (DLPack, for
C-contiguous arrays of a numeric dtype whose data is 64-byte aligned, which the engine
guarantees for its slots and leaves): no copy on the host. The tensor holds the NumPy
array, which holds the slot's lease, so a batch stays intact for as long as any tensor
made from it lives, while the loader moves on. Other arrays are copied
(`tf.convert_to_tensor`).

Devices: with one replica on this worker (no strategy, `OneDeviceStrategy`,
`MultiWorkerMirroredStrategy` with one device per worker) the batch is given whole, as
`tf.data` would; when that replica's device is not the host's CPU (an accelerator, or a
logical CPU device other than the first), the thread copies the batch to it ahead of the
step (what `prefetch_to_device` does for `tf.data`), so the step starts
with its input on the accelerator. With several local replicas (`MirroredStrategy`),
the batch is split along its first axis into contiguous, near-equal parts (as
`tf.data`'s rebatching does), each copied to its replica's device, and handed over as
`PerReplica` values.

Streams and probes are the loader's (see the NOTE in `kpipe/_engine/_position.py`): a
feed reads one stream; a feed made while the loader is in a probe (Keras's symbolic
build) reads in the calling thread, starts no thread and gives each batch whole. A feed's thread stops at the
end of its stream, on an error (re-raised by `next()` in the main thread, traceback
kept), when the feed is garbage collected, or when its loader is closed or collected;
batches it read ahead and nobody took are dropped with it, as `tf.data`'s prefetch
buffer drops them.
"""

import queue
import threading
import weakref

import numpy as np

from kpipe import _stream

_END = object()
_POLL_S = 0.1
_ALIGNMENT = 64
# NumPy dtype kinds aliased through DLPack (signed, unsigned, float); others are copied.
_DLPACK_KINDS = frozenset("iuf")


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc


def to_tensor(array):
    """A tensor with the contents of `array`: aliasing its memory where TensorFlow can
    (C-contiguous, numeric, 64-byte aligned, non-empty), a copy otherwise."""
    import tensorflow as tf

    if (
        isinstance(array, np.ndarray)
        and array.dtype.kind in _DLPACK_KINDS
        and array.size
        and array.flags.c_contiguous
        and array.flags.writeable
        and array.ctypes.data % _ALIGNMENT == 0
    ):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


class _Placement:
    """Where a batch goes for `strategy`: whole to one replica (copied to its device
    when that is not the host's first CPU), or split over several local replicas."""

    def __init__(self, strategy):
        devices = _local_devices(strategy)
        self.strategy = strategy
        self.devices = devices
        self.split = len(devices) > 1
        self.copy_to = devices[0] if len(devices) == 1 and not _is_host(devices[0]) else None

    def __call__(self, data, whole=False):
        """`data` as tensors: whole (also when `whole`: a probe only needs shapes, and
        Keras's symbolic build would average unequal per-replica parts), or split."""
        import tensorflow as tf

        if whole or not self.split:
            data = tf.nest.map_structure(_leaf_tensor, data)
            if self.copy_to is not None:
                with tf.device(self.copy_to):
                    data = tf.nest.map_structure(_copy, data)
            return data
        local = len(self.devices)
        parts = [_split_rows(a, local) for a in tf.nest.flatten(data)]
        per_replica = []
        for r, device in enumerate(self.devices):
            leaves = [_leaf_tensor(p[r]) for p in parts]
            with tf.device(device):
                per_replica.append(tf.nest.pack_sequence_as(data, [_copy(t) for t in leaves]))
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: per_replica[ctx.replica_id_in_sync_group % local]
        )


def _copy(value):
    import tensorflow as tf

    return tf.identity(value) if isinstance(value, tf.Tensor) else value


def _leaf_tensor(value):
    return to_tensor(value) if isinstance(value, np.ndarray) else value


def _split_rows(array, parts):
    """`parts` contiguous row ranges of `array`, sizes differing by at most one (the
    first ones larger), as tf.data's rebatching splits a global batch."""
    if not isinstance(array, np.ndarray) or array.ndim == 0:
        return [array] * parts
    size, extra = divmod(len(array), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(array[start:stop])
        start = stop
    return out


def _local_devices(strategy):
    """This worker's replica devices under `strategy` (one entry for the default one)."""
    try:
        devices = list(strategy.extended.worker_devices)
    except (AttributeError, NotImplementedError, RuntimeError):  # the default strategy has none
        return [_default_device()]
    return devices or [_default_device()]


def _default_device():
    """Where TensorFlow places a step without a strategy: the first GPU, else the CPU."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else "/device:CPU:0"


def _is_host(device):
    """Whether `device` is the host's first CPU, where the batches already are."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return (spec.device_type or "CPU").upper() == "CPU" and (spec.device_index or 0) == 0


class Feed:
    """An iterator of one stream's batches, converted ahead in a thread (see NOTE).

    Args:
        loader_ref: weak reference to the `ProcessLoader`.
        standardize: Keras's per-batch standardization (the adapter's
            `_standardize_batch`).
        strategy: the model's distribution strategy (unused when `place` is given).
        depth: batches converted ahead.
        consumer: the adapter's `kpipe._keras_hook.KerasConsumer`: the stream is
            recorded there, and the thread waits where the loader's read limit says the
            consumer's Keras epoch ends (see `kpipe._stream.stream_batches`).
        place: converts a standardized batch for the backend, `place(data, whole=...)`;
            its `close()`, if it has one, is called by the thread as it ends. Defaults to
            None: TensorFlow tensors placed for `strategy`.
        source: an iterator of batches read instead of the loader's stream (`loader_ref`
            is then None: no probe, no read limit; closed by the thread if it has
            `close`). Defaults to None.
        name: the thread's name. Defaults to "kpipe-feed".
    """

    def __init__(self, loader_ref, standardize, strategy, depth=1, consumer=None, place=None, source=None,
                 name="kpipe-feed"):
        self._ref = loader_ref
        self._consumer = consumer
        self._standardize = standardize
        self._place = place if place is not None else _Placement(strategy)
        self._depth = depth
        self._queue = None
        self._stop = threading.Event()
        self._thread = None
        self._sync = None  # the stream's generator when read in the calling thread
        self._done = False
        self._source, self._name = source, name

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._queue is None and self._sync is None:
            self._start()
        item = self._next_sync() if self._sync is not None else self._next_queued()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        if self._consumer is not None and self._sync is None:
            self._consumer.consumed += 1  # Keras took it (the thread reads ahead)
        return item

    def _start(self):
        loader = self._ref() if self._source is None else None
        probing = loader is not None and _stream.source_of(loader).probing()
        del loader
        if probing:
            self._sync = _stream.stream_batches(self._ref, consumer=self._consumer)
            return
        if self._source is not None:
            stream, self._source = self._source, None
        else:
            stream = _stream.stream_batches(self._ref, consumer=self._consumer, stop=self._stop)
        self._queue = queue.Queue(self._depth)
        stop = self._stop
        weakref.finalize(self, stop.set)  # a dropped feed stops its thread
        self._thread = threading.Thread(
            target=_produce,
            args=(stream, self._ref, self._standardize, self._place, self._queue, stop),
            name=self._name,
            daemon=True,
        )
        self._thread.start()

    def _next_sync(self):
        try:
            batch = next(self._sync)
        except StopIteration:
            return _END
        return self._place(self._standardize(batch), whole=True)

    def _next_queued(self):
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                self._lift_limit_if_waiting()
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(
                        "kpipe's feed thread ended without a batch, an end or an error: this is a bug in "
                        "kpipe; please report it with the traceback above (if any)."
                    ) from None


    def _lift_limit_if_waiting(self):
        """Keras asks for a batch while the thread waits at the loader's read limit (Keras
        reads past what its plan said): the loader lifts it."""
        consumer = self._consumer
        stream = consumer.stream if consumer is not None else None
        resume = getattr(stream, "resume", None)
        if resume is None or resume.is_set():
            return
        loader = self._ref()
        if loader is not None:
            _stream.source_of(loader).demand(consumer)


def _produce(stream, ref, standardize, place, out, stop):
    """The feed thread: read, standardize, convert, queue; until the stream ends."""
    try:
        for batch in stream:
            item = place(standardize(batch))
            del batch
            if not _put(out, item, stop, ref):
                return
            del item
        _put(out, _END, stop, ref)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the consuming thread
        _put(out, _Failure(exc), stop, ref)
    finally:
        for done in (getattr(stream, "close", None), getattr(place, "close", None)):
            if done is not None:
                done()


def _put(out, item, stop, ref):
    """Queues `item` unless the feed was stopped or dropped or its loader closed or
    collected meanwhile (then nobody will read it): True when queued."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            if ref is None:  # (a `source`: no loader)
                continue
            loader = ref()
            gone = loader is None or _stream.source_of(loader).closed
            del loader
            if gone:
                return False
    return False
