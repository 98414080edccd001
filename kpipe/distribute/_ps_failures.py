"""Which errors `ps_fit`'s coordinator treats as a lost worker (imports TensorFlow).

NOTE [ A killed worker's garbled request ]
------------------------------------------
`tf.distribute.coordinator.ClusterCoordinator` re-runs a step on another worker when the
step's worker is lost -- but only for the errors its `_is_worker_failure` recognises
(`UnavailableError`/`AbortedError` naming `/job:worker`, and a few `InvalidArgumentError`
and `NotFoundError` texts). Any other error fails the whole job. When a worker is
SIGKILLed, TF 2.21 sometimes sends the dying worker a request whose device field is
garbage ("String field 'tensorflow.eager.Operation.device' contains invalid UTF-8 data"
in the chief's log), and the closure fails with `InternalError: ... Unable to parse
request ... from remote target /job:worker/replica:0/task:N`: seen once in a fresh-clone
run of `tests/test_distribute_ps.py`, whose job kills a worker mid-epoch and must train
on. That error comes from the worker being lost, so `install()` adds it to the
recognised ones (for `/job:worker` tasks only; an error naming `/job:ps` is never a lost
worker): the coordinator then puts the step back and runs it on a live worker, as for
`UnavailableError`. Everything else is TF's own classification.
"""

from tensorflow.python.distribute.coordinator import cluster_coordinator as _coordinator

_ORIGINAL = _coordinator._is_worker_failure


def is_worker_failure(error):
    """TF's classification, plus the garbled request of a killed worker (the NOTE)."""
    if _ORIGINAL(error):
        return True
    if isinstance(error, (_coordinator.ClosureInputError, _coordinator.ClosureAbortedError)):
        error = error.original_exception
    import tensorflow as tf

    text = str(error)
    return (isinstance(error, tf.errors.InternalError) and "Unable to parse request" in text
            and "/job:worker" in text and "/job:ps" not in text)


def install():
    """Makes the coordinator use `is_worker_failure` (idempotent)."""
    _coordinator._is_worker_failure = is_worker_failure
