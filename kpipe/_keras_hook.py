"""kpipe's hooks into Keras's data adapters (`keras.src.trainers`).

Keras turns every `PyDataset` given to `fit`/`evaluate`/`predict` into a
`PyDatasetAdapter`. kpipe swaps in a subclass that leaves other datasets untouched and,
for a `ProcessLoader`:

* builds the adapter with `shuffle=False`: the loader orders its own batches (seeded
  shuffle, in-order prefetch), and Keras's `fit(shuffle=True)` default would otherwise
  request batches in a random order of its own and defeat prefetching; instead it tells
  the loader what Keras asked for, and a loader with `shuffle=None` draws that order
  itself (the NOTE in `kpipe/_order.py`);
* reads the loader through *streams*, never by Keras's epoch ends: each iterator Keras
  makes reads the rest of the loader's current pass, Keras's `on_epoch_begin`/
  `on_epoch_end` are not forwarded (they fall mid-pass when `steps_per_epoch < len`),
  and the reads Keras makes only to learn the tensor spec -- or to build the model
  under a strategy (`_maybe_symbolic_build`, wrapped here) -- are *probes* that consume
  nothing (see the NOTE in `kpipe/_engine/_position.py`);
* marks the `tf.data.Dataset` presharded when the loader loads only this worker's shard
  (`num_shards > 1`), so kpipe's `MultiWorkerMirroredStrategy` neither auto-shards it nor
  splits its batch again (also for any `PyDataset` with `num_shards > 1`).

From Keras 3.7 kpipe's epoch iterator also hands a ProcessLoader to the step functions as
a `kpipe._feed.Feed` (`_install_feed`), and under multi-worker training with
`steps_per_execution > 1` hands any other input over as a Python iterator
(`_StepsInPython`), so that Keras runs its steps in Python instead of the `tf.while_loop`
TensorFlow fails in there (see the NOTE in kpipe/distribute/_strategy.py).

NOTE [ Who keeps a ProcessLoader alive ]
----------------------------------------
`tf.data.Dataset.from_generator` registers its generator function with TensorFlow, and
the graphs Keras traces keep it (gradient registry -> FuncGraph -> the outer graph's
`_py_funcs_used_in_graph`) after `fit()` returns: whatever the generator references
lives on. So the adapter and the generators hold the loader only through a weak
reference. During `fit()`/`evaluate()`/`predict()` the caller's argument holds it (Keras
keeps `x` and `validation_data` for the whole call); afterwards, once the user drops it,
the loader is collected and its workers stop (`weakref.finalize` of its backend) --
`model.fit(kpipe.ProcessLoader(ds))` re-run in a notebook cell leaves no processes.
`as_dataset()` follows the same rule with the `tf.data.Dataset` it returns as the owner.

With a Keras lacking this module layout the hooks are not installed; a ProcessLoader
then still works (random access), but Keras's epoch ends reach `on_epoch_end`.
"""

import contextlib
import contextvars
import functools
import inspect
import weakref

from kpipe import _backends, _fit_scope, _order, _stream
from kpipe.errors import LoaderClosedError

# {id(loader): (runs, steps, each_a_call)} for the loaders of the Keras call running in this context
# (set by `_plan_calls`' wrappers, read when Keras builds the adapters inside the call).
_PLANS = contextvars.ContextVar("kpipe_keras_plans", default=None)
# loader -> weak reference to the epoch iterator Keras trains it with (see keras_iterator)
_ITERATORS = weakref.WeakKeyDictionary()


def keras_iterator(loader):
    """The epoch iterator Keras's `fit()` reads `loader` through (the last one it built a
    model with under a strategy), or None."""
    ref = _ITERATORS.get(loader)
    return ref() if ref is not None else None


def install():
    """Installs the adapter subclass and the symbolic-build probe (idempotent)."""
    try:
        from keras.src.trainers import data_adapters
    except ImportError:
        return
    base = data_adapters.PyDatasetAdapter
    if getattr(base, "_kpipe_hooked", False):
        return
    data_adapters.PyDatasetAdapter = _make_adapter(base)
    _plan_calls()
    if _backends.is_tensorflow():  # jax/torch: no TensorFlow import (kpipe/_backends.py)
        _wrap_symbolic_build()
        _install_feed()
    elif _backends.name() == "jax":  # the JAX trainer's feed (NOTE in kpipe/_jax_feed.py)
        from kpipe import _jax_feed

        _jax_feed.install()
    elif _backends.name() == "torch":  # tensors over the slots (NOTE in kpipe/_torch_feed.py)
        from kpipe import _torch_feed

        _torch_feed.install()
    from kpipe import _compat

    _compat.install_keras_fixes()  # a user's own strategy with a ProcessLoader gets them too


class KerasConsumer:
    """One Keras adapter's view of a ProcessLoader: the stream it reads now, and the
    Keras epochs its call will run (when kpipe's wrappers of `fit`/`evaluate`/`predict`
    told it: `runs()` epochs of `steps` steps, None: a pass each). Not thread-safe;
    used under the loader's lock and by Keras's thread."""

    __slots__ = ("stream", "consumed", "taken", "steps", "ends_call", "_runs", "_each_a_call", "_total", "_begun")

    def __init__(self, plan=None):
        self.stream = None
        self.consumed = 0  # batches of `stream` handed to Keras (Keras < 3.7: to tf.data's prefetch)
        self.taken = 0  # of those, what Keras's epochs took up to the last epoch end
        self._runs, self.steps, self._each_a_call = plan if plan is not None else (None, None, False)
        self.ends_call = False  # the epoch begun last is the last of a Keras call
        self._total = None
        self._begun = 0

    @property
    def each_a_call(self):
        """Whether every Keras epoch of this consumer is a call of its own (validation)."""
        return self._each_a_call

    def begin_epoch(self):
        """Counts a Keras epoch; returns how many the call runs from this one on (1: this
        is its last; None when unknown)."""
        if self._runs is None:
            return None
        if self._total is None:
            self._total = self._runs()  # at the first epoch: BackupAndRestore has set initial_epoch
        self._begun += 1
        left = max(1, self._total - self._begun + 1)
        # evaluate and each validation run are one epoch each: Keras (>= 3.7) starts the
        # next such call with its reset's on_epoch_end (see Reader.keras_epoch_end in kpipe/_reader.py)
        self.ends_call = left == 1 or self._each_a_call
        return left

    def end_epoch(self):
        """Counts the end of a Keras epoch of `stream`; returns the batches of it Keras took.

        Keras >= 3.7 takes each batch from kpipe's feed (`consumed`). Keras < 3.7 reads
        through `tf.data.Dataset.from_generator` and its prefetch, which run ahead of the
        steps: an epoch of `steps` steps ends after taking `steps` more batches, or all the
        stream had (it ran out: Keras ends the epoch there and drops its iterator)."""
        from kpipe import _compat

        if self.steps is None or _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET):
            self.taken = self.consumed
        else:
            self.taken = min(self.taken + self.steps, self.consumed)
        return self.taken

    def epoch_start(self):
        """The batches of `stream` Keras took before the epoch it begins now."""
        from kpipe import _compat

        if self.steps is None or _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET):
            return self.consumed
        return self.taken


def _plan_for(loader):
    plans = _PLANS.get()
    return plans.get(id(loader)) if plans else None


def install_fit_wrappers():
    """Installs the wrappers of `fit`/`evaluate`/`predict` alone (idempotent): kpipe's
    callbacks need them (`kpipe._fit_scope`) whatever the input."""
    _plan_calls()


def _plan_calls():
    """Wraps the active backend's trainer's `fit`/`evaluate`/`predict`: a `fit` runs inside
    `kpipe._fit_scope.running`, and while one runs, the adapters Keras builds for its
    ProcessLoaders (training and validation data) learn how many Keras epochs the call
    will run and how many steps each, so that a loader reads nothing ahead for an epoch
    the call will not run (its last epoch ends there)."""
    trainer = _backends.trainer_class()
    if trainer is None:
        return
    for name in ("fit", "evaluate", "predict"):
        original = getattr(trainer, name, None)
        if original is None or getattr(original, "_kpipe_wrapped", False):
            continue
        setattr(trainer, name, _planned(name, original))


def _planned(name, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: fit planned it
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # Keras raises its own error
            return original(self, *args, **kwargs)
        passed = set(bound.arguments)
        bound.apply_defaults()
        scope = _fit_scope.running(self, bound.arguments, passed) if name == "fit" else contextlib.nullcontext()
        with scope:  # callbacks' clean-ups run however fit() ends (kpipe/_fit_scope.py)
            plans = _call_plans(name, self, bound.arguments)
            if not plans:
                return original(self, *args, **kwargs)
            token = _PLANS.set(plans)
            try:
                return original(self, *args, **kwargs)
            finally:
                _PLANS.reset(token)

    call._kpipe_wrapped = True
    return call


def _call_plans(name, model, args):
    """`{id(loader): (runs, steps, each_a_call)}` for the ProcessLoaders a call reads (see
    `_plan_calls`); `runs()` is read at the loader's first epoch, as Keras's `fit` reads
    `initial_epoch` (BackupAndRestore sets `model._initial_epoch` when training begins);
    `each_a_call`: every epoch is an `evaluate` call of its own (validation)."""
    plans = {}
    x = args.get("x")
    if name != "fit":
        if _is_loader(x):
            plans[id(x)] = (lambda: 1, args.get("steps"), False)
        return plans
    epochs, initial = args.get("epochs", 1), args.get("initial_epoch", 0)

    def first_epoch():
        return getattr(model, "_initial_epoch", None) or initial

    if _is_loader(x):
        plans[id(x)] = (lambda: max(0, epochs - first_epoch()), args.get("steps_per_epoch"), False)
    val = args.get("validation_data")
    if isinstance(val, (tuple, list)) and val:
        val = val[0]
    if _is_loader(val) and val is not x:
        freq = args.get("validation_freq", 1)
        should_eval = getattr(model, "_should_eval", None)

        def validation_runs():
            start = first_epoch()
            if should_eval is None:
                return max(0, epochs - start)
            return sum(1 for epoch in range(start, epochs) if should_eval(epoch, freq))

        plans[id(val)] = (validation_runs, args.get("validation_steps"), True)
    return plans


def _is_loader(x):
    return getattr(type(x), "_kpipe_orders_batches", False)


def _make_adapter(base):
    from kpipe.distribute._sharding import is_presharded, mark_presharded

    class PyDatasetAdapter(base):
        _kpipe_hooked = True

        def __init__(self, x, class_weight=None, shuffle=False):
            orders = getattr(type(x), "_kpipe_orders_batches", False)
            super().__init__(x, class_weight=class_weight, shuffle=False if orders else shuffle)
            self._kpipe_loader = None
            if orders:
                _order.for_keras(x, shuffle)  # the loader draws the order fit(shuffle=) asks for
                self._kpipe_loader = weakref.ref(x)
                self.py_dataset = weakref.proxy(x)  # see NOTE: the graph must not own it
                self._kpipe_consumer = KerasConsumer(_plan_for(x))

        # -------------------------------------------------------------- loader path
        def _loader(self):
            loader = self._kpipe_loader() if self._kpipe_loader is not None else None
            if loader is None:
                raise LoaderClosedError(
                    "The ProcessLoader given to Keras was garbage collected: keep a reference to it "
                    "for as long as Keras iterates it (e.g. `loader = kpipe.ProcessLoader(...)`)."
                )
            return loader

        def _source(self):
            return _stream.source_of(self._loader())

        def _get_iterator(self):
            if self._kpipe_loader is None:
                return super()._get_iterator()
            return self._kpipe_stream()

        def _kpipe_stream(self):
            consumer = self._kpipe_consumer
            # tf.data's prefetch reads ahead of Keras's steps: Keras's epoch end, which
            # knows what it took, completes the pass
            for batch in _stream.stream_batches(self._kpipe_loader, consumer=consumer, confirm=True):
                consumer.consumed += 1  # (tf.data's prefetch takes them: Keras < 3.7)
                yield self._standardize_batch(batch)

        def on_epoch_begin(self):
            if self._kpipe_loader is None:
                return super().on_epoch_begin()
            consumer, source = self._kpipe_consumer, self._source()
            if source.probing():  # Keras's symbolic build iterates an epoch for one batch
                source.keras_epoch_begin(consumer, probe=True)
                return
            left = consumer.begin_epoch()
            source.keras_epoch_begin(consumer, steps=consumer.steps, left=left)

        def on_epoch_end(self):
            if self._kpipe_loader is None:
                return super().on_epoch_end()
            self._source().keras_epoch_end(self._kpipe_consumer)

        def _kpipe_reset(self):
            """Keras (>= 3.7) dropped its iterator (`EpochIterator.reset`)."""
            if self._kpipe_loader is not None:
                loader = self._kpipe_loader()
                if loader is not None:
                    _stream.source_of(loader).keras_reset(self._kpipe_consumer)

        def _kpipe_feed(self, strategy):
            """The iterator kpipe's epoch iterator gives Keras for one stream (see the
            NOTE in kpipe/_feed.py), or None for other datasets."""
            if self._kpipe_loader is None:
                return None
            from kpipe._feed import Feed

            self._loader()  # a clear error when the loader is gone
            return Feed(self._kpipe_loader, self._standardize_batch, strategy, consumer=self._kpipe_consumer)

        def _kpipe_probe(self):
            return self._source().probe()

        def get_tf_dataset(self):
            if self._kpipe_loader is None:
                ds = super().get_tf_dataset()
                return mark_presharded(ds) if is_presharded(self.py_dataset) else ds
            import tensorflow as tf
            from keras.src.trainers.data_adapters import data_adapter_utils

            loader = self._loader()
            if self._output_signature is None:
                n = loader.num_batches
                count = 2 if n is None else min(2, n)
                source = _stream.source_of(loader)
                batches = [self._standardize_batch(source.peek(i)) for i in range(count)]
                self._output_signature = data_adapter_utils.get_tensor_spec(batches)
                del batches
                if getattr(getattr(source, "dataset", None), "kpipe_varying_shapes", False):
                    # from_samples padding/collate: two batches do not fix an inner size
                    self._output_signature = tf.nest.map_structure(
                        lambda s: tf.TensorSpec(s.shape[:1].concatenate([None] * (s.shape.rank - 1)), s.dtype),
                        self._output_signature)
            ds = tf.data.Dataset.from_generator(self._get_iterator, output_signature=self._output_signature)
            # The loader's workers load ahead: no tf.data prefetch on top (as Keras does for
            # its own enqueuer), so the generator is pulled once per step and nothing is
            # read past the step Keras takes last (a prefetch ran 7-9 batches past it).
            options = tf.data.Options()
            options.autotune.enabled = False
            options.threading.private_threadpool_size = 1
            ds = ds.with_options(options)
            return mark_presharded(ds) if loader.num_shards > 1 else ds

    return PyDatasetAdapter


def _install_feed():
    """From Keras 3.7 the TensorFlow trainer's step functions take any Python iterator of
    batches: a ProcessLoader is read through a `kpipe._feed.Feed` instead of
    `tf.data.Dataset.from_generator` (see the NOTE in kpipe/_feed.py). Before 3.7 the
    step function calls `next()` on a `tf.data` iterator inside its graph, and loaders go
    through the adapter's `get_tf_dataset()`."""
    from kpipe import _compat

    if not _compat.keras_at_least(_compat.KERAS_ITERABLE_TRAIN_FUNCTION):
        return
    try:
        from keras.src.backend.tensorflow import trainer
    except ImportError:
        return
    base = trainer.TFEpochIterator
    if getattr(base, "_kpipe_feeds", False):
        return

    class TFEpochIterator(base):
        _kpipe_feeds = True

        def __init__(self, distribute_strategy=None, *args, **kwargs):
            # Keras 3.7-3.15's TFEpochIterator.__init__, with its `tf.data` dataset built
            # lazily (`_distributed_dataset` below, the same two calls) for a ProcessLoader:
            # that is read through a feed, and the dataset over it (`from_generator` +
            # `experimental_distribute_dataset`, ~30 ms, and 2 batch reads for its specs,
            # paid by every fit/evaluate/predict call before its first step) is built only
            # if asked for. Any other input gets it at once, as in Keras.
            super(base, self).__init__(*args, **kwargs)  # EpochIterator's: the adapter
            self._distribute_strategy = distribute_strategy
            self._dataset = None
            if getattr(self.data_adapter, "_kpipe_loader", None) is None:
                self._distributed_dataset  # noqa: B018 -- built now, as Keras builds it

        @property
        def _distributed_dataset(self):
            if self._dataset is None:
                import tensorflow as tf

                dataset = self.data_adapter.get_tf_dataset()
                if not isinstance(dataset, tf.distribute.DistributedDataset):
                    dataset = self._distribute_strategy.experimental_distribute_dataset(dataset)
                self._dataset = dataset
            return self._dataset

        @_distributed_dataset.setter
        def _distributed_dataset(self, dataset):
            self._dataset = dataset

        def reset(self):
            reset = getattr(self.data_adapter, "_kpipe_reset", None)
            if reset is not None:
                reset()
            return super().reset()

        def _get_iterator(self):
            feed = getattr(self.data_adapter, "_kpipe_feed", None)
            feed = feed(self._distribute_strategy) if feed is not None else None
            if feed is not None:
                return feed
            dataset = super()._get_iterator()
            steps = getattr(self, "steps_per_execution", 1)
            if isinstance(steps, int) and steps > 1 and _multi_worker(self._distribute_strategy):
                return _StepsInPython(dataset, steps)
            return dataset

    TFEpochIterator.__qualname__ = base.__qualname__
    TFEpochIterator.__module__ = base.__module__
    trainer.TFEpochIterator = TFEpochIterator


def _multi_worker(strategy) -> bool:
    """Whether `strategy` trains across several workers (kpipe's MultiWorkerMirroredStrategy
    counts them; the stock one knows whether it is in multi-worker mode)."""
    count = getattr(strategy, "_kpipe_num_workers", None)
    if count is not None:
        return count > 1
    extended = getattr(strategy, "extended", None)
    in_multi_worker_mode = getattr(extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode()) if callable(in_multi_worker_mode) else False


class _StepsInPython:
    """A distributed dataset that Keras iterates in Python, `steps` batches per execution.

    Keras (>= 3.7) runs `steps_per_execution > 1` over a `tf.distribute` iterator as a
    `tf.while_loop` of `get_next_as_optional`, which TensorFlow cannot run under
    multi-worker training (see the NOTE in kpipe/distribute/_strategy.py). Given any other
    iterator, Keras calls its compiled one-step function on each of the next `steps`
    batches instead: the same steps. Its end of data then needs care: Keras's Python loop
    returns the steps it ran when the data ends inside an execution, but fails
    (UnboundLocalError) when it ends at the start of one. So the iterator ends an
    execution it is inside with StopIteration (Keras keeps that execution's logs), and at
    an execution's start -- or once it has ended -- raises `tf.errors.OutOfRangeError`,
    which Keras's epoch iterator takes as the end of the data, as from the in-graph loop.
    """

    def __init__(self, dataset, steps):
        self._dataset = dataset
        self._steps = steps

    def __iter__(self):
        return _StepIterator(iter(self._dataset), self._steps)


class _StepIterator:
    def __init__(self, iterator, steps):
        self._iterator = iterator
        self._steps = steps
        self._taken = 0
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self):
        import tensorflow as tf

        if not self._ended:
            try:
                batch = next(self._iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                self._ended = True
                if self._taken % self._steps:
                    raise StopIteration from None  # inside an execution: it keeps its steps
            else:
                self._taken += 1
                return batch
        raise tf.errors.OutOfRangeError(None, None, "End of sequence")


def _wrap_symbolic_build():
    """Under a strategy, Keras's TensorFlow trainer pulls one batch from a fresh iterator
    to build the model, then drops it: for a ProcessLoader that read is a probe."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:
        return
    original = getattr(TensorFlowTrainer, "_maybe_symbolic_build", None)
    if original is None or getattr(original, "_kpipe_wrapped", False):
        return

    def _maybe_symbolic_build(self, *args, **kwargs):
        iterator = kwargs.get("iterator", args[0] if args else None)
        probe = getattr(getattr(iterator, "data_adapter", None), "_kpipe_probe", None)
        if probe is None or getattr(iterator.data_adapter, "_kpipe_loader", None) is None:
            return original(self, *args, **kwargs)
        _ITERATORS[iterator.data_adapter._loader()] = weakref.ref(iterator)  # BackupAndRestore aligns its step count
        kept = getattr(iterator, "_current_iterator", None)
        try:
            with probe():
                return original(self, *args, **kwargs)
        finally:
            # Keras < 3.7 builds from the epoch iterator's own `_current_iterator` when
            # steps are given, and trains on from it: a probe's stream, which ended with the
            # probe (the epoch then got only what tf.data had prefetched). Drop it, as
            # Keras 3.7+ drops its throwaway iterator: the epoch starts a stream of its own.
            if kept is None and getattr(iterator, "_current_iterator", None) is not None:
                iterator._current_iterator = None

    _maybe_symbolic_build._kpipe_wrapped = True
    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
