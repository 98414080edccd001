"""Each training step's loss and gradient are those of its global batch, however the
batch is split over the workers (imports TensorFlow).

NOTE [ Short and missing batches under multi-worker training ]
--------------------------------------------------------------
Keras 3 divides each replica's loss by the number of replicas `R` before the gradients
are summed across them (`keras.src.losses.loss.scale_loss_for_distribution`); the loss a
replica computes is the mean over *its* rows. The step's gradient is then the mean of the
replicas' means, which is the global batch's mean only when every replica got the same
number of rows. The last step of a pass often does not:

    per-worker batches of 8, 30 samples, 2 workers    step 2: rows (8, 6)
    a ProcessLoader shard with no batch left           a pad: rows (8, 0) -- see
                                                       kpipe/_engine/_planner.py
    tf.data's rebatching of a short global batch       rows (5, 0), (3, 2) ...
      (`experimental_distribute_dataset`)              (a dummy empty batch for a
                                                       replica without data)

and one process, which takes the same global batch whole, computes another gradient
(30 samples: epoch loss 0.52776 in one process, 0.52697 in 2 workers; final bias -0.0911
against -0.1023). So kpipe's `MultiWorkerMirroredStrategy` (with more than one worker)
weights each replica's loss by `R * rows / global_rows` -- `global_rows` summed over the
replicas in the step with one scalar all-reduce -- before the gradient is taken: the sum
over replicas is then the global batch's mean loss, exactly as one process computes it
(sample weights included: Keras divides their weighted sum by the row count). A step
whose replicas have equal rows gets a weight of exactly 1.0, so full steps are
unchanged bit for bit. The weight is applied in the optimizer's `scale_loss`, which
Keras's `train_step` calls inside the tape after the loss tracker saw the loss: logged
losses are Keras's own (per replica `mean * rows`, summed over replicas by the metric's
sync on read, divided by the total rows: the global mean). Metrics and `evaluate()` need
no weight: their state is sums over rows.

`predict()` needs none either: Keras gathers every replica's rows of a step onto every
worker (`keras.src.backend.tensorflow.trainer._multi_worker_concat`), in replica order,
whatever their counts; an empty part adds no row.

A model whose `train_step` is its own (not Keras's) is left alone.
"""

import contextvars

import tensorflow as tf

# The weight of this replica's loss in the step being traced (a scalar tensor), or None.
_WEIGHT = contextvars.ContextVar("kpipe_replica_loss_weight", default=None)


def install():
    """Wraps Keras's `train_step` and the optimizers' `scale_loss` (idempotent)."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        from keras.src.optimizers import base_optimizer, loss_scale_optimizer
    except ImportError:  # another Keras layout: nothing to weight
        return
    original = TensorFlowTrainer.train_step
    if not getattr(original, "_kpipe_global_batch", False):
        TensorFlowTrainer.train_step = _weighted_train_step(original)
    for cls in (base_optimizer.BaseOptimizer, loss_scale_optimizer.LossScaleOptimizer):
        scale = cls.__dict__.get("scale_loss")
        if scale is not None and not getattr(scale, "_kpipe_global_batch", False):
            cls.scale_loss = _weighted_scale_loss(scale)


def replica_weight(data, strategy):
    """This replica's loss weight for a step on `data` (see the NOTE), or None where
    `strategy` is not a multi-worker kpipe strategy or no replica context is active.

    Must be called in the replica function of a step: it runs one all-reduce.
    """
    if getattr(strategy, "_kpipe_num_workers", 1) <= 1:
        return None
    context = tf.distribute.get_replica_context()
    if context is None or strategy.num_replicas_in_sync <= 1:
        return None
    leaves = [leaf for leaf in tf.nest.flatten(data) if leaf is not None]
    if not leaves:
        return None
    rows = tf.cast(_rows(leaves[0]), tf.float32)
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, rows)
    return tf.math.divide_no_nan(rows * float(strategy.num_replicas_in_sync), total)


def _rows(leaf):
    """The number of rows (first dimension) of a batch's leaf, dense or not."""
    if isinstance(leaf, tf.RaggedTensor):
        return leaf.nrows()
    if isinstance(leaf, tf.SparseTensor):
        return leaf.dense_shape[0]
    return tf.shape(leaf)[0]


def _weighted_train_step(original):
    def train_step(self, data):
        weight = replica_weight(data, tf.distribute.get_strategy())
        if weight is None:
            return original(self, data)
        token = _WEIGHT.set(weight)
        try:
            return original(self, data)
        finally:
            _WEIGHT.reset(token)

    train_step._kpipe_global_batch = True
    train_step.__doc__ = original.__doc__
    train_step.__wrapped__ = original
    return train_step


def _weighted_scale_loss(original):
    def scale_loss(self, loss):
        weight = _WEIGHT.get()
        if weight is not None:
            loss = loss * tf.cast(weight, loss.dtype)
        return original(self, loss)

    scale_loss._kpipe_global_batch = True
    scale_loss.__doc__ = original.__doc__
    return scale_loss
