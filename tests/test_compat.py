"""Supported versions: the import-time check, the declared range, the version-aware helpers."""

import configparser
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import kpipe
from kpipe import _compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import version_matrix  # noqa: E402


# -- the import-time check ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("2.17.1", (2, 17, 1)), ("3.7.0.dev2024091203", (3, 7, 0)), ("2.18.0rc1", (2, 18, 0)),
     ("3.15.1+local", (3, 15, 1)), ("2.16", (2, 16))],
)
def test_parse_version(text, expected):
    assert _compat.parse_version(text) == expected


def test_older_tensorflow_is_refused_naming_installed_and_required(monkeypatch):
    monkeypatch.delenv("KPIPE_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(kpipe.IncompatibleVersionError) as info:
        _compat.check_versions({"tensorflow": "2.15.1", "keras": _compat.MIN_KERAS})
    message = str(info.value)
    assert "tensorflow 2.15.1 is installed" in message
    assert f"tensorflow>={_compat.MIN_TENSORFLOW}" in message and "keras" not in message
    assert isinstance(info.value, ImportError)


def test_older_keras_and_tensorflow_are_both_named(monkeypatch):
    monkeypatch.delenv("KPIPE_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(ImportError, match=r"tensorflow>=.* and keras>=.*tensorflow 2\.12\.0, keras 3\.0\.5 is installed"):
        _compat.check_versions({"tensorflow": "2.12.0", "keras": "3.0.5"})
    with pytest.raises(ImportError, match=r"keras 2\.15\.0 is installed"):
        _compat.check_versions({"tensorflow": "2.21.0", "keras": "2.15.0"})


def test_floor_newer_and_unknown_versions_pass(monkeypatch):
    monkeypatch.delenv("KPIPE_SKIP_VERSION_CHECK", raising=False)
    _compat.check_versions({"tensorflow": _compat.MIN_TENSORFLOW, "keras": _compat.MIN_KERAS})
    _compat.check_versions({"tensorflow": "2.22.0rc0", "keras": "3.16.0.dev2026"})
    _compat.check_versions({"tensorflow": None, "keras": None})  # source builds without metadata


def test_skip_variable_lets_an_old_version_import(monkeypatch):
    monkeypatch.setenv("KPIPE_SKIP_VERSION_CHECK", "1")
    _compat.check_versions({"tensorflow": "2.15.1", "keras": "3.0.0"})


def test_installed_versions_are_the_ones_imported():
    import tensorflow as tf

    assert _compat.installed_version("tensorflow") == tf.__version__
    assert _compat.installed_version("keras") == keras.__version__


def _fake_distributions(tmp_path, **versions):
    for name, version in versions.items():
        (tmp_path / f"{name}-{version}.dist-info").mkdir()
    return str(tmp_path)


def test_import_kpipe_with_an_old_tensorflow_raises_naming_both_versions(tmp_path):
    # Metadata of an older TensorFlow found first on sys.path, as a stale install would be.
    fake = _fake_distributions(tmp_path, tensorflow="2.15.1")
    env = {k: v for k, v in os.environ.items() if k != "KPIPE_SKIP_VERSION_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join([fake, REPO])
    proc = subprocess.run([sys.executable, "-c", "import kpipe"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kpipe._compat.IncompatibleVersionError: kpipe needs tensorflow>=")
    assert "tensorflow 2.15.1 is installed" in last
    env["KPIPE_SKIP_VERSION_CHECK"] = "1"
    proc = subprocess.run([sys.executable, "-c", "import kpipe"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- the declared range: setup.cfg, README and the matrix script agree ----------------------


def _setup_cfg_floors():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    floors = {}
    for line in config["options"]["install_requires"].split("\n"):
        match = re.fullmatch(r"\s*(tensorflow|keras)>=([\d.]+)\s*", line)
        if match:
            floors[match.group(1)] = match.group(2)
    return floors


def _readme_tested_pairs():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text.split("<!-- BEGIN tested-with", 1)[1].split("<!-- END tested-with", 1)[0]
    return [tuple(cell.strip() for cell in row.strip("|").split("|")[:3])
            for row in section.splitlines() if re.match(r"\|\s*\d", row)]


def test_setup_cfg_floors_are_the_oldest_tested_pair():
    assert _setup_cfg_floors() == {"tensorflow": _compat.MIN_TENSORFLOW, "keras": _compat.MIN_KERAS}
    oldest = min(version_matrix.MATRIX, key=lambda row: _compat.parse_version(row[0]))
    assert oldest[:2] == version_matrix.MATRIX[0][:2] == (_compat.MIN_TENSORFLOW, _compat.MIN_KERAS)


def test_readme_table_lists_the_matrix_script_pairs():
    assert _readme_tested_pairs() == [(tf, k, f"`-m \"{m}\"`" if m else "all") for tf, k, m in version_matrix.MATRIX]
    with open(os.path.join(REPO, "README.md")) as f:
        assert f"TensorFlow {_compat.MIN_TENSORFLOW}+ and Keras {_compat.MIN_KERAS}+" in f.read()


# -- version-aware helpers, on the installed Keras and as an older one would see them ------


def _model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_train_step_on_batches_equals_keras_fit_for_old_and_new_keras(monkeypatch):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batches = [(tf.constant(rng.normal(size=(4, 3)), tf.float32), tf.constant(rng.normal(size=(4, 2)), tf.float32))
               for _ in range(3)]
    reference = _model(1)
    reference.fit(tf.data.Dataset.from_tensor_slices(batches[0]).concatenate(
        tf.data.Dataset.from_tensor_slices(batches[1])).concatenate(
        tf.data.Dataset.from_tensor_slices(batches[2])).batch(4), epochs=1, verbose=0, shuffle=False)
    for version in (_compat.keras_version(), (3, 5, 0)):
        monkeypatch.setattr(_compat, "keras_version", lambda v=version: v)
        model = _model(1)
        model.make_train_function()
        step = _compat.train_step_on_batches(model, model.train_function)
        assert (step is model.train_function) == (version >= (3, 7))
        for batch in batches:  # one batch a call: steps_per_execution is 1
            logs = step([batch])
        assert set(logs) >= {"loss"}
        for got, want in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert _compat.train_step_on_batches(model, model.train_function) is step  # built once


def test_finite_steps_per_epoch(monkeypatch):
    monkeypatch.setattr(_compat, "keras_version", lambda: (3, 15, 1))
    assert _compat.finite_steps_per_epoch(8, 8, epochs=3) == 8
    assert _compat.finite_steps_per_epoch(3, 8, epochs=9) == 3
    monkeypatch.setattr(_compat, "keras_version", lambda: (3, 5, 0))
    assert _compat.finite_steps_per_epoch(8, 8, epochs=3) is None  # a full pass: Keras restarts it
    assert _compat.finite_steps_per_epoch(3, 8, epochs=2) == 3  # 6 of 8 batches: one pass is enough
    assert _compat.finite_steps_per_epoch(None, 8, epochs=2) is None
    assert _compat.finite_steps_per_epoch(5, None, epochs=2) == 5  # infinite dataset
    with pytest.raises(RuntimeError, match=r"steps_per_epoch=3 over 3 epochs .* needs Keras >= 3\.7; Keras 3\.5\.0 is installed.*or pass steps_per_epoch=8"):
        _compat.finite_steps_per_epoch(3, 8, epochs=3)


# -- scripts/version_matrix.py ------------------------------------------------------------


def test_matrix_parse_pair():
    assert version_matrix.parse_pair("2.17.1:3.5.0") == ("2.17.1", "3.5.0")
    assert version_matrix.parse_pair("2.19.1") == ("2.19.1", None)
    for bad in ("", "2.17:", "tf2.17", "2.17.1:latest"):
        with pytest.raises(ValueError, match="TF\\[:KERAS\\]"):
            version_matrix.parse_pair(bad)


def test_matrix_parse_summary():
    text = "....\n=== 3 failed, 313 passed, 5 skipped, 1 xfailed, 2 warnings, 1 error in 612.35s (0:10:12) ===\n"
    got = version_matrix.parse_summary(text)
    assert (got["failed"], got["passed"], got["skipped"], got["xfailed"], got["errors"], got["seconds"]) == (
        3, 313, 5, 1, 1, 612.35)
    assert version_matrix.parse_summary("no summary")["seconds"] is None


def test_matrix_script_help_and_dry_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        version_matrix.main(["--help"])
    assert exit_info.value.code == 0 and "--pair" in capsys.readouterr().out
    assert version_matrix.main(["--dry-run", "--root", str(tmp_path), "--pair", "2.17.1:3.5.0", "--", "-m", "not slow"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("tensorflow==2.17.1 keras==3.5.0 -e '.[test]'")
    assert out[2].endswith("-m pytest -p no:cacheprovider -m 'not slow'")
    assert not os.listdir(tmp_path)  # a dry run makes nothing
    assert version_matrix.main(["--list", "--oldest"]) == 0
    assert capsys.readouterr().out.split() == [":".join(version_matrix.MATRIX[0][:2])]
    version_matrix.main(["--dry-run", "--root", str(tmp_path)])  # the table, each row with its markers
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == 3 * len(version_matrix.MATRIX)
    for (tf, keras, markers), pytest_line in zip(version_matrix.MATRIX, commands[2::3]):
        assert pytest_line.endswith(f"-m '{markers}'" if markers else "no:cacheprovider")


def test_matrix_failure_summary_shows_pytests_short_summary(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("....F\n=== short test summary info ===\nFAILED tests/t.py::test_x - boom\n=== 1 failed in 2.0s ===\n")
    text = version_matrix.failure_summary({"log": str(log), "status": "failed", "tensorflow": "2.17.1", "keras": "3.5.0"})
    assert text.splitlines()[1:] == ["=== short test summary info ===", "FAILED tests/t.py::test_x - boom",
                                     "=== 1 failed in 2.0s ==="]


def test_install_keras_fixes_patches_only_older_keras():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.trainers.trainer import Trainer

    methods = (TFOptimizer._backend_update_step, BaseOptimizer.scale_loss, Trainer._get_metrics_result_or_logs)
    _compat.install_keras_fixes()
    _compat.install_keras_fixes()  # idempotent
    now = (TFOptimizer._backend_update_step, BaseOptimizer.scale_loss, Trainer._get_metrics_result_or_logs)
    version = _compat.keras_version()
    assert [getattr(m, "_kpipe_patched", False) for m in now] == [False, version < (3, 8), version < (3, 10)]
    if version >= (3, 10):
        assert now == methods


def test_is_keras_variable_knows_every_keras_variable():
    # Keras 3.5 exports `keras.Variable` as a class the backends' variables do not derive
    # from: an optimizer's learning rate failed `isinstance(lr, keras.Variable)` there, and
    # Warmup resumed by BackupAndRestore ramped to the restored mid-ramp rate (issue 52).
    import keras

    optimizer = keras.optimizers.SGD(0.05)
    assert _compat.is_keras_variable(optimizer._learning_rate)
    assert _compat.is_keras_variable(keras.Variable(1.0))
    assert not _compat.is_keras_variable(0.05)
    assert not _compat.is_keras_variable(keras.optimizers.schedules.ExponentialDecay(0.1, 4, 0.5))
