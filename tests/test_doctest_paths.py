"""Doctests that write files use a directory of their own (`tempfile.TemporaryDirectory()`),
never a fixed name in the system temp directory: two users (or two CI jobs) on one host
would otherwise collide on it."""

import doctest
import importlib
import pkgutil
import re

import kpipe

# Examples that name a temp path without writing to it (pure path computations).
_WRITES_NOTHING = {
    'per_worker_path("/tmp/backup")',
}
_FIXED_TEMP = re.compile(r"""["'](/tmp|/var/tmp)/|gettempdir\(\)""")


def _doctest_examples():
    finder = doctest.DocTestFinder()
    for info in pkgutil.walk_packages(kpipe.__path__, "kpipe."):
        module = importlib.import_module(info.name)
        for test in finder.find(module):
            for example in test.examples:
                yield test.name, example.source


def test_no_doctest_writes_a_fixed_name_in_the_temp_directory():
    offenders = [
        (name, source.strip()) for name, source in _doctest_examples()
        if _FIXED_TEMP.search(source) and not any(ok in source for ok in _WRITES_NOTHING)
    ]
    assert not offenders, (
        "Doctests use fixed paths in the shared temp directory; create one with "
        f"tempfile.TemporaryDirectory() instead: {offenders}")


def test_the_check_sees_the_doctests_it_checks():
    sources = [source for _, source in _doctest_examples()]
    assert any("tempfile.TemporaryDirectory()" in s for s in sources)
    assert any(_FIXED_TEMP.search(s) for s in sources)  # the allow-listed one is seen
