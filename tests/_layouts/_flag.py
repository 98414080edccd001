"""What every layout's batch holds: whether this process has imported TensorFlow."""

import sys

import numpy as np


def tf_flag(i):
    """Batch `i`: x = [i], y = [1 if TensorFlow is imported here else 0]."""
    return np.array([i], "int64"), np.array(["tensorflow" in sys.modules], "int64")
