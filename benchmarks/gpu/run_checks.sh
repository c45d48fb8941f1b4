#!/usr/bin/env bash
# Check and time sglang_bastion.kernels on one CUDA GPU (H200: under 10 minutes); torch and
# triton are all it needs. Results (JSON + Markdown) go to $OUT, else benchmarks/results/gpu.
#   benchmarks/gpu/run_checks.sh            # realistic shapes (Qwen3-8B), needs a GPU
#   benchmarks/gpu/run_checks.sh --dry-run  # tiny shapes on the CPU, TRITON_INTERPRET=1
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu}"
if [[ "${1:-}" == "--dry-run" ]]; then
    export TRITON_INTERPRET=1
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
exec timeout 570 "$PYTHON" benchmarks/gpu/driver.py --out "$OUT" "$@"
