"""Every Python snippet of the README runs as written, with small data.

Each ```python block of README.md is extracted and run in a fresh process, in a folder
holding the files it names (`train.h5`, `photos/`, ...). What runs before it defines only
what the README says the user defines -- their model (`model`, `build()`), their dataset
class's bodies, `augment_tf`, `train_seq`, ... -- and the snippet itself is changed only
where the README leaves something to the user (`...`, `Images(...)`) or where the sizes are
shrunk (`epochs=90`, `workers=8`), each change listed in `CASES` and checked to apply. A
README snippet without a case fails `test_every_readme_snippet_has_a_case`.
"""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
README = os.path.join(REPO, "README.md")

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def readme_snippets():
    """`(line, code)` of each ```python block of the README."""
    text = open(README, encoding="utf-8").read()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


# ---------------------------------------------------------------------------- the user's part

IMPORTS = "import h5py, keras, kpipe, numpy as np, tensorflow as tf\n"

# The README's `Images` with the bodies a user writes for its `...` (x: 8 features, y: 0/1).
IMAGES_BODIES = {
    "    def __len__(self): ...": textwrap.indent(textwrap.dedent("""\
        def __len__(self):
            if self._h5 is None:
                self._h5 = h5py.File(self.path, "r")
            return len(self._h5["x"]) // self.batch_size"""), "    "),
    "    def __getitem__(self, i): ...": textwrap.indent(textwrap.dedent("""\
        def __getitem__(self, i):
            if self._h5 is None:
                self._h5 = h5py.File(self.path, "r")
            s = slice(i * self.batch_size, (i + 1) * self.batch_size)
            return self._h5["x"][s], self._h5["y"][s]"""), "    "),
    "    def on_epoch_end(self): ...": "    def on_epoch_end(self):\n        pass",
}

BUILD = textwrap.dedent("""\
    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(2, activation="softmax")])
""")
MODEL = BUILD + 'model = build()\nmodel.compile("adam", "sparse_categorical_crossentropy")\n'


def _images_class():
    """The README's first snippet's class, with its bodies filled in as above."""
    code = next(code for _, code in readme_snippets() if "class Images(keras.utils.PyDataset)" in code)
    code = code[:code.index("\ntrain = ")]
    return _fill_bodies(code) + "\n"


def _fill_bodies(code):
    lines = []
    for line in code.splitlines():
        body = next((new for old, new in IMAGES_BODIES.items() if line.startswith(old)), None)
        lines.append(body if body is not None else line)
    return "\n".join(lines)


def _write_h5(path, n=64, x="x", y="y"):
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f[x] = rng.normal(size=(n, 8)).astype("float32")
        f[y] = (np.arange(n) % 2).astype("int64")


def _write_photos(folder):
    from PIL import Image

    for label in ("cat", "dog"):
        os.makedirs(os.path.join(folder, "photos", label))
        for i in range(2):
            pixels = np.random.default_rng(i).integers(0, 255, size=(40, 30, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, "photos", label, f"{i}.jpg"))


def _write_tfrecord(path):
    import tensorflow as tf

    with tf.io.TFRecordWriter(path) as writer:
        for i in range(4):
            features = {"image": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i)] * 784)),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


def _tensorboard_installed():
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


# ---------------------------------------------------------------------------- the cases
# key (a phrase only that snippet has) -> before (the user's part), changes [(old, new)],
# after (checks), files (what the folder holds), and how to run it.

LOGICAL_CPUS = ('tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0], '
                '[tf.config.LogicalDeviceConfiguration()] * 2)\n')

CASES = {
    "class Images(keras.utils.PyDataset)": dict(
        before=MODEL, changes=[("workers=8", "workers=2"), ("epochs=10", "epochs=2")], fill_bodies=True,
        after="assert len(model.history.history['loss']) == 2\n", files=["train.h5", "val.h5"]),
    "kpipe.fit_generator(model, generator=train_seq": dict(
        before=MODEL + "{images}train_seq, val_seq = Images('train.h5', 16), Images('val.h5', 16)\n",
        changes=[("epochs=10", "epochs=2"), ("workers=8", "workers=2")],
        after="assert len(model.history.history['loss']) == 2\n", files=["train.h5", "val.h5"],
        keras_restarts=True),  # (validation_steps shorter than the data: Keras >= 3.7, README's Known limits)
    "source = kpipe.data.from_hdf5(": dict(
        before=MODEL + textwrap.dedent("""\
            def augment_tf(x, y):
                return x + tf.random.normal(tf.shape(x), stddev=0.01), y
            def augment_numpy(x, y):
                return np.flip(x).copy(), y
        """), changes=[("workers=8", "workers=2"), ("epochs=10", "epochs=2")],
        after="assert len(model.history.history['loss']) == 2\n", files=["train-0.h5:images", "train-1.h5:images"]),
    "ds = kpipe.data.from_numpy(x_train, y_train)": dict(
        before="x_train, y_train = np.zeros((8, 4), 'float32'), np.arange(8) % 2\n", changes=[],
        after="x, y = next(iter(ds)); assert x['image'].shape == (784,) and int(y) == 0\n",
        files=["photos/", "train-0.tfrecord"]),
    "strategy = kpipe.distribute.auto_strategy()   # TF_CONFIG": dict(
        before=BUILD + "{images}",
        changes=[("global_batch=global_batch)), ...)", 'global_batch=global_batch)), "sparse_categorical_crossentropy")'),
                 ("Images(...)", 'Images("train.h5", 16)'), ("epochs=90", "epochs=6"), ("workers=8", "workers=2"),
                 ('"/shared/backup"', '"backup"')],
        after="assert len(model.history.history['loss']) == 6 and os.path.exists('model.keras')\n",
        files=["train.h5"], tensorboard=True),
    "profiler = kpipe.callbacks.InputProfiler(": dict(
        before=MODEL + "{images}" + textwrap.dedent("""\
            serial_profiler = kpipe.callbacks.InputProfiler(warn_above=None)   # a run before, without kpipe
            model.fit(Images("train.h5", 16), epochs=1, callbacks=[serial_profiler], verbose=0)
            train = kpipe.ProcessLoader(Images("train.h5", 16), workers=2)
        """), changes=[("epochs=10", "epochs=2")],
        after="train.close(); assert os.path.getsize('timeline.png') > 0 and os.path.exists('log.csv')\n",
        files=["train.h5"]),
    'os.environ["KERAS_BACKEND"] = "jax"': dict(  # (run on TensorFlow here; on JAX: tests/test_backend_jax.py)
        before=MODEL + "{images}",
        changes=[('import os; os.environ["KERAS_BACKEND"] = "jax"', "import os"), ("workers=8", "workers=2"),
                 ("epochs=10", "epochs=2")],
        after="assert len(model.history.history['loss']) == 2 and 'input_wait_share' in model.history.history\n",
        files=["train.h5", "val.h5"]),
    "workers=kpipe.RayWorkers(32": dict(
        before=MODEL + "{images}import ray\nray.init(num_cpus=2, resources={'preprocess': 2}, "
                       "include_dashboard=False, logging_level='ERROR', log_to_driver=False)\n",
        changes=[("RayWorkers(32", "RayWorkers(2"), ("epochs=10", "epochs=1")],
        after="loader.close(); ray.shutdown()\n", files=["train.h5"], needs="ray"),
    "history = kpipe.distribute.ps_fit(": dict(
        before=BUILD + textwrap.dedent("""\
            def make_dataset():
                x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
                return tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0).astype("int64"))).repeat()
            x_val, y_val = np.zeros((16, 8), "float32"), np.zeros(16, "int64")
        """),
        changes=[("epochs=10", "epochs=2"), ("steps_per_epoch=500", "steps_per_epoch=3"),
                 ('"/shared/ps-backup"', '"ps-backup"'), (".batch(256)", ".batch(32)")],
        after="assert len(history.history['loss']) == 2\n", files=[], launch_ps=True),
    "piped = kpipe.distribute.pipeline_model(": dict(
        before=LOGICAL_CPUS + BUILD + "{images}",
        changes=[('["/gpu:0", "/gpu:1"]', '["/cpu:0", "/cpu:1"]'),  # (no GPUs here: logical CPUs)
                 ("Images(...)", 'Images("train.h5", 16)'), ("workers=8", "workers=2"), ("epochs=10", "epochs=2")],
        after="m = build(); m.load_weights('w.weights.h5')\n", files=["train.h5"]),
}


def _case_of(code):
    keys = [key for key in CASES if key in code]
    assert len(keys) <= 1, f"several cases match one snippet: {keys}"
    return keys[0] if keys else None


def test_every_readme_snippet_has_a_case():
    snippets = readme_snippets()
    missing = [(line, code.splitlines()[0]) for line, code in snippets if _case_of(code) is None]
    assert not missing, f"README snippets without a case in CASES (add one): {missing}"
    assert {_case_of(code) for _, code in snippets} == set(CASES)  # (no case outlived its snippet)


def _script(code, case):
    for old, new in case["changes"]:
        assert old in code, f"the README snippet no longer has {old!r}: update its case"
        code = code.replace(old, new)
    if case.get("tensorboard") and not _tensorboard_installed():
        old = 'keras.callbacks.TensorBoard("logs")'
        assert old in code
        code = code.replace(old, 'keras.callbacks.CSVLogger("tb.csv")')  # (as the snippet says: it needs tensorboard)
    if case.get("fill_bodies"):
        code = _fill_bodies(code)
    before = case["before"].replace("{images}", _images_class())
    return "import os\n" + IMPORTS + before + "\n# --- README snippet ---\n" + code + "\n# --- checks ---\n" + case["after"]


def _make_files(folder, files):
    for name in files:
        if name == "photos/":
            _write_photos(folder)
        elif name.endswith(".tfrecord"):
            _write_tfrecord(os.path.join(folder, name))
        elif name.endswith(":images"):
            _write_h5(os.path.join(folder, name.split(":")[0]), n=128, x="images", y="labels")
        else:
            _write_h5(os.path.join(folder, name))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("line, code", readme_snippets(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_snippet_runs(line, code, tmp_path):
    case = CASES.get(_case_of(code))
    assert case is not None, f"README line {line}: no case (see test_every_readme_snippet_has_a_case)"
    if case.get("needs"):
        pytest.importorskip(case["needs"])
    if case.get("keras_restarts"):
        from kpipe import _compat

        if not _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET):
            pytest.skip("needs Keras >= 3.7 (it restarts a finite dataset: README, Known limits)")
    _make_files(str(tmp_path), case["files"])
    script = tmp_path / "snippet.py"
    script.write_text(_script(code, case))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KPIPE_CACHE_DIR")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(script)]
    if case.get("launch_ps"):
        command = [sys.executable, "-m", "kpipe.cli", "launch", "--workers", "2", "--ps", "1", "--timeout", "400",
                   "--", *command]
    proc = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, f"README line {line}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
