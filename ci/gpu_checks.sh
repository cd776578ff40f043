#!/usr/bin/env bash
# GPU checks: the `gpu`-marked tests on a machine with a CUDA GPU (CI has none; docs/verl.md, docs/vllm.md).
#   bash ci/gpu_checks.sh                # tests/gpu (the embedded engines on CUDA against the CPU among them:
#                                        # tests/gpu/test_embedded_cuda.py; `dsv4flash serve --trainer megatron`
#                                        # at tiny size on CUDA: tests/gpu/test_megatron_server_cuda.py,
#                                        # `-k megatron_server` alone), plus tests/vllm and tests/verl where a CUDA build of
#                                        # vLLM 0.33 is installed (generates a synthetic small V4.1 checkpoint once)
#   bash ci/gpu_checks.sh -k megatron    # pytest options pass through (here: the Megatron actor GRPO update only)
# A machine that can fetch nothing (the device tool's image: Python 3.12, CUDA torch, triton, peft; no vLLM, no
# Transformer Engine) gets what it lacks as wheels: `bash ci/gpu_wheels.sh` where PyPI is reachable fills
# ./.whl (megatron-core, megatron-bridge, omegaconf, CI's transformers), which this script installs offline
# into a scratch folder ahead of the image's own packages. Without vLLM the vLLM-engine checks skip.
# Env: DSV4FLASH_GPU_WHEELS (wheel folder; default ./.whl), DSV4FLASH_V41_CHECKPOINT (use this checkpoint
#      instead of the synthetic one), DSV4FLASH_GPU_CACHE (where the synthetic checkpoint is kept).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
site="$(mktemp -d "${TMPDIR:-/tmp}/dsv4flash-gpu-site.XXXXXX")"
trap 'rm -rf "$site"' EXIT
wheels="${DSV4FLASH_GPU_WHEELS:-$root/.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  echo "[gpu] installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels (offline)"
  "$py" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$wheels"/*.whl
fi
# The project's import names as setup.py maps them, for a checkout that is not pip-installed.
if ! "$py" -c 'import dsv4flash_bridge, dsv4flash_recipes' 2>/dev/null; then
  ln -s "$root/bridge" "$site/dsv4flash_bridge"
  ln -s "$root/recipes" "$site/dsv4flash_recipes"
fi
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
targets=(tests/gpu)
if "$py" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("ci/gpu_checks.sh: no CUDA device visible to torch")
print(f"[gpu] {torch.cuda.get_device_name()} | torch {torch.__version__} | Python {sys.version.split()[0]}")
try:
    import vllm, vllm._C  # noqa: F401  (the CUDA build ships its compiled ops)
except ImportError as exc:
    print(f"[gpu] no CUDA build of vLLM ({exc}): the vLLM-engine checks skip; tests/vllm and tests/verl not run")
    sys.exit(3)
print(f"[gpu] vllm {vllm.__version__}")
PY
then
  targets+=(tests/vllm tests/verl)
  export VLLM_TARGET_DEVICE=cuda  # the suite conftest defaults it to cpu only when it is unset
else
  status=$?
  [ "$status" -eq 3 ] || exit "$status"
fi
export DSV4FLASH_GPU_CACHE="${DSV4FLASH_GPU_CACHE:-$HOME/.cache/dsv4flash/gpu}"
mkdir -p "$DSV4FLASH_GPU_CACHE"
export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"  # megatron-core's jit_fuser would compile per process
"$py" -m pytest -m gpu "${targets[@]}" -v -rs --durations=10 -p no:cacheprovider "$@"
