"""scripts/fresh_clone_check.py: it finds the README's command, refuses bad arguments, and
its background load stops with the suite (the whole check runs by hand: README)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "fresh_clone_check.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import fresh_clone_check  # noqa: E402


def test_the_command_is_the_readmes():
    command = fresh_clone_check.readme_command(os.path.join(ROOT, "README.md"))
    assert command == 'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest'
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert command in f.read()  # CI runs the same line


def test_a_pytest_summary_line_is_read():
    out = "...\n==== 3 failed, 771 passed, 3 skipped, 1 xfailed, 210 warnings in 929.12s (0:15:29) ====\n"
    assert fresh_clone_check._SUMMARY.findall(out) == [("3 failed, 771 passed, 3 skipped, 1 xfailed, 210 warnings", "929.12")]


@pytest.mark.parametrize("args, message", [
    (["--runs", "busy"], "--runs takes idle and/or loaded. Received: --runs 'busy'"),
    (["--duty", "0"], "--duty must be in (0, 1] and --load-procs >= 1. Received: --duty 0.0"),
    (["--load-procs", "0"], "Received: --duty 0.5 --load-procs 0"),
])
def test_bad_arguments_are_refused(args, message):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.multiprocess
def test_the_load_runs_and_stops_with_its_block():
    with fresh_clone_check.Load(procs=2, duty=0.3, max_s=60) as load:
        assert all(p.poll() is None for p in load._children)
        children = list(load._children)
    assert len(children) == 2 and all(p.poll() is not None for p in children)
