"""Smoke test of scripts/bench_shm.py: every step is measured and bad sizes are refused."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_shm.py")


_STEPS = {"create + populate", "... no fallocate", "2nd mapping", "... for writing", "read, page by page", "full write"}


def test_prints_every_step_with_its_cost(tmp_path):
    out = tmp_path / "shm.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--mb", "2", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the raw measurements (a 2 MB write takes ~0.05 ms: a printed, rounded figure can read 0)
    measured = json.loads(out.read_text())
    assert set(measured["median_s"]) == _STEPS and len(measured["rounds_s"]) == 2
    assert all(s > 0 for r in measured["rounds_s"] for s in r.values()), measured
    # and the table prints every step, with a figure for each
    number = r"[0-9.]+(?:e[-+]?[0-9]+)?"
    rows = {m.group(1) for m in re.finditer(rf"^(\S.*?)\s+{number}\s+{number}\s+{number}$", proc.stdout, re.M)}
    assert rows == _STEPS, proc.stdout


def test_refuses_a_size_of_zero():
    proc = subprocess.run([sys.executable, SCRIPT, "--mb", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--mb must be > 0" in proc.stderr and "Received: --mb 0.0" in proc.stderr
