"""scripts/import_cost.py (issue 47): import time and memory per Keras backend, and whether
TensorFlow was imported -- a smoke test of the script (no timing assertions), and under
JAX the fact it reports: neither the process nor the loader's worker imported TensorFlow."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import import_cost  # noqa: E402 (scripts/)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install 'kpipe[jax]')")
def test_under_jax_neither_the_process_nor_the_worker_imports_tensorflow():
    result = import_cost.measure("jax")
    assert result["backend"] == "jax"
    assert (result["tf_after_import"], result["tf_after_loading"], result["tf_in_worker"]) == (False, False, False)
    assert result["import_s"] > 0 and 0 < result["rss_import_mb"] <= result["rss_loaded_mb"] * 1.5


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_script_prints_one_row_per_backend_and_skips_the_missing_ones():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "import_cost.py"), "--backends", "tensorflow,torch"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("backend") and lines[1].startswith("tensorflow ")
    assert lines[1].rstrip().endswith("yes / no")  # TensorFlow's own backend imports it; the worker does not
    torch_line = lines[2]
    assert torch_line.startswith("torch ")
    if importlib.util.find_spec("torch") is None:
        assert "skipped: torch is not installed" in torch_line
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "import_cost.py"), "--backends", "mxnet"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown backend 'mxnet'" in bad.stderr
