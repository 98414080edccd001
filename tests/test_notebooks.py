"""Every notebook runs top to bottom in a real Jupyter kernel (KPIPE_SMALL=1 sizes)."""

import base64
import glob
import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))
_MAX_CODE_LINES = 300


def test_there_are_five_notebooks():
    assert [os.path.basename(p)[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_clean_and_short(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    assert sum(len(c.source.splitlines()) for c in code) < _MAX_CODE_LINES
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom_in_a_kernel(path, tmp_path, monkeypatch):
    monkeypatch.setenv("KPIPE_SMALL", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The `python3` kernel spec runs `python` from PATH: make that this interpreter (the
    # venv's, even when it is not activated), and let it import this checkout.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import json, sys\nprint(json.dumps(sys.executable))"))
    client = NotebookClient(nb, kernel_name="python3", timeout=360, startup_timeout=180, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    assert os.path.realpath(json.loads(printed)) == os.path.realpath(sys.executable)
    if os.path.basename(path).startswith("01"):
        # The notebook ends with the before/after timeline, shown as an image in the cell.
        figure_cell = nb.cells[-2]
        assert ".plot(before=" in figure_cell.source
        images = [o for o in figure_cell.outputs if "image/png" in o.get("data", {})]
        assert len(images) == 1, [o.get("data", {}).keys() for o in figure_cell.outputs]
        assert base64.b64decode(images[0]["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"


_RERUN_SETUP = '''
import keras, numpy as np, psutil, gc, kpipe

class Cell(keras.utils.PyDataset):  # defined in a cell, as users do
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return np.full((8, 3), i, "float32"), np.zeros((8, 1), "float32")

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
'''
_RERUN_CELL = "model.fit(kpipe.ProcessLoader(Cell(), workers=2), epochs=1, verbose=0)"
_COUNT_CELL = '''gc.collect()
def running(p):
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it exited after children() listed it
        return False
print(len([p for p in psutil.Process().children(recursive=True) if running(p)]))'''


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rerunning_a_fit_cell_leaves_no_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    cells = [_RERUN_SETUP] + [_RERUN_CELL] * 10 + [_COUNT_CELL]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, kernel_name="python3", timeout=240, startup_timeout=180, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    assert int(printed) == 0, f"{printed.strip()} processes left after 10 runs of a fit cell"
