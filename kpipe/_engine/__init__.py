"""kpipe's process engine: worker pool, shared-memory slots, ordered delivery.

Nothing here imports TensorFlow or Keras: worker processes import only this package,
NumPy and cloudpickle (plus whatever the user's dataset imports).
"""
