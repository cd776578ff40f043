#!/usr/bin/env bash
# Wheels for the GPU checks on a machine that can fetch nothing (the device image: Python 3.12, CUDA torch,
# triton, peft, no vLLM / Transformer Engine): what the Megatron actor check needs and the image lacks, or
# holds in another version than CI pins. Run where pip reaches PyPI; ci/gpu_checks.sh installs them offline.
#   bash ci/gpu_wheels.sh [DIR]          # default DIR: ./.whl (git-ignored; ~30 MB)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/.whl}"
mkdir -p "$dest"
py="${PYTHON:-python3}"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# megatron-core/-bridge as CI installs them (--no-deps); omegaconf for the bridge's config module; transformers
# and tokenizers at the versions CI installs (megatron-bridge 0.6.2 wants transformers <= 5.12.1, dsv4flash.hf < 5.11).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dest" "megatron-core==0.19.2" "megatron-bridge==0.6.2" "omegaconf==2.3.0" "transformers==5.10.4" \
  "tokenizers==0.22.2"
# omegaconf's parser runtime is published as an sdist only: build its (pure-Python) wheel here.
"$py" -m pip wheel -q --no-deps -w "$dest" "antlr4-python3-runtime==4.9.3"
ls -l "$dest"
