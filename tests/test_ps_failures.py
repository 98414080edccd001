"""`ps_fit` counts a killed worker's garbled request as a lost worker, and nothing else
beyond TF's own classification (kpipe/distribute/_ps_failures.py)."""

import pytest

tf = pytest.importorskip("tensorflow")
from tensorflow.python.distribute.coordinator import cluster_coordinator  # noqa: E402

from kpipe.distribute import _ps_failures  # noqa: E402

GARBLED = ("2 root error(s) found.\n  (0) INTERNAL: {{function_node __wrapped__Identity_device_/job:chief/replica:0/task:0/"
           "device:CPU:0}} Unable to parse request\nAdditional GRPC error information from remote target "
           "/job:worker/replica:0/task:1/device:CPU:0 while calling /tensorflow.eager.EagerService/RunComponentFunction:")


def test_a_killed_workers_garbled_request_is_a_lost_worker_and_the_rest_is_tfs():
    is_lost = _ps_failures.is_worker_failure
    assert is_lost(tf.errors.InternalError(None, None, GARBLED))
    assert is_lost(cluster_coordinator.ClosureInputError(tf.errors.InternalError(None, None, GARBLED)))
    assert not is_lost(tf.errors.InternalError(None, None, GARBLED.replace("/job:worker", "/job:ps")))
    assert not is_lost(tf.errors.InternalError(None, None, "Unable to parse request"))  # names no worker
    assert not is_lost(tf.errors.InternalError(None, None, "/job:worker/replica:0/task:1: a bug in the step"))
    assert not is_lost(ValueError(GARBLED))
    unavailable = "Socket closed from /job:worker/replica:0/task:1"
    assert is_lost(tf.errors.UnavailableError(None, None, unavailable))  # TF's own, kept
    for error in (tf.errors.UnavailableError(None, None, "/job:ps/replica:0/task:0 is unreachable"),
                  tf.errors.AbortedError(None, None, unavailable), tf.errors.CancelledError(None, None, unavailable)):
        assert is_lost(error) == _ps_failures._ORIGINAL(error)  # everything else: TF's answer


def test_install_points_the_coordinator_at_it_idempotently():
    _ps_failures.install()
    _ps_failures.install()
    assert cluster_coordinator._is_worker_failure is _ps_failures.is_worker_failure
    assert _ps_failures._ORIGINAL is not _ps_failures.is_worker_failure
