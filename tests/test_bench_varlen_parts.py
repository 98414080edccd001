"""Smoke test of scripts/bench_varlen_parts.py: the serial parts and every row's CPU per
sample are reported, with the cap each peer's CPU sets; bad options are refused (no
timing assertions)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_varlen_parts.py")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_smoke_run_reports_the_parts_and_the_caps(tmp_path):
    out = tmp_path / "parts.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--workers", "1", "--epochs", "2", "--repeats", "1",
                           "--workloads", "audio", "--json", str(out)],
                          capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    audio = json.loads(out.read_text())["audio"]
    assert set(audio["serial_us_per_sample"]) == {"dataset", "dataset + pad", "kpipe batches"}
    assert all(us > 0 for us in audio["serial_us_per_sample"].values())
    rows = {r["row"] for r in audio["rows"]}
    assert {"kpipe", "bare processes", "tf.data bucket_by_sequence_length"} <= rows
    assert set(audio["caps"]) == rows - {"kpipe", "bare processes"}
    assert all(c["cap_by_cpu"] > 0 and c["kpipe_by_cpu"] > 0 for c in audio["caps"].values())
    assert "cap vs tf.data bucket_by_sequence_length:" in proc.stdout and "kpipe batches" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--epochs", "1"], "--workers and --repeats must be >= 1, --epochs >= 2. Received: --workers 2 --epochs 1"),
    (["--workloads", "video"], "--workloads takes a comma-separated subset of text, audio. Received: 'video'"),
])
def test_bad_options_are_refused(args, message):
    proc = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
