"""Smoke test of scripts/bench_jpeg_steps.py: every step of from_files's decoding is timed and
printed with its ratio (no timing assertions)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_jpeg_steps.py")
STEPS = ["keras", "map", "map+ignore", "source", "source-skip", "pipeline", "ref-rrc", "decoder-rrc", "source-rrc", "pipeline-rrc",
         "files-decode", "packed-decode", "packed-source", "packed-pipeline"]
SAMPLE_STEPS = ["read", "+window", "+decode", "+resize", "+flip", "whole decode"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_times_every_step(tmp_path):
    out = tmp_path / "steps.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--per-sample", "--json", str(out)], capture_output=True,
                          text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["images"] == 64 and list(got["steps"]) == STEPS
    assert all(s["cpu_ms"] > 0 and s["rate"] > 0 for s in got["steps"].values())
    lines = proc.stdout.splitlines()
    for step in STEPS:
        assert any(line.split()[:1] == [step] and line.split()[2].endswith("x") for line in lines), step
    # per sample: every decoder (simplejpeg where installed), both storages, every step
    decoders = ["pil", "cv2"] + (["simplejpeg"] if importlib.util.find_spec("simplejpeg") else [])
    assert list(got["per_sample"]) == decoders
    for decoder in decoders:
        assert list(got["per_sample"][decoder]) == ["folder", "packed-256"]
        for store in ("folder", "packed-256"):
            assert list(got["per_sample"][decoder][store]) == SAMPLE_STEPS
            assert all(v > 0 for v in got["per_sample"][decoder][store].values())
        assert sum(line.split()[:1] == [decoder] for line in lines) == len(SAMPLE_STEPS)
