"""Which order a `ProcessLoader`'s passes take: the loader's own `shuffle`, or -- with
`shuffle=None`, the default -- the `shuffle` of the Keras `fit()` that reads it.

NOTE [ Who orders a ProcessLoader's passes ]
--------------------------------------------
Plain Keras 3 shuffles a `PyDataset`'s batch order every epoch when `fit(shuffle=True)`,
`fit()`'s default (`PyDatasetAdapter` calls Python's `random.shuffle` on the indices), and
never in `evaluate`, `predict` or validation. A `ProcessLoader` cannot let Keras reorder
it -- its workers load ahead in its own order -- so it draws each pass's permutation
itself (`kpipe/_engine/_planner.py`: from `(seed, pass)` only), and this module decides,
when Keras builds its adapter for the loader, which order the passes take from then on:

    consumer                         loader shuffle=None          shuffle=True/False
    fit() reading it as `x`          fit's `shuffle`              the loader's (one warning
                                                                  if fit's says otherwise)
    evaluate/predict/validation      in order                     the loader's
    manual loop, as_dataset()        in order                     the loader's

An order is `(shuffle, seed)` and applies from the first pass no stream has begun on (the
head's pass, unless a restore put the head inside it) to every later pass
(`Position.follow`); batches loaded ahead for those passes are dropped if it changed.
The seed of a `fit()`'s passes is the loader's `seed` when given, else drawn from
Python's `random` as the fit begins -- what `keras.utils.set_random_seed` seeds and what
Keras's own shuffle draws from, so runs seeded alike see the same orders (and workers
reseed from the same per-batch seeds), and unseeded runs differ. The passes' `(shuffle,
seed)` go into `loader.state()`, so a restore (`BackupAndRestore`) continues the saved
permutation exactly. When the `fit()` ends (with kpipe's `fit` wrapper: the TensorFlow
backend) the next passes take the loader's own order again; on other backends they keep
the fit's until another Keras call sets one.

A loader that is both `fit()`'s `x` and its `validation_data` keeps the fit's order for
its validation passes too (one order per pass). Manual loops and `as_dataset()` choose
nothing: they read the passes in the order they have. Until a read or a Keras call, a
`shuffle=None` loader loads nothing ahead (`Position.order_due`): a permutation drawn
when `fit()` begins would throw that away. For `ProcessLoader.from_samples` the order is
a sample order: the plan keeps the batches in order and the key `(pass, batch, seed)`
tells the workers how to shuffle the samples (`kpipe/_samples.py`).

Shards (`num_shards > 1`) must agree on every pass's order: without a `seed` a fit-driven
shuffle would differ per worker, so it stays in order there, with a warning.
"""

import random
import sys
import warnings
import weakref

from kpipe import _fit_scope, _stream

_WARNED = weakref.WeakSet()  # loaders warned about their order (one warning each)


def follow(reader, shuffle, seed):
    """The passes of `reader` (a loader's source) from the first no stream has begun on
    take `(shuffle, seed)`; what was loaded ahead for them is dropped if that changed."""
    with reader.lock:
        first = reader.position.follow(shuffle, seed)
        if first is None:
            return
        current = reader.ahead.current
        if current is not None and current.pass_ >= first:
            reader.cancel_ahead()
        reader.window.drop_where(lambda k: k[0] >= first)
        reader.fill_after_read()


def for_keras(loader, keras_shuffle):
    """Keras builds an adapter for `loader` with `shuffle=keras_shuffle` (True only in a
    `fit()` that shuffles): sets the order of the passes it will read (the NOTE)."""
    reader = _stream.source_of(loader)
    if reader is None or getattr(reader, "position", None) is None:
        return
    position = reader.position
    own = position.own_shuffle
    call = _keras_call()
    in_fit_x = call is not None and call[0] == "fit" and call[2].get("x") is loader
    fit_x = in_fit_x and bool(call[2].get("shuffle")) == bool(keras_shuffle)
    if in_fit_x and not fit_x:  # fit's validation on its own training loader: the passes keep fit's order
        return
    if not fit_x:  # evaluate, predict, validation: never shuffled unless the loader says so
        follow(reader, bool(own), position.orders.at(position.head[0])[1])
        return
    fit_shuffle, model = bool(keras_shuffle), call[1]
    shuffle = fit_shuffle if own is None else own
    if position.length_of(position.head[0]) is None:
        shuffle = False  # an infinite dataset orders itself (Keras warns that it ignores shuffle=True)
    if own is not None and own != fit_shuffle and _passed(model, "shuffle", fit_shuffle):
        _warn_once(loader, f"`fit(shuffle={fit_shuffle})` was passed, but this ProcessLoader was built with "
                           f"shuffle={own}, which wins: its passes are {'shuffled' if own else 'read in order'}. Received: "
                           f"fit(shuffle={fit_shuffle}), ProcessLoader(shuffle={own}). Build the loader with shuffle=None "
                           "(the default) to follow fit(shuffle=...), or give both the same value.")
    if shuffle and own is None and position.num_shards > 1 and not position.seed_given:
        _warn_once(loader, f"fit(shuffle=True) does not shuffle this ProcessLoader: it loads shard "
                           f"{position.shard_index} of {position.num_shards}, and without a seed the workers' orders "
                           "would differ (samples duplicated and dropped). Received: seed=None. Pass the same "
                           "seed=... to the loader on every worker, or fit(shuffle=False) to silence this.")
        shuffle = False
    seed = position.planner.seed if position.seed_given else random.getrandbits(32)
    follow(reader, shuffle, seed)
    ref = weakref.ref(loader)
    _fit_scope.at_exit(model, lambda: _own_order(ref))  # the passes after this fit(): the loader's order


def _own_order(ref):
    loader = ref()
    reader = _stream.source_of(loader) if loader is not None else None
    if reader is not None and not reader.closed:
        position = reader.position
        follow(reader, bool(position.own_shuffle), position.planner.seed)


def _keras_call():
    """`(name, model, locals)` of the Keras `fit`/`evaluate`/`predict` building an adapter
    now (the nearest such frame of a `keras.Model` on this thread's stack), or None."""
    import keras

    frame = sys._getframe(2)  # noqa: SLF001
    while frame is not None:
        if frame.f_code.co_name in ("fit", "evaluate", "predict"):
            model = frame.f_locals.get("self")
            if isinstance(model, keras.Model):
                return frame.f_code.co_name, model, frame.f_locals
        frame = frame.f_back
    return None


def _passed(model, name, value):
    """Whether the running `fit()` of `model` was given `name` (kpipe's wrapper knows;
    elsewhere only a value other than fit's default `True` shows it was)."""
    call = _fit_scope.current(model)
    if call is not None and call.passed is not None:
        return name in call.passed
    return value is not True


def _warn_once(loader, message):
    """Warns once per loader, pointing at the user's line that called Keras (the first
    frame outside Keras and kpipe)."""
    if loader in _WARNED:
        return
    _WARNED.add(loader)
    level, frame = 1, sys._getframe(1)  # noqa: SLF001 -- level 1: this function
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("keras", "kpipe"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1 if frame is not None else 2)
