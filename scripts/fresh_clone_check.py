#!/usr/bin/env python3
"""Runs the README's test command on a fresh clone, on an idle machine and on a busy one.

What a new user does first: clone, then the README's command that makes a venv, installs
kpipe with its test extras and runs pytest. This script does exactly that twice, each in a
clone of its own made from `--repo` at `--commit` (default: HEAD of this checkout; only
committed work is cloned):

1. **idle**: nothing else runs (beyond what the machine already runs);
2. **loaded**: while the suite runs, `--load-procs` background processes (default: one per
   CPU this process may use) keep the cores busy, each spinning `--duty` of every 100 ms
   (default 0.5) at normal priority. The load is bounded: it starts after the install, it
   stops when pytest ends, and it never outlives `--timeout`.

It prints each run's pytest summary line, its wall time and exit status, and a table of
both; `--json FILE` writes them. The exit status is 0 only if both runs passed, with no
rerun (a plugin that reruns failures would hide a flaky test: any "rerun" in the summary
counts as a failure).

Example:
    python3 scripts/fresh_clone_check.py --root /tmp/kpipe-fresh --json fresh.json

The figures are whole runs (venv + install, then the suite), timed by this script.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SUMMARY = re.compile(r"^=+ (.*\b(?:passed|failed|error|errors|no tests ran)\b.*) in ([0-9.]+)s.*=+$", re.M)


def readme_command(readme_path):
    """The README's test command: the first line of a ```bash block that runs pytest."""
    with open(readme_path, encoding="utf-8") as f:
        text = f.read()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if "-m pytest" in line and "venv" in line:
                return line.strip()
    raise SystemExit(f"{readme_path} has no ```bash line that makes a venv and runs pytest; nothing to check.")


_SPIN = """
import sys, time
duty, stop_at = float(sys.argv[1]), time.monotonic() + float(sys.argv[2])
period = 0.1
while time.monotonic() < stop_at:
    start = time.monotonic()
    while time.monotonic() - start < duty * period:
        pass
    time.sleep(max(0.0, (1 - duty) * period))
"""


class Load:
    """`procs` spinning processes -- each busy for `duty` of every 100 ms, for `max_s` at
    most -- started and stopped around the suite (a context). Plain interpreters, not
    `multiprocessing` ones, which would leave its resource tracker behind."""

    def __init__(self, procs, duty, max_s):
        self.procs, self.duty, self.max_s = procs, duty, max_s
        self._children = []

    def __enter__(self):
        for _ in range(self.procs):
            self._children.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(self.duty), str(self.max_s)]))
        return self

    def __exit__(self, *exc):
        for p in self._children:
            p.terminate()
        for p in self._children:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return False


def one_run(name, args, command, load):
    """Clones, then runs `command` in the clone; with `load`, the load runs while pytest
    does (the command's install part runs first, on its own)."""
    where = os.path.join(args.root, name)
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", "--no-local", args.repo, where], check=True)
    subprocess.run(["git", "-C", where, "checkout", "--quiet", args.commit], check=True)
    head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    install, _, test = command.rpartition("&&")
    log_path = os.path.join(args.root, f"{name}.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(install.strip(), shell=True, cwd=where, stdout=log, stderr=subprocess.STDOUT,
                            timeout=args.timeout).returncode
        t_install = time.monotonic() - t0
        if rc == 0:
            t1 = time.monotonic()
            if load:
                with Load(args.load_procs, args.duty, args.timeout):
                    rc = _run_suite(test, where, log, args.timeout)
            else:
                rc = _run_suite(test, where, log, args.timeout)
            t_suite = time.monotonic() - t1
        else:
            t_suite = 0.0
    with open(log_path) as f:
        out = f.read()
    found = _SUMMARY.findall(out)
    summary = found[-1][0] if found else ("install failed" if t_suite == 0.0 else "no pytest summary (see the log)")
    reruns = "rerun" in summary.lower()
    return {"run": name, "commit": head, "command": command, "load": (f"{args.load_procs} procs x {args.duty:g} duty"
            if load else "none"), "returncode": rc, "summary": summary, "reruns": reruns,
            "install_s": round(t_install, 1), "suite_s": round(t_suite, 1), "log": log_path,
            "ok": rc == 0 and not reruns and bool(found)}


def _run_suite(test, where, log, timeout):
    try:
        return subprocess.run(test.strip(), shell=True, cwd=where, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        log.write(f"\n[fresh_clone_check] the suite ran past --timeout={timeout} s and was stopped\n")
        return 124


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=ROOT, help="repository to clone. Default: this checkout")
    parser.add_argument("--commit", default="HEAD", help="commit to check out. Default: HEAD")
    parser.add_argument("--root", default=os.path.join("/tmp", "kpipe-fresh-clone"), help="folder for the clones and logs")
    parser.add_argument("--runs", default="idle,loaded", help="which runs, comma-separated. Default: idle,loaded")
    parser.add_argument("--load-procs", type=int, default=len(os.sched_getaffinity(0)),
                        help="background processes in the loaded run. Default: one per usable CPU")
    parser.add_argument("--duty", type=float, default=0.5, help="share of each 100 ms a load process spins. Default: 0.5")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per install and per suite. Default: 3600")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or set(runs) - {"idle", "loaded"}:
        parser.error(f"--runs takes idle and/or loaded. Received: --runs {args.runs!r}")
    if not 0 < args.duty <= 1 or args.load_procs < 1:
        parser.error(f"--duty must be in (0, 1] and --load-procs >= 1. Received: --duty {args.duty} --load-procs {args.load_procs}")
    os.makedirs(args.root, exist_ok=True)
    command = readme_command(os.path.join(ROOT, "README.md"))
    print(f"README's test command: {command}", flush=True)
    rows = []
    for name in runs:
        print(f"[{name}] cloning {args.repo} at {args.commit} into {os.path.join(args.root, name)} ...", flush=True)
        row = one_run(name, args, command, load=name == "loaded")
        rows.append(row)
        print(f"[{name}] {'OK' if row['ok'] else 'FAILED'}: {row['summary']} (exit {row['returncode']}; "
              f"install {row['install_s']} s, suite {row['suite_s']} s; load: {row['load']}; log {row['log']})", flush=True)
    print("\n| run | commit | load | result | pytest summary | install s | suite s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['commit']} | {r['load']} | {'passed' if r['ok'] else 'FAILED'} | {r['summary']} | "
              f"{r['install_s']} | {r['suite_s']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
