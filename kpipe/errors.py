"""Exceptions raised by kpipe loaders. Importing this module is cheap (no TensorFlow)."""


class LoaderError(RuntimeError):
    """Base class of the errors kpipe raises about loading batches."""


class WorkerDiedError(LoaderError):
    """A worker process exited (crash, `os._exit`, a signal) while loading batches."""


class BatchTimeoutError(LoaderError, TimeoutError):
    """A batch took longer than the loader's `timeout` to arrive."""


class BatchStructureError(LoaderError, ValueError):
    """A batch is not a tree of numeric/bool arrays, or its structure differs from batch 0."""


class DatasetPicklingError(LoaderError, TypeError):
    """The dataset cannot be sent to worker processes."""


class LoaderClosedError(LoaderError):
    """The loader was used after `close()`, or a previous failure shut it down."""
