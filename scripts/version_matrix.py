#!/usr/bin/env python3
"""Runs the README's test command against TensorFlow/Keras pairs, one venv per pair.

For each pair it does what a user of that stack would do, in a venv of its own:

    python3 -m venv VENV
    VENV/bin/pip install tensorflow==TF keras==KERAS -e ".[test]"
    VENV/bin/python -m pytest -p no:cacheprovider [PYTEST ARGS]

from the repository root, and prints one table row per pair: the versions pip really
installed, how long the venv + install and the suite took, and pytest's counts. A pair is
`TF:KERAS` (`2.17.1:3.5.0`), or `TF` alone to take the Keras pip resolves for it (the
newest one TensorFlow's requirement allows). Without `--pair`, the pairs of the README's
"Tested with" table are run (`--list` shows them).

    python scripts/version_matrix.py --list
    python scripts/version_matrix.py --oldest                            # oldest declared pair
    python scripts/version_matrix.py --pair 2.19.1 -- -m "not slow"     # pytest args after --
    python scripts/version_matrix.py --reuse --json matrix.json         # keep venvs between runs

Venvs live under `--root` (default `$KPIPE_MATRIX_DIR`, else `~/.cache/kpipe/matrix`), one
folder per pair with `install.log` and `pytest.log` beside it; pip's own cache makes a
second install of the same versions fast. Exit status: 0 when every pair's suite passed.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The README's "Tested with" table: (tensorflow, keras, pytest -m expression or "" for the
# whole suite). Keep the two in step; setup.cfg's floors are the first row's versions. The
# other TensorFlow releases also run with the Keras pip resolves for them (the newest),
# without the slow, multi-worker and notebook tests (the whole suite is ~10 min a pair).
_QUICK = "not slow and not multiworker and not notebook"
MATRIX = (
    ("2.16.2", "3.5.0", ""),
    ("2.16.2", "3.15.1", _QUICK),
    ("2.17.1", "3.5.0", ""),
    ("2.18.1", "3.15.1", _QUICK),
    ("2.19.1", "3.15.1", _QUICK),
    ("2.20.0", "3.15.1", _QUICK),
    ("2.21.0", "3.15.1", ""),
)

_DEFAULT_TIMEOUT_S = 3600.0
_SUMMARY_RE = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")
_DURATION_RE = re.compile(r" in ([0-9.]+)s")


def parse_pair(text):
    """`"2.17.1:3.5.0"` -> `("2.17.1", "3.5.0")`; `"2.19.1"` -> `("2.19.1", None)`.

    Raises:
        ValueError: if a version is empty or not made of dotted numbers.
    """
    tf_version, _, keras_version = text.partition(":")
    versions = [tf_version] + ([keras_version] if keras_version else [])
    if not tf_version or any(not re.fullmatch(r"\d+(\.\d+)*(\.\*)?", v) for v in versions) or text.endswith(":"):
        raise ValueError(
            f"A pair is TF[:KERAS] with dotted version numbers. Received: {text!r}. "
            "Example: 2.17.1:3.5.0, or 2.19.1 to let pip choose Keras."
        )
    return tf_version, keras_version or None


def parse_summary(text):
    """Counts from pytest's closing line: {"passed": 3, "failed": 1, ..., "seconds": 12.5}.

    Missing counts are 0; `"seconds"` is None when no closing line was found.
    """
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0, "xpassed": 0, "deselected": 0}
    lines = [line for line in text.splitlines() if _DURATION_RE.search(line) and _SUMMARY_RE.search(line)]
    if not lines:
        return dict(counts, seconds=None)
    last = lines[-1]
    for number, word in _SUMMARY_RE.findall(last):
        if word.startswith("warning"):
            continue
        counts["errors" if word.startswith("error") else word] = int(number)
    return dict(counts, seconds=float(_DURATION_RE.search(last).group(1)))


def venv_name(tf_version, keras_version):
    return f"tf{tf_version}-keras{keras_version or 'resolved'}".replace("*", "x")


def install_command(venv, tf_version, keras_version):
    requirements = [f"tensorflow=={tf_version}"] + ([f"keras=={keras_version}"] if keras_version else [])
    return [_venv_python(venv), "-m", "pip", "install", "--disable-pip-version-check", *requirements, "-e", ".[test]"]


def pytest_command(venv, pytest_args):
    return [_venv_python(venv), "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]


def installed_versions(venv):
    """(tensorflow, keras) versions installed in `venv`, or None if it cannot tell."""
    code = "import importlib.metadata as m; print(m.version('tensorflow'), m.version('keras'))"
    try:
        out = subprocess.run([_venv_python(venv), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    return tuple(parts) if out.returncode == 0 and len(parts) == 2 else None


def run_pair(tf_version, keras_version, *, root, python, pytest_args, reuse, timeout_s, echo=print):
    """Makes (or reuses) the pair's venv, runs the suite there and returns a result row."""
    venv = os.path.join(root, venv_name(tf_version, keras_version))
    row = {"tensorflow": tf_version, "keras": keras_version, "venv": venv, "pytest_args": list(pytest_args)}
    t0 = time.monotonic()
    have = installed_versions(venv) if reuse and os.path.isdir(venv) else None
    wanted = have is not None and _matches(have[0], tf_version) and (keras_version is None or _matches(have[1], keras_version))
    if not wanted:
        shutil.rmtree(venv, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, venv_name(tf_version, keras_version) + ".install.log"), "w") as log:
            steps = ([python, "-m", "venv", venv], install_command(venv, tf_version, keras_version))
            for command in steps:
                echo("$ " + shlex.join(command))
                log.write("$ " + shlex.join(command) + "\n")
                log.flush()
                rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
                if rc != 0:
                    return dict(row, status="install failed", install_s=time.monotonic() - t0, log=log.name)
        have = installed_versions(venv)
    row["installed"] = {"tensorflow": have[0], "keras": have[1]} if have else None
    row["install_s"] = round(time.monotonic() - t0, 1)
    command = pytest_command(venv, pytest_args)
    echo("$ " + shlex.join(command))
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KPIPE_SMALL", "1")
    env.pop("PYTHONPATH", None)  # the venv's editable install, not another checkout
    log_path = venv + ".pytest.log"
    t1 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    row["suite_s"] = round(time.monotonic() - t1, 1)
    with open(log_path) as log:
        row.update(parse_summary(log.read()))
    row["returncode"] = rc
    row["status"] = "passed" if rc == 0 else ("timed out" if rc is None else "failed")
    row["log"] = log_path
    return row


def failure_summary(row, max_lines=60):
    """pytest's short summary of a failed pair (or the install log's tail), for CI logs."""
    path = row.get("log")
    if not path or not os.path.exists(path):
        return f"{row['tensorflow']}:{row['keras']}: {row['status']}"
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    marker = [i for i, line in enumerate(lines) if "short test summary info" in line]
    shown = lines[marker[-1]:] if marker else lines
    return "\n".join([f"--- {row['status']}: {path}"] + shown[-max_lines:])


def format_table(rows):
    head = ("tensorflow", "keras", "status", "passed", "failed", "errors", "skipped", "xfailed", "install s", "suite s", "pytest args")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        installed = r.get("installed") or {}
        cells = (
            installed.get("tensorflow", r["tensorflow"]),
            installed.get("keras", r["keras"] or "?"),
            r["status"],
            *(str(r.get(k, "")) for k in ("passed", "failed", "errors", "skipped", "xfailed")),
            str(r.get("install_s", "")),
            str(r.get("suite_s", "")),
            shlex.join(r["pytest_args"]) or "(none)",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    """Runs the matrix; returns 0 when every pair passed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        prog="version_matrix.py", description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to pytest (e.g. -- -m 'not slow').")
    parser.add_argument("--pair", action="append", default=[], metavar="TF[:KERAS]",
                        help="a TensorFlow[:Keras] pair; repeatable. Defaults to the README's table.")
    parser.add_argument("--oldest", action="store_true",
                        help="only the table's oldest pair (setup.cfg's floors), as CI runs it")
    parser.add_argument("--root", default=os.environ.get("KPIPE_MATRIX_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kpipe", "matrix"), help="folder for the venvs and logs")
    parser.add_argument("--python", default=sys.executable, help="interpreter the venvs are made from")
    parser.add_argument("--reuse", action="store_true", help="keep a venv that already has the pair installed")
    parser.add_argument("--timeout", type=float, default=_DEFAULT_TIMEOUT_S, help="seconds per install and per suite")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--list", action="store_true", help="print the default pairs and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    try:
        pairs = [parse_pair(p) + (None,) for p in args.pair] or list(MATRIX)
        if args.oldest:
            pairs = [MATRIX[0]]
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        for tf_version, keras_version, markers in pairs:
            print(f"{tf_version}:{keras_version or '(pip resolves)'}" + (f" -m {markers!r}" if markers else ""))
        return 0
    if args.dry_run:
        for tf_version, keras_version, markers in pairs:
            venv = os.path.join(args.root, venv_name(tf_version, keras_version))
            for command in ([args.python, "-m", "venv", venv], install_command(venv, tf_version, keras_version),
                            pytest_command(venv, _args_for(markers, pytest_args))):
                print(shlex.join(command))
        return 0
    rows = []
    for tf_version, keras_version, markers in pairs:
        row = run_pair(tf_version, keras_version, root=args.root, python=args.python,
                       pytest_args=_args_for(markers, pytest_args),
                       reuse=args.reuse, timeout_s=args.timeout)
        rows.append(row)
        if row["status"] != "passed":
            print(failure_summary(row), flush=True)
        print(format_table([row]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0 if rows and all(r["status"] == "passed" for r in rows) else 1


def _args_for(markers, pytest_args):
    """pytest arguments for a pair: those given after `--`, else the table's markers."""
    return list(pytest_args) if pytest_args or not markers else ["-m", markers]


def _venv_python(venv):
    return os.path.join(venv, "bin", "python")


def _matches(installed, wanted):
    return installed == wanted or (wanted.endswith(".*") and installed.startswith(wanted[:-1]))


if __name__ == "__main__":
    sys.exit(main())
