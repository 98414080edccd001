"""A package whose `__init__` imports keras: importing any of its modules imports TensorFlow."""

import keras  # noqa: F401
