"""Keeping TensorFlow's start-up log out of the way of the `kpipe` commands' own output.

Importing TensorFlow and listing its devices writes lines such as::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1796085493.152226  5323 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
    I0000 00:00:1796085493.333858  5323 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use ...
    E0000 00:00:1796085496.325173  5323 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: ...

`TF_CPP_MIN_LOG_LEVEL` hides only some of them: the absl lines written before
`absl::InitializeLog()` ignore it, and the cuInit failure is an error line. So, unless
`--verbose` is given, the commands that run TensorFlow in-process set
`TF_CPP_MIN_LOG_LEVEL` (when the user has not) and import TensorFlow with file descriptor 2
routed through a filter that drops exactly the known start-up lines (`is_startup_noise`)
and passes everything else through, in order, as it arrives. `kpipe launch` applies the
same filter to its workers' output. The CUDA lines are dropped only on hosts without an
NVIDIA device, where they say nothing; on a GPU host they explain why a GPU is unused.
kpipe's own warnings are never filtered.
"""

import contextlib
import functools
import glob
import os
import re
import sys
import threading
import warnings
from typing import Callable, Optional

_JOIN_TIMEOUT_S = 5.0

# `I0000 00:00:1796085493.152226    5323 cudart_stub.cc:31] message` (absl and TF format).
_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ (?P<source>[\w.]+):\d+\] (?P<message>.*)$")
# (source file, start of the message): start-up notices on every machine.
_NOTICES = (
    ("cpu_feature_guard.cc", "This TensorFlow binary is optimized to use available CPU instructions"),
    ("port.cc", "oneDNN custom operations are on"),
    ("cuda_fft.cc", "Unable to register cuFFT factory"),
    ("cuda_dnn.cc", "Unable to register cuDNN factory"),
    ("cuda_blas.cc", "Unable to register cuBLAS factory"),
    ("computation_placer.cc", "computation placer already registered"),
)
# Said only when CUDA is missing: noise on a host without an NVIDIA device.
_NO_GPU_NOTICES = (
    ("cudart_stub.cc", "Could not find cuda drivers on your machine"),
    ("cuda_platform.cc", "failed call to cuInit"),
    ("cuda_executor.cc", "failed call to cuInit"),
)
_PLAIN_LINES = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"),
    re.compile(r"^To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.$"),
)


def has_nvidia_device() -> bool:
    """Whether this host has an NVIDIA GPU device node or driver entry."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"))


def is_startup_noise(line: str, *, gpu_host: Optional[bool] = None) -> bool:
    """Whether `line` is one of TensorFlow's known start-up log lines.

    Args:
        line: One line of output, with or without its newline.
        gpu_host: Whether the host has an NVIDIA device (then CUDA failures are kept).
            Defaults to `None` (look at /dev and /proc).

    Returns:
        True for the lines `kpipe` hides unless `--verbose` is given.

    Example:

    >>> is_startup_noise("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
    True
    >>> is_startup_noise("kpipe demo: error: --epochs must be >= 1")
    False
    """
    line = line.rstrip("\r\n")
    if any(p.match(line) for p in _PLAIN_LINES):
        return True
    m = _LOG_LINE.match(line)
    if not m:
        return False
    source, message = m.group("source"), m.group("message")
    if any(source == s and message.startswith(t) for s, t in _NOTICES):
        return True
    if gpu_host is None:
        gpu_host = has_nvidia_device()
    return not gpu_host and any(source == s and message.startswith(t) for s, t in _NO_GPU_NOTICES)


def startup_noise_filter() -> Callable[[str], bool]:
    """`is_startup_noise` with this host's GPU presence looked up once."""
    return functools.partial(is_startup_noise, gpu_host=has_nvidia_device())


@contextlib.contextmanager
def filtered_stderr(drop: Callable[[str], bool]):
    """Routes file descriptor 2 through `drop` (lines it returns True for are discarded).

    Lines are forwarded to the real stderr by a thread as they arrive, so nothing waits
    for the block to end; a process that aborts inside the block can lose the last lines
    not yet forwarded (`--verbose` runs without the filter). Does nothing when fd 2 cannot
    be duplicated.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    read_fd, write_fd = os.pipe()

    def forward():
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                if not drop(raw.decode("utf-8", errors="replace")):
                    view = memoryview(raw)
                    while view:
                        view = view[os.write(saved, view):]

    thread = threading.Thread(target=forward, name="kpipe-stderr-filter", daemon=True)
    thread.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)  # closes the pipe's last write end: the thread sees EOF
        thread.join(_JOIN_TIMEOUT_S)
        if not thread.is_alive():
            os.close(saved)


def quiet_env(level: str = "1") -> dict:
    """Environment for child processes: `TF_CPP_MIN_LOG_LEVEL=level` unless the user set it.

    Level 1 hides TensorFlow's INFO lines and keeps its warnings and errors.
    """
    return {} if "TF_CPP_MIN_LOG_LEVEL" in os.environ else {"TF_CPP_MIN_LOG_LEVEL": level}


def quiet_tensorflow(verbose: bool, level: str = "1") -> None:
    """Imports TensorFlow with its start-up log hidden, unless `verbose`.

    Sets `TF_CPP_MIN_LOG_LEVEL` to `level` when the user has not set it, then imports
    TensorFlow and lists its physical devices (which initialises CUDA) behind
    `filtered_stderr(is_startup_noise)`. With `verbose`, does nothing: TensorFlow logs
    as it normally would. Must run before TensorFlow is imported to have any effect.
    """
    if verbose:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", level)
    if "tensorflow" in sys.modules:
        return
    with filtered_stderr(startup_noise_filter()):
        import tensorflow as tf

        tf.config.list_physical_devices()


@contextlib.contextmanager
def kpipe_warnings_as_lines(prog: str):
    """Shows kpipe's `OpenPortsWarning` as one `"{prog}: warning: ..."` line on stderr.

    Other warnings keep Python's usual format.
    """
    from kpipe.distribute._ports import OpenPortsWarning

    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, OpenPortsWarning):
            print(f"{prog}: warning: {message}", file=sys.stderr if file is None else file, flush=True)
        else:
            original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", OpenPortsWarning)
        warnings.showwarning = show
        yield
