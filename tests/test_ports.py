"""What TensorFlow's servers listen on, as `ss -ltn` would show it, and what kpipe says about it.

TensorFlow's gRPC server (started by `MultiWorkerMirroredStrategy` from `TF_CONFIG`) cannot
bind a chosen address: it listens on every interface (NOTE [ Open ports ] in
`kpipe/distribute/_launcher.py`). These tests assert that fact on a real 2-worker
`kpipe launch` job on loopback -- so that if a TensorFlow release starts honouring the host,
this test fails and kpipe can bind loopback instead of warning -- and that the launcher prints
its one-line warning. (The tf.data service servers are checked in
`test_distribute_data_service.py`.)
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kpipe.distribute._ports import outside_interfaces, wildcard_listeners

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "tests", "programs", "mw_listen.py")
_START_TIMEOUT_S = 150

pytestmark = [pytest.mark.multiworker, pytest.mark.slow, pytest.mark.timeout(300)]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return env


def _wait_for(predicate, what, proc, log):
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"launcher exited ({proc.returncode}) before {what}: {log()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {_START_TIMEOUT_S} s: {log()[-3000:]}")


def _listening(pid):
    """(ip, port) of every listening TCP socket of `pid`'s process tree."""
    found = set()
    for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        try:
            for c in proc.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


@pytest.mark.skipif(not outside_interfaces(), reason="no network interface besides loopback: no warning")
def test_multiworker_job_on_loopback_listens_on_every_interface_and_says_so(tmp_path, no_leaks):
    stop = tmp_path / "stop"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with open(out, "w") as out_f, open(err, "w") as err_f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2", "--timeout", "200", "--",
             sys.executable, PROGRAM, str(stop)],
            env=_env(), stdout=out_f, stderr=err_f, start_new_session=True)
    log = lambda: out.read_text() + err.read_text()  # noqa: E731
    try:
        def ready_lines():
            lines = [line.split() for line in out.read_text().splitlines() if " ready " in line]
            return lines if len(lines) == 2 else None

        ready = _wait_for(ready_lines, "two ready workers", launcher, log)
        ports = sorted(int(fields[-1].rsplit(":", 1)[1]) for fields in ready)
        assert all(fields[-1].startswith("127.0.0.1:") for fields in ready)  # TF_CONFIG says loopback

        listening = _listening(launcher.pid)
        for port in ports:
            ips = {ip for ip, p in listening if p == port}
            # TF_CONFIG names 127.0.0.1, yet the server is bound to the wildcard (`*:port` in ss).
            assert ips and ips <= {"0.0.0.0", "::"}, (port, listening)
        assert {p for _, _, p in wildcard_listeners([launcher.pid])} >= set(ports)

        line = _wait_for(lambda: next((l for l in err.read_text().splitlines() if "warning" in l), None),
                         "open-ports warning", launcher, log)
        assert line.startswith(f"kpipe launch: warning: workers 0, 1 listen on *:{ports[0]}, *:{ports[1]}, "
                               "on every network interface ("), line
        assert "not only on 127.0.0.1" in line, line
        # TensorFlow's start-up lines were left out of the workers' output.
        assert "absl::InitializeLog" not in out.read_text() and "cpu_feature_guard" not in out.read_text()

        stop.touch()
        assert launcher.wait(timeout=90) == 0, log()[-3000:]
        assert len([l for l in err.read_text().splitlines() if "warning" in l]) == 1
    finally:
        if launcher.poll() is None:  # the launcher stops its workers on SIGTERM
            workers = psutil.Process(launcher.pid).children(recursive=True)
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for proc in workers:
                    proc.kill()
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
