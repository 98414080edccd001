"""Every notebook runs top to bottom in a real Jupyter kernel (KPIPE_SMALL=1 sizes)."""

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


def test_there_are_four_notebooks():
    assert [os.path.basename(p)[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]


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
    client = NotebookClient(nb, kernel_name="python3", timeout=360, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    assert os.path.realpath(json.loads(printed)) == os.path.realpath(sys.executable)
