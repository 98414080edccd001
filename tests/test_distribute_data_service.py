"""tf.data service on loopback: `kpipe data-service dispatcher` + 2 `kpipe data-service worker`
processes run a `kpipe.data.pipeline` that a third process trains on with `fit()`."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kpipe.distribute._ports import wildcard_listeners

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "programs")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
_START_TIMEOUT_S = 90

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]


def _start(tmp_path, name, *args):
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kpipe.cli", "data-service", *args], env=ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def _wait_for_line(tmp_path, name, proc, marker):
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in (tmp_path / f"{name}.log").read_text().splitlines():
            if marker in line:
                return line
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{name} did not print {marker!r} in {_START_TIMEOUT_S} s")


@pytest.mark.timeout(240)
def test_dispatcher_and_two_workers_feed_fit(tmp_path, no_leaks):
    servers = []
    try:
        dispatcher = _start(tmp_path, "dispatcher", "dispatcher")
        servers.append(dispatcher)
        line = _wait_for_line(tmp_path, "dispatcher", dispatcher, "dispatcher ready at ")
        address = line.rsplit(" ", 1)[1]
        assert address.startswith("127.0.0.1:")
        for i in range(2):
            servers.append(_start(tmp_path, f"worker{i}", "worker", "--dispatcher", address))
        for i in range(2):
            _wait_for_line(tmp_path, f"worker{i}", servers[i + 1], "worker ready at 127.0.0.1:")
        # TensorFlow's servers cannot bind 127.0.0.1 alone: each listens on every interface
        # (`*:port` in ss), and each process says so in one warning line naming its port.
        for name, proc in [("dispatcher", dispatcher), ("worker0", servers[1]), ("worker1", servers[2])]:
            (_, ip, port), = wildcard_listeners([proc.pid])
            assert ip in ("0.0.0.0", "::")
            warning = _wait_for_line(tmp_path, name, proc, "kpipe data-service: warning:")
            assert f"listens on *:{port}, on every network interface (" in warning
        assert int(address.rsplit(":", 1)[1]) == wildcard_listeners([dispatcher.pid])[0][2]

        out = tmp_path / "fit.json"
        trainer = subprocess.run([sys.executable, os.path.join(PROGRAMS, "ds_fit.py"), address,
                                  str(out)], env=ENV, capture_output=True, text=True, timeout=150)
        assert trainer.returncode == 0, trainer.stdout[-3000:] + trainer.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["ids"] == list(range(64))  # one epoch: every sample exactly once
        assert len(result["loss"]) == 2 and all(loss > 0 for loss in result["loss"])

        for proc in servers:  # SIGTERM is a clean stop
            proc.send_signal(signal.SIGTERM)
        for proc in servers:
            assert proc.wait(timeout=60) == 0  # a deadline that only catches a server that does not stop
    finally:
        for proc in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_cli_rejects_bad_addresses_before_tensorflow_starts():
    # (run as `python -m kpipe.cli`, with an exit hook telling whether TensorFlow was imported)
    code = ("import atexit, sys; atexit.register(lambda: print('tensorflow imported:', 'tensorflow' in sys.modules)); "
            "sys.argv[0] = 'kpipe'; from kpipe.cli import main; sys.exit(main(sys.argv[1:]))")
    for args, message in ((["worker", "--dispatcher", "nohost"],
                           "Expected a tf.data service address like 127.0.0.1:5050. Received: 'nohost'"),
                          (["dispatcher", "--port", "70000"], "`port` must be an integer in [0, 65535]. Received: port=70000")):
        proc = subprocess.run([sys.executable, "-c", code, "data-service", *args], env=ENV, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
        assert "tensorflow imported: False" in proc.stdout
