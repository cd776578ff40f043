#!/usr/bin/env bash
# CI gate for the upstream patch series (docs/patches.md: `check` steps 1-7, then the both-forms tests).
#   bash ci/check_patches.sh [extra `dsv4flash patches check` options, e.g. --upstream megatron-lm]
# Pinned releases come from the package index exactly as base.txt pins them (sha256-verified) and are
# cached in $DSV4FLASH_CACHE_DIR (default ~/.cache/dsv4flash): cache that folder in CI, keyed on
# hashFiles('patches/*/base.txt'). First run downloads ~50 MB (the vLLM sdist dominates); later runs none.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-python}"
export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
report="${DSV4FLASH_PATCH_REPORT:-patch-check.json}"

"$py" -m dsv4flash patches list
# Metadata, both forms present and agreeing, generated index fresh, each patch alone and the whole
# series applied to every fetchable pinned release, then each patch's Tests run against both forms.
"$py" -m dsv4flash patches check --json "$report" --run-tests "$@"
# Exit 1 when a Remove-When holds for the installed stack: the patch and its twin must be retired.
"$py" -m dsv4flash patches status --probe
