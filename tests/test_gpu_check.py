"""scripts/gpu_check.py / gpu_check.sh: the no-GPU exit, and the utilisation-over-time figure."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import gpu_check  # noqa: E402

sys.path.pop(0)
HAVE_GPU = shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def png_size(path):
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(HAVE_GPU, reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_both_entry_points_say_so_and_exit_0(tmp_path, capsys):
    assert gpu_check.main(["--plot", str(tmp_path / "g.png")]) == 0
    assert "no NVIDIA GPU" in capsys.readouterr().out
    assert not (tmp_path / "g.png").exists()
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "no NVIDIA GPU" in proc.stdout


def test_figure_draws_utilisation_and_waits_for_both_arms(tmp_path):
    def arm(name, busy):
        return {
            "arm": name, "samples_per_sec": 1000.0 if busy > 50 else 300.0, "input_wait_share": 1 - busy / 100,
            "gpu_busy_pct": busy, "gpu_series": [(0.1 * i, (90.0 if i % 3 else 0.0) if busy < 50 else 88.0) for i in range(30)],
            "step_start_s": [0.05 * i for i in range(60)], "step_wait_ms": [20.0 if busy < 50 else 0.5] * 60,
            "step_ms": [50.0] * 60,
        }

    names = {"keras": "keras PyDataset", "kpipe": "kpipe ProcessLoader"}
    fig = gpu_check.plot_utilisation([arm("keras", 40.0), arm("kpipe", 88.0)], names, str(tmp_path / "u.png"))
    assert png_size(tmp_path / "u.png") == (1080, 520)
    (u0, u1), (w0, w1) = fig.axes[0:2], fig.axes[2:4]
    assert u0.get_ylabel() == "GPU utilisation (%)" and w0.get_ylabel() == "input wait per step (ms)"
    assert w1.get_xlabel() == "seconds into the timed epoch"
    assert "GPU busy 40%" in u0.get_title() and "GPU busy 88%" in u1.get_title()
    assert u0.get_shared_y_axes().joined(u0, u1) and w0.get_shared_x_axes().joined(w0, u0)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_cpu_run_prints_the_table_and_draws_the_waits(tmp_path):
    png = tmp_path / "gpu.png"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--cpu-ok", "--steps", "4", "--batch", "8",
         "--size", "16", "--workers", "2", "--arm-timeout", "170", "--plot", str(png),
         "--arms", "keras,kpipe,kpipe-dataset-device"],
        capture_output=True, text=True, timeout=380, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kpipe ProcessLoader (2 workers)" in proc.stdout and f"wrote {png}" in proc.stdout
    assert "kpipe as_dataset(device=GPU)" in proc.stdout and "kpipe-dataset-device / keras samples/s" in proc.stdout
    assert png_size(png) == (1620, 520)  # one column per arm


def test_pipeline_case_runs_with_two_gpus_and_says_why_not_otherwise():
    assert gpu_check.pipeline_skip_reason(2, cpu_ok=False, only=None) is None
    assert gpu_check.pipeline_skip_reason(0, cpu_ok=True, only="pipeline") is None  # logical CPU devices
    for gpus, cpu_ok in ((0, False), (1, False), (1, True)):
        reason = gpu_check.pipeline_skip_reason(gpus, cpu_ok=cpu_ok, only=None)
        assert f"lists {gpus} GPU(s)" in reason and "needs 2 or more" in reason


def test_pipeline_report_lists_each_gpus_peak_memory(capsys):
    gpu_check.print_pipeline({
        "arm": "pipeline", "devices": ["/gpu:0", "/gpu:1"], "microbatches": 4, "params": 134_000_000,
        "split": [["a"], ["b"]], "loss_one": [2.3, 2.1], "loss_pipeline": [2.3, 2.1], "max_rel_diff": 1e-7,
        "match": True, "peak_mb_one": [2100.0, 0.0], "peak_mb_pipeline": [1100.0, 1050.0],
        "seconds_one": 10.0, "seconds_pipeline": 12.0})
    out = capsys.readouterr().out
    assert "134,000,000-weight MLP in 2 stages over /gpu:0, /gpu:1, 4 micro-batches (bubble 20%)" in out
    assert "losses match one device" in out
    assert "/gpu:0" in out and "2,100" in out and "1,100" in out and "1,050" in out
    gpu_check.print_pipeline({"arm": "pipeline", "skipped": "nvidia-smi lists 1 GPU(s); model parallelism needs 2"})
    assert "gpu_check: pipeline case skipped: nvidia-smi lists 1 GPU(s)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_pipeline_case_on_logical_cpus_checks_the_losses(tmp_path):
    out = tmp_path / "pipe.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--cpu-ok", "--only", "pipeline", "--steps", "4",
         "--batch", "16", "--pipeline-width", "32", "--pipeline-depth", "3", "--arm-timeout", "170", "--json", str(out)],
        capture_output=True, text=True, timeout=190, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "losses match one device" in proc.stdout
    result = json.loads(out.read_text())["pipeline"]
    assert result["devices"] == ["/cpu:0", "/cpu:1"] and result["match"] and result["peak_mb_one"] is None
    assert len(result["loss_one"]) == 2 and result["max_rel_diff"] < 1e-4



def _torch_script():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import gpu_check_torch

    sys.path.pop(0)
    return gpu_check_torch, os.path.join(REPO, "scripts", "gpu_check_torch.py"), dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)


def test_torch_arm_says_skipped_and_exits_0_without_cuda_torch():
    """scripts/gpu_check_torch.py (kpipe/_torch_pin.py's GPU check) where torch is missing or
    has no CUDA: "skipped: no CUDA torch (<why>)", exit 0."""
    module, script, env = _torch_script()
    skip = module.cuda_skip_reason()
    if skip is None:
        pytest.skip("torch has CUDA here: the check runs (scripts/gpu_check.sh)")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"gpu_check_torch: skipped: no CUDA torch ({skip})" in proc.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_torch_arm_on_the_cpu_trains_every_arm_to_plain_keras_weights(tmp_path):
    """`--cpu-ok` with torch (CPU): every arm trains and ends with plain Keras's weights and
    losses (the pin arm through KPIPE_TORCH_PIN=cpu: the ahead copy with the CPU as device)."""
    module, script, env = _torch_script()
    skip = module.cuda_skip_reason()
    if skip is not None and skip.startswith("torch is not importable"):
        pytest.skip(skip)
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, script, "--cpu-ok", "--steps", "3", "--batch", "4", "--size", "8",
                           "--workers", "1", "--rounds", "1", "--epochs", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=380, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every arm ends with plain Keras's weights and losses" in proc.stdout
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["cuda"] is (skip is None)
    assert set(result) >= {"plain", "kpipe-pin", "kpipe-nopin", "torch-dl"}
    assert result["kpipe-pin"]["losses"] == result["plain"]["losses"] and len(result["plain"]["losses"]) == 2
