"""Smoke tests of scripts/bench_feed.py and scripts/bench_auto.py: every row runs and the
tables have their shape (no timing assertions)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ["tf.data", "PyDataset", "kpipe", "kpipe from_generator", "kpipe.as_dataset", "kpipe auto", "keras-mp"]
PATHS = ["fit(loader) from_generator", "fit(loader)", "fit(loader.as_dataset())"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_bench_feed_small_run_reports_every_row_and_the_breakdown(tmp_path):
    out = tmp_path / "feed.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_feed.py"), "--small", "--json", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    for size in ("1.5MB", "9.6MB"):
        mine = [r for r in rows if r["size"] == size]
        assert [r["row"] for r in mine] == ROWS
        assert all(r["steps_per_s"] > 0 and len(r["epoch_rates"]) == 2 for r in mine)
        assert mine[0]["vs_tfdata"] == 1.0
        assert all(r["whole_steps_per_s"] > 0 and r["first_step_ms"] > 0 and len(r["first_steps_ms"]) == 2 for r in mine)
        assert mine[0]["whole_vs_tfdata"] == 1.0 and mine[0]["first_step_vs_tfdata"] == 1.0
    assert [(b["size"], b["path"]) for b in result["breakdown"]] == [
        (s, p) for s in ("1.5MB", "9.6MB") for p in PATHS
    ]
    from kpipe import _compat

    feeds = _compat.keras_at_least(_compat.KERAS_ITERABLE_TRAIN_FUNCTION)
    for b in result["breakdown"]:
        assert b["loader_us"] > 0 and b["step_us"] > 0
        parts = b["wait_recv_us"] + b["arrays_us"] + b["submit_us"] + b["bookkeeping_us"]
        assert abs(parts - b["loader_us"]) < 1e-6 * max(1.0, b["loader_us"]) + 1e-9
        on_feed = feeds and b["path"] == "fit(loader)"  # the feed converts; from_generator does not
        assert (b["feed_next_us"] > 0 and b["convert_us"] > 0) == on_feed, b
        assert (b["standardize_us"] > 0) == (b["path"] != "fit(loader.as_dataset())"), b
    table = proc.stdout[proc.stdout.index("input to fit()"):]
    assert all(name in table for name in ROWS) and "Per-batch time of the kpipe paths" in proc.stdout
    assert "Whole calls (warm model and input)" in proc.stdout


def test_bench_feed_rejects_bad_arguments(capsys):
    # in this process: argument errors come before any measurement (one interpreter per
    # case would cost a TensorFlow import each)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import bench_feed
    finally:
        sys.path.pop(0)
    for bad in (["--sizes", "3MB"], ["--rows", "torch"], ["--epochs", "0"], ["--calls", "0"]):
        with pytest.raises(SystemExit) as info:
            bench_feed.main(bad)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Received" in err, (bad, err[-500:])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_auto_quick_run_reports_fixed_counts_and_auto(tmp_path):
    out = tmp_path / "auto.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_auto.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["workload"], r["workers"]) for r in rows] == [(w, c) for w in ("a", "c", "fit", "blas") for c in (1, 2, "auto")]
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert max(r["x_best_fixed"] for r in rows if r["workers"] != "auto") == 1.0
    auto = [r for r in rows if r["workers"] == "auto"]
    assert all(r["workers_end"] >= 1 and isinstance(r["auto_decisions"], list) for r in auto)
    # the BLAS workload's targets (issue #30), printed PASS or MISS and never asserted on
    blas = {r["workers"]: r["samples_per_s"] for r in rows if r["workload"] == "blas"}
    best, worst = max((1, 2), key=blas.get), min((1, 2), key=blas.get)
    assert [t["name"] for t in result["targets"]] == [
        "(blas) kpipe workers=2 >= 1.3x workers=1",
        f"(blas) kpipe workers='auto' >= 0.9x the best fixed count (workers={best})",
        f"(blas) kpipe slowest fixed count (workers={worst}) >= 0.8x workers=1",
    ]
    assert result["targets"][0]["measured"] == pytest.approx(blas[2] / blas[1])
    for t in result["targets"]:
        assert any(line.split()[:1] in (["PASS"], ["MISS"]) and t["name"] in line for line in proc.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install 'kpipe[jax]')")
def test_bench_feed_backend_jax_compares_kpipe_with_numpy_arrays(tmp_path):
    out = tmp_path / "feed-jax.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_feed.py"), "--backend", "jax", "--small", "--sizes", "1.5MB",
         "--worker-counts", "1,2", "--json", str(out)], capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "jax" and result["rounds"] == 1
    assert [r["row"] for r in result["rows"]] == ["numpy", "PyDataset", "kpipe in-thread", "kpipe workers=1", "kpipe workers=2"]
    assert all(r["steps_per_s"] > 0 and len(r["epoch_rates"]) == 2 for r in result["rows"])
    assert all(r["cpu_ms_per_step"] is None or r["cpu_ms_per_step"] > 0 for r in result["rows"])
    assert all(r["trainer_cpu_ms_per_step"] > 0 for r in result["rows"])  # (this process's part of the CPU)
    assert result["rows"][0]["vs_baseline"] == 1.0 and result["rows"][0]["median_vs_baseline"] == 1.0
    # the per-batch breakdown: in Keras's thread the loader runs inside the trainer's next();
    # through the feed, the conversion for JAX (device_put off the CPU) runs in the feed's thread
    paths = {b["path"]: b for b in result["breakdown"]}
    assert sorted(paths) == ["kpipe (feed)", "kpipe in-thread"]
    assert all(b["loader_us"] > 0 and b["next_us"] > 0 and b["step_us"] > 0 for b in paths.values())
    assert paths["kpipe in-thread"]["to_jax_us"] == 0 and paths["kpipe (feed)"]["to_jax_us"] > 0
    assert "baseline: numpy" in proc.stdout and "CPU ms/step" in proc.stdout and "Per-batch time of kpipe on JAX" in proc.stdout


def test_bench_feed_rejects_bad_worker_counts_and_rounds(capsys):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import bench_feed
    finally:
        sys.path.pop(0)
    for bad in (["--worker-counts", "0,2"], ["--worker-counts", "two"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as info:
            bench_feed.main(bad)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Received" in err, (bad, err[-500:])
