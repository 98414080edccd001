"""scripts/pipeline_heads.py: its table of per-epoch losses, unsplit vs pipeline stages, by head."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import pipeline_heads  # noqa: E402

sys.path.pop(0)


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        pipeline_heads.main(["--help"])
    assert exit_.value.code == 0 and "--microbatches" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pipeline_heads.main(["--stages", "1"])
    assert "--stages must be >= 2. Received: --stages 1." in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_small_run_has_every_head_and_matches_the_unsplit_model(tmp_path):
    out = tmp_path / "heads.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "pipeline_heads.py"), "--samples", "64", "--epochs", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=280, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| softmax, \"sparse_categorical_crossentropy\" |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["head"] for r in rows] == [h[0] for h in pipeline_heads.HEADS]
    for r in rows:
        assert len(r["pipeline_loss"]) == 2 and r["max_loss_diff"] < 1e-5 and r["max_weight_diff"] < 1e-5, r
        assert r["pipeline_moved"] > 1e-3, r  # the weights moved: the pipeline trained
