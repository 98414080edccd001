"""A dataset whose own code uses TensorFlow: its workers import it (the control)."""

import numpy as np

from _layouts._flag import tf_flag


class UsesTF:
    def __len__(self):
        return 2

    def __getitem__(self, i):
        import tensorflow as tf

        return np.asarray(tf.constant([i])), tf_flag(i)[1]
