"""kpipe under `KERAS_BACKEND=torch` (issue 47): the same cases as tests/test_backend_jax.py
-- the loaders, `fit_generator`, validation / evaluate / predict, `BackupAndRestore`
resuming mid-epoch in a new process, `Warmup`, `InputProfiler`, `kpipe.data` -- each
ending with plain Keras's weights on PyTorch (byte for byte), TensorFlow-only names
refused by name, and no TensorFlow in the process or the workers. Skipped where torch is
not installed (CI installs it with the `torch` extra in a line of its own: .ci/run)."""

import importlib.util

import pytest

import _backend_checks as checks

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch is not installed (pip install -e '.[torch]'; CI pins a CPU build: .ci/torch-constraints.txt)"),
]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch")
    record, arrays = checks.run(out, "first", "torch", timeout=360)
    assert record["backend"] == "torch"
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
    checks.check_tf_only_errors(first[1], "torch")


def test_a_batch_kept_as_a_backend_tensor_keeps_its_slot(first):
    checks.check_handover(first[1], aliases=True)  # torch.as_tensor: a view of the slot


def test_no_tensorflow_in_the_process_or_the_workers(first):
    checks.check_no_tensorflow(first[1])


def test_backup_resumes_mid_epoch_in_a_new_process_bit_identical(first):
    out, _, arrays = first
    record, resumed = checks.run(out, "resume", "torch")
    assert (record["restored_epoch"], record["restored_step"]) == (1, 10)
    full = checks.weights(arrays, "backup/full")
    assert [w.tobytes() for w in checks.weights(resumed, "backup/resumed")] == [w.tobytes() for w in full]


def test_batches_handed_to_the_torch_trainer_are_tensors_over_the_slots_equal_the_dataset(tmp_path):
    """Differential, zero copy (kpipe/_torch_feed.py): every batch the torch trainer took,
    kept until fit() returned, is torch tensors equal to the dataset called serially, byte
    for byte; each kept batch held its own slot (24 through a loader with max_queue_size=2:
    the tensors are the slots' memory, not Keras's copy of it), all given back once dropped;
    training ends with plain Keras's weights (tests/programs/jax_feed_cases.py)."""
    checks._outputs.run_program("jax_feed_cases.py", tmp_path, "--phase", "torch_handover", backend="torch", timeout=300,
                                env={"KPIPE_TORCH_PIN": "0"})  # (the ahead copy, forced on outside, copies by design)
    record, arrays = checks._outputs.read(tmp_path / "torch_handover", 0)
    assert record["backend"] == "torch" and record["kinds"] == ["Tensor"]
    assert record["taken"] == 24 and record["equal"] == [True] * 24
    assert record["slots_held_while_kept"] == 24 and record["slots_held_after_drop"] == 0
    for i in range(2):
        assert arrays[f"kpipe/{i}"].tobytes() == arrays[f"plain/{i}"].tobytes()
    assert record["tensorflow_imported"] is False


def test_the_ahead_copy_hands_the_torch_trainer_copies_equal_the_dataset_and_gives_slots_back(tmp_path):
    """kpipe/_torch_pin.py with the CPU as the device (`KPIPE_TORCH_PIN=cpu`: the thread, the
    buffer pool and the release of slots as on a CUDA device, pinning a no-op): every batch
    the trainer took, kept until fit() returned, equals the dataset called serially, byte for
    byte, yet holds no slot (each slot went back once its batch was copied); training ends
    with plain Keras's weights. On a CUDA device: scripts/gpu_check_torch.py."""
    checks._outputs.run_program("jax_feed_cases.py", tmp_path, "--phase", "torch_handover", backend="torch",
                                timeout=300, env={"KPIPE_TORCH_PIN": "cpu"})
    record, arrays = checks._outputs.read(tmp_path / "torch_handover", 0)
    assert record["kinds"] == ["Tensor"] and record["taken"] == 24 and record["equal"] == [True] * 24
    assert record["slots_held_while_kept"] == 0 and record["slots_held_after_drop"] == 0
    for i in range(2):
        assert arrays[f"kpipe/{i}"].tobytes() == arrays[f"plain/{i}"].tobytes()
    assert record["tensorflow_imported"] is False


def test_the_ahead_copy_thread_is_gone_after_fit_whole_or_partial_epochs(tmp_path):
    """No ahead-copy thread and no slot left once `fit()` returns, whether each epoch ran to
    its end or Keras dropped its iterator after `steps_per_epoch=5` of 12 batches
    (tests/programs/torch_pin_cases.py, KPIPE_TORCH_PIN=cpu)."""
    checks._outputs.run_program("torch_pin_cases.py", tmp_path, backend="torch", timeout=300,
                                env={"KPIPE_TORCH_PIN": "cpu"})
    record, arrays = checks._outputs.read(tmp_path / "threads", 0)
    assert record["mode"] == "cpu"
    for name in ("whole", "partial"):
        assert record[f"{name}/threads_after_fit"] == 0 and record[f"{name}/slots_after_fit"] == 0
        assert record[f"{name}/threads_after_close"] == 0
    for i in range(2):
        assert arrays[f"whole/{i}"].tobytes() == arrays[f"plain/{i}"].tobytes()


@pytest.mark.timeout(600)  # 226 s at load 4-8 on 2 cores
def test_keras_upstream_pydataset_tests_pass_under_torch_plain_and_through_kpipe():
    """tests/keras_upstream (Keras's own PyDataset tests, each case plain and through a
    ProcessLoader) in a pytest of its own under KERAS_BACKEND=torch: the cases upstream runs
    on PyTorch, its `multiprocessing` ones included (upstream skips them on TensorFlow and
    JAX only)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           os.path.join(root, "tests", "keras_upstream")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=570)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


@pytest.mark.parametrize("pin", ["cpu", "0"])
def test_steps_per_epoch_takes_plain_keras_batches_with_the_ahead_copy_on_and_off(tmp_path, pin):
    """`fit(epochs=3, steps_per_epoch=5)` over 12 batches (Keras carries its iterator over
    epoch ends and runs out in the third): each epoch's loss and the final weights equal
    plain Keras's, byte for byte, with the ahead copy's thread reading ahead (`cpu`) and
    without it (`0`): no batch skipped, repeated or reordered at an epoch's end
    (tests/programs/torch_steps_cases.py)."""
    checks._outputs.run_program("torch_steps_cases.py", tmp_path, backend="torch", timeout=300,
                                env={"KPIPE_TORCH_PIN": pin})
    record, arrays = checks._outputs.read(tmp_path / "steps", 0)
    assert record["mode"] == pin and len(record["plain/loss"]) == 3
    assert record["kpipe/loss"] == record["plain/loss"]
    for i in range(2):
        assert arrays[f"kpipe/{i}"].tobytes() == arrays[f"plain/{i}"].tobytes()
