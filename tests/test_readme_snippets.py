"""Every Python snippet of the README runs as written, with small data.

Each ```python block of README.md is extracted and run in a fresh process, in a folder
holding the files it names (`train.h5`, ...). What runs before it defines only what the
README says the user defines -- their model (`model`, `build()`) and their dataset class's
bodies -- and the snippet itself is changed only where the README leaves something to the
user (`...`) or where the sizes are shrunk (`workers=8`, `epochs=10`), each change listed in
`CASES` and checked to apply. A README snippet without a case fails
`test_every_readme_snippet_has_a_case`. (The docs site's pages, where the other examples
moved, are run by tests/test_docs.py.)
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


# ---------------------------------------------------------------------------- the cases
# key (a phrase only that snippet has) -> before (the user's part), changes [(old, new)],
# after (checks), files (what the folder holds), and how to run it.

CASES = {
    "class Images(keras.utils.PyDataset)": dict(
        before=MODEL, changes=[("workers=8", "workers=2"), ("epochs=10", "epochs=2")], fill_bodies=True,
        after="assert len(model.history.history['loss']) == 2\n", files=["train.h5", "val.h5"]),
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
    if case.get("fill_bodies"):
        code = _fill_bodies(code)
    return "import os\n" + IMPORTS + case["before"] + "\n# --- README snippet ---\n" + code + "\n# --- checks ---\n" + case["after"]


def _make_files(folder, files):
    for name in files:
        _write_h5(os.path.join(folder, name))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("line, code", readme_snippets(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_snippet_runs(line, code, tmp_path):
    case = CASES.get(_case_of(code))
    assert case is not None, f"README line {line}: no case (see test_every_readme_snippet_has_a_case)"
    _make_files(str(tmp_path), case["files"])
    script = tmp_path / "snippet.py"
    script.write_text(_script(code, case))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KPIPE_CACHE_DIR")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, f"README line {line}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
