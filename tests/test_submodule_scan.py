"""kpipe's faster search for imported submodules gives what cloudpickle's own gives."""

import contextlib
import subprocess
import sys
import textwrap
import types

import cloudpickle
import numpy as np
import pytest

from kpipe._engine import _pickling, _submodule_scan
from kpipe._engine._submodule_scan import submodule_scan


def _by_value_functions(tmp_path, name):
    """Functions of a module pickled by value that reach submodules through a package:
    `np.linalg`, `concurrent.futures`, and `<name>.sub` of a package on disk that is not
    imported yet (and `os.path`: `os` is no package, so cloudpickle looks no further)."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("VALUE = 41\n")
    sys.path.insert(0, str(tmp_path))
    module = types.ModuleType(f"user_module_{name}")
    exec(
        textwrap.dedent(
            f"""
            import os, concurrent, numpy as np, {name}
            def uses_path(p):
                return os.path.basename(p)
            def uses_linalg(a):
                return np.linalg.norm(a)
            def uses_futures():
                return concurrent.futures.ThreadPoolExecutor
            def uses_sub():
                return {name}.sub.VALUE + 1
            def uses_nothing(x):
                return x + 1
            """
        ),
        module.__dict__,
    )
    for f in vars(module).values():
        if isinstance(f, types.FunctionType):
            f.__module__ = "__main__"  # pickled by value, as a notebook's functions are
    return [module.uses_path, module.uses_linalg, module.uses_futures, module.uses_sub, module.uses_nothing]


@pytest.fixture
def functions(tmp_path):
    import concurrent.futures  # noqa: F401  (loaded, so functions may reach it)

    name = f"kpipe_scan_pkg_{tmp_path.name.replace('-', '_')}"
    try:
        yield name, _by_value_functions(tmp_path, name)
    finally:
        sys.path.remove(str(tmp_path))
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def _original():
    namespace = _submodule_scan._cloudpickle_globals()
    assert namespace is not None, "cloudpickle's _function_getstate no longer calls _find_imported_submodules"
    return namespace[_submodule_scan._NAME]


def _deps(f):
    return [f.__globals__[n] for n in f.__code__.co_names if n in f.__globals__]


def test_same_submodules_and_same_bytes_as_cloudpickle(functions):
    _, funcs = functions
    original = _original()
    plain = [cloudpickle.dumps(f) for f in funcs]
    with submodule_scan():
        for f in funcs:
            assert _submodule_scan._INDEX.find_imported_submodules(f.__code__, _deps(f)) == original(f.__code__, _deps(f))
        fast = [cloudpickle.dumps(f) for f in funcs]
    assert fast == plain
    found = {m.__name__ for f in funcs for m in original(f.__code__, _deps(f))}
    assert {"numpy.linalg", "concurrent.futures"} <= found  # the test reaches real submodules


def test_a_submodule_imported_between_pickles_is_found(functions):
    name, funcs = functions
    uses_sub = funcs[3]
    with submodule_scan():
        before = cloudpickle.dumps(uses_sub)
    __import__(f"{name}.sub")  # now loaded: the function's pickle must name it
    with submodule_scan():
        subs = _submodule_scan._INDEX.find_imported_submodules(uses_sub.__code__, _deps(uses_sub))
        after = cloudpickle.dumps(uses_sub)
    assert [m.__name__ for m in subs] == [f"{name}.sub"]
    assert after == cloudpickle.dumps(uses_sub) != before
    # ... and a fresh interpreter, where nothing imported it, can call the function.
    code = f"import sys, pickle; sys.path.insert(0, {str(sys.path[0])!r}); print(pickle.loads(sys.stdin.buffer.read())())"
    out = subprocess.run([sys.executable, "-c", code], input=after, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "42"


def test_cloudpickle_gets_its_own_function_back_even_after_an_error():
    original = _original()
    with pytest.raises(ZeroDivisionError):
        with submodule_scan():
            with submodule_scan():  # nested: restored by the outer block only
                assert _original() == _submodule_scan._INDEX.find_imported_submodules
            assert _original() == _submodule_scan._INDEX.find_imported_submodules
            1 / 0
    assert _original() is original


def test_dataset_pickles_go_through_the_index(functions, monkeypatch):
    """kpipe's `dumps` (what each pass end runs) uses the index, and its payload is what
    cloudpickle's own search gives."""
    _, funcs = functions
    calls = []
    real = _submodule_scan._Index.find_imported_submodules

    def counting(self, code, deps):
        calls.append(code.co_name)
        return real(self, code, deps)

    target = {"fns": funcs, "data": np.arange(10)}
    with monkeypatch.context() as m:
        m.setattr(_submodule_scan._Index, "find_imported_submodules", counting)
        fast, _ = _pickling.dumps(target)
    assert {"uses_sub", "uses_linalg"} <= set(calls)
    with monkeypatch.context() as m:
        m.setattr(_pickling, "submodule_scan", contextlib.nullcontext)
        plain, _ = _pickling.dumps(target)
    assert fast == plain


def test_the_per_code_lists_stay_bounded_and_give_the_same_submodules(functions, monkeypatch):
    """A notebook re-running its cells makes new code objects each time: the lists kept
    per code object are dropped past a bound, and what the search finds is unchanged."""
    _, funcs = functions
    original = _original()
    monkeypatch.setattr(_submodule_scan, "_MAX_CODES", 2)
    with submodule_scan():
        for _ in range(2):
            for f in funcs:
                assert _submodule_scan._INDEX.find_imported_submodules(f.__code__, _deps(f)) == original(f.__code__, _deps(f))
                assert len(_submodule_scan._INDEX.by_code) <= 2
