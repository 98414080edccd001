"""kpipe under `KERAS_BACKEND=jax` (issue 47): the loaders (both forms), `fit_generator`,
validation / evaluate / predict, `BackupAndRestore` resuming mid-epoch in a new process,
`Warmup`, `InputProfiler` and `kpipe.data` pipelines, each ending with plain Keras's weights
on JAX (byte for byte); TensorFlow-only names raise a named error; neither the process nor
the loader's workers import TensorFlow; `keras.distribution.DataParallel` over two host
devices fed by a ProcessLoader, and over two `jax.distributed` processes each loading its
shard; Keras's own PyDataset tests. Every run is a fresh process (Keras picks its backend at
import): tests/programs/backend_cases.py."""

import importlib.util

import numpy as np
import pytest

import _backend_checks as checks

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install 'kpipe[jax]')"),
]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax")
    record, arrays = checks.run(out, "first", "jax", timeout=360)
    assert record["backend"] == "jax"
    return out, record, arrays


def test_process_loader_validation_evaluate_predict_equal_plain_keras(first):
    checks.check_loader(*first[1:])


def test_from_samples_equals_numpy_arrays(first):
    checks.assert_same_bytes(first[2], "samples")


def test_fit_generator_equals_plain_fit(first):
    checks.assert_same_bytes(first[2], "fit_generator")


def test_warmup_ramps_as_on_plain_input(first):
    checks.check_warmup(*first[1:])


def test_input_profiler_measures_each_step_and_plots(first):
    checks.check_profiler(*first[1:], steps=16)


def test_kpipe_data_pipeline_equals_numpy_arrays(first):
    checks.assert_same_bytes(first[2], "data")


def test_tensorflow_only_names_raise_a_named_error(first):
    checks.check_tf_only_errors(first[1], "jax")


def test_a_batch_kept_as_a_backend_tensor_keeps_its_slot(first):
    checks.check_handover(first[1])


def test_no_tensorflow_in_the_process_or_the_workers(first):
    checks.check_no_tensorflow(first[1])


def test_backup_resumes_mid_epoch_in_a_new_process_bit_identical(first):
    out, _, arrays = first
    record, resumed = checks.run(out, "resume", "jax")
    assert (record["restored_epoch"], record["restored_step"]) == (1, 10)
    full = checks.weights(arrays, "backup/full")
    assert [w.tobytes() for w in checks.weights(resumed, "backup/resumed")] == [w.tobytes() for w in full]


def test_data_parallel_over_two_host_devices_equals_one_device(tmp_path):
    record, arrays = checks.run(tmp_path, "dataparallel", "jax",
                                env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert record["devices"] == 2
    # the batch is split over two devices and the gradients summed: equal up to float rounding
    np.testing.assert_allclose(record["data_parallel/loss"], record["one_device/loss"], rtol=1e-5)
    for a, b in zip(checks.weights(arrays, "data_parallel"), checks.weights(arrays, "one_device")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_keras_upstream_pydataset_tests_pass_under_jax_plain_and_through_kpipe():
    """tests/keras_upstream (Keras's own PyDataset tests, each case plain and through a
    ProcessLoader) in a pytest of its own under KERAS_BACKEND=jax."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           os.path.join(root, "tests", "keras_upstream")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=380)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


def test_two_jax_processes_each_loading_its_shard_equal_one_process(tmp_path):
    """`jax.distributed.initialize` on 127.0.0.1, two processes, `DataParallel` over both,
    each fed its shard by `ProcessLoader(num_shards=2, shard_index=i)`."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(checks.PROGRAMS, "backend_cases.py"), "--out", str(tmp_path),
                               "--phase", "multiprocess", "--process-id", str(i), "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errors]
    (r0, a0), (r1, a1) = (checks._outputs.read(os.path.join(str(tmp_path), "multiprocess"), i) for i in range(2))
    assert (r0["processes"], r0["devices"]) == (2, 2)
    assert r0["multiprocess/loss"] == r1["multiprocess/loss"]  # one job, one loss
    np.testing.assert_allclose(r0["multiprocess/loss"], r0["one_process/loss"], rtol=1e-5)
    for a, b in zip(checks.weights(a0, "multiprocess"), checks.weights(a0, "one_process")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(checks.weights(a0, "multiprocess"), checks.weights(a1, "multiprocess")))
