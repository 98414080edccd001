"""InputProfiler's per-step record, its picture, its TensorBoard scalars and its advice."""

import glob
import os
import struct
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kpipe
import kpipe.callbacks._profiler
from _datasets import Squares
from kpipe.callbacks import InputProfiler
from kpipe.callbacks import _timeline
from kpipe.callbacks._profiler import _advice
from kpipe.callbacks._timeline import PERIODIC, START, STEADY, BURSTS, StepTimeline, wait_pattern

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Delayed(keras.utils.PyDataset):
    """`delay(i)` seconds of sleep before batch i; 16 samples of 8 features."""

    def __init__(self, n=8, delay=lambda i: 0.0):
        super().__init__()
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay(i))
        x = np.random.default_rng(i).normal(size=(16, 8)).astype("float32")
        return x, x[:, :1]


def tiny_model(**compile_kw):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile("sgd", "mse", **compile_kw)
    return model


def fitted(data=None, epochs=2, **profiler_kw):
    profiler = InputProfiler(warn_above=None, **profiler_kw)
    tiny_model().fit(data if data is not None else Delayed(), epochs=epochs, verbose=0, callbacks=[profiler])
    return profiler


def png_size(path_or_bytes):
    data = open(path_or_bytes, "rb").read(32) if isinstance(path_or_bytes, (str, os.PathLike)) else path_or_bytes[:32]
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


# -- the record ------------------------------------------------------------------------------


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_per_step_records_add_up_to_the_logged_epoch_figures(steps_per_execution, tmp_path, monkeypatch):
    monkeypatch.setattr(kpipe.callbacks._profiler, "_TB_BATCH", 2)  # TensorBoard writes between steps, left out
    model = tiny_model(steps_per_execution=steps_per_execution)
    profiler = InputProfiler(warn_above=None, log_dir=str(tmp_path))
    history = model.fit(Delayed(n=7, delay=lambda i: 0.002 * (i % 3)), epochs=3, verbose=0, callbacks=[profiler])
    steps = profiler.steps
    assert len(steps) == len(steps.wait_s) == len(steps.queue_depth) and steps.window == 1
    assert steps.steps.sum() == 21 and not steps.counted[0] and steps.counted[1:].all()  # the warm-up step
    assert np.array_equal(steps.first_step, np.cumsum(steps.steps) - steps.steps)  # every step, in order
    assert np.isnan(steps.queue_depth).all()  # not a ProcessLoader
    assert np.allclose(steps.compute_s, steps.step_s - steps.wait_s) and (steps.compute_s >= 0).all()
    totals = steps.epoch_totals()
    assert sorted(totals) == [0, 1, 2]
    for logged, share, epoch in zip(profiler.epochs, history.history["input_wait_share"], range(3)):
        t = totals[epoch]
        assert t["steps"] == logged["steps"] and t["samples"] == logged["samples"] == 16 * logged["steps"]
        assert t["wait_s"] == pytest.approx(logged["input_wait_s"], rel=1e-9, abs=1e-12)
        assert t["step_s"] == pytest.approx(logged["wall_s"], rel=1e-9)
        assert t["wait_s"] / t["step_s"] == pytest.approx(share, rel=1e-9)
    # start_s increases step by step; epochs are contiguous runs
    assert (np.diff(steps.start_s) > 0).all() and (np.diff(steps.epoch) >= 0).all()
    logged = read_scalars(str(tmp_path))["step_ms"]  # every measured call, written mid-epoch too
    assert np.allclose([v for _, v in logged], 1e3 * steps.step_s[steps.counted], rtol=1e-6)


def test_memory_stays_bounded_and_sums_exact_over_100k_steps():
    rng = np.random.default_rng(0)
    n, epochs = 100_000, 7
    epoch = np.repeat(np.arange(epochs), -(-n // epochs))[:n]
    wait, step = rng.exponential(0.01, n), 0.005 + rng.exponential(0.01, n)
    step += wait
    depth = rng.integers(0, 9, n)
    timeline = StepTimeline(10_000)
    nbytes = timeline.nbytes
    starts = np.cumsum(step) - step
    for i in range(n):
        timeline.add(epoch=int(epoch[i]), start_s=float(starts[i]), wait_s=float(wait[i]), step_s=float(step[i]),
                     samples=32, depth=int(depth[i]), counted=i > 0)
        assert len(timeline) <= 10_000
    assert timeline.nbytes == nbytes < 1_000_000
    s = timeline.steps()
    assert s.window == 16 and len(s) <= 10_000 and s.steps.sum() == n
    assert np.array_equal(s.first_step, np.cumsum(s.steps) - s.steps)  # contiguous, complete coverage
    assert s.steps.max() <= 16 and not s.counted[0] and s.steps[0] == 1  # the warm-up step stays apart
    for e in range(epochs):
        rows, idx = s.epoch == e, epoch == e
        assert s.steps[rows].sum() == idx.sum()  # no row spans two epochs
        assert s.wait_s[rows].sum() == pytest.approx(wait[idx].sum(), rel=1e-9)
        assert s.step_s[rows].sum() == pytest.approx(step[idx].sum(), rel=1e-9)
    assert s.samples.sum() == 32 * n
    assert np.nansum(s.queue_depth * s.steps) == pytest.approx(depth.sum(), rel=1e-9)  # one sample per call
    assert np.array_equal(s.start_s, starts[s.first_step])


def test_more_epochs_than_half_the_capacity_still_bounded():
    timeline = StepTimeline(16)
    for i in range(2_000):  # 1000 epochs of 2 steps
        timeline.add(epoch=i // 2, start_s=float(i), wait_s=1.0, step_s=2.0)
        assert len(timeline) <= 16
    s = timeline.steps()
    assert s.steps.sum() == 2_000 and s.wait_s.sum() == 2_000.0 and s.step_s.sum() == 4_000.0
    assert np.isnan(s.queue_depth).all()


def test_rejects_a_too_small_record():
    with pytest.raises(ValueError, match=r"max_records=8\b"):
        InputProfiler(max_records=8)
    with pytest.raises(ValueError, match="log_dir=3"):
        InputProfiler(log_dir=3)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_process_loader_input_records_its_queue_depth(no_leaks):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    profiler = InputProfiler(warn_above=None)
    with kpipe.ProcessLoader(Squares(n=10, batch=4, last=3), workers=2, max_queue_size=4) as loader:
        model.fit(loader, epochs=2, verbose=0, callbacks=[profiler])
    depth = profiler.steps.queue_depth
    assert np.isfinite(depth).all() and (depth >= 0).all() and (depth <= 4).all()
    assert profiler.steps.samples[profiler.steps.epoch == 1].sum() == 39


# -- when the waits happen -------------------------------------------------------------------


def test_wait_pattern_tells_start_periodic_bursts_and_steady_apart():
    base = np.full(60, 0.001)
    start = base.copy()
    start[:3] = 0.2
    assert wait_pattern(start)[0] == START
    periodic = base.copy()
    periodic[7::8] = 0.08
    name, detail = wait_pattern(periodic)
    assert name == PERIODIC and detail["every"] == 8
    bursts = base.copy()
    bursts[[9, 10, 23, 41, 44, 55]] = 0.08
    assert wait_pattern(bursts)[0] == BURSTS
    steady = 0.015 + 0.002 * np.random.default_rng(0).random(60)
    assert wait_pattern(steady)[0] == STEADY
    assert wait_pattern(np.zeros(10)) == (None, {})
    # windows of 4 steps: the spacing is counted in steps, not rows
    windows = np.full(30, 0.004)
    windows[1::2] = 0.3
    assert wait_pattern(windows, np.full(30, 4)) == (STEADY, wait_pattern(windows, np.full(30, 4))[1])
    windows = np.full(30, 0.004)
    windows[3::4] = 0.3
    name, detail = wait_pattern(windows, np.full(30, 4))
    assert name == PERIODIC and detail["every"] == 16


FIGURES = {"input_wait_share": 0.6, "wall_s": 1.0, "steps": 50}


@pytest.mark.parametrize(
    "kind, pattern, expected",
    [
        (("process_loader", 4), (START, {"head_share": 0.8}), ["start of the epoch", "80%", "on_epoch_end", "max_queue_size` (now 6)"]),
        (("pydataset", 1), (START, {"head_share": 0.9}), ["start of the epoch", "keeps its workers"]),
        (("tf.data", None), (START, {"head_share": 0.7}), ["start of the epoch", "shuffle(buffer_size)"]),
        (("process_loader", 4), (PERIODIC, {"every": 8, "spike_steps": 0.12}), ["every 8 steps", "12%", "max_queue_size` (now 6)", "workers` (now 4)"]),
        (("tf.data", None), (BURSTS, {"spike_steps": 0.1}), ["irregular intervals", ".prefetch(k)"]),
        (("pydataset", 1), (STEADY, {}), ["steadily", "kpipe.ProcessLoader(dataset, workers=N)"]),
        (("process_loader", 2), (STEADY, {}), ["steadily", "more workers (now workers=2)"]),
    ],
)
def test_advice_says_when_and_the_fix_for_that_pattern(kind, pattern, expected):
    class Loader:
        max_queue_size = 6

    text = _advice(FIGURES, 0.2, 3, kind, pattern, Loader())
    assert text.startswith("InputProfiler: in epoch 3 the training step waited for input 60%")
    for part in expected:
        assert part in text, (part, text)


def test_warning_names_a_start_of_epoch_stall():
    # Batches 0-1 of every epoch take 0.25 s, the rest nothing: the waits fall at the epoch start.
    profiler = InputProfiler(warn_above=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model().fit(Delayed(n=30, delay=lambda i: 0.25 if i < 2 else 0.0), epochs=2, shuffle=False, verbose=0,
                         callbacks=[profiler])
    found = [str(w.message) for w in caught if "InputProfiler" in str(w.message)]
    assert len(found) == 1 and "When: at the start of the epoch" in found[0], found
    assert "keeps its workers" in found[0]
    assert profiler.epochs[-1]["wait_pattern"] == START


# -- the picture ------------------------------------------------------------------------------


def test_plot_one_and_two_profilers_writes_pngs_of_the_expected_size(tmp_path):
    before = fitted(Delayed(delay=lambda i: 0.01))
    after = fitted()
    one = after.plot(str(tmp_path / "one.png"))
    assert png_size(tmp_path / "one.png") == (800, 400)
    two = after.plot(str(tmp_path / "two.png"), before=before, labels=["before", "after"], title="T")
    assert png_size(tmp_path / "two.png") == (1080, 400)
    assert png_size(two._repr_png_()) == (1080, 400)  # how Jupyter shows it
    left, right = two.axes[:2]
    assert left.get_shared_y_axes().joined(left, right) and left.get_shared_x_axes().joined(left, right)
    assert left.get_title().startswith("before\n") and "steps/s" in right.get_title()
    assert left.get_ylabel() == "time per step (ms)" and right.get_xlabel() == "training step"
    assert two.get_suptitle() == "T" and "step" in one.get_suptitle()
    legend = [t.get_text() for t in two.legends[0].get_texts()]
    assert legend[:2] == ["waiting for input", "computing (step + callbacks)"]  # (+ a marker for outliers)
    epochs = [t.get_text() for t in left.texts]
    assert epochs == [f"epoch {e['epoch'] + 1}\n{e['input_wait_share']:.0%} wait" for e in before.epochs]
    assert len([line for line in left.lines if line.get_linestyle() == "--"]) == 1  # between the two epochs


def test_plot_rejects_wrong_arguments_with_the_fix():
    profiler = fitted(epochs=1)
    with pytest.raises(ValueError, match="labels"):
        profiler.plot(labels=["one", "two"])
    with pytest.raises(ValueError, match="before=3"):
        profiler.plot(before=3)
    with pytest.raises(ValueError, match="no measured training step"):
        InputProfiler().plot()


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    profiler = fitted(epochs=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r'pip install "kpipe\[plot\]"'):
        profiler.plot()


# -- TensorBoard ------------------------------------------------------------------------------


def read_scalars(log_dir):
    scalars = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                scalars.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


def test_tensorboard_event_files_hold_the_per_step_and_epoch_scalars(tmp_path):
    model = tiny_model()
    profiler = InputProfiler(warn_above=None, log_dir=tmp_path)
    model.fit(Delayed(n=5, delay=lambda i: 0.003), epochs=2, verbose=0, callbacks=[profiler])
    scalars = read_scalars(str(tmp_path))
    assert set(scalars) == {"input_wait_ms", "step_ms", "input_wait_share"}
    steps = profiler.steps
    counted = steps.counted
    # one value per measured step, at Keras's global step numbers (optimizer iterations)
    assert [s for s, _ in scalars["input_wait_ms"]] == list(steps.first_step[counted] + 1)
    assert np.allclose([v for _, v in scalars["input_wait_ms"]], 1e3 * steps.wait_s[counted], rtol=1e-6)
    assert np.allclose([v for _, v in scalars["step_ms"]], 1e3 * steps.step_s[counted], rtol=1e-6)
    assert [s for s, _ in scalars["input_wait_share"]] == [0, 1]
    assert np.allclose([v for _, v in scalars["input_wait_share"]], [e["input_wait_share"] for e in profiler.epochs], rtol=1e-6)
    # a second fit of the same model continues the step numbers in a new event file
    profiler2 = InputProfiler(warn_above=None, log_dir=tmp_path)
    model.fit(Delayed(n=5), epochs=1, verbose=0, callbacks=[profiler2])
    steps_logged = [s for s, _ in read_scalars(str(tmp_path))["input_wait_ms"]]
    assert steps_logged[-1] == 15 and len(glob.glob(str(tmp_path / "train" / "events.out.tfevents.*"))) == 2


# -- where users look -------------------------------------------------------------------------


def test_plot_script_has_help():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot_input_wait.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--out" in proc.stdout and "--delay-ms" in proc.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_plot_script_writes_the_figure_and_its_numbers(tmp_path, no_leaks):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import plot_input_wait
    finally:
        sys.path.pop(0)
    out = tmp_path / "fig.png"
    assert plot_input_wait.main(["--out", str(out), "--steps", "6", "--epochs", "2", "--delay-ms", "5",
                                 "--workers", "2", "--json", str(tmp_path / "n.json")]) == 0
    assert png_size(out) == (1080, 400) and os.path.getsize(out) < 150_000
    import json

    numbers = json.load(open(tmp_path / "n.json"))
    for run in ("before", "after"):
        assert 0 <= numbers[run]["input_wait_share"] <= 1 and numbers[run]["steps_per_sec"] > 0
        assert len(numbers[run]["per_epoch_share"]) == 2


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_writes_the_before_after_timeline(tmp_path, monkeypatch, capsys, no_leaks):
    from kpipe.cli import main

    monkeypatch.setenv("KPIPE_CACHE_DIR", str(tmp_path))
    out = tmp_path / "demo.png"
    assert main(["demo", "--samples", "256", "--epochs", "2", "--workers", "2", "--plot", str(out)]) == 0
    assert f"timeline: {out}" in capsys.readouterr().out
    assert png_size(out) == (1080, 400)


def test_demo_plot_without_matplotlib_fails_before_training(monkeypatch, capsys):
    from kpipe.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--plot", "x.png"]) == 2
    assert 'pip install "kpipe[plot]"' in capsys.readouterr().err
