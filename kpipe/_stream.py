"""The stream protocol: how kpipe's readers of a `ProcessLoader` -- its Keras adapter
(`_keras_hook.py`), the feed into the step functions (`_feed.py`), `BackupAndRestore` and
`InputProfiler` -- talk to it, without reaching into it.

A loader registers, when it is built, the object that answers for it (`register(loader,
source)`; kpipe's is `kpipe._reader.Reader`); a reader finds it with `source_of(loader)`.
What a source answers (see the NOTE in `kpipe/_engine/_position.py` for streams, probes
and passes):

    open_stream(hooks=None, consumer=None, confirm=False) -> Stream
    stream_next(stream) -> a batch, None (its pass ended) or AT_LIMIT (it waits at the
                           read limit: see `stream_batches`)
    keras_epoch_begin(consumer, steps=None, left=None, probe=False)
    keras_epoch_end(consumer)              Keras's epoch calls, from kpipe's adapter
    keras_reset(consumer)                  Keras dropped the consumer's iterator
    demand(consumer)                       Keras asks past the read limit: lift it
    peek(index)                            batch `index` after the head, kept
    probe()                                a context: reads in it consume nothing
    probing() -> bool
    state_after(origin, consumed) -> dict  the state `consumed` batches after `origin`
    head() -> (pass, position)
    queue_depth() -> int                   requested, not handed out; read without a lock
    closed -> bool

This module imports nothing from `kpipe.loader`: the loader depends on it, not the other
way round.
"""

import threading
import weakref

AT_LIMIT = object()  # stream_next: the stream waits at the read limit (see stream_batches)
_PARK_POLL_S = 0.1
_SOURCES = weakref.WeakKeyDictionary()  # loader -> its source, for as long as the loader lives


def register(loader, source):
    """Makes `source` answer for `loader` (for the loader's lifetime)."""
    _SOURCES[loader] = source


def source_of(loader):
    """The source answering for `loader`, or None for anything that is not a loader."""
    try:
        return _SOURCES.get(loader)
    except TypeError:  # unhashable or not weak-referenceable: not a loader
        return None


def stream_batches(ref, *, hooks=None, consumer=None, stop=None, confirm=False):
    """Yields one stream of the loader behind weak reference `ref`: the rest of its current
    pass. Holds the loader only while fetching (see NOTE in kpipe/_keras_hook.py).

    Args:
        ref: A weak reference to the loader.
        hooks: "iteration" for a stream whose start and end run the dataset's epoch hooks
            (`as_dataset()`). Defaults to None.
        consumer: The Keras consumer (kpipe's adapter) reading the stream: it then
            records the stream, and Keras's epoch calls are passed on by the stream's
            position. Defaults to None.
        stop: A `threading.Event` of the reader (kpipe's feed thread): with it, the
            stream waits at the loader's read limit -- where the consumer's Keras epoch
            ends and its hooks come first, or where its last epoch ends -- instead of
            loading past it, until the limit moves, is lifted (`demand`), or `stop` is
            set (the stream then ends). Without it the stream reads on: a tf.data thread
            must never wait for the main thread. Defaults to None.
        confirm: The pass completes at the consumer's Keras epoch end that took its last
            batch, not when the stream hands that batch out (a `tf.data` reader runs
            ahead of Keras's steps). Defaults to False.
    """
    loader = ref()
    if loader is None:
        return
    stream = source_of(loader).open_stream(hooks=hooks, consumer=consumer, confirm=confirm)
    if stop is not None:
        stream.resume = threading.Event()  # set: reading; clear: waiting at the read limit
        stream.resume.set()
    del loader
    while True:
        loader = ref()
        batch = None if loader is None else source_of(loader).stream_next(stream)
        del loader
        if batch is AT_LIMIT:
            event = stream.resume
            while not event.wait(_PARK_POLL_S):
                if stop.is_set() or ref() is None:
                    return
            continue
        if batch is None:
            return
        yield batch
