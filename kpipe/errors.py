"""Exceptions raised by kpipe loaders. Importing this module is cheap (no TensorFlow)."""


class LoaderError(RuntimeError):
    """Base class of the errors kpipe raises about loading batches.

    Catch it to handle every kpipe loading failure at once; a worker's own exception is
    re-raised with its own type instead (a `ValueError` from `__getitem__` stays one).

    Example:

    >>> import numpy as np, kpipe
    >>> loader = kpipe.ProcessLoader([np.zeros(2), np.ones(2)], workers=0)
    >>> loader.close()
    >>> try:
    ...     loader[0]
    ... except kpipe.LoaderError as e:
    ...     print(type(e).__name__)
    LoaderClosedError
    """


class WorkerDiedError(LoaderError):
    """A worker process exited (crash, `os._exit`, a signal) while loading batches.

    The message names the worker, its pid, its exit code and the batch; the loader is
    closed after it (its other workers are stopped).

    Example:

    >>> import os, numpy as np, kpipe
    >>> class Dies:
    ...     def __len__(self):
    ...         return 2
    ...     def __getitem__(self, i):
    ...         if i == 1:
    ...             os._exit(3)  # a crash in the worker
    ...         return np.zeros(1)
    >>> with kpipe.ProcessLoader(Dies(), workers=1) as loader:
    ...     try:
    ...         loader[0], loader[1]
    ...     except kpipe.WorkerDiedError as e:
    ...         print("exited with code 3" in str(e))
    True
    """


class BatchTimeoutError(LoaderError, TimeoutError):
    """A batch took longer than the loader's `timeout` to arrive.

    Example:

    >>> import time, numpy as np, kpipe
    >>> class Slow:
    ...     def __len__(self):
    ...         return 1
    ...     def __getitem__(self, i):
    ...         time.sleep(3)
    ...         return np.zeros(1)
    >>> with kpipe.ProcessLoader(Slow(), workers=1, timeout=0.5) as loader:
    ...     try:
    ...         loader[0]
    ...     except kpipe.BatchTimeoutError as e:
    ...         print(str(e)[:53])
    Batch 0 of `Slow` did not arrive within timeout=0.5 s
    """


class BatchStructureError(LoaderError, ValueError):
    """A batch is not a tree of numeric/bool arrays, or its structure differs from batch 0.

    Example:

    >>> import numpy as np, kpipe
    >>> names = [np.array(["cat", "dog"])]  # strings: not something a model can take
    >>> try:
    ...     with kpipe.ProcessLoader(names, workers=0) as loader:
    ...         loader[0]
    ... except kpipe.BatchStructureError as e:
    ...     print("numeric or bool" in str(e))
    True
    """


class DatasetPicklingError(LoaderError, TypeError):
    """The dataset cannot be sent to worker processes.

    Raised when the loader is built. Open h5py objects, files opened for reading and
    memmaps are sent by their file names and reopened in each worker; a lock, a socket,
    a database connection or a file opened for writing is not, and the message names the
    attribute that holds it and what works instead.

    Example:

    >>> import threading, numpy as np, kpipe
    >>> class Locked:
    ...     def __init__(self):
    ...         self.lock = threading.Lock()
    ...     def __len__(self):
    ...         return 1
    ...     def __getitem__(self, i):
    ...         return np.zeros(1)
    >>> try:
    ...     kpipe.ProcessLoader(Locked(), workers=1)
    ... except kpipe.DatasetPicklingError as e:
    ...     print(str(e)[:81])
    `Locked` cannot be pickled to send it to worker processes (`self.lock` holds a _t
    """


class LoaderClosedError(LoaderError):
    """The loader was used after `close()`, or a previous failure shut it down.

    Example:

    >>> import numpy as np, kpipe
    >>> with kpipe.ProcessLoader([np.zeros(2)], workers=0) as loader:
    ...     x = loader[0]
    >>> try:
    ...     loader[0]  # the `with` block closed it
    ... except kpipe.LoaderClosedError as e:
    ...     print(type(e).__name__)
    LoaderClosedError
    """


class UnsupportedBackendError(RuntimeError):
    """A TensorFlow-only kpipe name was used while Keras runs on another backend (JAX or
    PyTorch). The message names what to use there instead.

    Example:

    >>> import kpipe
    >>> issubclass(kpipe.UnsupportedBackendError, RuntimeError)
    True
    """
