"""InputProfiler: input-wait share, throughput keys, warning, strategies, restoring Keras."""

import csv
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kpipe
from _datasets import Squares
from kpipe.callbacks import InputProfiler
from kpipe.callbacks._profiler import _TimedTrainFunction

KEYS = ("input_wait_share", "steps_per_sec", "samples_per_sec")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SlowData(keras.utils.PyDataset):
    """Sleeps `delay` per batch: far longer than the tiny model's step (~1 ms), by so much
    (200x) that a loaded machine's slower steps and stalls cannot bring the share of time
    spent waiting near the thresholds the tests assert."""

    def __init__(self, n=6, batch=16, delay=0.2, fail_at=None):
        super().__init__()
        self.n, self.batch, self.delay, self.fail_at = n, batch, delay, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"batch {i} is corrupt")
        time.sleep(self.delay)
        rng = np.random.default_rng(i)
        return rng.normal(size=(self.batch, 8)).astype("float32"), rng.normal(size=(self.batch, 1)).astype("float32")


def tiny_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def profiler_warnings(caught):
    return [w for w in caught if "InputProfiler" in str(w.message)]


def test_rejects_invalid_arguments():
    with pytest.raises(ValueError, match=r"warn_above=1.5"):
        InputProfiler(warn_above=1.5)
    with pytest.raises(ValueError, match=r"skip_steps=-1"):
        InputProfiler(skip_steps=-1)


def test_slow_dataset_reports_high_share_warns_once_and_logs_to_history():
    model, profiler = tiny_model(), InputProfiler(warn_above=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(SlowData(), epochs=2, verbose=0, callbacks=[profiler])
    for key in KEYS:
        assert len(history.history[key]) == 2, key
    # Epoch 0's prefetch fills while step 0 compiles, so its share can be lower; epoch 1 is steady.
    shares = history.history["input_wait_share"]
    assert shares[1] > 0.5 and min(shares) > 0.2, shares
    # Every batch has 16 samples: samples/s is exactly 16 x steps/s.
    for steps, samples in zip(history.history["steps_per_sec"], history.history["samples_per_sec"]):
        assert samples == pytest.approx(16 * steps)
    assert [e["steps"] for e in profiler.epochs] == [5, 6]  # first step of epoch 0 skipped
    found = profiler_warnings(caught)
    assert len(found) == 1, [str(w.message) for w in found]
    assert "kpipe.ProcessLoader(dataset, workers=N)" in str(found[0].message)
    assert not isinstance(model.train_function, _TimedTrainFunction)  # Keras's own again


def test_in_memory_data_reports_low_share_and_no_warning():
    # A model that computes for a while per step, fed from arrays already in memory.
    model = keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(1024, activation="relu") for _ in range(3)] + [keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(2048, 256)).astype("float32")
    y = x[:, :1].copy()
    profiler = InputProfiler(warn_above=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=256, epochs=2, verbose=0, callbacks=[profiler])
    shares = history.history["input_wait_share"]
    assert all(0.0 <= s < 0.2 for s in shares), shares
    assert profiler.epochs[1]["samples"] == 2048 and profiler.epochs[1]["steps"] == 8
    assert not profiler_warnings(caught)


def test_tf_data_with_steps_per_execution_and_csv_logger(tmp_path):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=2)
    data = tf.data.Dataset.from_tensor_slices((np.ones((70, 8), "float32"), np.ones((70, 1), "float32"))).batch(10)
    log = tmp_path / "log.csv"
    profiler = InputProfiler(warn_above=None)
    history = model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[profiler, keras.callbacks.CSVLogger(str(log))])
    assert profiler.epochs[1]["steps"] == 7 and profiler.epochs[1]["samples"] == 70
    assert profiler._input_kind == ("tf.data", None)
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(float(r["input_wait_share"]) == pytest.approx(s) for r, s in zip(rows, history.history["input_wait_share"]))
    assert all(float(r["samples_per_sec"]) > 0 for r in rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_process_loader_counts_every_sample(no_leaks):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    profiler = InputProfiler(warn_above=None)
    with kpipe.ProcessLoader(Squares(n=10, batch=4, last=3), workers=2) as loader:
        history = model.fit(loader, epochs=2, verbose=0, callbacks=[profiler])
    assert len(history.history["samples_per_sec"]) == 2
    assert profiler.epochs[1]["steps"] == 10 and profiler.epochs[1]["samples"] == 39
    assert profiler._input_kind == ("process_loader", 2)


def test_failed_fit_leaves_a_pass_through_that_the_next_profiler_unwraps():
    model = tiny_model()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="corrupt"):
        model.fit(SlowData(n=4, delay=0.0, fail_at=2), epochs=1, verbose=0, callbacks=[InputProfiler()])
    stale = model.train_function
    assert isinstance(stale, _TimedTrainFunction)
    model.fit(SlowData(n=3, delay=0.0), epochs=1, verbose=0)  # no profiler: stale one passes through
    profiler = InputProfiler(warn_above=None)
    history = model.fit(SlowData(n=3, delay=0.0), epochs=1, verbose=0, callbacks=[profiler])
    assert "input_wait_share" in history.history
    assert model.train_function is stale.original


_MIRRORED = textwrap.dedent(
    """
    import json, sys, time, warnings
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from kpipe.callbacks import InputProfiler

    class Slow(keras.utils.PyDataset):
        def __init__(self, delay=0.2):
            super().__init__()
            self.delay = delay
        def __len__(self):
            return 10
        def __getitem__(self, i):
            time.sleep(self.delay)  # far longer than a step, even on a loaded machine: the wait share stays high
            x = np.random.default_rng(i).normal(size=(16, 8)).astype("float32")
            return x, x[:, :1] * 2.0

    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        plain = keras.models.clone_model(model)
        plain.set_weights(model.get_weights())
        plain.compile("sgd", "mse")
    profiler = InputProfiler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(Slow(), epochs=2, verbose=0, shuffle=False, callbacks=[profiler])
    # The same training, unprofiled; the same batches without the sleep (nothing is timed there).
    plain.fit(Slow(delay=0.0), epochs=2, verbose=0, shuffle=False)
    print("RESULT", json.dumps({
        "replicas": strategy.num_replicas_in_sync,
        "history": history.history,
        "epochs": profiler.epochs,
        "warnings": [str(w.message) for w in caught if "InputProfiler" in str(w.message)],
        "max_weight_diff": max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), plain.get_weights())),
    }))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_under_mirrored_strategy_on_two_logical_devices():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", _MIRRORED], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["replicas"] == 2
    shares = result["history"]["input_wait_share"]
    assert shares[1] > 0.5 and min(shares) > 0.2, result  # epoch 0: prefetched during tracing
    # PerReplica batches: both replicas' halves are counted, 16 samples a step.
    assert [e["samples"] for e in result["epochs"]] == [16 * e["steps"] for e in result["epochs"]]
    assert result["epochs"][1]["steps"] == 10
    assert len(result["warnings"]) == 1
    assert result["max_weight_diff"] < 1e-6  # profiling does not change what is computed
