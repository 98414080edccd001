#!/usr/bin/env bash
# GPU check: is the GPU kept busy? Keras multiprocessing vs kpipe.ProcessLoader feeding a
# ResNet-style model, with nvidia-smi sampled at 10 Hz (see scripts/gpu_check.py). With 2 or
# more GPUs, also the pipeline case: a model in stages over the GPUs (kpipe.distribute.
# pipeline_model) checked against one GPU, with each GPU's peak memory; skipped otherwise.
#
#   scripts/gpu_check.sh                   # defaults: 60 steps x 2 epochs per arm, < 9 minutes
#   scripts/gpu_check.sh --only pipeline   # just the model-parallel case (2+ GPUs)
#   scripts/gpu_check.sh --workers 16 --json gpu.json --plot gpu.png   # figure: utilisation over time
#   PYTHON=/path/to/python scripts/gpu_check.sh   # use an existing environment
#
# PyTorch arm: when the chosen Python has torch with CUDA, scripts/gpu_check_torch.py runs
# first (kpipe's pinned-memory ahead copy under KERAS_BACKEND=torch against plain Keras and
# torch's DataLoader(pin_memory=True); < 4 minutes). GPU_CHECK_TORCH=0 skips it,
# GPU_CHECK_TORCH=only runs just it.
#
# Without an NVIDIA GPU it says so and exits 0. Otherwise it makes sure `kpipe` (this
# checkout, `pip install -e .`) and a TensorFlow that sees the GPU are installed in the
# chosen Python (default: ./.venv if present, else a new ./.venv-gpu), then runs the check.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU found (nvidia-smi missing or failing); nothing to check."
    exit 0
fi
nvidia-smi -L

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu
    PY=.venv-gpu/bin/python
fi

sees_gpu() {
    "$PY" - <<'PY' 2>/dev/null
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
sys.exit(0 if tf.config.list_physical_devices("GPU") else 1)
PY
}

"$PY" -c "import kpipe, matplotlib" 2>/dev/null || "$PY" -m pip install -q -e ".[plot]"
if ! sees_gpu; then
    echo "gpu_check: TensorFlow in $PY does not see the GPU; installing tensorflow[and-cuda]..."
    TF_VERSION=$("$PY" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null || echo "")
    "$PY" -m pip install -q "tensorflow[and-cuda]${TF_VERSION:+==$TF_VERSION}"
    if ! sees_gpu; then
        echo "gpu_check: nvidia-smi lists a GPU but TensorFlow cannot use it (CUDA driver/library mismatch?)." >&2
        exit 1
    fi
fi

torch_rc=0
case "${GPU_CHECK_TORCH:-1}" in
    0) ;;
    *)
        if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            timeout 240 "$PY" scripts/gpu_check_torch.py || torch_rc=$?
        else
            echo "gpu_check: torch arm skipped: no CUDA torch in $PY (pip install torch with CUDA to run it)"
        fi
        if [ "${GPU_CHECK_TORCH:-1}" = only ]; then exit "$torch_rc"; fi
        ;;
esac
if [ "$torch_rc" != 0 ]; then
    echo "gpu_check: the torch arm failed (exit $torch_rc); the TensorFlow arms follow" >&2
    timeout 540 "$PY" scripts/gpu_check.py "$@" || true
    exit "$torch_rc"
fi

# 9-minute budget for the whole check (four loader arms and the pipeline case); each arm also has its
# own timeout.
exec timeout 540 "$PY" scripts/gpu_check.py "$@"
