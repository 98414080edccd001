"""scripts/bench_tfdata.py runs end to end (tiny sizes) and reports every ratio."""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_benchmark_script_reports_four_ratios(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))  # workers import `augment` from it
    import bench_tfdata
    out = tmp_path / "bench.json"
    assert bench_tfdata.main(["--scale", "0.01", "--repeats", "1", "--batch-size", "16", "--workers", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["workload"].split()[0]: r for r in result["results"]}
    assert set(rows) == {"HDF5", "NumPy", "I/O", "Arrays"}
    for r in rows.values():
        assert r["baseline_sps"] > 0 and r["kpipe_sps"] > 0 and r["ratio"] == pytest.approx(r["kpipe_sps"] / r["baseline_sps"])
    printed = capsys.readouterr().out
    assert "ratio" in printed and "from_hdf5 + pipeline" in printed
