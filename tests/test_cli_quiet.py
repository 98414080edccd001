"""TensorFlow's start-up log stays out of the `kpipe` commands' output unless `--verbose`.

The end-to-end tests run the CLI in a child process with `TF_CPP_MIN_LOG_LEVEL` removed from
its environment (CI exports it), first learning from a bare `import tensorflow` which start-up
lines this machine prints at all.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from kpipe._cli import _quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lines TensorFlow 2.21 printed on this project's CPU-only CI machine.
ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
CUDART = "I0000 00:00:1796085493.152226    5323 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used."
CPU_GUARD = ("I0000 00:00:1796085493.333858    5323 cpu_feature_guard.cc:227] This TensorFlow binary is optimized "
             "to use available CPU instructions in performance-critical operations.")
CPU_GUARD_2 = "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags."
CUINIT = ("E0000 00:00:1796085496.325173    5323 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)")
ONEDNN = ("I0000 00:00:1721112222.123456    4242 port.cc:153] oneDNN custom operations are on. You may see slightly "
          "different numerical results due to floating-point round-off errors from different computation orders.")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def test_known_start_up_lines_are_noise_and_other_lines_are_not():
    for line in (ABSL_BANNER, CUDART, CPU_GUARD, CPU_GUARD_2, CUINIT, ONEDNN):
        assert _quiet.is_startup_noise(line + "\n", gpu_host=False), line
    for line in (
        "kpipe launch: warning: workers 0, 1 listen on *:2222, *:2223, on every network interface",
        "W0000 00:00:1796085496.325173    5323 loader.py:12] Your input ran out of data",
        "E0000 00:00:1796085496.325173    5323 cuda_platform.cc:52] something else went wrong",
        "UserWarning: `class_weight` ignores classes missing from the labels",
        "Epoch 1/3",
        "",
    ):
        assert not _quiet.is_startup_noise(line, gpu_host=False), line


def test_on_a_gpu_host_cuda_failures_are_kept():
    """There, "could not find cuda drivers" and cuInit errors explain why the GPU is unused."""
    assert not _quiet.is_startup_noise(CUDART, gpu_host=True)
    assert not _quiet.is_startup_noise(CUINIT, gpu_host=True)
    assert _quiet.is_startup_noise(ABSL_BANNER, gpu_host=True) and _quiet.is_startup_noise(CPU_GUARD, gpu_host=True)


def test_filtered_stderr_drops_noise_written_to_fd_2_and_passes_the_rest_in_order():
    code = textwrap.dedent(f"""
        import os, sys
        from kpipe._cli import _quiet
        with _quiet.filtered_stderr(_quiet.startup_noise_filter()):
            os.write(2, b"first\\n" + {ABSL_BANNER!r}.encode() + b"\\n")
            print("second (python)", file=sys.stderr)
            os.write(2, {CPU_GUARD!r}.encode() + b"\\n" + b"third, no newline")
        print("after", file=sys.stderr)
        """)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # A partial last line is passed on too (and joins the next write, as it would unfiltered).
    assert proc.stderr.splitlines() == ["first", "second (python)", "third, no newlineafter"]


def _learn_startup_lines():
    """The start-up lines a bare TensorFlow import prints here (those kpipe knows)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import tensorflow"],
        env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if _quiet.is_startup_noise(line)]


def _kinds(lines):
    """A line's identity without its timestamp and thread id."""
    return {line.split("] ", 1)[0].rsplit(" ", 1)[-1] if "] " in line else line
            for line in lines if _quiet.is_startup_noise(line)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_hides_tensorflow_start_up_lines_unless_verbose():
    baseline = _learn_startup_lines()
    if not baseline:
        pytest.skip("TensorFlow prints none of the known start-up lines on this machine")
    command = [sys.executable, "-m", "kpipe.cli", "data-service", "dispatcher", "--duration", "0.1"]

    quiet = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "dispatcher ready at 127.0.0.1:" in quiet.stdout
    assert [line for line in quiet.stderr.splitlines() if _quiet.is_startup_noise(line)] == []
    assert not any(re.match(r"I\d{4} ", line) for line in quiet.stderr.splitlines())  # INFO: level 1
    # kpipe's own warning is not hidden with them.
    assert "kpipe data-service: warning: tf.data service dispatcher listens on *:" in quiet.stderr

    verbose = subprocess.run(command + ["--verbose"], env=_env(), capture_output=True, text=True, timeout=120)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert _kinds(baseline) <= _kinds(verbose.stderr.splitlines())
    assert "kpipe data-service: warning:" in verbose.stderr
    # `kpipe --verbose COMMAND` is the same switch.
    assert "--verbose" in subprocess.run([sys.executable, "-m", "kpipe.cli", "--help"], env=_env(),
                                         capture_output=True, text=True, timeout=60).stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_launch_drops_start_up_lines_from_worker_output_unless_verbose():
    """The workers' own TensorFlow is not imported here: they print the lines themselves."""
    program = textwrap.dedent(f"""
        import os, sys
        print({ABSL_BANNER!r}, file=sys.stderr)
        print({CPU_GUARD!r}, file=sys.stderr)
        print("level", os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
        """)
    command = [sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2", "--", sys.executable, "-c", program]
    quiet = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert sorted(quiet.stdout.splitlines()) == ["[worker 0] level 1", "[worker 1] level 1"]
    verbose = subprocess.run(command[:3] + ["--verbose"] + command[3:], env=_env(), capture_output=True,
                             text=True, timeout=60)
    assert verbose.returncode == 0, verbose.stderr
    lines = verbose.stdout.splitlines()
    assert lines.count(f"[worker 0] {ABSL_BANNER}") == 1 and f"[worker 1] {CPU_GUARD}" in lines
    assert "[worker 0] level None" in lines  # the environment is left as the user set it
    user_set = subprocess.run(command, env=_env(TF_CPP_MIN_LOG_LEVEL="0"), capture_output=True, text=True, timeout=60)
    assert "[worker 0] level 0" in user_set.stdout.splitlines()
