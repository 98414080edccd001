"""Smoke test of scripts/bench_loaders.py: every loader runs and the JSON has every row."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args):
    """Runs the benchmark with `--quick` and `args`; returns its stdout and JSON."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_loaders.py"), "--quick", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_quick_run_reports_every_loader(tmp_path):
    stdout, result = _run(tmp_path, "--workloads", "a", "--epochs", "1", "--warmup-epochs", "1", "--rss-epochs", "3")
    rows = result["rows"]
    assert [r["loader"] for r in rows] == ["serial", "keras-threads", "keras-mp", "tf.data", "kpipe", "ceiling"]
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert "Targets:" in stdout and "kpipe RSS over 3 epochs" in stdout
    assert result["warmup_epochs"] == 1 and "after 1 untimed" in stdout
    assert result["warm_mb"] == 128  # 1024 MB scaled for --quick


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_loaders_runs_the_fixed_order_workload_beside_b(tmp_path):
    stdout, result = _run(tmp_path, "--workloads", "b,b-fixed", "--loaders", "kpipe", "--epochs", "2", "--rss-epochs", "0")
    assert [(r["workload"], r["loader"]) for r in result["rows"]] == [(w, k) for w in ("b", "b-fixed") for k in ("kpipe", "ceiling")]
    assert "(b) kpipe >= 0.85x ceiling" in stdout
