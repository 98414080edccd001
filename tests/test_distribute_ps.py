"""Parameter-server training on 127.0.0.1: `kpipe launch --workers 2 --ps 1` (a chief, two
workers, one ps task) running `tests/programs/ps_train.py`. Three launches in all: a run
that loses a worker mid-training, then a run whose ps task is killed, then its relaunch."""

import csv
import io
import json
import os
import signal
import sys

import psutil
import pytest

from kpipe.distribute import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "programs")
sys.path.insert(0, PROGRAMS)
import ps_train  # noqa: E402  (constants of the program; it imports no TensorFlow at import)

ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
       "TF_CPP_MIN_LOG_LEVEL": "2"}
TASKS = ("chief0", "worker0", "worker1", "ps0")

pytestmark = [pytest.mark.multiworker, pytest.mark.slow, pytest.mark.timeout(240)]


def _launch(out_dir, *args, expect=0):
    command = [sys.executable, os.path.join(PROGRAMS, "ps_train.py"), "--out", str(out_dir),
               *args]
    output = io.StringIO()
    result = launch(command, workers=2, ps=1, env=ENV, output=output, timeout_s=200,
                    grace_s=5, warn_open_ports=False)
    if result.returncode != expect and "address already in use" in "".join(result.tails).lower():
        output = io.StringIO()  # a port was taken between free_ports() and the bind
        result = launch(command, workers=2, ps=1, env=ENV, output=output, timeout_s=200,
                        grace_s=5, warn_open_ports=False)
    assert result.returncode == expect, "\n".join(
        [f"launch returned {result.returncode}, expected {expect}"] + list(result.tails))
    _assert_all_gone(out_dir)
    return result, output.getvalue()


def _assert_all_gone(out_dir):
    for task in TASKS:
        pid = int((out_dir / f"pid_{task}").read_text())
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (task, pid)
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_main")
    result, output = _launch(out, "--kill-worker", "1")
    return out, result, output, json.loads((out / "chief.json").read_text())


def test_the_chief_trains_a_learnable_task(main_run):
    _, _, _, record = main_run
    assert record["coordinator"] == "ClusterCoordinator"
    loss = record["history"]["loss"]
    assert len(loss) == ps_train.EPOCHS and record["epochs"] == list(range(ps_train.EPOCHS))
    assert loss[-1] < loss[0] and loss[-1] < ps_train.LOSS_THRESHOLD
    assert len(record["history"]["val_loss"]) == ps_train.EPOCHS
    assert record["history"]["val_accuracy"][-1] > 0.8


def test_the_step_counter_is_exact_even_when_steps_are_re_run(main_run):
    _, _, _, record = main_run
    assert record["iterations"] == ps_train.EPOCHS * ps_train.STEPS
    steps = record["kpipe_steps"]
    assert steps["completed"] == ps_train.EPOCHS * ps_train.STEPS
    # The parameter server's atomic count: every step that ran is counted (a step re-run
    # after the worker was killed may count twice); Keras's own assign_add loses counts.
    assert steps["counted_on_ps"] >= steps["completed"]


def test_a_killed_worker_does_not_stop_training(main_run):
    _, result, output, record = main_run
    assert result.tasks == ("chief", "worker 0", "worker 1", "ps 0")
    assert result.returncodes[2] == -signal.SIGKILL and result.returncodes[0] == 0
    assert "[chief] chief: killed worker1 in epoch 1" in output
    assert "[kpipe launch] worker 1 exited with status 137" in output
    assert "[chief] chief: done" in output


def test_chief_callbacks_see_epochs_and_logs(main_run):
    out, _, output, record = main_run
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(ps_train.EPOCHS))
    assert [float(r["loss"]) for r in rows] == pytest.approx(record["history"]["loss"])
    assert (out / "m.weights.h5").exists()
    assert output.count(f"{ps_train.STEPS}/{ps_train.STEPS} - ") == ps_train.EPOCHS


def test_class_weights_change_the_loss_as_in_one_process(main_run):
    _, _, _, record = main_run
    cw = record["class_weight"]
    assert cw["ps_weighted"] == pytest.approx(cw["local_weighted"], rel=1e-5)
    assert cw["ps_unweighted"] == pytest.approx(cw["local_unweighted"], rel=1e-5)
    assert abs(cw["ps_weighted"] - cw["ps_unweighted"]) > 0.1


def test_unusable_pipelines_fail_with_the_fix(main_run):
    _, _, _, record = main_run
    errors = record["errors"]
    assert errors["numpy"].startswith("`dataset_fn` must return a `tf.data.Dataset` of batches. "
                                      "Received: an object of type tuple")
    assert "EagerPyFunc" in errors["py_function"] and "via_data_service" in errors["py_function"]


def test_a_lost_ps_is_reported_and_a_relaunch_resumes_from_the_backup(tmp_path):
    backup = tmp_path / "backup"
    _, output = _launch(tmp_path, "--scenario", "backup", "--backup", str(backup),
                        "--kill-ps", "1", expect=3)
    error = json.loads((tmp_path / "chief.json").read_text())["error"]
    assert error.startswith("Parameter server ps 0 (127.0.0.1:")
    assert "Relaunch the whole job" in error and "resumes from ckpt-1" in error
    assert "[chief] chief: killed ps0 in epoch 1" in output
    (tmp_path / "chief.json").unlink()
    _, output = _launch(tmp_path, "--scenario", "backup", "--backup", str(backup))
    record = json.loads((tmp_path / "chief.json").read_text())
    assert record["epochs"] == list(range(1, ps_train.EPOCHS))  # epoch 0 came from the backup
    assert record["iterations"] == ps_train.EPOCHS * ps_train.STEPS
    assert record["learning_rate"] == pytest.approx(ps_train.LR)  # Warmup handed over
    assert not backup.exists()  # deleted once training completed
