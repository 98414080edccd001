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


@pytest.fixture(scope="module")
def handover(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax_feed")
    checks._outputs.run_program("jax_feed_cases.py", out, "--phase", "handover", backend="jax", timeout=300)
    return checks._outputs.read(out / "handover", 0)


def test_batches_handed_to_the_jax_trainer_equal_the_dataset_called_serially(handover):
    """Differential: every batch Keras's JAX trainer took through kpipe's feed, kept until
    fit() returned (as NumPy arrays over the slots, or as JAX arrays aliasing them), equals
    the dataset's batch called serially, byte for byte; training ends with plain Keras's
    weights (tests/programs/jax_feed_cases.py)."""
    record, arrays = handover
    assert record["backend"] == "jax" and record["iterators"] == ["JaxFeed"]
    assert record["taken"] == 24 and record["equal"] == [True] * 24
    assert record["kinds"] == ["ndarray", "ArrayImpl"]
    for i in range(2):
        assert arrays[f"kpipe/{i}"].tobytes() == arrays[f"plain/{i}"].tobytes()
    assert record["tensorflow_imported"] is False


def test_kept_batches_keep_their_slots_and_give_them_back_when_dropped(handover):
    """Zero copy on the CPU: the handed NumPy arrays view the loader's slots and a JAX array
    made from one aliases it; each kept batch (24, in a ring sized for 2) held its own slot,
    none was reused under it, and dropping them gave every slot back."""
    record, _ = handover
    assert record["numpy_views_slot"] and record["jax_aliases_slot"]
    assert record["slots_held_while_kept"] == 24
    assert record["slots_held_after_drop"] == 0


def test_fork_start_method_is_refused_once_jax_runtime_runs(tmp_path):
    """`start_method="fork"` in a process running JAX's runtime: a ValueError naming the
    cause and the fix (the fork server, the default, or spawn), both of which then load."""
    checks._outputs.run_program("jax_feed_cases.py", tmp_path, "--phase", "fork", backend="jax", timeout=240)
    record, _ = checks._outputs.read(tmp_path / "fork", 0)
    assert record["runtime_before"] is False and record["runtime_after"] is True  # importing Keras/JAX starts none
    kind, message = record["fork_error"]
    assert kind == "ValueError"
    assert "JAX's runtime runs in this process" in message and "Received: start_method='fork'" in message
    assert "start_method='forkserver' (the default" in message and "'spawn'" in message
    assert record["forkserver_batch0"] and record["spawn_batch0"]
