"""Functions in a module that imports keras: a `py_map_fn`, or a function a dataset from
another module holds (`_holder.Holder(heavy_fns.batch)`), pickled by reference would make
each worker import this module, and keras and TensorFlow with it."""

import keras  # noqa: F401 -- (the user's training module imports it)
import numpy as np

from _layouts._flag import tf_flag


def sample(x):
    """A per-sample `py_map_fn`: the sample and whether TensorFlow is imported here."""
    return np.asarray(x), tf_flag(0)[1][0]


def batch(i):
    return tf_flag(i)


class Scale:
    """An object of this module's class held by a dataset of another module."""

    def __call__(self, i):
        return tf_flag(i)
