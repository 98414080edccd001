"""The checks tests/test_backend_jax.py and tests/test_backend_torch.py share: each reads
what tests/programs/backend_cases.py left from a fresh process on one Keras backend and
asserts that kpipe's run ended with plain Keras's weights on that backend."""

import os
import sys

import numpy as np

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
sys.path.insert(0, PROGRAMS)
import _outputs  # noqa: E402 (tests/programs)


def run(out, phase, backend, env=None, timeout=240):
    """`(record, arrays)` of backend_cases.py's `phase`, run in a fresh process."""
    _outputs.run_program("backend_cases.py", out, "--phase", phase, backend=backend, env=env, timeout=timeout)
    return _outputs.read(os.path.join(str(out), phase), 0)


def weights(arrays, name):
    """The weights a case kept under `name` (`case/plain`, `case/kpipe`...), in order."""
    keys = sorted((k for k in arrays if k.startswith(name + "/") and k[len(name) + 1:].isdigit()),
                  key=lambda k: int(k.rsplit("/", 1)[1]))
    assert keys, f"no weights kept under {name!r}"
    return [arrays[k] for k in keys]


def assert_same_bytes(arrays, case, plain="plain", kpipe="kpipe"):
    a, b = weights(arrays, f"{case}/{plain}"), weights(arrays, f"{case}/{kpipe}")
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, (case, i)
        assert x.tobytes() == y.tobytes(), (case, i, float(np.abs(x - y).max()))


def check_loader(record, arrays):
    assert_same_bytes(arrays, "loader")
    assert record["loader/kpipe/val_loss"] == record["loader/plain/val_loss"]
    assert record["loader/kpipe/evaluate"] == record["loader/plain/evaluate"]
    assert np.array_equal(arrays["loader/kpipe/predict"], arrays["loader/plain/predict"])


def check_warmup(record, arrays):
    assert_same_bytes(arrays, "warmup")
    rates = record["warmup/rates"]
    assert rates["kpipe"] == rates["plain"]
    first = rates["kpipe"][:7]  # Warmup(steps=6, initial_lr=0.005) up to SGD's 0.05
    assert np.allclose(first, [0.005 + 0.045 * s / 6 for s in range(7)], rtol=1e-5), first
    assert all(np.isclose(r, 0.05) for r in rates["kpipe"][6:])
    # the ramp trained: not the weights of the same fit without Warmup
    assert any(x.tobytes() != y.tobytes()
               for x, y in zip(weights(arrays, "warmup/kpipe"), weights(arrays, "fit_generator/plain")))


def check_profiler(record, arrays, steps):
    assert_same_bytes(arrays, "profiler")  # the profiler changes nothing in training
    history = record["profiler/history"]
    assert all(len(v) == 2 for v in history.values())
    assert all(0.0 <= s <= 1.0 for s in history["input_wait_share"])
    assert all(v > 0 for v in history["steps_per_sec"] + history["samples_per_sec"])
    assert record["profiler/steps"] == steps
    assert record["profiler/samples"] == [8] * steps
    wait = record["profiler/wait_s"]
    assert all(w >= 0 for w in wait) and sum(wait) > 0  # one worker sleeping 20 ms a batch: steps waited
    assert record["profiler/queue_depth_known"] and record["profiler/kind"] == ["process_loader", 1]
    assert record["profiler/train_function_restored"]
    if record["profiler/plot"] is not None:
        assert os.path.getsize(record["profiler/plot"]) > 1000  # a PNG the user can open


def check_tf_only_errors(record, backend):
    errors = record["tf_only_errors"]
    assert sorted(errors) == ["MultiWorkerMirroredStrategy", "auto_strategy", "pipeline_model", "ps_fit"]
    for name, message in errors.items():
        assert f"kpipe.distribute.{name}" in message and f"KERAS_BACKEND={backend!r}" in message
        assert "instead" in message and "KERAS_BACKEND=tensorflow" in message


def check_no_tensorflow(record):
    assert record["tf_after_import"] is False
    assert record["tf_in_worker"] == [False, False]
    assert record["tf_after_loading"] is False


def check_handover(record, aliases=None):
    """A batch kept as a backend tensor after the loader moved on: its slot was not reused
    (`aliases`: the tensor views the slot's memory, no copy)."""
    assert record["handover/batches"] == 8 and record["handover/aliases"] == aliases
    assert record["handover/kept_equal"] and record["handover/later_equal"]
