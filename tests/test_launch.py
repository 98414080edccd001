"""`kpipe launch` / `kpipe.distribute.launch`: TF_CONFIG per worker, output prefixes, failure
propagation, signal forwarding, timeouts and no process left behind. No TensorFlow here."""

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kpipe.distribute import _launcher, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _py(code):
    return [sys.executable, "-c", textwrap.dedent(code)]


def _wait_for(predicate, timeout_s=60.0):  # a deadline that only catches a hang
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_each_worker_gets_its_tf_config_and_prefixed_output(no_leaks):
    out = io.StringIO()
    result = launch(_py("""
        import os
        print(os.environ["TF_CONFIG"])
        print("second line")
        """), workers=3, output=out)
    assert result.returncode == 0 and result.returncodes == (0, 0, 0)
    lines = out.getvalue().splitlines()
    configs = {}
    for line in lines:
        prefix, _, rest = line.partition("] ")
        worker = int(prefix.removeprefix("[worker "))
        if rest.startswith("{"):
            configs[worker] = json.loads(rest)
    assert sorted(configs) == [0, 1, 2]
    clusters = {json.dumps(c["cluster"]) for c in configs.values()}
    assert len(clusters) == 1  # all workers agree on the cluster
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert [configs[i]["task"] for i in range(3)] == [{"type": "worker", "index": i} for i in range(3)]
    assert sum(line.endswith("] second line") for line in lines) == 3


def test_explicit_port_numbers_workers_consecutively(no_leaks):
    port = _launcher.free_ports(1)[0]
    out = io.StringIO()
    result = launch(_py("import os; print(os.environ['TF_CONFIG'])"), workers=2, port=port, output=out)
    assert result.returncode == 0
    config = json.loads(out.getvalue().splitlines()[0].partition("] ")[2])
    assert config["cluster"]["worker"] == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]


def test_failing_worker_stops_the_others_and_sets_the_exit_code(no_leaks):
    result = launch(_py("""
        import os, sys, time
        if os.environ["KPIPE_LAUNCH_WORKER"] == "1":
            sys.exit(3)
        time.sleep(120)
        """), workers=2, output=io.StringIO(), grace_s=5)
    assert result.returncode == 3
    assert result.failed_worker == 1
    assert result.returncodes == (-signal.SIGTERM, 3)


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, no_leaks):
    ready = tmp_path / "ignoring"
    result = launch(_py(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["KPIPE_LAUNCH_WORKER"] == "0":
            deadline = time.monotonic() + 60  # fail only once worker 1 ignores SIGTERM
            while not os.path.exists({str(ready)!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(5)
        open({str(ready)!r}, "w").close()
        time.sleep(120)
        """), workers=2, output=io.StringIO(), grace_s=0.5)
    assert result.returncode == 5 and result.failed_worker == 0
    assert result.returncodes[1] == -signal.SIGKILL


def test_signal_death_reads_as_128_plus_signal(no_leaks):
    result = launch(_py("""
        import os, signal
        if os.environ["KPIPE_LAUNCH_WORKER"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        """), workers=2, output=io.StringIO())
    assert result.returncode == 128 + signal.SIGKILL
    assert result.failed_worker == 1


def test_no_grandchild_outlives_the_job(tmp_path, no_leaks):
    # Each worker starts a long-lived child (as a loader would) and exits: the launcher
    # kills the whole process group.
    result = launch(_py(f"""
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(os.path.join({str(tmp_path)!r}, os.environ["KPIPE_LAUNCH_WORKER"]), "w") as f:
            f.write(str(child.pid))
        """), workers=2, output=io.StringIO())
    assert result.returncode == 0
    pids = [int((tmp_path / str(i)).read_text()) for i in range(2)]
    assert _wait_for(lambda: all(_gone(pid) for pid in pids)), pids


def test_timeout_stops_every_worker(no_leaks):
    result = launch(_py("import time; time.sleep(120)"), workers=2, output=io.StringIO(),
                    timeout_s=1.0, grace_s=2)
    assert result.timed_out and result.returncode == 124
    assert result.returncodes == (-signal.SIGTERM, -signal.SIGTERM)
    assert result.failed_worker is None


def test_failure_tail_is_kept_for_error_messages(no_leaks):
    result = launch(_py("""
        import os, sys
        if os.environ["KPIPE_LAUNCH_WORKER"] == "1":
            raise RuntimeError("boom in worker one")
        """), workers=2, output=io.StringIO())
    assert result.returncode == 1 and result.failed_worker == 1
    assert "RuntimeError: boom in worker one" in result.tails[1]


@pytest.mark.parametrize("kwargs, match", [
    ({"workers": 0}, "`workers` must be >= 1. Received: workers=0"),
    ({"workers": 2, "port": 65535}, "`port` must leave room for 2 ports"),
])
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(_py("pass"), output=io.StringIO(), **kwargs)
    with pytest.raises(ValueError, match="`command` is empty"):
        launch([], output=io.StringIO())


def test_missing_program_raises_and_starts_nothing(no_leaks):
    with pytest.raises(OSError):
        launch(["/nonexistent/kpipe-test-program"], workers=2, output=io.StringIO())


def test_address_helpers():
    ports = _launcher.free_ports(3)
    assert len(set(ports)) == 3
    assert _launcher.parse_addresses(" a:1,b:2 ") == ["a:1", "b:2"]
    for bad in ("a", "a:x", "a:0", "a:1,a:1", ""):
        with pytest.raises(ValueError):
            _launcher.parse_addresses(bad)
    text = _launcher.format_tf_configs(["h0:10", "h1:11"])
    exports = [line for line in text.splitlines() if line.startswith("export ")]
    configs = [json.loads(line.split("=", 1)[1].strip("'")) for line in exports]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    assert configs[1]["cluster"] == {"worker": ["h0:10", "h1:11"]}


# -- the CLI, as a notebook or shell would run it ----------------------------------------

def _cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "kpipe.cli", *args], env=ENV, capture_output=True,
                          text=True, timeout=60, **kwargs)


def test_cli_runs_the_job_and_returns_the_first_failure(no_leaks):
    proc = _cli("launch", "--workers", "2", "--", *_py("""
        import os, sys
        print("hello from", os.environ["KPIPE_LAUNCH_WORKER"])
        sys.exit(4 if os.environ["KPIPE_LAUNCH_WORKER"] == "1" else 0)
        """))
    assert proc.returncode == 4, proc.stderr
    assert "[worker 0] hello from 0" in proc.stdout
    assert "[worker 1] hello from 1" in proc.stdout
    assert "worker 1 exited with status 4" in proc.stderr


def test_cli_print_tf_config():
    proc = _cli("launch", "--print-tf-config", "10.0.0.1:2222,10.0.0.2:2222")
    assert proc.returncode == 0
    exports = [line for line in proc.stdout.splitlines() if line.startswith("export TF_CONFIG=")]
    assert len(exports) == 2
    second = json.loads(exports[1].split("=", 1)[1].strip("'"))
    assert second == {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
                      "task": {"type": "worker", "index": 1}}
    bad = _cli("launch", "--print-tf-config", "10.0.0.1")
    assert bad.returncode == 2 and "'10.0.0.1' is not a host:port address" in bad.stderr


def test_cli_usage_errors():
    assert _cli("launch", "--workers", "2").returncode == 2
    proc = _cli("launch", "--workers", "0", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2 and "workers=0" in proc.stderr
    proc = _cli("launch", "--", "/nonexistent/kpipe-test-program")
    assert proc.returncode == 127


def test_cli_forwards_ctrl_c_to_every_worker(tmp_path, no_leaks):
    program = _py(f"""
        import os, signal, sys, time
        me = os.environ["KPIPE_LAUNCH_WORKER"]
        def on_sigint(signum, frame):
            open(os.path.join({str(tmp_path)!r}, "sigint-" + me), "w").close()
            sys.exit(0)
        signal.signal(signal.SIGINT, on_sigint)
        open(os.path.join({str(tmp_path)!r}, "ready-" + me), "w").close()
        time.sleep(120)
        """)
    launcher = subprocess.Popen([sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2", "--",
                                 *program], env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert _wait_for(lambda: all((tmp_path / f"ready-{i}").exists() for i in range(2)))
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 130
        assert all((tmp_path / f"sigint-{i}").exists() for i in range(2))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


# -- open ports: the launcher sees what its workers listen on ------------------------------

_LISTENER = """
    import json, os, socket, time
    config = json.loads(os.environ["TF_CONFIG"])
    me = config["task"]["index"]
    addresses = config["cluster"]["worker"]
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((BIND, int(addresses[me].rsplit(":", 1)[1])))
    server.listen()
    open(os.path.join(MARKS, f"listening-{os.getpid()}"), "w").close()
    print("port", server.getsockname()[1], flush=True)
    stop = os.path.join(MARKS, "stop")
    deadline = time.monotonic() + 60  # wait until every worker listens, as TF's servers do
    for address in addresses:
        host, port = address.rsplit(":", 1)
        while time.monotonic() < deadline and not os.path.exists(stop):  # (stopped: the others may be gone)
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
    HOLD
    """

# Hold the sockets until the test says the launcher has looked at them (it creates
# MARKS/stop); at most 60 s, so that a launcher that never looks fails the test, not hangs it.
_HOLD_UNTIL_STOP = """deadline = time.monotonic() + 60
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.02)"""


def _listener(bind, marks, hold_s=None):
    """A worker listening on `bind` that holds its socket until `marks/stop` exists, or
    for `hold_s` seconds where nothing can tell when the launcher looked."""
    os.makedirs(marks, exist_ok=True)
    hold = _HOLD_UNTIL_STOP if hold_s is None else f"time.sleep({hold_s!r})"
    return _py(_LISTENER.replace("HOLD", hold).replace("BIND", repr(bind)).replace("MARKS", repr(str(marks))))


def _stop_once_looked_at(monkeypatch, marks, workers):
    """Creates `marks/stop` once this process's launcher has looked at the listening
    sockets of each of `workers` listeners after it listened (an event, where a fixed
    hold could end before a slow machine's launcher looked)."""
    real = _launcher.wildcard_listeners
    seen = set()

    def spy(pids):
        pids = list(pids)
        listening = {int(p.name.rsplit("-", 1)[1]) for p in marks.glob("listening-*")}  # before the look
        found = real(pids)
        seen.update(p for p in pids if p in listening or any(pid == p for pid, _, _ in found))
        if len(seen) >= workers:
            (marks / "stop").touch()
        return found

    monkeypatch.setattr(_launcher, "wildcard_listeners", spy)


needs_outside_interface = pytest.mark.skipif(
    not _launcher.outside_interfaces(), reason="this host has no network interface besides loopback")


@needs_outside_interface
def test_workers_listening_on_every_interface_get_one_warning_naming_them(tmp_path, monkeypatch, no_leaks):
    _stop_once_looked_at(monkeypatch, tmp_path, workers=2)
    out = io.StringIO()
    with pytest.warns(_launcher.OpenPortsWarning) as record:
        result = launch(_listener("0.0.0.0", tmp_path), workers=2, output=out, timeout_s=90)
    assert result.returncode == 0, result.tails
    ports = sorted(int(line.split()[-1]) for line in out.getvalue().splitlines() if " port " in line)
    messages = [str(w.message) for w in record if w.category is _launcher.OpenPortsWarning]
    assert len(messages) == 1 and len(ports) == 2, (messages, out.getvalue())
    interfaces = ", ".join(_launcher.outside_interfaces())
    assert messages[0].startswith(f"workers 0, 1 listen on *:{ports[0]}, *:{ports[1]}, on every network "
                                  f"interface ({interfaces}), not only on 127.0.0.1")
    assert "run any graph sent to them without authentication" in messages[0]
    assert record[0].filename == __file__  # points at the launch() call


def test_workers_listening_on_loopback_only_get_no_warning(tmp_path, monkeypatch, no_leaks, recwarn):
    _stop_once_looked_at(monkeypatch, tmp_path / "loopback", workers=2)  # the launcher looked, and said nothing
    result = launch(_listener("127.0.0.1", tmp_path / "loopback"), workers=2, output=io.StringIO(), timeout_s=90)
    assert result.returncode == 0, result.tails
    assert (tmp_path / "loopback" / "stop").exists()
    assert not [w for w in recwarn if w.category is _launcher.OpenPortsWarning]
    # warn_open_ports=False: the launcher does not look at all, so there is nothing to wait for
    result = launch(_listener("0.0.0.0", tmp_path / "off", hold_s=1.5), workers=1, output=io.StringIO(), timeout_s=90,
                    warn_open_ports=False)
    assert result.returncode == 0 and not [w for w in recwarn if w.category is _launcher.OpenPortsWarning]


@needs_outside_interface
def test_cli_prints_the_open_ports_warning_as_one_line(tmp_path, no_leaks):
    launcher = subprocess.Popen([sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2", "--",
                                 *_listener("0.0.0.0", tmp_path)], env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = []
        for line in launcher.stderr:  # the workers hold their sockets until the warning is out
            seen.append(line)
            if "warning" in line:
                break
        (tmp_path / "stop").touch()
        _, rest = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    stderr = "".join(seen) + rest
    assert launcher.returncode == 0, stderr
    lines = [line for line in stderr.splitlines() if "warning" in line]
    assert len(lines) == 1 and lines[0].startswith("kpipe launch: warning: workers 0, 1 listen on *:"), stderr


def test_host_help_does_not_claim_to_choose_the_listening_address():
    text = _cli("launch", "--help").stdout
    assert "address the workers listen on" not in text
    assert "listen on every network interface" in " ".join(text.split())


def test_no_warning_inside_a_loopback_only_network_namespace(tmp_path, no_leaks):
    """`unshare --net` (or `docker run --network none`) fences a local job in: nothing to warn."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unprivileged network namespaces are not available here")
    launcher = " ".join(map(shlex.quote, [sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2",
                                          "--", *_listener("0.0.0.0", tmp_path, hold_s=3)]))
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
                           f"ip link set lo up 2>/dev/null; exec {launcher}"],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line.split()[1] for line in proc.stdout.splitlines()) == ["0]", "1]"]  # both listened
    assert "warning" not in proc.stderr, proc.stderr
    # why it is silent, whether or not its look fell inside the listeners' 3 s: in there, the
    # launcher sees no interface besides loopback (outside it, this host has one: above)
    inside = subprocess.run(["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c",
                             "from kpipe.distribute._ports import outside_interfaces; print(outside_interfaces())"],
                            env=ENV, capture_output=True, text=True, timeout=60)
    assert inside.returncode == 0 and inside.stdout.strip() == "[]", inside.stderr


def test_security_page_says_what_is_exposed_and_how_to_fence_it():
    with open(os.path.join(ROOT, "docs", "security.md")) as f:
        section = f.read()  # the Security page of the docs site (the README links it)
    for fact in ("every network interface", "no authentication", "grpc_server_lib.cc", "server_lib.cc",
                 "OpenPortsWarning", "iptables", "private subnet", "unshare --user --map-root-user --net"):
        assert fact in section, fact


def _leaves_early_then_fails(pid_file):
    # Worker 1 exits 0 mid-job; worker 0 fails once the launcher has reaped worker 1 (its
    # pid is gone), as a collective that lost its peer fails; any other worker waits.
    return _py(f"""
        import os, sys, time
        worker = os.environ["KPIPE_LAUNCH_WORKER"]
        if worker == "1":
            with open({str(pid_file)!r} + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
            sys.exit(0)
        if worker != "0":
            time.sleep(120)
        deadline = time.monotonic() + 60
        while not os.path.exists({str(pid_file)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = int(open({str(pid_file)!r}).read())
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)  # a zombie until the launcher's poll reaps it
            except ProcessLookupError:
                break
            time.sleep(0.01)
        sys.exit(1)
        """)


def test_a_worker_that_leaves_early_is_named_as_the_one_that_started_the_shutdown(tmp_path, no_leaks):
    out = io.StringIO()
    result = launch(_leaves_early_then_fails(tmp_path / "pid"), workers=3, output=out, grace_s=5)
    assert result.returncode == 1 and result.failed_worker == 0 and result.left_first == 1
    assert result.returncodes == (1, 0, -signal.SIGTERM)
    assert "[kpipe launch] worker 1 exited with status 0 while the others were still running; " \
           "then worker 0 exited with status 1." in out.getvalue()


def test_a_job_that_hangs_after_a_worker_left_names_it_at_the_timeout(no_leaks):
    # (Worker 1 exits at once; the timeout leaves it seconds to do so, even on a busy machine.)
    result = launch(_py("""
        import os, sys, time
        if os.environ["KPIPE_LAUNCH_WORKER"] == "1":
            sys.exit(0)
        time.sleep(120)  # a collective waiting for the peer that left
        """), workers=2, output=io.StringIO(), timeout_s=8, grace_s=2)
    assert result.timed_out and result.returncode == 124
    assert result.failed_worker is None and result.left_first == 1


def test_no_worker_is_named_as_leaving_first_when_the_job_succeeds_or_one_fails_first(no_leaks):
    ok = launch(_py("""
        import os, time
        time.sleep(0.5 * int(os.environ["KPIPE_LAUNCH_WORKER"]))
        """), workers=2, output=io.StringIO())
    assert ok.returncode == 0 and ok.left_first is None
    failed = launch(_py("""
        import os, sys, time
        if os.environ["KPIPE_LAUNCH_WORKER"] == "1":
            sys.exit(3)
        time.sleep(120)
        """), workers=2, output=io.StringIO(), grace_s=5)
    assert failed.returncode == 3 and failed.failed_worker == 1 and failed.left_first is None


def test_cli_names_the_worker_that_left_early(tmp_path, no_leaks):
    proc = _cli("launch", "--workers", "2", "--", *_leaves_early_then_fails(tmp_path / "pid"))
    assert proc.returncode == 1, proc.stderr
    assert "worker 1 exited first, with status 0, while the others were still running" in proc.stderr
    assert "then worker 0 exited with status 1; stopped the others." in proc.stderr
