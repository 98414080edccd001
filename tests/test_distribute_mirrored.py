"""MirroredStrategy over 2 logical CPU devices, chosen by `kpipe.distribute.auto_strategy`, in a
fresh process: `kpipe.ProcessLoader` input with `class_weight` trains exactly like one device, and
batches whose rows do not divide evenly are split over the replicas as tf.data splits them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
ENV.pop("TF_CONFIG", None)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_logical_cpus_train_like_one_device(tmp_path, no_leaks):
    out = tmp_path / "mirrored.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "programs", "mirrored_cpu.py"),
                           str(out)], env=ENV, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["strategy"] == "MirroredStrategy" and result["replicas"] == 2
    assert all(np.isfinite(result["loss_2_devices"]))
    np.testing.assert_allclose(result["loss_2_devices"], result["loss_1_device"], rtol=1e-5)
    assert result["max_weight_diff"] < 1e-5
    # A batch of 5 rows is split over the 2 replicas exactly as tf.data splits it.
    np.testing.assert_allclose(result["loss_loader_odd"], result["loss_tfdata_odd"], rtol=1e-6)
    placement = result["placement"]
    if placement:  # Keras >= 3.7: kpipe's feed (kpipe/_feed.py) places each replica's rows
        assert [p["device"].split("/")[-1] for p in placement] == ["device:CPU:0", "device:CPU:1"]
        assert [p["y_device"] for p in placement] == [p["device"] for p in placement]
        np.testing.assert_allclose(placement[0]["x"] + placement[1]["x"], result["x_last_batch"])
        assert [len(p["x"]) for p in placement] == [3, 2]
    # One replica on the second device: the same training; batches copied there ahead.
    np.testing.assert_allclose(result["loss_one_device_cpu1"], result["loss_1_device"], rtol=1e-5)
    assert all(d.endswith("device:CPU:1") for d in result["as_dataset_on"])
    if result["fed_on"] is not None:
        assert all(d.endswith("device:CPU:1") for d in result["fed_on"])


_MISSING = """
import json, sys
import tensorflow as tf
import kpipe
if sys.argv[1] == "logical":
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
try:
    strategy = kpipe.distribute.auto_strategy(devices=["/cpu:0", "/cpu:1"])
    print(json.dumps({"replicas": strategy.num_replicas_in_sync}))
except kpipe.distribute.DeviceNotFoundError as e:
    print(json.dumps({"error": str(e), "is_value_error": isinstance(e, ValueError)}))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setup", ["none", "logical"])
def test_devices_that_do_not_exist_fail_fast_with_a_named_error(setup):
    proc = subprocess.run([sys.executable, "-c", _MISSING, setup], env=ENV, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if setup == "logical":  # the fix the error names works
        assert result == {"replicas": 2}
        return
    message = result["error"]
    assert result["is_value_error"]
    assert "Received: devices=['/cpu:0', '/cpu:1']; not found: ['/cpu:1']" in message
    assert "Devices found: ['/device:CPU:0'" in message
    assert "tf.config.set_logical_device_configuration" in message and "before TensorFlow initialises" in message
