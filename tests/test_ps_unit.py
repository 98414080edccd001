"""Parameter-server training, fast checks: TF_CONFIG roles, the server's chief watch, the
launcher's parameter-server rules (plain Python children, no TensorFlow) and `ps_fit`'s
errors. The real cluster runs in tests/test_distribute_ps.py."""

import io
import json
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kpipe.distribute as kd
from kpipe.distribute import _launcher

CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}


def _config(task_type, index=0, cluster=CLUSTER):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.fixture
def tf_config(monkeypatch):
    def set_config(value):
        monkeypatch.setenv("TF_CONFIG", value)
    return set_config


# -- roles -------------------------------------------------------------------------------

@pytest.mark.parametrize("task_type, index, worker_index, is_chief, address", [
    ("chief", 0, 0, True, "h:1"), ("worker", 1, 2, False, "h:3"), ("ps", 0, None, False, "h:4"),
])
def test_cluster_info_knows_every_parameter_server_role(task_type, index, worker_index,
                                                       is_chief, address):
    info = kd.cluster_info(_config(task_type, index))
    assert (info.task_type, info.worker_index, info.is_chief) == (task_type, worker_index,
                                                                   is_chief)
    assert info.address == address and info.num_workers == 3


def test_ps_cluster_needs_a_chief_and_workers(tf_config):
    pytest.importorskip("tensorflow")
    tf_config(_config("worker", 0, {"worker": ["h:2"], "ps": ["h:4"]}))
    with pytest.raises(ValueError, match=r"no `chief` task\. Received: cluster=.*kpipe launch "
                                         r"--ps M adds one"):
        kd.auto_strategy()
    tf_config(_config("chief", 0, {"chief": ["h:1"], "ps": ["h:4"]}))
    with pytest.raises(ValueError, match="has no `worker` task"):
        kd.auto_strategy()


def test_an_evaluator_task_is_told_what_to_do(tf_config):
    pytest.importorskip("tensorflow")
    tf_config(_config("evaluator", 0))
    with pytest.raises(ValueError, match="nothing to run for task type 'evaluator'"):
        kd.auto_strategy()


def test_servers_get_at_least_one_inter_op_thread_per_worker_plus_one():
    pytest.importorskip("tensorflow")
    from kpipe.distribute import _ps

    assert _ps.server_thread_count(8) >= 9
    assert _ps.server_thread_count(1) >= 2


class _FakeChief:
    """A clock and a chief that is up during [up_from, up_until) seconds."""

    def __init__(self, up_from, up_until):
        self.now, self.up_from, self.up_until = 0.0, up_from, up_until

    def reachable(self, address):
        return self.up_from <= self.now < self.up_until

    def sleep(self, seconds):
        self.now += seconds


def test_a_server_stops_once_the_chief_it_saw_is_gone():
    pytest.importorskip("tensorflow")
    from kpipe.distribute import _ps

    chief = _FakeChief(up_from=5, up_until=50)
    status = _ps.watch_chief("h:1", poll_s=1, gone_checks=3, wait_s=600,
                             reachable=chief.reachable, clock=lambda: chief.now,
                             sleep=chief.sleep)
    assert status == 0 and 52 <= chief.now <= 53


def test_a_server_gives_up_on_a_chief_that_never_starts():
    pytest.importorskip("tensorflow")
    from kpipe.distribute import _ps

    chief = _FakeChief(up_from=10**9, up_until=10**9)
    status = _ps.watch_chief("h:1", poll_s=1, wait_s=30, reachable=chief.reachable,
                             clock=lambda: chief.now, sleep=chief.sleep)
    assert status == 1 and 30 <= chief.now <= 32


# -- launcher ----------------------------------------------------------------------------

def test_role_tf_configs_put_the_chief_first_and_the_ps_tasks_last():
    configs = _launcher.role_tf_configs(["h:2", "h:3"], chief="h:1", ps=["h:4"])
    assert [(t, i) for t, i, _ in configs] == [("chief", 0), ("worker", 0), ("worker", 1),
                                               ("ps", 0)]
    for task_type, index, config in configs:
        info = kd.cluster_info(config)
        assert info.cluster == {k: tuple(v) for k, v in CLUSTER.items()}
        assert (info.task_type, info.task_index) == (task_type, index)


def test_print_tf_config_with_ps_names_every_role():
    out = subprocess.run([sys.executable, "-m", "kpipe.cli", "launch", "--ps", "1",
                          "--print-tf-config", "h:1,h:2,h:3,h:4"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert [line for line in out.splitlines() if line.startswith("#")] == [
        "# chief on h:1", "# worker 0 on h:2", "# worker 1 on h:3", "# ps 0 on h:4"]
    exports = [line for line in out.splitlines() if line.startswith("export")]
    assert json.loads(exports[3].split("=", 1)[1].strip("'"))["task"] == {"type": "ps",
                                                                          "index": 0}
    bad = subprocess.run([sys.executable, "-m", "kpipe.cli", "launch", "--ps", "1",
                          "--print-tf-config", "h:1,h:2"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "leave no worker" in bad.stderr


@pytest.mark.parametrize("kwargs, match", [
    ({"ps": -1}, r"`ps` must be >= 0\. Received: ps=-1"),
    ({"ps": 1, "chief": False}, r"needs a chief\. Received: ps=1, chief=False"),
])
def test_launch_checks_the_roles(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kd.launch([sys.executable, "-c", "pass"], **kwargs)


def _role_program(body):
    """Each task runs `body` with `task` = "chief" / "worker 0" / "ps 0"."""
    return [sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys, time
        t, i = os.environ["KPIPE_LAUNCH_TASK"].split(":")
        task = t if t == "chief" else f"{t} {i}"
        """) + textwrap.dedent(body)]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_chief_completion_stops_the_servers_and_exits_0(tmp_path, no_leaks):
    out = io.StringIO()
    result = kd.launch(_role_program(f"""
        marks = {str(tmp_path)!r}
        if task == "chief":  # once the 3 servers said so (a deadline that only catches a hang)
            deadline = time.monotonic() + 60
            while len(os.listdir(marks)) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            print("trained"); sys.exit(0)
        print("serving"); open(os.path.join(marks, task), "w").close(); time.sleep(120)
        """), workers=2, ps=1, output=out, grace_s=5)
    assert result.returncode == 0 and result.failed_worker is None
    assert result.tasks == ("chief", "worker 0", "worker 1", "ps 0")
    assert result.returncodes[1:] == (-signal.SIGTERM,) * 3
    lines = out.getvalue().splitlines()
    assert "[chief] trained" in lines and "[ps 0] serving" in lines


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_dead_worker_is_tolerated_but_a_dead_ps_ends_the_job(tmp_path, no_leaks):
    out = io.StringIO()
    pid_file = str(tmp_path / "worker-1.pid")
    result = kd.launch(_role_program(f"""
        if task == "worker 1":
            with open({pid_file + ".tmp"!r}, "w") as f:
                f.write(str(os.getpid()))
            os.rename({pid_file + ".tmp"!r}, {pid_file!r})
            os.kill(os.getpid(), signal.SIGKILL)
        if task == "chief":  # once the launcher reaped worker 1 (it then reports it): a
            deadline = time.monotonic() + 60  # deadline that only catches a hang
            while time.monotonic() < deadline:
                if os.path.exists({pid_file!r}):
                    pid = int(open({pid_file!r}).read())
                    if not os.path.exists(f"/proc/{{pid}}"):  # a zombie keeps its entry until reaped
                        break
                time.sleep(0.02)
            print("still training"); sys.exit(0)
        time.sleep(120)
        """), workers=2, ps=1, output=out, grace_s=5)
    assert result.returncode == 0 and result.returncodes[2] == -signal.SIGKILL
    assert "[kpipe launch] worker 1 exited with status 137; the chief runs its steps" \
        in out.getvalue() and "[chief] still training" in out.getvalue()

    out = io.StringIO()
    result = kd.launch(_role_program("""
        if task == "ps 0":
            sys.exit(7)
        time.sleep(120)        # the chief never notices: stopped after grace_s
        """), workers=1, ps=1, output=out, grace_s=0.5)
    assert result.returncode == 7 and result.tasks[result.failed_worker] == "ps 0"
    assert "[kpipe launch] ps 0 exited with status 7; waiting up to 0.5 s" in out.getvalue()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_failing_chief_sets_the_exit_code_and_no_worker_left_stops_the_job(no_leaks):
    result = kd.launch(_role_program("""
        if task == "chief":
            time.sleep(0.5); sys.exit(4)
        time.sleep(120)
        """), workers=1, ps=1, output=io.StringIO(), grace_s=5)
    assert result.returncode == 4 and result.failed_worker == 0
    result = kd.launch(_role_program("""
        if task.startswith("worker"):
            sys.exit(5)
        time.sleep(120)
        """), workers=2, ps=1, output=io.StringIO(), grace_s=5)
    assert result.returncode == 5 and result.tasks[result.failed_worker].startswith("worker")


def test_launch_without_ps_keeps_the_worker_prefixes_and_failure_rule(no_leaks):
    out = io.StringIO()
    result = kd.launch(_role_program("""
        print(task)
        """), workers=1, chief=True, output=out)
    assert result.returncode == 0 and result.tasks == ("chief", "worker 0")
    assert sorted(out.getvalue().splitlines()) == ["[chief] chief", "[worker 0] worker 0"]


# -- ps_fit's checks (no cluster needed) -------------------------------------------------

@pytest.fixture(scope="module")
def tf_keras():
    tf = pytest.importorskip("tensorflow")
    import keras

    return tf, keras


@pytest.mark.parametrize("kwargs, match", [
    ({"epochs": 0}, r"`epochs` must be an integer >= 1\. Received: epochs=0"),
    ({"steps_per_epoch": 2.5}, r"Received: steps_per_epoch=2\.5"),
    ({"verbose": 3}, r"Received: verbose=3"),
    ({"validation_steps": 0}, r"Received: validation_steps=0"),
    ({"class_weight": {"a": 1.0}}, r"class index \(int >= 0\).*Received: class_weight=\{'a'"),
])
def test_ps_fit_checks_its_arguments(tf_keras, kwargs, match):
    _, keras = tf_keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    args = {"epochs": 1, "steps_per_epoch": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        kd.ps_fit(model, lambda ctx: None, **args)


def test_ps_fit_needs_a_parameter_server_strategy(tf_keras):
    _, keras = tf_keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"Received: a model built under _DefaultDistribution"
                                         r"Strategy.*auto_strategy\(\)"):
        kd.ps_fit(model, lambda ctx: None, epochs=1, steps_per_epoch=1)
    with pytest.raises(ValueError, match="`dataset_fn` must be a function"):
        kd.ps_fit(model, [1, 2], epochs=1, steps_per_epoch=1)


class _Images:
    def __len__(self):
        return 1


def test_worker_datasets_must_be_tf_data_without_python_steps(tf_keras):
    tf, keras = tf_keras
    from kpipe.distribute import _ps_fit

    x = np.zeros((8, 2), "float32")
    with pytest.raises(ValueError, match=r"must return a `tf.data.Dataset`.*type tuple"):
        _ps_fit.check_worker_dataset((x, x))

    class Seq(keras.utils.PyDataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return x, x

    with pytest.raises(ValueError, match=r"Python-side dataset \(Seq\).*via_data_service"):
        _ps_fit.check_worker_dataset(Seq())
    base = tf.data.Dataset.from_tensor_slices(x)
    cases = {
        "EagerPyFunc": base.map(lambda t: tf.py_function(lambda a: a, [t], tf.float32)),
        "PyFunc": base.map(lambda t: tf.numpy_function(lambda a: a, [t], tf.float32)),
        "generator": tf.data.Dataset.from_generator(lambda: iter(x), output_signature=
                                                    tf.TensorSpec((2,), tf.float32)),
    }
    for name, dataset in cases.items():
        with pytest.raises(ValueError, match=r"Python steps.*tf.data service") as info:
            _ps_fit.check_worker_dataset(dataset.batch(2).prefetch(1))
        assert "PyFunc" in str(info.value), name
    _ps_fit.check_worker_dataset(base.map(lambda t: t * 2).batch(2))  # TF ops only: fine


def test_class_weights_become_sample_weights_for_sparse_and_one_hot_labels(tf_keras):
    tf, _ = tf_keras
    from kpipe.distribute import _ps_fit

    add = _ps_fit._class_weight_fn({0: 3.0, 2: 0.5})
    x = tf.zeros((3, 1))
    _, _, w = add(x, tf.constant([0, 1, 2]))
    np.testing.assert_allclose(w.numpy(), [3.0, 0.0, 0.5])
    _, _, w = add(x, tf.one_hot([2, 0, 0], 3))
    np.testing.assert_allclose(w.numpy(), [0.5, 3.0, 3.0])
    with pytest.raises(ValueError, match="needs batches `\\(x, y\\)`.*Received: batches of 3"):
        add(x, x, x)


def test_partitioned_variables_and_unusable_callbacks_are_rejected(tf_keras):
    tf, keras = tf_keras
    from kpipe import callbacks as kcb
    from kpipe.distribute import _ps_fit

    class Extended:
        _variable_partitioner = staticmethod(lambda shape, dtype: [2, 1])

    class Strategy:
        extended = Extended()

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"ShardedVariable.*Received: variable_partitioner="
                                         r".*without `variable_partitioner`"):
        _ps_fit._check_not_partitioned(Strategy(), model)
    with pytest.raises(ValueError, match=r"InputProfiler.*run on the workers"):
        _ps_fit._check_callbacks([kcb.InputProfiler()])
    with pytest.raises(ValueError, match=r"keras.*BackupAndRestore.*Pass `backup_dir=`"):
        _ps_fit._check_callbacks([keras.callbacks.BackupAndRestore("/nonexistent/b")])


def test_a_lost_parameter_server_is_named_with_the_way_to_resume(tf_keras):
    tf, _ = tf_keras
    from kpipe.distribute import _ps_fit

    class Strategy:
        class _cluster_resolver:
            @staticmethod
            def cluster_spec():
                return tf.train.ClusterSpec({"ps": ["h:4", "h:5"], "worker": ["h:2"]})

    error = tf.errors.UnavailableError(None, None, "Graph execution error:\n\nfailed to connect "
                                       "to all addresses\nfrom /job:ps/replica:0/task:1/device:"
                                       "CPU:0 while calling RunComponentFunction")
    found = _ps_fit._ps_error(error, Strategy(), None, None)
    assert isinstance(found, kd.ParameterServerError)
    assert "ps 1 (h:5) is unreachable" in str(found) and "failed to connect" in str(found)
    assert "pass backup_dir=" in str(found)
    assert _ps_fit._ps_error(tf.errors.UnavailableError(None, None, "/job:worker/task:0"),
                             Strategy(), None, None) is None
