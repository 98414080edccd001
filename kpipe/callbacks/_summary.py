"""TensorBoard scalars for `InputProfiler`, written without the `tensorboard` package.

`tf.summary.scalar` lives in the `tensorboard` package (TensorFlow 2.21 no longer installs
it) and costs about a millisecond per call in eager mode. The scalars it writes are
`Event` protos in a TFRecord file, each a float32 scalar tensor tagged for the "scalars"
plugin. `ScalarWriter` writes exactly that record, built as protos in Python and appended
with `tf.io.TFRecordWriter` (a few microseconds a value), so TensorBoard, `keras.callbacks.
TensorBoard` runs and `tf.compat.v1.train.summary_iterator` read it as they read
`tf.summary.scalar` output.
"""

import itertools
import os
import socket
import time

_COUNTER = itertools.count()


class ScalarWriter:
    """Appends scalar summaries to a new event file in `log_dir`.

    Not thread-safe; one writer per `fit()`.

    Args:
        log_dir: Directory of the event file (created if missing): a TensorBoard run.
    """

    def __init__(self, log_dir):
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorflow.core.util import event_pb2

        self._pb = (summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2, event_pb2)
        self._metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_COUNTER)}.kpipe.v2"
        self.path = os.path.join(log_dir, name)
        self._writer = tf.io.TFRecordWriter(self.path)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step, values, wall_time=None):
        """Writes `{tag: float}` at `step` (one event)."""
        summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2, event_pb2 = self._pb
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(
                    tag=tag,
                    metadata=self._metadata,
                    tensor=tensor_pb2.TensorProto(
                        dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(), float_val=[float(v)]
                    ),
                )
                for tag, v in values.items()
            ]
        )
        self._write(event_pb2.Event(wall_time=wall_time or time.time(), step=int(step), summary=summary))

    def _write(self, event):
        self._writer.write(event.SerializeToString())

    def flush(self):
        self._writer.flush()

    def close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
