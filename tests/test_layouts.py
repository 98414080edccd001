"""No worker imports TensorFlow because of where the dataset's class lives.

Each layout's batches carry whether their worker had TensorFlow in `sys.modules`. The
classes live in `tests/_layouts/` (a package whose `__init__` imports no keras), in
`__main__` (a script run in a subprocess) and in a notebook-like namespace (a module
object that is not importable, as a cell's class is).
"""

import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import kpipe

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def _tf_in_workers(dataset, **kw):
    with kpipe.ProcessLoader(dataset, workers=2, **kw) as loader:
        return {int(loader[i][1][0]) for i in range(len(loader))}


def _layout(name):
    import importlib

    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(f"_layouts.{module}"), cls)


@pytest.mark.parametrize("name", [
    "with_keras.WithKeras",  # a module that imports keras (the README's)
    "base.Base",  # the base class itself
    "only_base.OnlyBase",  # a module that imports only its base's module
    "sub_sub.SubSub",  # a subclass of a subclass, each in its own module
    "sequence.Seq",  # keras.utils.Sequence
    "heavy_pkg.plain.Plain",  # a package whose __init__ imports keras
])
def test_no_tensorflow_in_workers_whatever_module_the_class_lives_in(name, no_leaks):
    assert _tf_in_workers(_layout(name)()) == {0}


def test_no_tensorflow_in_workers_for_a_notebook_like_class(no_leaks):
    cell = types.ModuleType("cell")  # (not importable: its class travels by value, as a cell's)
    exec(textwrap.dedent("""
        import keras
        from _layouts._flag import tf_flag

        class Cell(keras.utils.PyDataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return tf_flag(i)
    """), cell.__dict__)
    assert _tf_in_workers(cell.Cell()) == {0}


def test_a_dataset_whose_own_code_uses_tensorflow_imports_it(no_leaks):
    assert _tf_in_workers(_layout("uses_tf.UsesTF")()) == {1}  # (the check can fail)


@pytest.mark.parametrize("held", ["function", "object"])
def test_no_tensorflow_in_workers_for_a_dataset_holding_code_of_a_module_that_imports_keras(held, no_leaks):
    from _layouts import heavy_fns
    from _holder import Holder  # (a module of no package: nothing of it leads to heavy_fns)

    assert _tf_in_workers(Holder(heavy_fns.batch if held == "function" else heavy_fns.Scale())) == {0}


def test_no_tensorflow_in_workers_for_a_py_map_fn_of_a_module_that_imports_keras(no_leaks):
    import tensorflow as tf

    from _layouts import heavy_fns

    ds = kpipe.data.pipeline(tf.data.Dataset.range(8), batch_size=4, py_map_fn=heavy_fns.sample, workers=1)
    flags = [f.tolist() for _, f in ds.as_numpy_iterator()]
    todo = [ds]  # (the mapper pool sits on a dataset under pipeline()'s prefetch and options)
    while todo:
        d = todo.pop()
        if hasattr(d, "_kpipe_mapper_pool"):
            d._kpipe_mapper_pool.close()  # (its workers, now: not after the idle close)
        todo.extend(d._inputs())
    assert flags == [[0] * 4] * 2


_MAIN = textwrap.dedent("""
    import sys
    import keras, kpipe
    from _layouts.base import Base
    from _layouts._flag import tf_flag

    class Main(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return tf_flag(i)

    class MainOverBase(Base):  # a class in __main__ over the user's own base
        pass

    for cls in (Main, MainOverBase):
        with kpipe.ProcessLoader(cls(), workers=2) as loader:
            print(cls.__name__, sorted({int(loader[i][1][0]) for i in range(len(loader))}))
""")


def test_no_tensorflow_in_workers_for_a_class_in_main(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_MAIN)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, TESTS, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["Main [0]", "MainOverBase [0]"]


@pytest.mark.timeout(300)
def test_kpipe_bench_hides_tensorflow_start_up_log_of_its_workers(tmp_path):
    from kpipe._cli._quiet import startup_noise_filter

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, TESTS, os.environ.get("PYTHONPATH")]))
    noise = startup_noise_filter()
    seen = {}
    for verbose in (False, True):  # (--verbose: the log shows, so the check can fail)
        args = ["bench", "_layouts.uses_tf:UsesTF", "--workers", "2", "--batches", "3"] + ["--verbose"] * verbose
        proc = subprocess.run([sys.executable, "-m", "kpipe.cli", *args], cwd=str(tmp_path), env=env,
                              capture_output=True, text=True, timeout=250)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "run 1/1: workers=2: 3 batches" in proc.stderr
        seen[verbose] = [line for line in proc.stderr.splitlines() if noise(line)]
    assert seen[False] == []
    assert seen[True]
