#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that has torch, transformers and peft but no
# package registry: wheels of the packages polytinker imports that such a machine lacks, at the
# versions this checkout's virtual environment holds, and a model cache with the tiny-random preset
# (its tokenizer comes from the default model's GGUF file, which is too large to carry).
#
# Usage: scripts/gpu_bundle.sh [WHEEL_DIR] [MODEL_CACHE] [PYTHON_VERSION]
#   defaults: .whl .gpucache 3.12 (both folders are ignored by git; about 35 MB together)
# Then, on the GPU machine, from the checkout: scripts/gpu_check.sh .whl .gpucache
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-.whl}"
CACHE="${2:-.gpucache}"
PYVER="${3:-3.12}"
PY="${VENV:-.venv}/bin/python"
[[ "$CACHE" = /* ]] || CACHE="$PWD/$CACHE"
# Imported by the package or its tests and absent from a CUDA image of torch, transformers and peft.
PACKAGES=(pyzmq pettingzoo gymnasium farama-notifications fastapi starlette pydantic pydantic-core
  typing-inspection annotated-types uvicorn pyrage)
mkdir -p "$WHEELS"
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [[ -n "$version" ]] || { echo "gpu_bundle: $name is not installed in $PY's environment (run make venv)" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "$name==$version"
done
POLYTINKER_CACHE="$CACHE" "$PY" -c 'from polytinker.engine.models import TINY_RANDOM, load_model; load_model(TINY_RANDOM)'
du -sh "$WHEELS" "$CACHE"
