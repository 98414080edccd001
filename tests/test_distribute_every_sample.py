"""Multi-worker jobs see every sample once and compute what one process computes, for
every dataset length: 2- and 3-worker jobs on 127.0.0.1 (`kpipe.distribute.launch`) run
`tests/programs/mw_residues.py` over sample counts of every residue modulo the global
batch (workers x per-worker batch = 6 in both jobs), on a sharded `ProcessLoader`, a
sharded `ProcessLoader.from_samples` and auto-sharded tf.data; one plain process (the
same program without TF_CONFIG) is the reference: fit's epoch losses and final weights,
evaluate with and without sample weights, and predict's rows and values.

The short last batches (e.g. 13 samples: steps of 6, 6, 1) and the shards' pads (a worker
with no batch left in the last step) are where one process and the workers used to part:
see the NOTE in kpipe/distribute/_global_batch.py."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from kpipe import _compat
from kpipe.distribute import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "programs")
PROGRAM = os.path.join(PROGRAMS, "mw_residues.py")
sys.path.insert(0, PROGRAMS)
import _outputs  # noqa: E402
from conftest import killed_at_exit  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
       "TF_CPP_MIN_LOG_LEVEL": "2"}
GLOBAL_BATCH = 6
COUNTS = tuple(range(12, 12 + GLOBAL_BATCH))  # every residue modulo the global batch
INPUTS = ("loader", "samples", "tfdata")
WORKERS = (2, 3)

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]
# Keras < 3.10 keeps metrics per replica (kpipe/_compat.py): an epoch's logs and evaluate()'s
# figures are then exact only where every replica had as many rows as the others.
METRICS_SYNCED = _compat.keras_at_least(_compat._KERAS_SYNCS_METRICS_ON_READ)


def _counts_arg():
    return ",".join(map(str, COUNTS))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The one-process reference, started in the background when the first job starts (a
    single process beside the job's workers) and read by `reference`."""
    out = tmp_path_factory.mktemp("one_process")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(ENV)
    with open(out / "log.txt", "w") as log:  # (a file: nobody reads a pipe while the job runs)
        proc = subprocess.Popen([sys.executable, PROGRAM, "--out", str(out), "--batch", str(GLOBAL_BATCH),
                                 "--counts", _counts_arg()], env=env, stdout=log, stderr=subprocess.STDOUT)
    with killed_at_exit(proc):
        yield out, proc


@pytest.fixture(scope="module")
def reference(reference_run):
    out, proc = reference_run
    proc.wait(timeout=400)  # (it ran beside a job: a longer deadline than alone)
    assert proc.returncode == 0, (out / "log.txt").read_text()[-6000:]
    return _outputs.read(out, 0)


@pytest.fixture(scope="module", params=WORKERS, ids=lambda w: f"{w}_workers")
def job(request, tmp_path_factory, reference_run):
    workers = request.param
    out = tmp_path_factory.mktemp(f"job{workers}")
    command = [sys.executable, PROGRAM, "--out", str(out), "--batch", str(GLOBAL_BATCH // workers),
               "--counts", _counts_arg()]
    result = launch(command, workers=workers, env=ENV, output=io.StringIO(), timeout_s=300)
    if result.returncode != 0 and "address already in use" in "".join(result.tails).lower():
        result = launch(command, workers=workers, env=ENV, output=io.StringIO(), timeout_s=300)
    assert result.returncode == 0, "\n".join([f"launch returned {result.returncode}"] + list(result.tails))
    return workers, [_outputs.read(out, w) for w in range(workers)]


def _cases(job):
    workers, outputs = job
    for worker, (record, arrays) in enumerate(outputs):
        for name in INPUTS:
            for n in COUNTS:
                yield worker, name, n, record[f"{name}/{n}"], {
                    k.rsplit("/", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{name}/{n}/")}


@pytest.mark.timeout(600)
def test_every_worker_loads_an_equal_number_of_steps_covering_every_batch(job):
    # (which batches each shard holds, pads included: tests/test_position.py)
    workers, outputs = job
    for n in COUNTS:
        steps = -(-n // GLOBAL_BATCH)  # the steps one process takes, its last batch maybe short
        for worker, (record, _) in enumerate(outputs):
            # [num_shards, shard_index, len(loader), len(from_samples loader)]
            assert record[f"shards/{n}"] == [workers, worker, steps, steps], (n, worker)


@pytest.mark.timeout(600)
def test_predict_returns_every_row_in_order_on_every_worker(job, reference):
    ref_record, ref_arrays = reference
    for worker, name, n, record, arrays in _cases(job):
        assert record["rows"] == n, (worker, name, n)
        np.testing.assert_allclose(arrays["predict"], ref_arrays[f"reference/{n}/predict"], rtol=1e-5, atol=1e-6,
                                   err_msg=f"worker {worker}, {name}, {n} samples")


@pytest.mark.timeout(600)
def test_evaluate_equals_one_process_with_and_without_sample_weights(job, reference):
    if not METRICS_SYNCED:
        pytest.skip("Keras < 3.10 reports per-replica metrics (kpipe/_compat.py)")
    ref_record, _ = reference
    for worker, name, n, record, _ in _cases(job):
        want = ref_record[f"reference/{n}"]
        for key in ("evaluate", "evaluate_weighted"):
            np.testing.assert_allclose(record[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{key}: worker {worker}, {name}, {n} samples")
        assert want["evaluate_weighted"][0] != pytest.approx(want["evaluate"][0])  # the weights count


@pytest.mark.timeout(600)
def test_fit_with_a_short_or_missing_last_batch_equals_one_process(job, reference):
    # tf.data in the same job is held to the same standard: its rebatching splits a short
    # global batch unevenly too (e.g. (1, 0) rows), which kpipe's strategy weights alike.
    ref_record, ref_arrays = reference
    for worker, name, n, record, arrays in _cases(job):
        want = ref_record[f"reference/{n}"]
        if METRICS_SYNCED:
            np.testing.assert_allclose(record["loss"], want["loss"], rtol=1e-5,
                                       err_msg=f"worker {worker}, {name}, {n} samples")
        for k in range(4):
            np.testing.assert_allclose(arrays[f"w{k}"], ref_arrays[f"reference/{n}/w{k}"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"w{k}: worker {worker}, {name}, {n} samples")


@pytest.mark.timeout(600)
def test_weights_are_bitwise_identical_on_every_worker(job):
    _, outputs = job
    first = outputs[0][1]
    for _, arrays in outputs[1:]:
        for key, value in first.items():
            assert np.array_equal(arrays[key], value), key
