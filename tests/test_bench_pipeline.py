"""Smoke test of scripts/bench_pipeline.py: every arm runs and the table has its shape and the
bubble formula (no timing assertions)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench_pipeline  # noqa: E402

sys.path.pop(0)


def test_bubble_is_gpipes_idle_share():
    assert bench_pipeline.bubble(2, 1) == 0.5
    assert bench_pipeline.bubble(2, 4) == 0.2
    assert bench_pipeline.bubble(4, 8) == 3 / 11
    assert bench_pipeline.bubble(1, 8) == 0.0


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_pipeline.main(["--stages", "1"])
    assert "--stages must be >= 2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_small_run_measures_every_arm(tmp_path):
    out = tmp_path / "pipe.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_pipeline.py"), "--microbatches", "1", "4", "--steps", "1",
         "--rounds", "1", "--warmup", "1", "--width", "16", "--depth", "2", "--batch", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=190, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bubble (K-1)/(M+K-1)" in proc.stdout and "2 stages/unsplit" in proc.stdout
    result = json.loads(out.read_text())
    assert result["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert [r["microbatches"] for r in result["rows"]] == [1, 4]
    assert [r["bubble"] for r in result["rows"]] == [0.5, 0.2]
    for r in result["rows"]:
        assert min(r["unsplit_ms"], r["one_stage_ms"], r["stages_ms"]) > 0
