#!/usr/bin/env bash
# Install dsv4flash and, with `test`, every test dependency (the real megatron-core, megatron-bridge,
# verl and vllm) into the active Python environment; create and use ./.venv when none is active.
#   bash ci/install.sh main [-- CMD...]   # the project and its runtime deps, then run CMD in that env
#   bash ci/install.sh test [-- CMD...]   # + dev tools and the upstream stacks (CPU-only), then CMD
# Never pulls a CUDA torch on CPU machines and never installs transformer-engine.
set -euo pipefail
mode="${1:-test}"
shift || true
case "$mode" in main|test) ;; *) echo "ci/install.sh: mode must be 'main' or 'test', got '$mode'" >&2; exit 2;; esac
if [ "${1:-}" = "--" ]; then shift; fi
run_after=("$@")
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    py="$(command -v python3.11 || command -v python3)"
    echo "[install] creating ./.venv with $py"
    "$py" -m venv .venv
  fi
  echo "[install] using ./.venv (no virtual environment was active)"
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
python -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
  || { echo "ci/install.sh: Python >= 3.11 required" >&2; exit 2; }

# Pins that keep the stack consistent on CPU: the local CPU torch wheel, and the one transformers
# release that verl 0.9.1 and megatron-bridge 0.6.2 both accept (vllm 0.33 runs with it too).
constraints="$(mktemp)"
pip_note="$(mktemp -u)"  # created once the pip-conflict note has been printed (ci/pip_conflicts.py)
trap 'rm -f "$constraints" "$pip_note"' EXIT
{ [ -f /etc/xdg/pip/constraints.txt ] && grep -v '^torch[<=>]' /etc/xdg/pip/constraints.txt || true
  echo "torch==2.13.0"
  echo "transformers==5.10.4"
  echo "transformer-engine==0.0.0.invalid.never-install"; } >"$constraints" 2>/dev/null || true
sed -i '/transformer-engine/d' "$constraints"
# pip's stderr goes through ci/pip_conflicts.py: the conflicts of the --no-deps installs below become one note
# line (why they are harmless: ci/install_sides.md); every other line, and pip's exit status, pass unchanged.
pipi() {
  local err status=0
  err="$(mktemp)"
  python -m pip install --disable-pip-version-check -q -c "$constraints" "$@" 2>"$err" || status=$?
  python "$root/ci/pip_conflicts.py" --note-once "$pip_note" <"$err" >&2
  rm -f "$err"
  return "$status"
}

has_cuda_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

echo "[install] torch + dsv4flash ($mode)"
if has_cuda_gpu; then pipi "torch>=2.6"; else pipi "torch==2.13.0"; fi
if [ "$mode" = "main" ]; then
  pipi -e ".[plot]"
  # The test command runs strict: a skip other than "no GPU here" or an opt-in network test fails (tests/conftest.py),
# so a dependency this script failed to install cannot turn into a quietly skipped test.
[ "$mode" = test ] && export DSV4FLASH_STRICT_SKIPS=1
[ "${#run_after[@]}" -eq 0 ] || exec "${run_after[@]}"
  exit 0
fi
echo "[install] dev tools (.[dev]: pytest, ...)"
pipi -e ".[dev]"

echo "[install] PostgreSQL server + psycopg (lifecycle catalog tests start their own throwaway server)"
bash ci/install_postgres.sh

echo "[install] megatron-core 0.19.2 + megatron-bridge 0.6.2 (--no-deps: their full deps are CUDA builds)"
pipi triton einops "transformers==5.10.4" peft accelerate typing_extensions
pipi --no-deps --ignore-requires-python "megatron-core==0.19.2" "megatron-bridge==0.6.2"
echo "[install] megatron-energon + nvidia-modelopt (imported by Megatron-Bridge's training/checkpointing; CPU-only deps)"
# megatron.bridge.training.config (imported by veRL's make_megatron_module) needs the energon data loader;
# its own deps are CPU-only (webdataset, s3fs, multi-storage-client), so it installs with them.
pipi "megatron-energon==7.4.1"
# megatron.bridge.training.checkpointing (veRL's Megatron checkpoint save/load) imports modelopt; its deps are
# CPU-only (scipy, PuLP, nvidia-ml-py).
pipi "nvidia-modelopt==0.47.0"
echo "[install] boto3 + moto[server] (s3:// adapter stores; the store tests start moto's S3 server on 127.0.0.1)"
# After energon: resolved together with its s3fs, whose aiobotocore pins botocore to a narrow range, so pip picks
# the boto3 release of that botocore instead of upgrading botocore past aiobotocore's pin.
pipi "boto3>=1.35" "moto[server]>=5" s3fs

echo "[install] dsv4flash serve: the real tinker SDK 0.38.0 (its deps are CPU-only; torch/transformers stay pinned)"
pipi "tinker==0.38.0" "starlette>=0.40" "uvicorn>=0.30" "zstandard>=0.24" "tokenizers>=0.22,<=0.23.0"
echo "[install] tinker-cookbook 0.6.1 (its requirements, then the wheel --no-deps)"
# tinker-cookbook 0.6.1 (its supervised/RL train.main run against the server in tests): its requirements, then the
# wheel --no-deps, because it asks for tml-renderers>=0.4.1, which only its Inkling/Kimi renderers import (lazily)
# and which the index may not carry.
pipi aiohttp anyio "blobfile>=3" "chz>=0.4" cloudpickle "datasets>=2.14" huggingface-hub pillow "pyrage>=1.4" rich \
  safetensors termcolor "tiktoken>=0.12" tqdm
pipi --no-deps "tinker-cookbook==0.6.1"
echo "[install] MinT's client (mindlab-toolkit 0.2.0 + tinker 0.22.0) into .sdk/mint"
# MinT's client pins tinker 0.22.0: it goes to its own target directory (tests put it first on PYTHONPATH), with
# --no-deps because every dependency of tinker 0.22 is already in this environment.
mint_err="$(mktemp)"
python -m pip install --disable-pip-version-check -q --no-deps --upgrade --target "$root/.sdk/mint" \
  "mindlab-toolkit==0.2.0" "tinker==0.22.0" 2>"$mint_err" || { cat "$mint_err" >&2; exit 1; }
python "$root/ci/pip_conflicts.py" --note-once "$pip_note" <"$mint_err" >&2
rm -f "$mint_err"

echo "[install] verl 0.9.1 (base deps only; its extras pin a CUDA torch)"
pipi "verl==0.9.1"

echo "[install] vllm 0.33.0 (its CPU-usable deps, then the wheel itself --no-deps)"
wheel_dir="${DSV4FLASH_WHEEL_CACHE:-$HOME/.cache/dsv4flash-wheels}"
mkdir -p "$wheel_dir"
ls "$wheel_dir"/vllm-0.33.0-*.whl >/dev/null 2>&1 \
  || { echo "[install] downloading the vllm 0.33.0 wheel into $wheel_dir"
       python -m pip download --disable-pip-version-check -q --no-deps -d "$wheel_dir" "vllm==0.33.0"; }
vllm_wheel="$(ls "$wheel_dir"/vllm-0.33.0-*.whl | head -n1)"
vllm_reqs="$(mktemp)"
python ci/vllm_cpu_requirements.py "$vllm_wheel" >"$vllm_reqs"
pipi -r "$vllm_reqs"
rm -f "$vllm_reqs"
echo "[install] vllm 0.33.0 wheel --no-deps ($vllm_wheel)"
pipi --no-deps "$vllm_wheel"

echo "[install] checking: no CUDA torch without a GPU, no transformer-engine"

python - <<'PY'
import importlib.util, sys, torch
assert torch.version.cuda is None or torch.cuda.is_available(), "a CUDA torch landed on a machine without a GPU"
assert importlib.util.find_spec("transformer_engine") is None, "transformer-engine must not be installed on CPU"
print(f"[install] ok: python {sys.version.split()[0]}, torch {torch.__version__}")
PY
# The test command runs strict: a skip other than "no GPU here" or an opt-in network test fails (tests/conftest.py),
# so a dependency this script failed to install cannot turn into a quietly skipped test.
[ "$mode" = test ] && export DSV4FLASH_STRICT_SKIPS=1
[ "${#run_after[@]}" -eq 0 ] || exec "${run_after[@]}"
