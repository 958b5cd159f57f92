#!/usr/bin/env bash
# The CUDA paths, checked on a machine with one NVIDIA GPU and a CUDA build of torch.
#
# Usage: scripts/gpu_check.sh [WHEEL_DIR] [MODEL_CACHE]
#   WHEEL_DIR    wheels to add to the machine's Python first (e.g. pyzmq when it is missing)
#   MODEL_CACHE  a polytinker model cache holding models/tiny-random (POLYTINKER_CACHE), relative
#                to the checkout or absolute
# Runs the tests marked `gpu` that need no vLLM: the hf engine on CUDA, learner workers placed on CUDA by their device
# and dtype, agents' batched updates on the GPU, NCCL learner groups (torchrun and
# LearnerGroup.start) and CUDA tensors through the transport codec. Fails when CUDA is absent, when
# any of them fails, when any is skipped, or when none ran: a check that skips has not passed.
# Then prints benchmarks/gpu.py's figures (random-weight 1B Llama shape built on the GPU; no download).
# vLLM on CUDA (tests/test_gpu_vllm.py) is not run here: its CUDA wheels are far larger than what
# such a machine can be given; run `pytest -m gpu tests/test_gpu_vllm.py` where vllm is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-}"
CACHE="${2:-}"
OUT_DIR="${OUT:-/tmp/polytinker-gpu-check}"
mkdir -p "$OUT_DIR"
if [[ -n "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/polytinker-site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/polytinker-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [[ -n "$CACHE" ]]; then
  if [[ "$CACHE" = /* ]]; then export POLYTINKER_CACHE="$CACHE"; else export POLYTINKER_CACHE="$PWD/$CACHE"; fi
fi
nvidia-smi -L
python3 - <<'PY'
import sys

import peft
import torch
import transformers

if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device: nothing here can be checked")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "peft", peft.__version__, "nccl", torch.cuda.nccl.version())
PY
echo "vLLM on CUDA: not run by this check (tests/test_gpu_vllm.py needs vLLM's CUDA build)"
python3 -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 300 --junitxml "$OUT_DIR/gpu_tests.xml" \
  tests/test_learner_torchrun.py tests/test_transport_codec.py tests/test_gpu_learner.py tests/test_gpu_hf.py 2>&1 | tee "$OUT_DIR/gpu_tests.log"
# pytest exits 0 when every test is skipped: count them from its report.
python3 - "$OUT_DIR/gpu_tests.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
ran, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
if ran == 0 or skipped:
    sys.exit(f"gpu_check: {skipped} of {ran} GPU tests skipped: a skipped GPU test is a failure")
print(f"gpu_check: {ran} GPU tests passed, none skipped")
PY
# The figures: engine mixed 8-adapter vs single-adapter, learner 4 adapters batched vs in turn,
# adapter sync, and a LoRA RL step of the runtime with its engine and learner on the GPU.
timeout 420 python3 benchmarks/gpu.py | tee "$OUT_DIR/gpu_figures.txt"
