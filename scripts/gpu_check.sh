#!/usr/bin/env bash
# The GPU check (docs/scaling.md, "The GPU check"): on one machine with NVIDIA GPUs, in minutes.
#
#   scripts/gpu_check.sh                             # installs .venv-gpu with the serve extra (vLLM)
#   PRODRL_GPU_PYTHON=/path/to/python scripts/gpu_check.sh   # an environment that has the packages
#
# 1. The trainer: one recorded round trained on the CPU, on the GPU and with FSDP2 over NCCL
#    (one torchrun process per GPU); losses, parameter differences, engine mismatch, speed-up.
# 2. vLLM, when installed: the lab model served by vLLM with the recording flags behind the
#    capture gateway; engine-vs-trainer mismatch and the recording overhead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PRODRL_GPU_PYTHON:-}
if [ -z "$PY" ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q -e '.[serve]'
  PY=.venv-gpu/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== trainer: CPU vs GPU vs FSDP2 over NCCL"
"$PY" -m bench.gpu_check
if "$PY" -c "import vllm" 2>/dev/null; then
  echo "== vLLM: recording through the gateway"
  "$PY" -m bench.vllm_check
else
  echo "== vLLM: not installed in this environment; skipped"
fi
