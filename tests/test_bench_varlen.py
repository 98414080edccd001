"""Smoke test of scripts/bench_varlen.py: every row runs on both workloads and reports a
rate and its padding waste; peers that are not installed are skipped with the reason; bad
options are refused (no timing assertions)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_varlen.py")
ROWS = ["kpipe", "bare processes", "tf.data bucket_by_sequence_length"]


def _importable(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_smoke_run_reports_every_row_with_its_padding_waste(tmp_path):
    out = tmp_path / "varlen.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--workers", "1", "--epochs", "2", "--json", str(out),
                           "--kpipe-queues", "4"],
                          capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    optional = [row for row, module in [("torch DataLoader pad_sequence", "torch"), ("grain", "grain")] if _importable(module)]
    for workload in ("text", "audio"):
        rows = [r for r in result["rows"] if r["workload"] == workload]
        assert [r["row"] for r in rows] == ROWS[:1] + ["kpipe max_queue_size=4"] + ROWS[1:] + optional
        assert all(r["median_samples_per_s"] > 0 and len(r["epoch_rates"]) == 1 and r["padding_waste"] >= 1 for r in rows)
        assert rows[2]["vs_bare"] == 1.0
        # the same buckets: the same padding in each bucketed row, less than plain random batches pad
        assert len({round(r["padding_waste"], 9) for r in rows[:4]}) == 1
        assert result["ratios"][workload]["best_peer"] not in ("kpipe", "kpipe max_queue_size=4")
        assert result["ratios"][workload]["waste_without_buckets"] > rows[0]["padding_waste"]
        assert result["ratios"][workload]["kpipe_vs_bare"] > 0
    skipped = {(s["workload"], s["row"]) for s in result["skipped"]}
    for row, module in [("torch DataLoader pad_sequence", "torch"), ("grain", "grain")]:
        if not _importable(module):
            assert ("text", row) in skipped and f"{row}: {module} is not importable here" in proc.stdout
    assert "kpipe / bare processes:" in proc.stdout and "padding waste of plain shuffled batches" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--epochs", "1"], "--epochs must be >= 2 (the first is a warm-up). Received: --epochs 1"),
    (["--workers", "0"], "--workers must be >= 1. Received: --workers 0"),
    (["--workloads", "video"], "--workloads takes a comma-separated subset of text, audio. Received: 'video'"),
    (["--kpipe-queues", "4,0"], "--kpipe-queues takes comma-separated integers >= 1. Received: '4,0'"),
])
def test_bad_options_are_refused(args, message):
    proc = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
