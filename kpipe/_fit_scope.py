"""What a running Keras `fit()` was called with, and clean-ups that run when it ends --
returning or raising.

Keras calls a callback's `on_train_end` only when `fit()` returns: a `fit()` stopped by
an exception (a crash, Ctrl-C, another callback raising) leaves whatever a callback had
changed for the duration of the call -- a learning rate in the middle of a warmup ramp,
a wrapped schedule -- to the next `fit()` of the model. kpipe's wrapper of the
TensorFlow trainer's `fit` (`kpipe._keras_hook._plan_calls`) runs each call inside
`running(model, arguments)`; a callback registers what must be undone with
`at_exit(model, fn)`, and it runs however the call ends. A callback that finds no
running call (kpipe's wrapper not installed, e.g. another backend, or installed after
that `fit` was looked up) gets `False` back and falls back on `on_train_end` (and on
cleaning up at its next `on_train_begin`).

The calls are kept per thread of execution (a `contextvars.ContextVar`): Keras runs a
`fit()`'s callbacks in the thread that called it.
"""

import contextlib
import contextvars
import logging
import sys
from typing import Callable, Dict, List, Optional

logger = logging.getLogger("kpipe")

_CALLS = contextvars.ContextVar("kpipe_fit_calls", default=())


class FitCall:
    """One running `fit()`: its model, its bound arguments (name -> value, defaults
    included), the names the caller passed (None: not known) and the clean-ups
    registered for its end."""

    __slots__ = ("model", "arguments", "registered", "passed", "_exits")

    def __init__(self, model, arguments: Dict, registered: bool = True, passed=None):
        self.model, self.arguments, self.registered = model, dict(arguments), registered
        self.passed = None if passed is None else frozenset(passed)
        self._exits: List[Callable[[], None]] = []

    def _run_exits(self):
        while self._exits:
            fn = self._exits.pop()
            try:
                fn()
            except Exception:  # noqa: BLE001 -- never hide the error that ended fit()
                logger.warning("kpipe: a clean-up at the end of fit() failed.", exc_info=True)


@contextlib.contextmanager
def running(model, arguments: Dict, passed=None):
    """Marks a `fit()` of `model` with `arguments` (of which the caller passed the names
    `passed`) as running while the block runs; runs its clean-ups (newest first) when the
    block ends, however it ends."""
    call = FitCall(model, arguments, passed=passed)
    token = _CALLS.set(_CALLS.get() + (call,))
    try:
        yield call
    finally:
        _CALLS.reset(token)
        call._run_exits()  # noqa: SLF001


def current(model) -> Optional[FitCall]:
    """The innermost running `fit()` of `model` in this thread, or None.

    A `fit` looked up before kpipe's wrapper was installed (`model.fit(x,
    callbacks=[kpipe.callbacks.Warmup(...)])`, the first kpipe name used in the process)
    runs unwrapped: its arguments are then read from its frame, and `at_exit` is not
    available for it."""
    for call in reversed(_CALLS.get()):
        if call.model is model:
            return call
    frame = sys._getframe(1)  # noqa: SLF001
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return FitCall(model, frame.f_locals, registered=False)
        frame = frame.f_back
    return None


def at_exit(model, fn: Callable[[], None]) -> bool:
    """Runs `fn()` when the running `fit()` of `model` ends; `False` (and `fn` is not
    kept) when no `fit()` of `model` is known to run.

    Example:

    >>> at_exit(object(), lambda: None)
    False
    """
    call = current(model)
    if call is None or not call.registered:
        return False
    call._exits.append(fn)  # noqa: SLF001
    return True

