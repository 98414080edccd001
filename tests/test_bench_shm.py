"""Smoke test of scripts/bench_shm.py: every step is measured and bad sizes are refused."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_shm.py")


def test_prints_every_step_with_its_cost():
    proc = subprocess.run([sys.executable, SCRIPT, "--mb", "2", "--repeats", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S.*?)\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+$", proc.stdout, re.M)}
    assert set(rows) == {"create + populate", "... no fallocate", "2nd mapping", "... for writing", "read, page by page", "full write"}, proc.stdout
    assert all(ms > 0 for ms in rows.values())


def test_refuses_a_size_of_zero():
    proc = subprocess.run([sys.executable, SCRIPT, "--mb", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--mb must be > 0" in proc.stderr and "Received: --mb 0.0" in proc.stderr
