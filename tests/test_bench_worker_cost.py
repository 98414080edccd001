"""Smoke test of scripts/bench_worker_cost.py: every row runs, the breakdown has its parts,
and the copy into the slot is where it should be (no timing assertions)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_worker_cost_small_run_reports_every_row_and_part(tmp_path):
    out = tmp_path / "cost.json"
    env = dict(os.environ)
    if importlib.util.find_spec("jax") is not None:  # (the script imports no backend; jax is the lighter Keras import)
        env["KERAS_BACKEND"] = "jax"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_worker_cost.py"), "--small", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["tiny", "view", "kpipe.empty"]
    for r in rows.values():
        assert r["cpu_ms"] >= 0 and r["minflt"] >= 0 and "rest_ms" in r
        assert set(r["parts_ms"]) == {"getitem", "flatten", "copy", "reserve", "keep_apart", "recv", "send", "copied_bytes"}
        assert r["parts_ms"]["getitem"] > 0 and r["parts_ms"]["recv"] > 0 and r["parts_ms"]["send"] > 0
    batch, labels = 16 * 16 * 16 * 3, 128 * 8  # (--small batch: 16 x 16 x 16 x 3 uint8, and 128 int64 labels)
    assert rows["view"]["parts_ms"]["copied_bytes"] == batch + labels  # the view is copied into the slot...
    assert rows["kpipe.empty"]["parts_ms"]["copied_bytes"] == labels  # ... a kpipe.empty batch is not
    assert rows["tiny"]["parts_ms"]["copied_bytes"] == 4 * 8 + labels
    assert result["copy_alone_ms"] > 0
    assert "Worker cost per batch" in proc.stdout and "copy alone" in proc.stdout
