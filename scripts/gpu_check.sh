#!/usr/bin/env bash
# GPU checks of the packed broadcast core (issue 5), for the device machine: one NVIDIA GPU, a python3 with CUDA
# PyTorch and pytest, no network. In well under 10 minutes it runs every `gpu`-marked test, which covers:
#   - exact round trips on CUDA (every dtype and awkward layout, both packing modes, 1-3 buffers);
#   - host tensors fed to a CUDA producer;
#   - one stream per buffer, cached per (device, count) and reused across calls;
#   - producer -> consumer on one GPU over a gloo group (NCCL refuses two ranks on one GPU), 2 buffers on their
#     streams, with and without a casting post_iter_func, checked bit for bit;
#   - CUDA packing throughput against a plain device-to-device copy of the same bytes (printed as "[gpu] ...");
#   - group.backend=shm on the GPU (three processes on GPU 0, segments passed by CUDA IPC handle, copied device to
#     device): every packing mode bit for bit, a consumer's broadcast, a killed consumer (tests/test_shm_gpu.py).
# Usage, from anywhere:  scripts/gpu_check.sh            (PYTHON=... to pick the interpreter; OUT=... for the log)
# The repository is put on PYTHONPATH, so no install is needed (the core and these tests need no Hydra).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-outputs/gpu_check}
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: $PY has no usable CUDA device (torch.cuda.is_available() is False); run this on a GPU machine" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")'

# Only the files that hold gpu tests: the others import the application (Hydra), which this machine may lack.
mapfile -t FILES < <(grep -l 'pytest.mark.gpu' tests/test_*.py)
echo "gpu tests in: ${FILES[*]}"
set +e
timeout 540 "$PY" -m pytest -m gpu -v -s -p no:cacheprovider "${FILES[@]}" 2>&1 | tee "$LOG_DIR/gpu_check.log"
status=${PIPESTATUS[0]}
set -e
grep '^\[gpu\]' "$LOG_DIR/gpu_check.log" > "$LOG_DIR/gpu_throughput.txt" || true
echo "gpu_check: pytest exited $status; log in $LOG_DIR/gpu_check.log"
# The vLLM backend over NCCL and pynccl (issue 10) needs vLLM's GPU build, in its own venv:
#   python3 -m venv /tmp/vllm-gpu && /tmp/vllm-gpu/bin/pip install -e '.[vllm,test]'
#   /tmp/vllm-gpu/bin/python -m pytest -m gpu -v tests/vllm_engine
if "$PY" -c 'import vllm' 2>/dev/null; then
    timeout 540 "$PY" -m pytest -m gpu -v -s -p no:cacheprovider tests/vllm_engine 2>&1 | tee -a "$LOG_DIR/gpu_check.log"
    status=$(( status || PIPESTATUS[0] ))
fi
exit "$status"
