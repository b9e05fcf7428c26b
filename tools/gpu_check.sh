#!/usr/bin/env bash
# The GPU checks, in one run of a few minutes on a machine with one CUDA GPU:
#   1. tests/cuda: the compiled Triton kernels against the reference, the HF parity suite on
#      CUDA (Triton attention, CUDA graphs), decode as CUDA graphs against eager steps;
#   2. benchmarks/gpu_check.py: decode attention against torch SDPA, decode throughput
#      against transformers, CUDA graphs against eager steps.
# Run from the repository root; logs and results go to $OUT (default gpu_out/). Nothing is
# installed: pagedllm runs from src/ over the PyTorch, Triton and transformers already there.
# tests/cuda runs in a process of its own: the rest of the suite imports Triton under its CPU
# interpreter (TRITON_INTERPRET=1), which the compiled kernels must not share.
#
#   tools/gpu_check.sh [--quick]
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
{ nvidia-smi; $PY -c 'import torch, triton, transformers; print(torch.__version__,
  triton.__version__, transformers.__version__)'; } >"$OUT/versions.txt" 2>&1
timeout "${TEST_TIMEOUT:-270}" $PY -m pytest tests/cuda -q -p no:cacheprovider \
  --junitxml="$OUT/cuda_tests.xml" 2>&1 | tee "$OUT/cuda_tests.log"
tests=$?
timeout "${BENCH_TIMEOUT:-280}" $PY benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
bench=$?
echo "tests exit $tests, benchmark exit $bench"
exit $((tests || bench))
