#!/usr/bin/env bash
# The CUDA paths, checked on a machine with one NVIDIA GPU and a CUDA build of torch.
#
# Usage: scripts/gpu_check.sh [WHEEL_DIR] [MODEL_CACHE]
#   WHEEL_DIR    wheels to add to the machine's Python first (e.g. pyzmq when it is missing)
#   MODEL_CACHE  a polytinker model cache holding models/tiny-random (POLYTINKER_CACHE)
# Runs the tests marked `gpu`: NCCL learner groups (torchrun and LearnerGroup.start), CUDA
# tensors through the transport codec, and vLLM on CUDA where vllm is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-}"
CACHE="${2:-}"
OUT_DIR="${OUT:-/tmp/polytinker-gpu-check}"
mkdir -p "$OUT_DIR"
if [[ -n "$WHEELS" ]] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/polytinker-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="/tmp/polytinker-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
[[ -n "$CACHE" ]] && export POLYTINKER_CACHE="$PWD/$CACHE"
nvidia-smi -L
python3 - <<'PY'
import importlib.util as u
import torch, transformers, peft
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "peft", peft.__version__,
      "nccl", torch.cuda.nccl.version(), "vllm", "yes" if u.find_spec("vllm") else "absent")
PY
python3 -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 300 \
  tests/test_learner_torchrun.py tests/test_transport_codec.py tests/test_gpu_vllm.py 2>&1 | tee "$OUT_DIR/gpu_tests.log"
