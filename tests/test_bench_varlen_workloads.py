"""Smoke test of the text and audio workloads registered in scripts/_workloads/ (issue 46):
`bench_loaders.py --workloads text,audio` runs bench_varlen's rows for each, and reports
every row's rate, CPU per sample and padding waste, and the issue's two ratios; peers that
are not installed are listed as skipped (no timing assertions)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALWAYS = {"kpipe", "bare processes", "tf.data bucket_by_sequence_length"}
OPTIONAL = {"torch DataLoader pad_sequence": "torch", "grain": "grain"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bench_loaders_runs_the_text_and_audio_workloads(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_loaders.py"), "--quick", "--workloads",
                           "text,audio", "--rss-epochs", "0", "--json", str(out)], capture_output=True, text=True,
                          timeout=580, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for workload in ("text", "audio"):
        got = {r["loader"]: r for r in result["rows"] if r["workload"] == workload}
        skipped = {k.split("/", 1)[1] for k in result["skipped"] if k.startswith(workload + "/")}
        assert set(got) | skipped == ALWAYS | set(OPTIONAL) and not (set(got) & skipped), (set(got), skipped)
        assert skipped <= set(OPTIONAL)
        assert all(r["rate"] > 0 and r["cpu_ms"] >= 0 and r["padding_waste"] >= 1 for r in got.values())
        # the bucketed rows pad alike
        assert len({round(got[row]["padding_waste"], 9) for row in ALWAYS}) == 1
        assert f"{workload} workload: workers 2" in proc.stdout
        assert "kpipe / bare processes:" in proc.stdout and "kpipe / best peer" in proc.stdout
        for row in skipped:
            assert f"{row}: {OPTIONAL[row]} is not importable here" in proc.stdout


def test_the_workloads_are_registered():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import _workloads

        for name in ("text", "audio"):
            module = _workloads.load(name)
            assert module.NAME == name and module.HELP
            assert all(callable(getattr(module, f)) for f in ("add_arguments", "run", "print_rows"))
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
