"""`steps_per_execution > 1` under multi-worker training, in one process: the Python loop of
steps kpipe's epoch iterator makes Keras run (`kpipe._keras_hook._StepsInPython`) against
Keras's own in-graph loop, and the refusal left for that loop
(`kpipe.distribute._strategy._check_steps_per_execution`). The two-worker runs are in
`tests/test_distribute_multiworker.py`."""

import warnings

import numpy as np
import pytest

from kpipe import _compat, _keras_hook

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

needs_keras_loop = pytest.mark.skipif(
    not _compat.keras_at_least(_compat.KERAS_STEPS_PER_EXECUTION_IN_GRAPH),
    reason="Keras < 3.7 always runs steps_per_execution as a Python loop")


def _drain(iterator, steps, calls):
    """What each of `calls` executions of Keras's Python loop sees: the batches it takes
    (`zip(range(steps), iterator)`) and how it ends."""
    seen = []
    for _ in range(calls):
        try:
            seen.append([b for _, b in zip(range(steps), iterator)])
        except tf.errors.OutOfRangeError:
            seen.append("end")
    return seen


def test_the_data_ends_an_execution_it_is_inside_and_then_every_call_is_the_end():
    it = iter(_keras_hook._StepsInPython(range(4), 3))
    assert _drain(it, 3, 4) == [[0, 1, 2], [3], "end", "end"]


def test_data_ending_at_an_execution_start_is_the_end_at_once():
    it = iter(_keras_hook._StepsInPython(range(4), 2))
    assert _drain(it, 2, 4) == [[0, 1], [2, 3], "end", "end"]
    # An iterator that ends with TensorFlow's error (a tf.data iterator in graph mode).
    class Raises:
        def __iter__(self):
            return self

        def __next__(self):
            raise tf.errors.OutOfRangeError(None, None, "End of sequence")

    assert _drain(iter(_keras_hook._StepsInPython(Raises(), 2)), 2, 2) == ["end", "end"]


def test_every_pass_gets_a_fresh_iterator():
    steps = _keras_hook._StepsInPython(range(3), 2)
    assert _drain(iter(steps), 2, 3) == [[0, 1], [2], "end"]
    assert _drain(iter(steps), 2, 2) == [[0, 1], [2]]


def _make_model(initial=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    if initial is not None:
        model.set_weights(initial)
    return model


class _Counts(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begins = {"train": 0, "test": 0, "predict": 0}

    def on_train_batch_begin(self, batch, logs=None):
        self.begins["train"] += 1

    def on_test_batch_begin(self, batch, logs=None):
        self.begins["test"] += 1

    def on_predict_batch_begin(self, batch, logs=None):
        self.begins["predict"] += 1


def _run(initial, make_input, steps):
    model = _make_model(initial)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=steps)
    counts = _Counts()
    history = model.fit(make_input(), epochs=3, verbose=0, shuffle=False,
                        validation_data=make_input(), callbacks=[counts])
    evaluated = model.evaluate(make_input(), verbose=0, callbacks=[counts])
    predicted = model.predict(make_input(), verbose=0, callbacks=[counts])
    return model.get_weights(), history.history, evaluated, predicted, counts.begins


@needs_keras_loop
@pytest.mark.parametrize("length", ["known", "unknown"])
@pytest.mark.parametrize("steps", [2, 3])
def test_the_python_loop_of_steps_gives_what_kerass_in_graph_loop_gives(monkeypatch, length, steps):
    rng = np.random.RandomState(0)
    x, y = rng.rand(80, 4).astype("float32"), rng.randint(0, 2, 80)

    def make_input():  # 5 batches: steps=2 and 3 both end an epoch inside an execution
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        return ds if length == "known" else ds.filter(lambda a, b: True)

    _keras_hook.install()  # what importing kpipe.distribute or kpipe.ProcessLoader does
    initial = _make_model().get_weights()
    in_graph = _run(initial, make_input, steps)  # Keras's tf.while_loop (one process)
    wrapped = []
    original = _keras_hook._StepsInPython

    def spy(dataset, k):
        wrapped.append(k)
        return original(dataset, k)

    monkeypatch.setattr(_keras_hook, "_multi_worker", lambda strategy: True)
    monkeypatch.setattr(_keras_hook, "_StepsInPython", spy)
    in_python = _run(initial, make_input, steps)
    assert wrapped and set(wrapped) == {steps}  # the Python loop really ran
    for a, b in zip(in_python[0], in_graph[0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert in_python[1].keys() == in_graph[1].keys()
    for log in in_graph[1]:
        np.testing.assert_allclose(in_python[1][log], in_graph[1][log], rtol=1e-6)
    np.testing.assert_allclose(in_python[2], in_graph[2], rtol=1e-6)
    np.testing.assert_allclose(in_python[3], in_graph[3], rtol=1e-6, atol=1e-7)
    assert in_python[3].shape == (80, 2)
    assert in_python[4] == in_graph[4]  # the callbacks saw the same executions


class _Owner:
    steps_per_execution = 2

    def step(self, x):
        return x


def _errors_when_traced_in_a_loop(fn):
    """The errors `_check_steps_per_execution(fn, 2)` raises traced in a tf.while_loop body."""
    from kpipe.distribute._strategy import _check_steps_per_execution

    raised = []

    def body(i):
        try:
            _check_steps_per_execution(fn, 2)
        except ValueError as e:
            raised.append(str(e))
        return (i + 1,)

    tf.function(lambda: tf.while_loop(lambda i: i < 2, body, (tf.constant(0),)))()
    return raised


def test_the_refusal_is_only_for_a_step_traced_inside_a_while_loop():
    from kpipe.distribute._strategy import _check_steps_per_execution

    fn = _Owner().step
    _check_steps_per_execution(fn, 2)  # eagerly: nothing to refuse
    tf.function(lambda: _check_steps_per_execution(fn, 2))()  # a graph, no loop
    raised = _errors_when_traced_in_a_loop(fn)
    assert len(raised) == 1 and "Received: steps_per_execution=2" in raised[0]
    assert "2 workers" in raised[0] and "compile with steps_per_execution=1" in raised[0]
    one_step = _Owner()
    one_step.steps_per_execution = 1
    assert _errors_when_traced_in_a_loop(one_step.step) == []


@needs_keras_loop
@pytest.mark.parametrize("steps, steps_per_epoch, epochs, repeat, runs_out", [
    (2, 4, 2, False, True),  # epoch 2 goes on with the 5th batch: the input runs out
    (3, 4, 3, False, False),  # 6 steps taken >= 5 batches: Keras restarts the input
    (2, 3, 3, True, False),  # an endless input, epochs that end inside an execution
    (3, None, 2, False, False),  # each epoch ends inside its second execution
])
def test_under_a_strategy_with_steps_per_epoch_the_python_loop_gives_what_keras_gives(
        monkeypatch, steps, steps_per_epoch, epochs, repeat, runs_out):
    # Under a strategy Keras builds the model from a first batch, and with
    # `steps_per_epoch` it keeps one iterator across epochs: the Python loop must count
    # its executions the same way as Keras's own in-graph loop through both.
    _keras_hook.install()
    rng = np.random.RandomState(0)
    x, y = rng.rand(80, 4).astype("float32"), rng.randint(0, 2, 80)

    def run():
        keras.utils.set_random_seed(0)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(2)])  # built from the first batch
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=steps)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        counts = _Counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(ds.repeat() if repeat else ds, epochs=epochs, verbose=0,
                                shuffle=False, steps_per_epoch=steps_per_epoch, callbacks=[counts])
        ran_out = any("ran out of data" in str(w.message) for w in caught)
        return model.get_weights(), history.history["loss"], counts.begins["train"], ran_out

    in_graph = run()
    wrapped = []
    original = _keras_hook._StepsInPython
    monkeypatch.setattr(_keras_hook, "_multi_worker", lambda strategy: True)
    monkeypatch.setattr(_keras_hook, "_StepsInPython", lambda *a: wrapped.append(a) or original(*a))
    in_python = run()
    assert wrapped  # the Python loop really ran
    for a, b in zip(in_python[0], in_graph[0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(in_python[1], in_graph[1], rtol=1e-6)
    assert len(in_python[1]) == epochs and in_python[2] == in_graph[2]
    # Keras's warning when a finite input runs out before `steps_per_epoch * epochs`.
    assert in_python[3] == in_graph[3] == runs_out
