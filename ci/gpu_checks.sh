#!/usr/bin/env bash
# GPU checks for the vLLM / veRL integration (issue 10): the `gpu`-marked tests of tests/gpu, tests/vllm and
# tests/verl on a machine with a CUDA GPU and a CUDA build of vLLM 0.33 in the active environment.
#   bash ci/gpu_checks.sh            # all GPU tests (generates a synthetic small V4.1 checkpoint once)
#   bash ci/gpu_checks.sh -k kernels # pytest options pass through
# Env: DSV4FLASH_V41_CHECKPOINT (use this checkpoint instead of the synthetic one),
#      DSV4FLASH_GPU_CACHE (where the synthetic checkpoint is kept; default ~/.cache/dsv4flash/gpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
"$py" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("ci/gpu_checks.sh: no CUDA device visible to torch")
try:
    import vllm, vllm._C  # noqa: F401  (the CUDA build ships its compiled ops)
except ImportError as exc:
    sys.exit(f"ci/gpu_checks.sh: vLLM with CUDA kernels is required ({exc})")
print(f"[gpu] {torch.cuda.get_device_name()} | torch {torch.__version__} | vllm {vllm.__version__}")
PY
export DSV4FLASH_GPU_CACHE="${DSV4FLASH_GPU_CACHE:-$HOME/.cache/dsv4flash/gpu}"
mkdir -p "$DSV4FLASH_GPU_CACHE"
export VLLM_TARGET_DEVICE=cuda  # the suite conftest defaults it to cpu only when it is unset
exec "$py" -m pytest -m gpu tests/gpu tests/vllm tests/verl -v -rs --durations=10 "$@"
