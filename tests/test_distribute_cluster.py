"""`kpipe.distribute` pieces that need no cluster: TF_CONFIG parsing, shards, sharding rules,
the linear scaling rule and chief-only paths."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import kpipe.distribute as kd
from kpipe.distribute import _sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(cluster, task=None):
    config = {"cluster": cluster}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


TWO_WORKERS = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}
CHIEF_AND_WORKERS = {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}


@pytest.fixture
def tf_config(monkeypatch):
    def set_config(value):
        if value is None:
            monkeypatch.delenv("TF_CONFIG", raising=False)
        else:
            monkeypatch.setenv("TF_CONFIG", value)
    yield set_config


def test_importing_kpipe_distribute_does_not_import_tensorflow():
    code = ("import sys, kpipe.distribute as d; d.cluster_info(); d.default_shard(); "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_without_tf_config_the_process_is_its_own_chief(tf_config):
    tf_config(None)
    info = kd.cluster_info()
    assert (info.num_workers, info.worker_index, info.is_chief, info.task_type) == (1, 0, True, None)
    assert not info.is_multi_worker and info.address is None
    assert kd.default_shard() is None
    tf_config("  ")
    assert kd.cluster_info().num_workers == 1


def test_workers_only(tf_config):
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    info = kd.cluster_info()
    assert (info.num_workers, info.worker_index, info.is_chief) == (2, 1, False)
    assert info.address == "127.0.0.1:2223"
    assert kd.default_shard() == (2, 1)
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 0}))
    assert kd.cluster_info().is_chief and kd.default_shard() == (2, 0)


def test_chief_comes_first_in_the_input_pipeline_order(tf_config):
    tf_config(_config(CHIEF_AND_WORKERS, {"type": "chief", "index": 0}))
    assert (kd.cluster_info().worker_index, kd.cluster_info().is_chief) == (0, True)
    assert kd.default_shard() == (3, 0)
    tf_config(_config(CHIEF_AND_WORKERS, {"type": "worker", "index": 0}))
    assert (kd.cluster_info().worker_index, kd.cluster_info().is_chief) == (1, False)
    assert kd.default_shard() == (3, 1)


def test_evaluator_and_ps_tasks_load_everything(tf_config):
    tf_config(_config(TWO_WORKERS, {"type": "evaluator", "index": 0}))
    info = kd.cluster_info()
    assert info.worker_index is None and not info.is_chief and kd.default_shard() is None
    tf_config(_config({**TWO_WORKERS, "ps": ["h9:1"]}, {"type": "ps", "index": 0}))
    assert kd.default_shard() is None


def test_single_task_cluster_needs_no_task(tf_config):
    tf_config(_config({"worker": ["h:1"]}))
    info = kd.cluster_info()
    assert (info.num_workers, info.task_type, info.is_chief) == (1, "worker", True)


def test_dict_addresses_and_string_index_are_accepted(tf_config):
    tf_config(_config({"worker": {"1": "h1:1", "0": "h0:1"}}, {"type": "worker", "index": "1"}))
    assert kd.cluster_info().address == "h1:1"


def test_parse_is_cached_until_the_variable_changes(tf_config):
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 0}))
    assert kd.cluster_info() is kd.cluster_info()
    first = kd.cluster_info()
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    assert kd.cluster_info() is not first and kd.cluster_info().worker_index == 1


@pytest.mark.parametrize("raw, match", [
    ("{not json", "it is not valid JSON"),
    ("[1, 2]", "it must be a JSON object"),
    ('{"task": {"type": "worker", "index": 0}}', "`cluster` is missing"),
    ('{"cluster": ["h:1"]}', "`cluster` must be an object"),
    (_config(TWO_WORKERS), "`task` is missing but the cluster has several tasks"),
    (_config(TWO_WORKERS, {"type": "master", "index": 0}), "unknown task type 'master'"),
    (_config({**TWO_WORKERS, "trainer": ["h:1"]}, {"type": "worker", "index": 0}),
     "unknown task type 'trainer' in `cluster`"),
    (_config(TWO_WORKERS, {"type": "worker", "index": 2}), "`task.index` 2 is out of range"),
    (_config(TWO_WORKERS, {"type": "worker", "index": -1}), "`task.index` -1 is out of range"),
    (_config(TWO_WORKERS, {"type": "worker", "index": 0.5}), "`task.index` must be an integer"),
    (_config(TWO_WORKERS, {"type": "chief", "index": 0}), "task type 'chief' has no addresses"),
    (_config({"worker": ["localhost"]}, {"type": "worker", "index": 0}), "not a \"host:port\" address"),
    (_config({"worker": "h:1"}, {"type": "worker", "index": 0}), "must be a list"),
    (_config({"chief": ["a:1", "b:1"]}, {"type": "chief", "index": 0}), "at most one chief"),
    (_config(TWO_WORKERS, "worker"), "`task` must be an object"),
    (_config({"worker": {"a": "h:1"}}, {"type": "worker", "index": 0}),
     r"`cluster\['worker'\]` has the key 'a', which is not a task index"),
    (_config({"worker": {"0": "h:1", "-1": "h:2"}}, {"type": "worker", "index": 0}),
     r"has the key '-1', which is not a task index"),
    (_config({"worker": {"0": "h:1", "00": "h:2"}}, {"type": "worker", "index": 0}),
     r"names task 0 twice \(keys '0' and '00'\)"),
    (_config({"worker": {"0": "h:1", "2": "h:2"}}, {"type": "worker", "index": 0}),
     r"has task indices \[0, 2\] with 1 missing.*Number the 'worker' tasks 0 to 1"),
    (_config({"worker": ["h:1", "h:2", "h:1"]}, {"type": "worker", "index": 0}),
     r"tasks worker 0 and worker 2 both have the address 'h:1'.*its own host:port"),
    (_config({"chief": ["h:1"], "worker": ["h:1"]}, {"type": "worker", "index": 0}),
     r"tasks chief 0 and worker 0 both have the address 'h:1'"),
])
def test_malformed_tf_config_errors_quote_the_value(tf_config, raw, match):
    tf_config(raw)
    with pytest.raises(kd.TFConfigError, match=match) as info:
        kd.cluster_info()
    assert "Received: TF_CONFIG=" in str(info.value) and raw[:20] in str(info.value)
    with pytest.raises(kd.TFConfigError):
        kd.default_shard()


def test_explicit_argument_does_not_touch_the_cache(tf_config):
    tf_config(None)
    info = kd.cluster_info(_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    assert info.worker_index == 1
    assert kd.cluster_info().num_workers == 1


# -- sharding rules ------------------------------------------------------------------------

def test_is_presharded():
    class Sharded:
        num_shards = 2

    class Whole:
        num_shards = 1

    class Marked:
        _kpipe_presharded = True

    assert kd.is_presharded(Sharded()) and kd.is_presharded(Marked())
    assert not kd.is_presharded(Whole()) and not kd.is_presharded(object())
    assert not kd.is_presharded(None)


def test_unseeded_shuffle_is_an_error_only_across_workers(tf_config):
    tf_config(None)
    kd.check_shuffle_seed(True, None)  # one process: any order is fine
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 0}))
    kd.check_shuffle_seed(True, 0)
    kd.check_shuffle_seed(False, None)
    with pytest.raises(ValueError, match=r"`ProcessLoader\(shuffle=True\)` needs a `seed`.*"
                                         r"Received: seed=None"):
        kd.check_shuffle_seed(True, None)


def test_shuffles_without_seed_are_found_in_tf_data_graphs():
    tf = pytest.importorskip("tensorflow")
    tf.random.set_seed(None)
    try:
        assert _sharding.unseeded_shuffles(tf.data.Dataset.range(8).shuffle(8)) != []
        assert _sharding.unseeded_shuffles(tf.data.Dataset.range(8).shuffle(8, seed=1)) == []
        # Keras's NumPy adapter shuffles with tf.random.shuffle inside a map function.
        ds = tf.data.Dataset.range(1).map(lambda _: tf.random.shuffle(tf.range(8)))
        assert any("tf.random.shuffle" in p for p in _sharding.unseeded_shuffles(ds))
        nested = tf.data.Dataset.range(2).flat_map(
            lambda _: tf.data.Dataset.range(4).shuffle(4)).batch(2)
        assert _sharding.unseeded_shuffles(nested) != []
        tf.random.set_seed(7)  # a global seed makes every op seed deterministic
        ds = tf.data.Dataset.range(1).map(lambda _: tf.random.shuffle(tf.range(8)))
        assert _sharding.unseeded_shuffles(ds) == []
        assert _sharding.unseeded_shuffles(tf.data.Dataset.range(8).batch(2)) == []
    finally:
        tf.random.set_seed(None)


def test_presharded_marker_survives_transformations():
    tf = pytest.importorskip("tensorflow")
    ds = kd.mark_presharded(tf.data.Dataset.range(8).batch(2))
    ds = ds.map(lambda x: x * 2).prefetch(1)
    assert _sharding.dataset_is_marked_presharded(ds)
    assert (ds.options().experimental_distribute.auto_shard_policy
            == tf.data.experimental.AutoShardPolicy.OFF)
    assert not _sharding.dataset_is_marked_presharded(tf.data.Dataset.range(2))


# -- the linear scaling rule -----------------------------------------------------------------

def test_scaled_learning_rate():
    assert kd.scaled_learning_rate(0.1, 256, 1024) == pytest.approx(0.4)
    assert kd.scaled_learning_rate(0.1, base_batch=256, global_batch=64) == pytest.approx(0.025)
    for bad in ({"base_lr": 0}, {"base_batch": -1}, {"global_batch": True}, {"base_lr": "0.1"}):
        args = {"base_lr": 0.1, "base_batch": 256, "global_batch": 512, **bad}
        name, value = next(iter(bad.items()))
        with pytest.raises(ValueError, match=f"`{name}` must be a positive number. "
                                             f"Received: {name}={value!r}"):
            kd.scaled_learning_rate(**args)


# -- chief-only side effects -------------------------------------------------------------------

def test_paths_on_the_chief_are_unchanged(tf_config, tmp_path):
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 0}))
    target = str(tmp_path / "model.keras")
    assert kd.chief_path(target) == target
    assert kd.per_worker_path(str(tmp_path / "backup")) == str(tmp_path / "backup" / "worker-0")


def test_paths_on_other_workers_are_private_and_throwaway(tf_config, tmp_path):
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    target = str(tmp_path / "ckpt" / "model-{epoch:02d}.keras")
    a, b = kd.chief_path(target), kd.chief_path(target)
    assert a != b and a != target
    assert os.path.basename(a) == "model-{epoch:02d}.keras"
    assert not a.startswith(str(tmp_path)) and os.path.isdir(os.path.dirname(a))
    assert kd.per_worker_path(str(tmp_path / "backup")) == str(tmp_path / "backup" / "worker-1")


def test_chief_only_redirects_writers_on_other_workers(tf_config, tmp_path):
    keras = pytest.importorskip("keras")
    callbacks = [keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
                 keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 keras.callbacks.TensorBoard(str(tmp_path / "tb")),
                 keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                 keras.callbacks.EarlyStopping()]
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 0}))
    chief = kd.chief_only(*callbacks)
    assert chief[:3] == callbacks[:3] and chief[4] is callbacks[4]
    assert chief[3].backup_dir == str(tmp_path / "backup" / "worker-0")

    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    other = kd.chief_only(*callbacks)
    assert other[4] is callbacks[4]
    assert other[0].filepath.endswith("m.keras") and not other[0].filepath.startswith(str(tmp_path))
    assert other[1].filename.endswith("log.csv") and not other[1].filename.startswith(str(tmp_path))
    assert not other[2].log_dir.startswith(str(tmp_path))
    assert other[2]._train_dir.startswith(other[2].log_dir)
    assert other[3].backup_dir == str(tmp_path / "backup" / "worker-1")
    assert other[3]._weights_path.startswith(other[3].backup_dir)
    # The originals are untouched: the same objects could be adapted again.
    assert callbacks[0].filepath == str(tmp_path / "m.keras")
    assert callbacks[3].backup_dir == str(tmp_path / "backup")


# -- auto_strategy's choice (in this process: no TF_CONFIG, no GPU) ---------------------------

def test_auto_strategy_without_cluster_is_the_default_strategy(tf_config, caplog):
    tf = pytest.importorskip("tensorflow")
    tf_config(None)
    with caplog.at_level("INFO", logger="kpipe.distribute"):
        strategy = kd.auto_strategy()
    assert strategy is tf.distribute.get_strategy() and strategy.num_replicas_in_sync == 1
    assert "default strategy (no TF_CONFIG" in caplog.text


@pytest.mark.parametrize("config, kwargs, match", [
    (None, {"communication": "mpi"}, "`communication` must be one of"),
    (_config(TWO_WORKERS, {"type": "worker", "index": 0}), {"devices": ["/cpu:0"]},
     "`devices` cannot be chosen under a multi-worker TF_CONFIG"),
    (_config({**TWO_WORKERS, "ps": ["h:1"]}, {"type": "worker", "index": 0}), {},
     "TF_CONFIG lists `ps` tasks but it has no `chief` task"),
])
def test_auto_strategy_rejects_what_keras_fit_cannot_do(tf_config, config, kwargs, match):
    pytest.importorskip("tensorflow")
    tf_config(config)
    with pytest.raises(ValueError, match=match):
        kd.auto_strategy(**kwargs)


def test_data_service_arguments_are_checked_before_starting_anything():
    with pytest.raises(ValueError, match="Received: port=-1"):
        kd.start_dispatcher(-1)
    with pytest.raises(ValueError, match="Received: 'nohost'"):
        kd.start_worker("nohost")
    with pytest.raises(ValueError, match="`processing_mode` must be one of"):
        kd.via_data_service(None, "127.0.0.1:1", processing_mode="sometimes")


def test_scratch_dirs_of_killed_workers_are_removed(tf_config, monkeypatch, tmp_path):
    from kpipe.distribute import _chief

    monkeypatch.setattr(_chief.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_chief, "_scratch_dir", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"kpipe-worker1-pid{dead.pid}-abc"
    live = tmp_path / f"kpipe-worker1-pid{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    tf_config(_config(TWO_WORKERS, {"type": "worker", "index": 1}))
    path = kd.chief_path("model.keras")
    assert path.startswith(str(tmp_path / f"kpipe-worker1-pid{os.getpid()}-"))
    assert not stale.exists() and live.exists()
    shutil.rmtree(_chief._scratch_dir)
