"""Support for the Keras tests adapted in this folder (see README.md).

* `mode` -- every test runs twice: "plain" gives Keras the test's PyDataset as it is (the
  baseline), "kpipe" gives Keras `kpipe.ProcessLoader(dataset, workers=2)` instead.
* `wrap` -- `wrap(dataset, **loader_kwargs)`: the dataset itself in "plain" mode, a
  ProcessLoader of it (closed when the test ends) in "kpipe" mode.
* `UpstreamTestCase` -- a pytest class whose `self.assert...` are those of Keras's
  `keras.src.testing.TestCase`, so the upstream assertions stay textually unchanged
  while pytest fixtures and parametrization apply. The array assertions are Keras
  v3.15.1's (copied below, Apache License 2.0): older Keras's `assertAllEqual` cannot
  compare scalars, which the v3.15.1 tests do.
* `named_parameters` -- absl's `parameterized.named_parameters` (dict cases) for pytest.

Keep `unittest.TestCase` subclasses out of the test modules' namespaces: pytest collects
them whatever their name.
"""

import inspect

import numpy as np
import pytest
from absl.testing import absltest

import kpipe
import kpipe.loader  # noqa: F401 -- installs kpipe's Keras hooks now, for both modes alike
from kpipe import _compat
from keras.src import backend
from keras.src import testing

MODES = ("plain", "kpipe")
FIXTURES = ("request", "mode", "wrap")  # what `named_parameters` passes on, if asked for


class _Keras3151Assertions:
    """The array assertions of keras-team/keras v3.15.1 keras/src/testing/test_case.py
    (Apache License 2.0), less their TPU tolerances (the tests run on CPU)."""

    def convert_to_numpy(self, x):
        if isinstance(x, np.ndarray):
            return x
        elif backend.is_tensor(x) or isinstance(x, backend.Variable):
            return backend.convert_to_numpy(x)
        return np.array(x)

    def assertAllClose(self, actual, desired, atol=1e-6, rtol=1e-6, msg=None):
        actual = self.convert_to_numpy(actual)
        desired = self.convert_to_numpy(desired)
        np.testing.assert_allclose(
            actual, desired, atol=atol, rtol=rtol, err_msg=msg or ""
        )

    def assertNotAllClose(self, x1, x2, atol=1e-6, rtol=1e-6, msg=None):
        try:
            self.assertAllClose(x1, x2, atol=atol, rtol=rtol)
        except AssertionError:
            return
        msg = msg or ""
        raise AssertionError(
            f"The two values are close at all elements. \n{msg}.\nValues: {x1}"
        )

    def assertAllEqual(self, actual, desired, msg=None):
        actual = self.convert_to_numpy(actual)
        desired = self.convert_to_numpy(desired)
        np.testing.assert_array_equal(actual, desired, err_msg=msg or "")

    def assertLen(self, iterable, expected_len, msg=None):
        self.assertEqual(len(iterable), expected_len, msg=msg)


class _Checker(_Keras3151Assertions, testing.TestCase, absltest.TestCase):
    # Keras < 3.6's TestCase is a bare unittest.TestCase: absltest adds the assertions
    # upstream now inherits through parameterized.TestCase (assertContainsExactSubsequence).
    def runTest(self):  # pragma: no cover -- never run, only instantiated
        pass


class UpstreamTestCase:
    """Base of the adapted upstream test classes (pytest style, see the module docstring)."""

    def setup_method(self, method):
        self._checker = _Checker()
        self._checker.setUp()  # Keras's per-test setUp: clear_session() and the like

    def teardown_method(self, method):
        checker = self.__dict__.pop("_checker", None)
        if checker is not None:
            checker.tearDown()
            checker.doCleanups()

    def __getattr__(self, name):
        checker = self.__dict__.get("_checker")
        if checker is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(checker, name)


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


@pytest.fixture
def wrap(mode):
    loaders = []

    def wrap(dataset, **loader_kwargs):
        if mode == "plain":
            return dataset
        loader = kpipe.ProcessLoader(dataset, workers=2, **loader_kwargs)
        loaders.append(loader)
        return loader

    yield wrap
    for loader in loaders:
        loader.close()


def skip_in_kpipe(mode, reason):
    if mode == "kpipe":
        pytest.skip(reason)


def xfail_in_kpipe(request, mode, reason):
    """A kpipe bug: the case passes in plain mode and must fail in kpipe mode (strict)."""
    if mode == "kpipe":
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"kpipe bug: {reason}"))


def needs_keras(version, reason):
    """Skips (in both modes) where the installed Keras predates `version`, the release
    whose behaviour the upstream test checks."""
    if not _compat.keras_at_least(version):
        wanted = ".".join(map(str, version))
        pytest.skip(f"Keras < {wanted}: {reason}")


def named_parameters(cases):
    """absl's `parameterized.named_parameters(cases)` for a pytest test method.

    Each case is a dict with `testcase_name`; the decorated function keeps its upstream
    signature (defaults included) plus any of `request`, `mode`, `wrap` it names, and is
    called with the case's keyword arguments."""

    params = [
        pytest.param({k: v for k, v in case.items() if k != "testcase_name"}, id=case["testcase_name"])
        for case in cases
    ]

    def decorate(fn):
        wanted = [name for name in FIXTURES if name in inspect.signature(fn).parameters]

        def test(self, request, mode, wrap, params):
            fixtures = {"request": request, "mode": mode, "wrap": wrap}
            return fn(self, **{name: fixtures[name] for name in wanted}, **params)

        test.__name__ = test.__qualname__ = fn.__name__
        test.__doc__ = fn.__doc__
        test.pytestmark = list(getattr(fn, "pytestmark", []))
        return pytest.mark.parametrize("params", params)(test)

    return decorate
