"""A dataset whose module imports TensorFlow (as a user's might): its worker imports it."""

import os

import numpy as np
import tensorflow as tf


class TfThreads:
    """Returns pid and TensorFlow's intra/inter-op thread counts after one TF op."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        x = tf.reduce_sum(tf.ones((4, 4))).numpy()
        threading = tf.config.threading
        return np.array([os.getpid(), threading.get_intra_op_parallelism_threads(),
                         threading.get_inter_op_parallelism_threads(), int(x)], dtype=np.int64)
