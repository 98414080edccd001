"""`kpipe bench` and `kpipe demo`, end to end with tiny sizes."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kpipe import _demo
from kpipe.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env.pop("KPIPE_CACHE_DIR", None)
    return env


def _kpipe(args, cwd, timeout, **env):
    return subprocess.run([sys.executable, "-m", "kpipe.cli", *args], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- bench


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bench_module_target_json_figures_are_consistent():
    proc = _kpipe(["bench", "_datasets:Squares", "--workers", "0,1", "--threads", "--batches", "12", "--json"], TESTS, 100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert [(r["workers"], r["mode"]) for r in report["results"]] == [(0, "inline"), (1, "processes"), (1, "threads")]
    for r in report["results"]:
        # Squares: 4 samples of x (4, 1) float32 and y (4, 1) float32 = 32 bytes per batch.
        assert r["samples_per_s"] == pytest.approx(4 * r["batches_per_s"])
        assert r["mb_per_s"] * 1e6 == pytest.approx(32 * r["batches_per_s"])
        assert r["first_batch_s"] > 0 and r["peak_rss_mb"] > 0
    assert (report["recommended"]["workers"], report["recommended"]["use_threads"]) in {(r["workers"], r["mode"] == "threads") for r in report["results"]}
    assert "run 3/3: workers=1 threads: 12 batches" in proc.stderr


_SCRIPT = textwrap.dedent(
    """
    import numpy as np

    class Noise:  # defined in the script: reaches spawned workers by value
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return np.random.default_rng(i).random((8, 3), dtype="float32"), np.zeros(8, "int64")

    def make():
        return Noise()
    """
)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bench_script_target_prints_table_recommendation_and_plot(tmp_path, capsys, monkeypatch, no_leaks):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script's folder is added to it
    (tmp_path / "my_data.py").write_text(_SCRIPT)
    png = tmp_path / "bench.png"
    rc = main(["bench", str(tmp_path / "my_data.py") + ":make", "--workers", "0,2", "--batches", "10", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "samples/s" in out and "first batch" in out and "peak RSS" in out
    assert len([l for l in out.splitlines() if l.strip().startswith(("0 inline", "2 processes"))]) == 2
    assert "recommended: kpipe.ProcessLoader(dataset, workers=" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "no_colon_here"], "TARGET must be module:callable"),
        (["bench", "_datasets:DoesNotExist"], "has no attribute 'DoesNotExist'"),
        (["bench", "_datasets:Squares", "--workers", "2,-1"], "--workers=2,-1"),
        (["bench", "_datasets:Squares", "--batches", "1"], "--batches=1"),
        (["bench", "missing_script.py:make"], "does not exist"),
        (["bench", "not_a_dataset.py:make"], "returned int, not a dataset"),
    ],
)
def test_bench_rejects_bad_arguments_with_the_fix(argv, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "not_a_dataset.py").write_text("def make():\n    return 42\n")
    monkeypatch.chdir(TESTS if "_datasets" in argv[1] else tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_plot_without_matplotlib_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.chdir(TESTS)
    rc = main(["bench", "_datasets:Squares", "--plot", "x.png"])
    assert rc == 2
    assert "pip install 'kpipe[plot]'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ demo


def test_demo_dataset_is_imbalanced_cached_and_weighted(tmp_path, monkeypatch):
    monkeypatch.setenv("KPIPE_CACHE_DIR", str(tmp_path))
    path, created = _demo.ensure_dataset(512)
    assert created and path.startswith(str(tmp_path))
    assert _demo.ensure_dataset(512) == (path, False)
    import h5py

    with h5py.File(path, "r") as f:
        labels = f["labels"][:]
        assert f["images"].shape == (512, 32, 32, 3) and f["images"].dtype == np.uint8
    counts = np.bincount(labels, minlength=4)
    assert counts[0] > counts[1] > counts[3] > 0
    weights = _demo.class_weights(path)
    assert sum(weights[c] * counts[c] for c in range(4)) == pytest.approx(len(labels))  # balanced
    x, y = _demo.DemoImages(path, batch_size=64)[1]
    assert x.shape == (64, 32, 32, 3) and x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    assert np.array_equal(y, labels[64:128])
    with pytest.raises(ValueError, match="samples=10"):
        _demo.ensure_dataset(10)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_demo_runs_end_to_end_on_two_logical_devices_then_from_cache(tmp_path, monkeypatch, capsys, no_leaks):
    proc = _kpipe(["demo", "--samples", "256", "--epochs", "1", "--devices", "2", "--workers", "2"], REPO, 200, XDG_CACHE_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "generated" in out and "MirroredStrategy, 2 replica(s)" in out
    assert os.path.exists(tmp_path / "kpipe" / "demo-v2-256x32px-seed0.h5")
    rows = {row: next(l for l in out.splitlines() if l.startswith(row))[len(row):].split() for row in ("samples/s", "input wait share")}
    serial, fast, ratio = rows["samples/s"]  # one figure per run, and their ratio
    assert float(serial) > 0 and float(fast) > 0 and ratio.endswith("x")
    assert all(0 <= int(share.rstrip("%")) <= 100 for share in rows["input wait share"])
    assert "serial PyDataset" in out and "ProcessLoader(workers=2)" in out

    # Second run, in this process, one device: the dataset comes from the cache.
    monkeypatch.delenv("KPIPE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["demo", "--samples", "256", "--epochs", "1", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "cached" in out and "1 replica(s)" in out and "ProcessLoader(workers=1)" in out


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--epochs", "0"]) == 2
    assert "--epochs=0" in capsys.readouterr().err
    assert main(["demo", "--devices", "3"]) == 2
    assert "--devices=3" in capsys.readouterr().err


def test_readme_quickstart_is_the_two_commands_ci_and_these_tests_run():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    # The first runs `kpipe demo` (exercised above with tiny sizes); CI runs the second.
    assert "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/kpipe demo" in readme
    assert 'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest' in readme
    with open(os.path.join(REPO, "setup.cfg")) as f:
        assert "kpipe = kpipe.cli:main" in f.read()  # the console script the first command calls


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_installed_console_script_runs_the_demo(tmp_path):
    """The README's first command ends in `.venv/bin/kpipe demo`: run that entry point, as a
    newcomer would (no TF_CPP_MIN_LOG_LEVEL): TensorFlow's start-up lines stay out of it."""
    from kpipe._cli._quiet import is_startup_noise

    script = os.path.join(os.path.dirname(sys.executable), "kpipe")
    if not os.path.exists(script):
        pytest.skip("kpipe is not installed in this interpreter's environment (pip install -e .)")
    env = _env(XDG_CACHE_HOME=str(tmp_path))
    del env["TF_CPP_MIN_LOG_LEVEL"]
    proc = subprocess.run(
        [script, "demo", "--samples", "256", "--epochs", "1", "--workers", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ProcessLoader(workers=2)" in proc.stdout and "input wait share" in proc.stdout
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if is_startup_noise(line)]
    assert noise == [], noise
    assert proc.stdout.startswith("dataset: 256 images"), proc.stdout[:500]  # kpipe's words come first
