"""The docstring examples that are not doctests run too, each where it is meant to run.

Most public names carry a `>>>` example that `--doctest-modules` runs. A few examples need a
setting a doctest cannot give: a multi-worker job (`kpipe launch`), parameter servers, a Ray
instance, a plotting file. Each of those runs here, as written in the docstring, in a fresh
interpreter after a short prelude that defines the names the example leaves to the reader
(`build_model`, `x`, `Images(...)`), inside the setting its `Example (...)` line names; and a
check fails when a public name gets an example of that kind that this file does not run.
"""

import inspect
import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
       "TF_CPP_MIN_LOG_LEVEL": "2"}

_DATA = """
import numpy as np, keras, kpipe, kpipe.distribute
rng = np.random.default_rng(0)
x = rng.random((256, 4), dtype="float32")
"""

# name -> the prelude before the example (the names it leaves to the reader)
PRELUDES = {
    "kpipe.distribute.MultiWorkerMirroredStrategy": _DATA + """
y = x.sum(axis=1, keepdims=True)
def build_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
""",
    "kpipe.distribute.ps_fit": _DATA + """
import tensorflow as tf
def build_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
def make_dataset():
    return tf.data.Dataset.from_tensor_slices((x, (x.sum(axis=1) > 2).astype("int64"))).repeat()
""",
    "kpipe.RayWorkers": """
import numpy as np, keras, kpipe, ray
ray.init(address="local", num_cpus=4, resources={"preprocess": 4}, include_dashboard=False,
         logging_level="WARNING", log_to_driver=False)
class Images(keras.utils.PyDataset):
    def __init__(self, *args):
        super().__init__()
    def __len__(self):
        return 6
    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.random((8, 4), dtype="float32"), rng.random((8, 1), dtype="float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
""",
    "kpipe.callbacks.InputProfiler": "",
}


def _public():
    import kpipe

    modules = [kpipe, kpipe.data, kpipe.distribute, kpipe.callbacks]
    return {f"{m.__name__}.{name}": getattr(m, name) for m in modules for name in m.__all__}


def example(obj):
    """(the `Example (...):` lines, its code) of a docstring whose example is not a doctest."""
    lines = (inspect.getdoc(obj) or "").split("\n")
    first = next((i for i, line in enumerate(lines) if re.match(r"Examples?\b", line)), None)
    if first is None:
        return None
    last = next(i for i in range(first, len(lines)) if lines[i].rstrip().endswith(":"))  # the setting may wrap
    head, rest = " ".join(line.strip() for line in lines[first:last + 1]), lines[last + 1:]
    if any(line.lstrip().startswith(">>>") for line in rest):
        return None
    fence = next((i for i, line in enumerate(rest) if line.strip() == "```python"), None)
    if fence is not None:
        end = next(i for i in range(fence + 1, len(rest)) if rest[i].strip() == "```")
        return head, "\n".join(rest[fence + 1:end])
    body = []
    for line in rest:
        if line.strip() and not line.startswith("    "):
            break
        body.append(line)
    return head, textwrap.dedent("\n".join(body)).strip()


def _script(tmp_path, name, code):
    path = tmp_path / "example.py"
    path.write_text(PRELUDES[name] + "\n" + code + "\n")
    return str(path)


def _launched(tmp_path, name, code, **job):
    """The output of `code` (after its prelude) run as a `kpipe launch` job of `job`'s tasks,
    which must all succeed."""
    from kpipe.distribute import launch

    out = io.StringIO()
    result = launch([sys.executable, _script(tmp_path, name, code)], env=ENV, output=out, timeout_s=240,
                    warn_open_ports=False, **job)
    assert result.returncode == 0, out.getvalue()[-3000:]
    return out.getvalue()


def test_example_reader_takes_the_indented_or_fenced_block():
    class Indented:
        """Does x.

        Example (run it
        somewhere):

            a = 1
            print(a)

        More text.
        """

    class Fenced:
        """Does y.

        Example:

        ```python
        b = 2
        ```
        """

    class Doctest:
        """Example:

        >>> 1
        1
        """

    assert example(Indented) == ("Example (run it somewhere):", "a = 1\nprint(a)")
    assert example(Fenced) == ("Example:", "b = 2")
    assert example(Doctest) is None


def test_every_example_that_is_not_a_doctest_runs_here():
    not_doctests = sorted(n for n, obj in _public().items() if example(obj) is not None)
    assert not_doctests == sorted(PRELUDES), (
        "public names whose docstring example is not a doctest must be run by this file (add a prelude "
        f"and a test) or become doctests: {sorted(set(not_doctests) ^ set(PRELUDES))}")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_multiworkermirroredstrategy_example_trains_under_kpipe_launch(tmp_path, no_leaks):
    name = "kpipe.distribute.MultiWorkerMirroredStrategy"
    head, code = example(_public()[name])
    assert "kpipe launch --workers 2" in head
    out = _launched(tmp_path, name, code + "\nprint('weights', np.concatenate([w.ravel() for w in model.get_weights()]).tolist())",
                    workers=2)
    weights = [line.partition("weights ")[2] for line in out.splitlines() if "] weights [" in line]
    assert len(weights) == 2 and weights[0] == weights[1], out[-3000:]  # one model, in sync


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ps_fit_example_trains_under_kpipe_launch_with_a_parameter_server(tmp_path, no_leaks):
    name = "kpipe.distribute.ps_fit"
    head, code = example(_public()[name])
    assert "kpipe launch --workers 2 --ps 1" in head and '"/shared/backup"' in code
    code = code.replace('"/shared/backup"', repr(str(tmp_path / "backup")))  # (the one path the reader picks)
    out = _launched(tmp_path, name, code, workers=2, ps=1)
    losses = [line.partition("] ")[2] for line in out.splitlines() if line.startswith("[chief] [")]
    assert len(losses) == 1, out[-3000:]
    assert len(eval(losses[0])) == 3  # three epochs' losses, on the chief


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rayworkers_example_trains_on_a_ray_instance_with_the_resource(tmp_path):
    pytest.importorskip("ray")
    name = "kpipe.RayWorkers"
    _, code = example(_public()[name])
    script = _script(tmp_path, name, code + """
import time
from ray._private import state  # (Ray's actor table: the state API needs the dashboard)
def left():
    return sum(1 for a in state.actors().values() if a["ActorClassName"] == "Loader" and a["State"] != "DEAD")
deadline = time.monotonic() + 60  # (killed actors are marked dead within it: a deadline, not a timing)
while left() and time.monotonic() < deadline:
    time.sleep(0.2)
print("history", len(model.history.history["loss"]), "actors left", left())
ray.shutdown()
""")
    proc = subprocess.run([sys.executable, script], env=ENV, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "history 2 actors left 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_inputprofiler_example_logs_the_wait_share_and_draws_the_timeline(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    name = "kpipe.callbacks.InputProfiler"
    _, code = example(_public()[name])
    monkeypatch.chdir(tmp_path)  # (in this process: it has TensorFlow imported already)
    printed = io.StringIO()
    monkeypatch.setattr(sys, "stdout", printed)
    exec(compile(PRELUDES[name] + code, "example.py", "exec"), {})
    assert re.fullmatch(r"\[[0-9., e-]+\] \[[0-9., e-]+\]\n", printed.getvalue()), printed.getvalue()
    assert (tmp_path / "timeline.png").stat().st_size > 1000
